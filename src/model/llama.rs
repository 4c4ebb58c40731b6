//! The one decoder for every architecture kvq runs: the Llama family (Llama 2/3, SmolLM,
//! Mistral, Qwen2/2.5, Qwen3), Gemma 2, Gemma 3 (text) and Phi-3.
//!
//! Decision: one decoder with config switches, not a file per architecture. The architectures
//! share the whole skeleton (embedding, pre-norm attention and gated MLP blocks with residuals,
//! paged attention, final norm, output projection); what differs is a handful of switches read
//! from [`ModelConfig`]: Gemma's embedding scale, post-norms after attention and MLP, GeGLU and
//! soft-capping; q/k norms (Qwen3, Gemma 3); Phi-3's fused q/k/v and gate/up matrices (split
//! after one matmul); and per layer ([`ModelConfig::layers`]) a global or sliding-window
//! attention with its own RoPE base (Gemma 3's local layers). Separate files would repeat the
//! forward pass five times for these few lines.
//!
//! A forward pass takes a flat list of new tokens from any number of sequences (no padding):
//! each sequence brings its own positions, so RoPE, masks and lengths are per sequence, and a
//! batch of prompts gives each row what it would get alone. Shapes: T = new tokens in the batch,
//! H = query heads, KVH = KV heads, D = head_dim.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

use super::config::{Arch, ModelConfig, RopeScaling};
use super::weights::{Embedding, Linear, Name, WeightMath, Weights};
use crate::kv::attend::{paged_attention, plan_decode, SeqSlice};
use crate::kv::cache::{PagedKvCache, SeqId};

