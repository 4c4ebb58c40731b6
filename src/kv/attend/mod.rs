//! Attention of each sequence's new query tokens over its cached keys and values.
//!
//! Sequences are ragged: each has its own length and positions, so each is attended on its own
//! (no padding, no shared offset). Grouped-query attention folds the query heads that share a KV
//! head into the row dimension of one matmul, so K/V are never repeated per query head. Scores,
//! mask and softmax are computed in f32 whatever the cache dtype. Layers stored rotated
//! (`kv::format::rotation`) attend in the rotated space: the query is rotated in, the output back.

pub mod decode;
pub mod dense;
#[cfg(feature = "cuda")]
pub mod fixed;
pub mod plan;
mod residual;

pub use decode::{decode_attention, decode_attention_rotated};
pub use dense::attend_one;
#[cfg(feature = "cuda")]
pub use fixed::FixedStep;
pub use plan::{plan_decode, DecodeGroup, SeqSlice, SliceGroup};

use candle_core::{Result, Tensor};

use crate::kv::cache::PagedKvCache;
use dense::{attend_masked, chunk_mask};

/// `q`: `[T, heads, head_dim]` for all new tokens of the batch (after RoPE); the new K/V are
/// already written to the cache. Queries planned by [`plan_decode`] use the fused decode kernel;
/// other prompt chunks gather their keys and values. Returns `[T, heads, head_dim]`.
pub fn paged_attention(
    q: &Tensor,
    cache: &PagedKvCache,
    layer: usize,
    batch: &[SeqSlice],
    decode: &[DecodeGroup],
    scale: f64,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let cfg = cache.config();
    let window = cache.layer_window(layer);
    let group = cache.group_of(layer);
    if softcap.is_some() && cache.centers_keys(layer) {
        return Err(candle_core::Error::Msg(format!(
            "layer {layer}: --kv-center shifts every score of a query by the same amount, which \
             softmax ignores but this model's soft-capping of the scores does not; run without \
             --kv-center"
        )));
    }
    let mut outs: Vec<Option<Tensor>> = vec![None; batch.len()];
    for g in decode.iter().filter(|_| softcap.is_none()) {
        let rot = cache.rotation(layer, g.main);
        let t = g.tables.get(group).ok_or_else(|| {
            candle_core::Error::Msg(format!("layer {layer}: its layer group was not planned"))
        })?;
        let qg = match &g.rows {
            Some(rows) => q.index_select(rows, 0)?,
            None => q.narrow(0, 0, t.starts.dim(0)?)?,
        };
        let step = decode::StepTables {
            tables: &t.tables,
            starts: &t.starts,
            lens: &g.lens,
            host: Some(t.host.view()),
        };
        let o = if g.main && cache.residual(layer) > 0 {
            residual::attend(&qg, cache, layer, g, t, batch, scale as f32)?
        } else {
            decode::decode_attention_step(
                &qg,
                cache.layer_storage(layer, g.main),
                &step,
                cfg.block_size,
                cfg.num_kv_heads,
                scale as f32,
                rot,
            )?
        };
        if g.members.len() == batch.len() {
            return Ok(o); // every sequence is in this group, in batch order
        }
        for &(i, at, n) in &g.members {
            outs[i] = Some(o.narrow(0, at, n)?);
        }
    }
    for (i, s) in batch.iter().enumerate() {
        if outs[i].is_some() {
            continue;
        }
        let sg = s.groups.get(group).ok_or_else(|| {
            candle_core::Error::Msg(format!("layer {layer}: its layer group was not sliced"))
        })?;
        let slots = match sg.slots.get() {
            Some(t) => t.clone(),
            None => {
                let end = s.start + s.n;
                let host = cache
                    .slots(s.seq, group, sg.kstart, end)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let t = Tensor::from_vec(host, end - sg.kstart, q.device())?;
                sg.slots.get_or_init(|| t.clone());
                t
            }
        };
        let in_main = cache
            .in_main_pool(s.seq)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        // Rotated rows (main pool): attend in the rotated space, then rotate the output back.
        let rot = in_main.then(|| cache.rotation(layer, true)).flatten();
        if in_main && cache.residual(layer) > 0 {
            return Err(candle_core::Error::Msg(format!(
                "layer {layer}: --kv-residual attends through the fused decode kernels, which \
                 this {} does not use; run without --kv-residual",
                if softcap.is_some() {
                    "model (attention logit soft-capping)"
                } else {
                    "prompt chunk"
                }
            )));
        }
        let (k, v) = cache
            .gather(layer, s.seq, &slots, q.dtype())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let qs = q.narrow(0, s.offset, s.n)?;
        let mask = match sg.mask.get() {
            Some(m) => m.clone(),
            None => {
                let m = chunk_mask(s.n, k.dim(0)?, s.start, sg.kstart, window, q.device())?;
                sg.mask.get_or_init(|| m.clone());
                m
            }
        };
        let o = match rot {
            Some(r) => r.unrotate(&attend_masked(
                &r.rotate(&qs)?,
                &k,
                &v,
                mask.as_ref(),
                scale,
                softcap,
            )?)?,
            None => attend_masked(&qs, &k, &v, mask.as_ref(), scale, softcap)?,
        };
        outs[i] = Some(o);
    }
    let outs: Vec<Tensor> = outs.into_iter().flatten().collect();
    Tensor::cat(&outs, 0)
}

