//! A decode step of a few rows on CUDA through the fused projections ([`gemv`]): the layer
//! as four kernels besides attention's (docs/ARCHITECTURE.md, "One decode step").

use anyhow::{bail, Result};
use candle_core::Tensor;

use super::{Block, GateUpProj, Llama, QkvProj, Rope, Step, Writes};
use crate::model::fused;
use crate::model::gemv::{self, Epilogue};
use crate::model::linear::Linear;

impl Llama {
    /// Whether a pass of `rows` rows runs on the fused projections ([`gemv`]).
    pub(super) fn small_step(&self, rows: usize) -> bool {
        let c = &self.cfg;
        self.small
            && rows <= gemv::max_rows()
            && [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
                .iter()
                .all(|&width| gemv::rows_fit(rows, width))
    }

    /// [`Llama::block`] for a step of a few rows on CUDA ([`Llama::small_step`]): four kernels
    /// besides attention's and a quantized cache's write (norm + q|k|v + RoPE + dense K/V
    /// write; output projection + residual; norm + gate|up + gated unit; down + residual), five
    /// with per-head q/k norms (Qwen3).
    /// Returns the residual stream after the layer.
    pub(super) fn block_small(
        &self,
        l: usize,
        b: &Block,
        x: &Tensor,
        mlp: Option<&Tensor>,
        s: &Step<'_>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps as f32;
        let (QkvProj::Fused(qkv), GateUpProj::Fused(gate_up), Rope::Tables(cos, sin)) =
            (&b.qkv, &b.gate_up, s.rope)
        else {
            bail!("layer {l}: the fused small-step path needs stacked projections and RoPE tables");
        };
        let dense = |lin: &Linear| {
            lin.dense_weight()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("layer {l}: a projection is not dense"))
        };
        let dense_pool = match s.writes {
            Writes::Fixed(w) => s.cache.dense_layer(l, self.dtype).map(|p| (p, &*w.slots)),
            Writes::Spans(_) => None,
        };
        let slots = match &dense_pool {
            Some((_, slots)) => Some(slots.on(x.device())?),
            None => None,
        };
        let rope = gemv::RopeOut {
            pos: s.pos,
            cos,
            sin,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            pool: dense_pool
                .zip(slots.as_ref())
                .map(|(((kp, vp), _), sl)| (kp, vp, sl)),
        };
        let norm = Some((&b.attn_norm, eps));
        let (sum, q, kv) = match b.qk_norm(eps) {
            // Per-head q/k norms need a whole head's outputs: the projection, then the norms
            // with RoPE and the K/V write as one more kernel.
            Some(qk) => {
                let (sum, y) =
                    gemv::project(x, mlp, norm, &dense(qkv)?, qkv.bias(), Epilogue::Store)?;
                let (shape, tables) = ((nh, nkv, hd), (cos, sin));
                match rope.pool {
                    Some(pools) => {
                        let q = fused::rope_qkv_into(&y, s.pos, tables, shape, Some(qk), pools)?;
                        (sum, q, None)
                    }
                    None => {
                        let (q, k, v) = fused::rope_qkv(&y, s.pos, tables, shape, Some(qk))?;
                        (sum, q, Some((k, v)))
                    }
                }
            }
            None => gemv::project_rope(x, mlp, norm, &dense(qkv)?, qkv.bias(), rope)?,
        };
        let x = sum.unwrap_or_else(|| x.clone());
        if let Some((k, v)) = kv {
            match s.writes {
                Writes::Spans(spans) => s.cache.write_spans(l, spans, &k, &v)?,
                Writes::Fixed(w) => s.cache.write_fixed(l, w, &k, &v)?,
            }
        }
        let attn = self.attend(l, &q, s)?;
        let (o, down) = (&b.o, &b.down);
        let (_, x1) = gemv::project(&attn, None, None, &dense(o)?, o.bias(), Epilogue::Add(&x))?;
        let glu = Epilogue::Glu {
            gelu: cfg.arch.is_gemma(),
        };
        let norm = Some((&b.ffn_norm, eps));
        let (_, act) = gemv::project(&x1, None, norm, &dense(gate_up)?, gate_up.bias(), glu)?;
        let add = Epilogue::Add(&x1);
        Ok(gemv::project(&act, None, None, &dense(down)?, down.bias(), add)?.1)
    }
}

/// The one-row fused path of a model with per-head q/k norms (Qwen3 shape, random f16 weights)
/// against the op-by-op layer on the same GPU: same logits up to f16 rounding and the two paths'
/// sum orders.
#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::super::{Llama, LogitsFor, SeqInput};
    use crate::kv::cache::{CacheConfig, PagedKvCache};
    use crate::model::config::ModelConfig;
    use crate::model::weights::Weights;
    use crate::ops::testing::{max_abs, max_abs_diff};
    use candle_core::{DType, Device, Tensor};

    fn logits(m: &Llama, dev: &Device, prompt: &[u32], steps: &[u32]) -> Vec<Tensor> {
        let c = m.config();
        let cfg = CacheConfig::dense(c.num_layers, c.num_kv_heads, c.head_dim, 16, 16, DType::F16);
        let mut cache = PagedKvCache::new(cfg, dev).unwrap();
        cache.add_sequence(0).unwrap();
        cache.reserve(0, prompt.len()).unwrap();
        let inp = [SeqInput {
            seq: 0,
            tokens: prompt.to_vec(),
        }];
        m.forward(&inp, &mut cache, LogitsFor::Last).unwrap();
        let mut out = Vec::new();
        for &t in steps {
            cache.reserve(0, 1).unwrap();
            let inp = [SeqInput {
                seq: 0,
                tokens: vec![t],
            }];
            out.push(m.forward(&inp, &mut cache, LogitsFor::Last).unwrap());
        }
        out
    }

    #[test]
    fn one_row_steps_with_qk_norms_match_the_op_by_op_layer() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let cfg = ModelConfig::from_hf_json(&serde_json::json!({
            "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 4096,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true
        }))
        .unwrap();
        assert!(cfg.qk_norm);
        let mut w = Weights::dummy(&cfg, &dev, DType::F16, 7).unwrap();
        let mut m = Llama::load(&cfg, &mut w).unwrap();
        assert!(m.small, "a one-row step takes the fused path");
        let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 512).collect();
        let steps = [3u32, 400, 77, 211];
        let fused = logits(&m, &dev, &prompt, &steps);
        m.small = false;
        let plain = logits(&m, &dev, &prompt, &steps);
        for (i, (a, b)) in fused.iter().zip(&plain).enumerate() {
            let (scale, err) = (max_abs(b), max_abs_diff(a, b));
            assert!(scale > 0.0, "step {i}: logits are all zero");
            assert!(
                err <= 2e-2 * scale,
                "step {i}: max |fused - plain| {err} of {scale}"
            );
        }
    }
}
