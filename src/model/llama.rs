//! The one decoder for the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2/2.5, Qwen3).
//!
//! A forward pass takes a flat list of new tokens from any number of sequences (no padding):
//! each sequence brings its own positions, so RoPE, masks and lengths are per sequence, and a
//! batch of prompts gives each row what it would get alone. Shapes: T = new tokens in the batch,
//! H = query heads, KVH = KV heads, D = head_dim.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

use super::config::ModelConfig;
use super::weights::{Linear, Name, Weights};
use crate::kv::attention::{paged_attention, plan_decode, SeqSlice};
use crate::kv::cache::{PagedKvCache, SeqId};

struct Block {
    attn_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
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
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    /// RoPE tables `[max_positions, D/2]`, f32.
    cos: Tensor,
    sin: Tensor,
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
        let embed = w.dense(Name::Embed, &[cfg.vocab_size, h])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let bias = cfg.attention_bias;
            blocks.push(Block {
                attn_norm: w.dense(Name::AttnNorm(l), &[h])?,
                q: w.linear(Name::Q(l), h, q_out, bias)?,
                k: w.linear(Name::K(l), h, kv_out, bias)?,
                v: w.linear(Name::V(l), h, kv_out, bias)?,
                o: w.linear(Name::O(l), q_out, h, false)?,
                q_norm: if cfg.qk_norm {
                    Some(w.dense(Name::QNorm(l), &[hd])?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(w.dense(Name::KNorm(l), &[hd])?)
                } else {
                    None
                },
                ffn_norm: w.dense(Name::FfnNorm(l), &[h])?,
                gate: w.linear(Name::Gate(l), h, cfg.intermediate_size, false)?,
                up: w.linear(Name::Up(l), h, cfg.intermediate_size, false)?,
                down: w.linear(Name::Down(l), cfg.intermediate_size, h, false)?,
            });
        }
        let norm = w.dense(Name::OutputNorm, &[h])?;
        let lm_head = w.lm_head(cfg.vocab_size, h, &embed)?;
        let (cos, sin) = rope_tables(cfg, w.device())?;
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            cos,
            sin,
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

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether any projection runs on quantized weight blocks (else every matmul is dense).
    pub fn has_quantized_weights(&self) -> bool {
        self.lm_head.is_quantized()
            || self.blocks.iter().any(|b| {
                [&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down]
                    .iter()
                    .any(|l| l.is_quantized())
            })
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
            let kstart = cache.first_visible(start);
            batch.push(SeqSlice {
                seq: inp.seq,
                offset: tokens.len(),
                start,
                n,
                kstart,
                slots: Default::default(),
                mask: Default::default(),
            });
            tokens.extend_from_slice(&inp.tokens);
            positions.extend((start..start + n).map(|p| p as u32));
        }
        let t = tokens.len();
        let ids = Tensor::from_vec(tokens, t, &self.device)?;
        let pos = Tensor::from_vec(positions, t, &self.device)?;
        let cos = self.cos.index_select(&pos, 0)?.to_dtype(self.dtype)?;
        let sin = self.sin.index_select(&pos, 0)?.to_dtype(self.dtype)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let eps = cfg.rms_norm_eps as f32;

        let decode = plan_decode(cache, &batch, self.batch_invariant)?;
        let spans: Vec<_> = batch
            .iter()
            .map(|s| (s.seq, s.start, s.offset, s.n))
            .collect();
        let mut x = self.embed.index_select(&ids, 0)?; // [T, hidden]
        for (l, b) in self.blocks.iter().enumerate() {
            let residual = &x;
            let hs = candle_nn::ops::rms_norm(&x, &b.attn_norm, eps)?;
            let q = b.q.forward(&hs)?.reshape((t, nh, hd))?;
            let k = b.k.forward(&hs)?.reshape((t, nkv, hd))?;
            let v = b.v.forward(&hs)?;
            let (q, k) = match (&b.q_norm, &b.k_norm) {
                (Some(qn), Some(kn)) => (
                    candle_nn::ops::rms_norm(&q.contiguous()?, qn, eps)?,
                    candle_nn::ops::rms_norm(&k.contiguous()?, kn, eps)?,
                ),
                _ => (q, k),
            };
            // RoPE on [1, T, heads, D] with per-token cos/sin [T, D/2].
            let q = candle_nn::rotary_emb::rope_thd(&q.unsqueeze(0)?.contiguous()?, &cos, &sin)?
                .squeeze(0)?;
            let k = candle_nn::rotary_emb::rope_thd(&k.unsqueeze(0)?.contiguous()?, &cos, &sin)?
                .squeeze(0)?
                .reshape((t, nkv * hd))?;
            cache.write_spans(l, &spans, &k, &v)?;
            let attn =
                paged_attention(&q, cache, l, &batch, &decode, scale)?.reshape((t, nh * hd))?;
            let x1 = (b.o.forward(&attn)? + residual)?;
            let hs = candle_nn::ops::rms_norm(&x1, &b.ffn_norm, eps)?;
            let mlp = (candle_nn::ops::silu(&b.gate.forward(&hs)?)? * b.up.forward(&hs)?)?;
            x = (b.down.forward(&mlp)? + x1)?;
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
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }
}

/// cos/sin of `position * inv_freq` for every position of the window, f32 `[P, D/2]`.
fn rope_tables(cfg: &ModelConfig, dev: &Device) -> Result<(Tensor, Tensor)> {
    let d = cfg.head_dim;
    let mut inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / d as f32))
        .collect();
    if let Some(s) = &cfg.rope_scaling {
        // Llama 3: long wavelengths are slowed by `factor`, short ones kept, smooth in between.
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
