//! Attention of each sequence's new query tokens over its cached keys and values.
//!
//! Sequences are ragged: each has its own length and positions, so each is attended on its own
//! (no padding, no shared offset). Grouped-query attention folds the query heads that share a KV
//! head into the row dimension of one matmul, so K/V are never repeated per query head. Scores,
//! mask and softmax are computed in f32 whatever the cache dtype. Layers stored rotated
//! (`kv::rotation`) attend in the rotated space: the query is rotated in, the output back.

use candle_core::{DType, Result, Tensor};
use std::cell::OnceCell;

use super::cache::{PagedKvCache, SeqId};
use super::decode::decode_attention_rotated;

/// One sequence's share of a forward pass: `n` new tokens at positions `start..start + n`,
/// rows `offset..offset + n` of the flattened batch.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    pub seq: SeqId,
    pub offset: usize,
    pub start: usize,
    pub n: usize,
    /// First key position any of the new tokens can see (> 0 only with a sliding window).
    pub kstart: usize,
    /// Cache slots of positions `kstart..start + n` (u32), shared by all layers: built by the
    /// first layer that gathers this sequence's rows (a prompt chunk off the decode kernel), so
    /// a decode step neither lists nor uploads any sequence's whole history.
    pub slots: OnceCell<Tensor>,
    /// A prompt chunk's causal mask (`None`: it needs none), built by the first layer that
    /// attends the chunk by gathering and shared by the others.
    pub mask: OnceCell<Option<Tensor>>,
}

/// Queries that share a pool and go through the fused decode kernel together: every decode
/// token (n = 1), and with `prefill_as_decode` every prompt token too. Built once per forward
/// pass (block tables are the same in every layer).
pub struct DecodeGroup {
    main: bool,
    /// Per member sequence, in batch order: its index in the batch, and the range of its
    /// queries among the group's rows.
    members: Vec<(usize, usize, usize)>,
    /// Row of each query in the flattened batch (u32 `[Q]`); `None` when they are rows 0..Q in
    /// order (a decode-only batch: no gather launch per layer).
    rows: Option<Tensor>,
    tables: Tensor,
    starts: Tensor,
    lens: Tensor,
}

