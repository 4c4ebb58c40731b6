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

use super::config::ModelConfig;
use super::fused;
use super::fused_cpu;
use super::gemv::{self, Epilogue};

mod build;
mod small;
use super::linear::{Embedding, Linear, WeightMath};
#[cfg(feature = "cuda")]
use crate::kv::attend::FixedStep;
use crate::kv::attend::{paged_attention, plan_decode, DecodeGroup, SeqSlice};
use crate::kv::cache::FixedWrites;
use crate::kv::cache::{PagedKvCache, SeqId, WriteSpan};
use crate::ops::pool;

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

    /// The per-head q/k norms for the fused RoPE kernel (Qwen3), with epsilon `eps`.
    fn qk_norm(&self, eps: f32) -> Option<fused::QkNorm<'_>> {
        match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some(fused::QkNorm { q, k, eps }),
            _ => None,
        }
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
    /// Gemma: embeddings times √hidden, that factor rounded to the compute dtype as Gemma's
    /// reference code does.
    embed_scale: Option<f64>,
    /// Every layer and the head can run a step of a few rows on the fused projections
    /// ([`gemv`], when enabled): dense f16/bf16 weights on CUDA, stacked q|k|v and gate|up,
    /// RoPE from tables, no post-norms.
    small: bool,
}