/// Q, K and V projections: three matrices, or one whose output rows are q, k, v (Phi-3).
enum QkvProj {
    Split { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// Gate and up projections: two matrices, or one whose output rows are gate, up (Phi-3).
enum GateUpProj {
    Split { gate: Linear, up: Linear },
    Fused(Linear),
}

struct Block {
    attn_norm: Tensor,
    qkv: QkvProj,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// Gemma: norms of the attention and MLP outputs before their residual adds.
    post_attn_norm: Option<Tensor>,
    post_ffn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate_up: GateUpProj,
    down: Linear,
    /// Index of this layer's RoPE tables in `Llama::ropes`.
    rope: usize,
}

impl Block {
    fn linears(&self) -> Vec<&Linear> {
        let mut v = vec![&self.o, &self.down];
        match &self.qkv {
            QkvProj::Split { q, k, v: vv } => v.extend([q, k, vv]),
            QkvProj::Fused(l) => v.push(l),
        }
        match &self.gate_up {
            GateUpProj::Split { gate, up } => v.extend([gate, up]),
            GateUpProj::Fused(l) => v.push(l),
        }
        v
    }
}

/// One sequence's new tokens in a forward pass.
#[derive(Debug, Clone)]
pub struct SeqInput {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
}

/// Which positions produce logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last new token of each sequence (generation).
    Last,
    /// Every new token (perplexity, tests).
    All,
}

pub struct Llama {
    cfg: ModelConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    /// RoPE tables `[max_positions, D/2]`, f32, one (cos, sin) pair per distinct base.
    ropes: Vec<(Tensor, Tensor)>,
    device: Device,
    dtype: DType,
    /// Attend prompt tokens as decode queries ([`plan_decode`]): see [`Llama::batch_invariant`].
    batch_invariant: bool,
}

impl Llama {
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
            let qkv = if fused {
                QkvProj::Fused(w.linear(Name::Qkv(l), h, q_out + 2 * kv_out, bias)?)
            } else {
                QkvProj::Split {
                    q: w.linear(Name::Q(l), h, q_out, bias)?,
                    k: w.linear(Name::K(l), h, kv_out, bias)?,
                    v: w.linear(Name::V(l), h, kv_out, bias)?,
                }
            };
            let gate_up = if fused {
                GateUpProj::Fused(w.linear(Name::GateUp(l), h, 2 * ff, false)?)
            } else {
                GateUpProj::Split {
                    gate: w.linear(Name::Gate(l), h, ff, false)?,
                    up: w.linear(Name::Up(l), h, ff, false)?,
                }
            };
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
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            ropes,
            device: w.device().clone(),
            dtype: w.dtype(),
            batch_invariant: w.device().is_cpu(),
        })
    }

    /// Whether every row of a forward pass depends only on its own sequence (its tokens, its
    /// cache), never on the other sequences in the call or on how its prompt was chunked: bit
    /// for bit, greedy batched generation then equals each request alone. On the CPU (the
    /// default there) with dense weights: projections go through the row-invariant matmul
    /// (always), prompt tokens attend as decode queries of their own position through the
    /// fused decode kernel, whose order depends only on a query's visible span.
    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// Turns the prompt-as-decode attention of [`Llama::batch_invariant`] on or off (off:
    /// prompt chunks attend with matmuls over their keys).
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.batch_invariant = on;
    }

    /// The dimensions a KV cache for this model is shaped by.
    pub fn kv_shape(&self) -> crate::kv::cache::ModelShape {
        let c = self.config();
        crate::kv::cache::ModelShape {
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            layer_windows: c.layers.iter().map(|l| l.window).collect(),
            max_positions: c.max_position_embeddings,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the projections are computed: candle's quantized matmul if any projection uses it,
    /// else kvq's block kernels if any does, else dense.
    pub fn weight_math(&self) -> WeightMath {
        let all =
            std::iter::once(&self.lm_head).chain(self.blocks.iter().flat_map(|b| b.linears()));
        all.map(Linear::math)
            .max_by_key(|m| match m {
                WeightMath::Dense => 0,
                WeightMath::Blocks => 1,
                WeightMath::Quantized => 2,
            })
            .unwrap_or(WeightMath::Dense)
    }

    /// Runs the new tokens of `inputs` through the model, appending their K/V to `cache` (space
    /// must be reserved). Returns f32 logits `[rows, vocab]`: one row per sequence for
    /// [`LogitsFor::Last`], one per token (in input order) for [`LogitsFor::All`].
    pub fn forward(
        &self,
        inputs: &[SeqInput],
        cache: &mut PagedKvCache,
        which: LogitsFor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut batch = Vec::with_capacity(inputs.len());
        for inp in inputs {
            if inp.tokens.is_empty() {
                bail!("sequence {} has no new tokens", inp.seq);
            }
            let start = cache.seq_len(inp.seq)?;
            let n = inp.tokens.len();
            if start + n > cfg.max_position_embeddings {
                bail!(
                    "sequence {} would reach position {} but the context window is {}",
                    inp.seq,
                    start + n,
                    cfg.max_position_embeddings
                );
            }
            batch.push(SeqSlice::new(cache, inp.seq, tokens.len(), start, n));
            tokens.extend_from_slice(&inp.tokens);
            positions.extend((start..start + n).map(|p| p as u32));
        }
        let t = tokens.len();
        let ids = Tensor::from_vec(tokens, t, &self.device)?;
        let pos = Tensor::from_vec(positions, t, &self.device)?;
        let ropes = self
            .ropes
            .iter()
            .map(|(cos, sin)| -> Result<_> {
                Ok((
                    cos.index_select(&pos, 0)?.to_dtype(self.dtype)?,
                    sin.index_select(&pos, 0)?.to_dtype(self.dtype)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let eps = cfg.rms_norm_eps as f32;
        let (q_out, kv_out) = (nh * hd, nkv * hd);

        let decode = plan_decode(cache, &batch, self.batch_invariant)?;
        let spans: Vec<_> = batch
            .iter()
            .map(|s| (s.seq, s.start, s.offset, s.n))
            .collect();
        let mut x = self.embed.forward(&ids)?; // [T, hidden]
        if cfg.arch.is_gemma() {
            // √hidden, rounded to the compute dtype as Gemma's reference code does.
            let scale = Tensor::new((cfg.hidden_size as f32).sqrt(), &self.device)?
                .to_dtype(self.dtype)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            x = x.affine(scale, 0.0)?;
        }
        for (l, b) in self.blocks.iter().enumerate() {
            let residual = &x;
            let hs = candle_nn::ops::rms_norm(&x, &b.attn_norm, eps)?;
            let (q, k, v) = match &b.qkv {
                QkvProj::Split { q, k, v } => (q.forward(&hs)?, k.forward(&hs)?, v.forward(&hs)?),
                QkvProj::Fused(qkv) => {
                    let y = qkv.forward(&hs)?;
                    (
                        y.narrow(1, 0, q_out)?.contiguous()?,
                        y.narrow(1, q_out, kv_out)?.contiguous()?,
                        y.narrow(1, q_out + kv_out, kv_out)?.contiguous()?,
                    )
                }
            };
            let q = q.reshape((t, nh, hd))?;
            let k = k.reshape((t, nkv, hd))?;
            let (q, k) = match (&b.q_norm, &b.k_norm) {
                (Some(qn), Some(kn)) => (
                    candle_nn::ops::rms_norm(&q.contiguous()?, qn, eps)?,
                    candle_nn::ops::rms_norm(&k.contiguous()?, kn, eps)?,
                ),
                _ => (q, k),
            };
            // RoPE on [1, T, heads, D] with per-token cos/sin [T, D/2] of this layer's base.
            let (cos, sin) = &ropes[b.rope];
            let q = candle_nn::rotary_emb::rope_thd(&q.unsqueeze(0)?.contiguous()?, cos, sin)?
                .squeeze(0)?;
            let k = candle_nn::rotary_emb::rope_thd(&k.unsqueeze(0)?.contiguous()?, cos, sin)?
                .squeeze(0)?
                .reshape((t, nkv * hd))?;
            cache.write_spans(l, &spans, &k, &v)?;
            let attn = paged_attention(
                &q,
                cache,
                l,
                &batch,
                &decode,
                cfg.attn_scale,
                cfg.attn_softcap,
            )?
            .reshape((t, nh * hd))?;
            let mut attn = b.o.forward(&attn)?;
            if let Some(n) = &b.post_attn_norm {
                attn = candle_nn::ops::rms_norm(&attn, n, eps)?;
            }
            let x1 = (attn + residual)?;
            let hs = candle_nn::ops::rms_norm(&x1, &b.ffn_norm, eps)?;
            let (gate, up) = match &b.gate_up {
                GateUpProj::Split { gate, up } => (gate.forward(&hs)?, up.forward(&hs)?),
                GateUpProj::Fused(gu) => {
                    let y = gu.forward(&hs)?;
                    let ff = cfg.intermediate_size;
                    (y.narrow(1, 0, ff)?, y.narrow(1, ff, ff)?)
                }
            };
            let act = if cfg.arch.is_gemma() {
                gate.gelu()? // tanh approximation (gelu_pytorch_tanh)
            } else {
                candle_nn::ops::silu(&gate)?
            };
            let mut mlp = b.down.forward(&(act * up)?.contiguous()?)?;
            if let Some(n) = &b.post_ffn_norm {
                mlp = candle_nn::ops::rms_norm(&mlp, n, eps)?;
            }
            x = (mlp + x1)?;
        }
        for s in &batch {
            cache.advance(s.seq, s.n)?;
        }
        let x = match which {
            LogitsFor::All => x,
            LogitsFor::Last => {
                let last: Vec<u32> = batch.iter().map(|s| (s.offset + s.n - 1) as u32).collect();
                let n = last.len();
                x.index_select(&Tensor::from_vec(last, n, &self.device)?, 0)?
            }
        };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(match cfg.final_softcap {
            Some(c) => ((logits / c as f64)?.tanh()? * c as f64)?,
            None => logits,
        })
    }
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

/// Returns the last dimension's argmax of f32 logits `[rows, vocab]` (first index on ties).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
    Ok(rows
        .iter()
        .map(|r| {
            let mut best = 0;
            for (i, &x) in r.iter().enumerate() {
                if x > r[best] {
                    best = i;
                }
            }
            best as u32
        })
        .collect())
}