/// Groups the batch's decode tokens (n = 1) by pool for [`paged_attention`]. With
/// `prefill_as_decode`, each token of a prompt chunk joins too, as a decode query of its own
/// position (visible keys up to and including itself): each query then has one summation order
/// whatever chunk or batch it came in (the CPU decode kernel's order depends only on the
/// query's visible span), so prompts give the same K/V however they are chunked and batched —
/// the batch-invariant path. Without it, chunks attend with matmuls over their keys
/// ([`attend_one`]), whose rounding depends on the chunk's shape.
pub fn plan_decode(
    cache: &PagedKvCache,
    batch: &[SeqSlice],
    prefill_as_decode: bool,
) -> Result<Vec<DecodeGroup>> {
    let err = |e: super::cache::CacheError| candle_core::Error::Msg(e.to_string());
    let dev = cache.device();
    let mut groups = Vec::new();
    for main in [true, false] {
        let mut members = Vec::new();
        let mut tables = Vec::new();
        let (mut rows, mut starts, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for (i, s) in batch.iter().enumerate() {
            if (s.n == 1 || prefill_as_decode) && cache.in_main_pool(s.seq).map_err(err)? == main {
                members.push((i, rows.len(), s.n));
                let table = cache.block_table(s.seq).map_err(err)?;
                for t in 0..s.n {
                    let pos = s.start + t;
                    rows.push((s.offset + t) as u32);
                    starts.push(cache.first_visible(pos) as u32);
                    lens.push(pos as u32 + 1);
                    tables.push(table.clone());
                }
            }
        }
        if members.is_empty() {
            continue;
        }
        let width = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat(0)).take(width))
            .collect();
        let q = rows.len();
        let in_order = rows.iter().enumerate().all(|(i, &r)| r == i as u32);
        groups.push(DecodeGroup {
            main,
            rows: if in_order {
                None
            } else {
                Some(Tensor::from_vec(rows, q, dev)?)
            },
            starts: Tensor::from_vec(starts, q, dev)?,
            lens: Tensor::from_vec(lens, q, dev)?,
            tables: Tensor::from_vec(flat, (q, width), dev)?,
            members,
        });
    }
    Ok(groups)
}

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
) -> Result<Tensor> {
    let cfg = cache.config();
    let mut outs: Vec<Option<Tensor>> = vec![None; batch.len()];
    for g in decode {
        let rot = cache.rotation(layer, g.main);
        let qg = match &g.rows {
            Some(rows) => q.index_select(rows, 0)?,
            None => q.narrow(0, 0, g.starts.dim(0)?)?,
        };
        let o = decode_attention_rotated(
            &qg,
            cache.layer_storage(layer, g.main),
            &g.tables,
            &g.starts,
            &g.lens,
            cfg.block_size,
            cfg.num_kv_heads,
            scale as f32,
            rot,
        )?;
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
        let slots = match s.slots.get() {
            Some(t) => t.clone(),
            None => {
                let end = s.start + s.n;
                let host = cache
                    .slots(s.seq, s.kstart, end)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let t = Tensor::from_vec(host, end - s.kstart, q.device())?;
                s.slots.get_or_init(|| t.clone());
                t
            }
        };
        let (k, v) = cache
            .gather(layer, s.seq, &slots, q.dtype())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let qs = q.narrow(0, s.offset, s.n)?;
        let mask = match s.mask.get() {
            Some(m) => m.clone(),
            None => {
                let m = chunk_mask(s.n, k.dim(0)?, s.start, s.kstart, cfg.window, q.device())?;
                s.mask.get_or_init(|| m.clone());
                m
            }
        };
        // Rotated rows: attend in the rotated space, then rotate the output back.
        let rot = cache
            .in_main_pool(s.seq)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?
            .then(|| cache.rotation(layer, true))
            .flatten();
        let o = match rot {
            Some(r) => r.unrotate(&attend_masked(
                &r.rotate(&qs)?,
                &k,
                &v,
                mask.as_ref(),
                scale,
            )?)?,
            None => attend_masked(&qs, &k, &v, mask.as_ref(), scale)?,
        };
        outs[i] = Some(o);
    }
    let outs: Vec<Tensor> = outs.into_iter().flatten().collect();
    Tensor::cat(&outs, 0)
}

/// Causal attention of `q` (`[n, H, D]`, positions `start..start+n`) over `k`, `v`
/// (`[L, KVH, D]`, positions `kstart..start + n`); with a `window` W a query at p sees only
/// positions > p − W.
pub fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    kstart: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor> {
    let mask = chunk_mask(q.dim(0)?, k.dim(0)?, start, kstart, window, q.device())?;
    attend_masked(q, k, v, mask.as_ref(), scale)
}