impl Llama {
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
        if self.device.is_cpu() {
            // On a thread of the kernels' pool: its ~150 parallel kernels then do not each wake
            // this thread (`ops::pool`).
            return pool::run(|| self.forward_here(inputs, cache, which));
        }
        self.forward_here(inputs, cache, which)
    }

    fn forward_here(
        &self,
        inputs: &[SeqInput],
        cache: &mut PagedKvCache,
        which: LogitsFor,
    ) -> Result<Tensor> {
        let Batch {
            slices,
            tokens,
            positions,
        } = self.begin(inputs, cache)?;
        let t = tokens.len();
        let ids = Tensor::from_vec(tokens, t, &self.device)?;
        let pos = Tensor::from_vec(positions, t, &self.device)?;
        // The residual window's merge is part of the decode kernels' call, so prompt tokens
        // attend as decode queries under it on every device.
        let as_decode = self.batch_invariant || cache.config().residual > 0;
        let decode = plan_decode(cache, &slices, as_decode)?;
        let spans: Vec<_> = slices
            .iter()
            .map(|s| (s.seq, s.start, s.offset, s.n))
            .collect();
        let (x, mlp) = self.layers(&ids, &pos, &slices, &decode, Writes::Spans(&spans), cache)?;
        for s in &slices {
            cache.advance(s.seq, s.n)?;
        }
        match which {
            LogitsFor::All => self.head(&x, mlp.as_ref()),
            LogitsFor::Last => {
                let last: Vec<u32> = slices.iter().map(|s| (s.offset + s.n - 1) as u32).collect();
                let n = last.len();
                let last = Tensor::from_vec(last, n, &self.device)?;
                let pick = |t: &Tensor| t.index_select(&last, 0);
                self.head(&pick(&x)?, mlp.as_ref().map(pick).transpose()?.as_ref())
            }
        }
    }

    #[cfg(feature = "cuda")]
    /// The decode step whose inputs [`FixedStep::fill`] wrote: logits `[rows, vocab]` of every
    /// row (padding included). Launches device work only, reading `step`'s buffers and
    /// uploading nothing, so a CUDA graph can capture it; the caller advances the cache.
    pub fn forward_fixed(&self, step: &FixedStep, cache: &PagedKvCache) -> Result<Tensor> {
        let (slices, decode) = step.plan();
        let writes = step.writes();
        let (x, mlp) = self.layers(
            &step.ids,
            &step.pos,
            slices,
            &decode,
            Writes::Fixed(&writes),
            cache,
        )?;
        self.head(&x, mlp.as_ref())
    }

    /// Runs every projection of the first layer and the output projection once on `rows` rows
    /// of zeros: the scratch buffers candle's quantized matmuls keep between calls (grow-only)
    /// then already have the size `rows` rows need, so no later call of at most `rows` rows
    /// moves them — captured CUDA graphs hold their addresses.
    pub fn warm_matmuls(&self, rows: usize) -> Result<()> {
        let c = &self.cfg;
        let (h, a, ff) = (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size);
        let zeros = |n: usize| Tensor::zeros((rows, n), self.dtype, &self.device);
        let Some(b) = self.blocks.first() else {
            return Ok(());
        };
        let mut runs: Vec<(&Linear, usize)> = vec![(&b.o, a), (&b.down, ff), (&self.lm_head, h)];
        match &b.qkv {
            QkvProj::Split { q, k, v } => runs.extend([(q, h), (k, h), (v, h)]),
            QkvProj::Fused(l) => runs.push((l, h)),
        }
        match &b.gate_up {
            GateUpProj::Split { gate, up } => runs.extend([(gate, h), (up, h)]),
            GateUpProj::Fused(l) => runs.push((l, h)),
        }
        for (l, n) in runs {
            drop(l.forward(&zeros(n)?)?);
        }
        Ok(())
    }

    /// The host side of a forward pass: each input's slice of the batch (its positions from
    /// the cache), checked against the context window.
    pub fn begin(&self, inputs: &[SeqInput], cache: &PagedKvCache) -> Result<Batch> {
        let cfg = &self.cfg;
        let mut b = Batch {
            slices: Vec::with_capacity(inputs.len()),
            tokens: Vec::new(),
            positions: Vec::new(),
        };
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
            b.slices
                .push(SeqSlice::new(cache, inp.seq, b.tokens.len(), start, n));
            b.tokens.extend_from_slice(&inp.tokens);
            b.positions.extend((start..start + n).map(|p| p as u32));
        }
        Ok(b)
    }

    /// Embedding and every layer: hidden states `[T, hidden]` of the batch's new tokens
    /// (`ids`, `pos`: u32 `[T]`), their K/V written to `cache` as `writes` says. Returned as
    /// `(x, mlp)` with the last residual add still to do (the head fuses it with its norm).
    fn layers(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        batch: &[SeqSlice],
        decode: &[DecodeGroup],
        writes: Writes<'_>,
        cache: &PagedKvCache,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let fused_rope = fused::has_rope_qkv(ids)
            && self
                .blocks
                .iter()
                .all(|b| b.q_norm.is_some() == b.k_norm.is_some())
            && self
                .blocks
                .iter()
                .all(|b| matches!(b.qkv, QkvProj::Fused(_)));
        let ropes = self
            .ropes
            .iter()
            .map(|(cos, sin)| -> Result<_> {
                Ok(match fused_rope {
                    true => Rope::Tables(cos.clone(), sin.clone()),
                    false => Rope::Rows(
                        cos.index_select(pos, 0)?.to_dtype(self.dtype)?,
                        sin.index_select(pos, 0)?.to_dtype(self.dtype)?,
                    ),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut x = self.embed.forward(ids)?; // [T, hidden]
        if let Some(scale) = self.embed_scale {
            x = x.affine(scale, 0.0)?;
        }
        let small = fused_rope && self.small_step(x.dim(0)?);
        let mut mlp = None;
        for (l, b) in self.blocks.iter().enumerate() {
            let step = Step {
                pos,
                rope: &ropes[b.rope],
                batch,
                decode,
                writes: &writes,
                cache,
            };
            (x, mlp) = match small {
                true => (self.block_small(l, b, &x, mlp.as_ref(), &step)?, None),
                false => {
                    let (x1, m) = self.block(l, b, &x, mlp.as_ref(), &step)?;
                    (x1, Some(m))
                }
            };
        }
        Ok((x, mlp))
    }

    /// One decoder layer. Input: the residual stream `x` plus the previous layer's MLP output
    /// `mlp` not yet added (added here, fused with this layer's first norm). Returns this
    /// layer's `(x + attention, mlp output)`, again with the last add left to the next layer.
    fn block(
        &self,
        l: usize,
        b: &Block,
        x: &Tensor,
        mlp: Option<&Tensor>,
        s: &Step<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (q_out, kv_out) = (nh * hd, nkv * hd);
        let shape = (nh, nkv, hd);
        let eps = cfg.rms_norm_eps as f32;
        let (x, hs) = fused::add_rms_norm(x, mlp, &b.attn_norm, eps)?;
        let t = x.dim(0)?;
        // A fixed step into a dense layer of the compute dtype: RoPE writes K and V straight
        // into their slots (no separate cache write).
        if let (QkvProj::Fused(qkv), Rope::Tables(cos, sin), Writes::Fixed(w)) =
            (&b.qkv, s.rope, s.writes)
        {
            if let Some((kp, vp)) = s.cache.dense_layer(l, self.dtype) {
                let y = qkv.forward(&hs)?;
                let slots = w.slots.on(y.device())?;
                let pools = (kp, vp, &slots);
                let q = fused::rope_qkv_into(&y, s.pos, (cos, sin), shape, b.qk_norm(eps), pools)?;
                return self.finish_block(l, b, &x, &q, s);
            }
        }
        let (q, k, v) = match (&b.qkv, s.rope) {
            (QkvProj::Fused(qkv), Rope::Tables(cos, sin)) => {
                let y = qkv.forward(&hs)?;
                fused::rope_qkv(&y, s.pos, (cos, sin), shape, b.qk_norm(eps))?
            }
            (QkvProj::Fused(qkv), Rope::Rows(cos, sin))
                if b.q_norm.is_none() && fused_cpu::applies(&hs) =>
            {
                let (q, k, v) = fused_cpu::rope_qkv(&qkv.forward(&hs)?, cos, sin, (nh, nkv, hd))?;
                (q, k, v)
            }
            (qkv, Rope::Rows(cos, sin)) => {
                let (q, k, v) = match qkv {
                    QkvProj::Split { q, k, v } => {
                        (q.forward(&hs)?, k.forward(&hs)?, v.forward(&hs)?)
                    }
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
                let q = candle_nn::rotary_emb::rope_thd(&q.unsqueeze(0)?.contiguous()?, cos, sin)?
                    .squeeze(0)?;
                let k = candle_nn::rotary_emb::rope_thd(&k.unsqueeze(0)?.contiguous()?, cos, sin)?
                    .squeeze(0)?
                    .reshape((t, nkv * hd))?;
                (q, k, v)
            }
            (QkvProj::Split { .. }, Rope::Tables(..)) => {
                bail!("layer {l}: fused RoPE needs a stacked q/k/v projection")
            }
        };
        match s.writes {
            Writes::Spans(spans) => s.cache.write_spans(l, spans, &k, &v)?,
            Writes::Fixed(w) => s.cache.write_fixed(l, w, &k, &v)?,
        }
        self.finish_block(l, b, &x, &q, s)
    }

    /// The rest of a layer once its K/V are in the cache: attention of `q` (`[T, H, D]`), the
    /// output projection, the residual add with `x` fused with the MLP's norm, and the MLP.
    fn finish_block(
        &self,
        l: usize,
        b: &Block,
        x: &Tensor,
        q: &Tensor,
        s: &Step<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let eps = cfg.rms_norm_eps as f32;
        let attn = self.attend(l, q, s)?;
        let mut attn = b.o.forward(&attn)?;
        if let Some(n) = &b.post_attn_norm {
            attn = candle_nn::ops::rms_norm(&attn, n, eps)?;
        }
        let (x1, hs) = fused::add_rms_norm(&attn, Some(x), &b.ffn_norm, eps)?;
        let gemma = cfg.arch.is_gemma();
        let act = match &b.gate_up {
            GateUpProj::Split { gate, up } => {
                fused::glu_split(&gate.forward(&hs)?, &up.forward(&hs)?, gemma)?
            }
            GateUpProj::Fused(gu) => fused::glu(&gu.forward(&hs)?, cfg.intermediate_size, gemma)?,
        };
        let mut mlp = b.down.forward(&act)?;
        if let Some(n) = &b.post_ffn_norm {
            mlp = candle_nn::ops::rms_norm(&mlp, n, eps)?;
        }
        Ok((x1, mlp))
    }

    /// Layer `l`'s attention of the rows `q` (`[T, H, D]`, RoPE applied, the step's K/V already
    /// written) over the cache: `[T, H·D]`.
    fn attend(&self, l: usize, q: &Tensor, s: &Step) -> Result<Tensor> {
        let cfg = &self.cfg;
        let t = q.dim(0)?;
        let attn = paged_attention(
            q,
            s.cache,
            l,
            s.batch,
            s.decode,
            cfg.attn_scale,
            cfg.attn_softcap,
        )?;
        Ok(attn.reshape((t, cfg.num_heads * cfg.head_dim))?)
    }

    /// The last residual add (`x + mlp`), final norm, output projection and soft-capping: f32
    /// logits of the rows of `x`.
    fn head(&self, x: &Tensor, mlp: Option<&Tensor>) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps as f32;
        let dense = self.lm_head.dense_weight();
        let logits = match dense {
            Some(w) if self.small_step(x.dim(0)?) => {
                let norm = Some((&self.norm, eps));
                let bias = self.lm_head.bias();
                gemv::project(x, mlp, norm, w, bias, Epilogue::Logits)?.1
            }
            _ => {
                let (_, x) = fused::add_rms_norm(x, mlp, &self.norm, eps)?;
                self.lm_head.forward(&x)?.to_dtype(DType::F32)?
            }
        };
        Ok(match self.cfg.final_softcap {
            Some(c) => ((logits / c as f64)?.tanh()? * c as f64)?,
            None => logits,
        })
    }
}

/// The host side of a forward pass ([`Llama::begin`]).
pub struct Batch {
    pub slices: Vec<SeqSlice>,
    /// New tokens of every sequence, flattened in input order.
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
}

/// What every layer of one forward pass shares.
struct Step<'a> {
    pos: &'a Tensor,
    rope: &'a Rope,
    batch: &'a [SeqSlice],
    decode: &'a [DecodeGroup],
    writes: &'a Writes<'a>,
    cache: &'a PagedKvCache,
}

/// A RoPE base's cos/sin: the f32 tables `[positions, D/2]` for the fused kernel, or the
/// batch's rows of them in the compute dtype `[T, D/2]` for candle's `rope_thd`.
enum Rope {
    Tables(Tensor, Tensor),
    Rows(Tensor, Tensor),
}

/// How a forward pass writes the new K/V rows into the cache.
enum Writes<'a> {
    /// `(seq, start, offset, n)` per sequence ([`PagedKvCache::write_spans`]).
    Spans(&'a [WriteSpan]),
    /// A fixed step's rows, through device copies of where they go only
    /// ([`PagedKvCache::write_fixed`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Fixed(&'a FixedWrites),
}
