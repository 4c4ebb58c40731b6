//! [`Llama::load`]: the decoder built from its weights — each layer's projections (stacked on
//! GPUs), norms and RoPE tables (one per distinct base).

use super::{Block, GateUpProj, Llama, QkvProj};
use crate::model::config::{Arch, ModelConfig, RopeScaling};
use crate::model::gemv;
use crate::model::linear::{Linear, WeightMath};
use crate::model::weights::{Name, Weights};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

impl Llama {
    /// The decoder of shape `cfg` with the weights `w` supplies.
    pub fn load(cfg: &ModelConfig, w: &mut Weights) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let q_out = cfg.num_heads * hd;
        let kv_out = cfg.num_kv_heads * hd;
        let ff = cfg.intermediate_size;
        let fused = cfg.arch == Arch::Phi3;
        let gemma = cfg.arch.is_gemma();
        let embed = w.embedding(cfg.vocab_size, h)?;
        let mut thetas: Vec<f32> = Vec::new();
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let bias = cfg.attention_bias;
            let theta = cfg.layers[l].rope_theta;
            let rope = match thetas.iter().position(|&t| t == theta) {
                Some(i) => i,
                None => {
                    thetas.push(theta);
                    thetas.len() - 1
                }
            };
            let mut qkv = if fused {
                QkvProj::Fused(w.linear(Name::Qkv(l), h, q_out + 2 * kv_out, bias)?)
            } else {
                QkvProj::Split {
                    q: w.linear(Name::Q(l), h, q_out, bias)?,
                    k: w.linear(Name::K(l), h, kv_out, bias)?,
                    v: w.linear(Name::V(l), h, kv_out, bias)?,
                }
            };
            let mut gate_up = if fused {
                GateUpProj::Fused(w.linear(Name::GateUp(l), h, 2 * ff, false)?)
            } else {
                GateUpProj::Split {
                    gate: w.linear(Name::Gate(l), h, ff, false)?,
                    up: w.linear(Name::Up(l), h, ff, false)?,
                }
            };
            // One matmul for q/k/v and one for gate/up: on a GPU each launch costs more host
            // time than these small matmuls take, and on the CPU each call wakes the thread
            // pool. CPU weights stack where they are GGUF blocks (the dense ones would be
            // copied: mapped safetensors become resident).
            let cpu = w.device().is_cpu();
            if let QkvProj::Split { q, k, v } = &qkv {
                if !cpu || all_blocks(&[q, k, v]) {
                    if let Some(f) = Linear::stacked(&[q, k, v])? {
                        qkv = QkvProj::Fused(f);
                    }
                }
            }
            if let GateUpProj::Split { gate, up } = &gate_up {
                if !cpu || all_blocks(&[gate, up]) {
                    if let Some(f) = Linear::stacked(&[gate, up])? {
                        gate_up = GateUpProj::Fused(f);
                    }
                }
            }
            let opt = |w: &mut Weights, on: bool, name: Name, len: usize| -> Result<_> {
                Ok(if on {
                    Some(w.dense(name, &[len])?)
                } else {
                    None
                })
            };
            blocks.push(Block {
                attn_norm: w.dense(Name::AttnNorm(l), &[h])?,
                qkv,
                o: w.linear(Name::O(l), q_out, h, false)?,
                q_norm: opt(w, cfg.qk_norm, Name::QNorm(l), hd)?,
                k_norm: opt(w, cfg.qk_norm, Name::KNorm(l), hd)?,
                post_attn_norm: opt(w, gemma, Name::PostAttnNorm(l), h)?,
                post_ffn_norm: opt(w, gemma, Name::PostFfnNorm(l), h)?,
                ffn_norm: w.dense(Name::FfnNorm(l), &[h])?,
                gate_up,
                down: w.linear(Name::Down(l), ff, h, false)?,
                rope,
            });
        }
        let norm = w.dense(Name::OutputNorm, &[h])?;
        let lm_head = w.lm_head(cfg.vocab_size, h, &embed)?;
        let ropes = thetas
            .iter()
            .map(|&t| rope_tables(cfg, t, w.device()))
            .collect::<Result<Vec<_>>>()?;
        let dense = |l: &Linear| l.dense_weight().is_some_and(gemv::weight_fits);
        let small = gemv::max_rows() > 0
            && w.dtype() != DType::F32
            && dense(&lm_head)
            && blocks.iter().all(|b| {
                matches!(&b.qkv, QkvProj::Fused(l) if dense(l))
                    && matches!(&b.gate_up, GateUpProj::Fused(l) if dense(l))
                    && dense(&b.o)
                    && dense(&b.down)
                    && b.post_attn_norm.is_none()
                    && b.post_ffn_norm.is_none()
            });
        Ok(Self {
            small,
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            ropes,
            device: w.device().clone(),
            dtype: w.dtype(),
            batch_invariant: w.device().is_cpu(),
            embed_scale: match gemma {
                true => Some(
                    Tensor::new((h as f32).sqrt(), w.device())?
                        .to_dtype(w.dtype())?
                        .to_dtype(DType::F64)?
                        .to_scalar::<f64>()?,
                ),
                false => None,
            },
        })
    }
}

/// Whether every projection of `parts` is kept in GGUF blocks for kvq's CPU kernels.
fn all_blocks(parts: &[&Linear]) -> bool {
    parts.iter().all(|l| l.math() == WeightMath::Blocks)
}

/// cos/sin of `position * inv_freq` for every position of the window, f32 `[P, D/2]`, for
/// RoPE base `theta` (scaling, Llama 3 or linear, applies to the model's global base only).
fn rope_tables(cfg: &ModelConfig, theta: f32, dev: &Device) -> Result<(Tensor, Tensor)> {
    let d = cfg.head_dim;
    let mut inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / d as f32))
        .collect();
    match cfg
        .rope_scaling
        .as_ref()
        .filter(|_| theta == cfg.rope_theta)
    {
        Some(RopeScaling::Llama3(s)) => {
            // Llama 3: long wavelengths are slowed by `factor`, short ones kept, smooth between.
            let old = s.original_max_position_embeddings as f32;
            let low_wl = old / s.low_freq_factor;
            let high_wl = old / s.high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wl = 2.0 * std::f32::consts::PI / *f;
                *f = if wl < high_wl {
                    *f
                } else if wl > low_wl {
                    *f / s.factor
                } else {
                    let smooth =
                        (old / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * *f / s.factor + smooth * *f
                };
            }
        }
        Some(RopeScaling::Linear { factor }) => {
            for f in inv_freq.iter_mut() {
                *f /= factor;
            }
        }
        None => {}
    }
    let p = cfg.max_position_embeddings;
    let inv = Tensor::from_vec(inv_freq, (1, d / 2), dev)?;
    let pos = Tensor::arange(0u32, p as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((p, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    Ok((freqs.cos()?, freqs.sin()?))
}