/// The additive mask `attend_one` needs for `n` queries over `l` keys, if any (one query with
/// no window that cuts its keys sees them all): 0 where query `i` (position `start + i`) may see
/// key `j` (position `kstart + j`), else -inf. Built on `dev` from two position vectors: a long
/// prefill chunk's `[n, L]` mask would otherwise be filled on the host and copied over for every
/// layer.
fn chunk_mask(
    n: usize,
    l: usize,
    start: usize,
    kstart: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if n <= 1 && window.is_none_or(|w| l <= w) {
        return Ok(None);
    }
    // Positions as f32 are exact far beyond any context window (2^24).
    let qpos = Tensor::arange(start as u32, (start + n) as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let kpos = Tensor::arange(kstart as u32, (kstart + l) as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((1, l))?;
    let mut visible = kpos.broadcast_le(&qpos)?; // u8 [n, L]
    if let Some(w) = window {
        // p - kp < w  <=>  kp > p - w
        let lo = (&qpos - w as f64)?;
        visible = (visible * kpos.broadcast_gt(&lo)?)?;
    }
    let zeros = Tensor::zeros((n, l), DType::F32, dev)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (n, l), dev)?;
    visible.where_cond(&zeros, &blocked).map(Some)
}

/// [`attend_one`] with its mask (`[n, L]`, or none) given.
fn attend_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let (n, h, d) = q.dims3()?;
    let (l, kvh, _) = k.dims3()?;
    let g = h / kvh;
    let dtype = q.dtype();
    // [n, H, D] -> [KVH, G*n, D]: query heads of one KV head become rows of one matmul.
    let qg = q
        .reshape((n, kvh, g, d))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, g * n, d))?;
    let kt = k.transpose(0, 1)?.contiguous()?; // [KVH, L, D]
    let vt = v.transpose(0, 1)?.contiguous()?;
    let scores = qg
        .matmul(&kt.t()?)?
        .to_dtype(DType::F32)?
        .affine(scale, 0.0)?; // [KVH, G*n, L]
    let scores = match mask {
        Some(mask) => scores
            .reshape((kvh, g, n, l))?
            .broadcast_add(mask)?
            .reshape((kvh, g * n, l))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
    probs
        .matmul(&vt)? // [KVH, G*n, D]
        .reshape((kvh, g, n, d))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((n, h, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Straightforward per-head attention with explicit loops, the reference for `attend_one`.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        h: usize,
        kvh: usize,
        d: usize,
        start: usize,
    ) -> Vec<f32> {
        let l = start + n;
        let g = h / kvh;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; n * h * d];
        for i in 0..n {
            for hh in 0..h {
                let kh = hh / g;
                let qv = &q[(i * h + hh) * d..(i * h + hh + 1) * d];
                let vis = start + i + 1;
                let s: Vec<f32> = (0..vis)
                    .map(|j| {
                        let kv = &k[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
                        qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in 0..d {
                        out[(i * h + hh) * d + c] += ej / z * v[(j * kvh + kh) * d + c];
                    }
                }
            }
            let _ = l;
        }
        out
    }

    #[test]
    fn matches_naive_attention_gqa_and_offsets() {
        let dev = Device::Cpu;
        for &(n, h, kvh, start) in &[(1, 6, 2, 9), (5, 6, 3, 0), (4, 8, 1, 3), (3, 4, 4, 2)] {
            let d = 8;
            let l = start + n;
            let q = Tensor::randn(0f32, 1.0, (n, h, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (l, kvh, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (l, kvh, d), &dev).unwrap();
            let got = attend_one(&q, &k, &v, start, 0, None, 1.0 / (d as f64).sqrt()).unwrap();
            let want = naive(
                &q.flatten_all().unwrap().to_vec1().unwrap(),
                &k.flatten_all().unwrap().to_vec1().unwrap(),
                &v.flatten_all().unwrap().to_vec1().unwrap(),
                n,
                h,
                kvh,
                d,
                start,
            );
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err < 1e-5,
                "n={n} h={h} kvh={kvh} start={start}: max err {err}"
            );
        }
    }
}

#[cfg(test)]
mod rotated_tests {
    use super::*;
    use crate::kv::cache::CacheConfig;
    use crate::kv::layer::KvFormat;
    use crate::kv::quant::QuantFormat;
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
        let slots = Tensor::from_vec(cache.slots(0, 0, len).unwrap(), len, &Device::Cpu).unwrap();
        let (kr, vr) = cache.gather(0, 0, &slots, DType::F32).unwrap();
        let (ku, vu) = (rot.unrotate(&kr).unwrap(), rot.unrotate(&vr).unwrap());
        let scale = 1.0 / (d as f64).sqrt();
        for (n, as_decode) in [(1usize, false), (5, false), (5, true)] {
            let start = len - n;
            let q = Tensor::randn(0f32, 1.0, (n, h, d), &Device::Cpu).unwrap();
            let batch = [SeqSlice {
                seq: 0,
                offset: 0,
                start,
                n,
                kstart: 0,
                slots: slots.clone().into(),
                mask: Default::default(),
            }];
            let plan = plan_decode(&cache, &batch, as_decode).unwrap();
            assert_eq!(plan.len(), usize::from(n == 1 || as_decode));
            let got = paged_attention(&q, &cache, 0, &batch, &plan, scale).unwrap();
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