#[cfg(test)]
mod rotated_tests {
    use super::*;
    use crate::kv::cache::CacheConfig;
    use crate::kv::format::{KvFormat, QuantFormat};
    use candle_core::DType;
    use candle_core::Device;

    /// A cache whose one layer stores 8-bit rotated rows, holding `len` random positions of
    /// sequence 0, plus the rows as written (unrotated, `[len, KVH, D]`).
    fn filled(len: usize, kvh: usize, d: usize) -> (PagedKvCache, Tensor, Tensor) {
        let dev = Device::Cpu;
        let mut cfg = CacheConfig::dense(1, kvh, d, 4, 64, DType::F32);
        cfg.formats[0] = KvFormat::affine(QuantFormat::new(8, 32).unwrap(), DType::F32, true);
        let mut c = PagedKvCache::new(cfg, &dev).unwrap();
        c.add_sequence(0).unwrap();
        c.reserve(0, len).unwrap();
        let k = Tensor::randn(0f32, 1.0, (len, kvh * d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (len, kvh * d), &dev).unwrap();
        c.write(0, 0, 0, &k, &v).unwrap();
        c.advance(0, len).unwrap();
        let shape = (len, kvh, d);
        (c, k.reshape(shape).unwrap(), v.reshape(shape).unwrap())
    }

    /// Rotated storage must be invisible to attention: the output equals dense attention over
    /// the stored rows rotated back (exact up to f32 rounding), in the decode kernel and in the
    /// prefill path alike, and is close to attention over the original rows (8-bit error).
    #[test]
    fn rotated_layers_attend_like_their_unrotated_rows() {
        let (kvh, h, d, len) = (2, 6, 64, 23);
        let (cache, k, v) = filled(len, kvh, d);
        let rot = cache.rotation(0, true).expect("rotated layer").clone();
        let slots =
            Tensor::from_vec(cache.slots(0, 0, 0, len).unwrap(), len, &Device::Cpu).unwrap();
        let (kr, vr) = cache.gather(0, 0, &slots, DType::F32).unwrap();
        let (ku, vu) = (rot.unrotate(&kr).unwrap(), rot.unrotate(&vr).unwrap());
        let scale = 1.0 / (d as f64).sqrt();
        for (n, as_decode) in [(1usize, false), (5, false), (5, true)] {
            let start = len - n;
            let q = Tensor::randn(0f32, 1.0, (n, h, d), &Device::Cpu).unwrap();
            let batch = [SeqSlice::new(&cache, 0, 0, start, n)];
            batch[0].groups[0].slots.get_or_init(|| slots.clone());
            let plan = plan_decode(&cache, &batch, as_decode).unwrap();
            assert_eq!(plan.len(), usize::from(n == 1 || as_decode));
            let got = paged_attention(&q, &cache, 0, &batch, &plan, scale, None).unwrap();
            let want = attend_one(&q, &ku, &vu, start, 0, None, scale).unwrap();
            let exact = (&got - &want).unwrap().abs().unwrap().max_all().unwrap();
            let exact: f32 = exact.to_scalar().unwrap();
            assert!(exact < 1e-4, "n={n}: rotated vs unrotated-back {exact}");
            let orig = attend_one(&q, &k, &v, start, 0, None, scale).unwrap();
            let err: f32 = (&got - &orig)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert!(err < 0.05, "n={n}: 8-bit rotated error {err}");
        }
    }
}
