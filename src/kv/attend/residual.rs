//! Decode attention with a dense residual window (`--kv-residual N`): a query at position `p`
//! attends positions `p − N + 1 ..= p` — and with `--kv-sinks S` positions `0..S` — through the
//! dense f16 copies of their rows (`kv::cache::residual`) and the others through the quantized
//! pool, as one softmax.
//!
//! The fused kernel attends the quantized part (its visible span cut short) and returns each
//! query head's log-sum-exp; the dense part — at most `N` rows per query — is summed here, and
//! the two are merged like two position splits of the kernel. Both parts depend only on the
//! query's own position and history, so a prompt token attended as a decode query gets what the
//! same position gets when decoded (batch invariance holds).

use candle_core::{DType, Result, Tensor};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::decode::{self, HostView, StepTables};
use super::plan::{DecodeGroup, GroupTables, SeqSlice};
use crate::kv::cache::PagedKvCache;

/// The dense rows of one sequence, widened to f32: positions `start..start + k.len() / width`
/// (the window) and `0..sk.len() / width` (the sinks).
struct Dense {
    start: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    sk: Vec<f32>,
    sv: Vec<f32>,
}

/// Attention of decode group `g`'s queries `q` (`[Q, H, D]`, unrotated) over `layer`, whose
/// newest `cache.residual(layer)` positions per query are attended dense. `t`: the group's
/// tables in the layer's group. Returns `[Q, H, D]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    q: &Tensor,
    cache: &PagedKvCache,
    layer: usize,
    g: &DecodeGroup,
    t: &GroupTables,
    batch: &[SeqSlice],
    scale: f32,
) -> Result<Tensor> {
    let cfg = cache.config();
    let (n_q, heads, hd) = q.dims3()?;
    let (kvh, width) = (cfg.num_kv_heads, cfg.width());
    let group = heads / kvh.max(1);
    let keep = cache.residual(layer);
    // Each query's sequence, and the dense rows of each member sequence.
    let mut seq_of = vec![0usize; n_q];
    let mut dense: Vec<Option<Dense>> = Vec::with_capacity(g.members.len());
    for (m, &(i, at, n)) in g.members.iter().enumerate() {
        seq_of[at..at + n].fill(m);
        let id = batch
            .get(i)
            .ok_or_else(|| candle_core::Error::Msg(format!("residual: no batch entry {i}")))?
            .seq;
        dense.push(cache.with_residual(id, layer, |tail| {
            tail.map(|t| Dense {
                start: t.start,
                k: t.k.to_f32_vec(),
                v: t.v.to_f32_vec(),
                sk: t.sink_k.to_f32_vec(),
                sv: t.sink_v.to_f32_vec(),
            })
        }));
    }
    // Each query's parts, of the positions [start, len) it sees: the sinks held [start, hs),
    // the quantized rows [max(start, hs), lo) and the window [lo, len) — its newest `keep`
    // positions, where copies are held.
    let host = &t.host;
    let (mut qs, mut lo) = (vec![0u32; n_q], vec![0u32; n_q]);
    for r in 0..n_q {
        let (st, len) = (host.starts[r] as usize, host.lens[r] as usize);
        let d = dense[seq_of[r]].as_ref();
        let hs = d.map_or(0, |d| (d.sk.len() / width).min(len));
        let q0 = st.max(hs);
        let l = match d {
            Some(d) if d.start + d.k.len() / width >= len => {
                len.saturating_sub(keep).max(d.start).max(q0)
            }
            _ => len,
        };
        qs[r] = q0.min(l) as u32;
        lo[r] = l.min(len) as u32;
    }
    let starts_q = Tensor::new(qs.as_slice(), q.device())?;
    let lens_q = Tensor::new(lo.as_slice(), q.device())?;
    let step = StepTables {
        tables: &t.tables,
        starts: &starts_q,
        lens: &lens_q,
        host: Some(HostView {
            tables: &host.tables,
            starts: &qs,
            lens: &lo,
        }),
    };
    let (oq, lse) = decode::decode_attention_step_lse(
        q,
        cache.layer_storage(layer, g.main),
        &step,
        cfg.block_size,
        kvh,
        scale,
        cache.rotation(layer, g.main),
    )?;
    let mut out: Vec<f32> = oq.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let qv: Vec<f32> = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    out.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(r, o)| {
            let (st, lo, len) = (
                host.starts[r] as usize,
                lo[r] as usize,
                host.lens[r] as usize,
            );
            let Some(d) = dense[seq_of[r]].as_ref() else {
                return;
            };
            // Dense rows: (K, V, index) of the visible sinks, then of the window.
            let sinks = st..(d.sk.len() / width).min(len);
            let rows: Vec<(&[f32], &[f32], usize)> = sinks
                .map(|p| (&d.sk[..], &d.sv[..], p))
                .chain((lo..len).map(|p| (&d.k[..], &d.v[..], p - d.start)))
                .collect();
            if rows.is_empty() {
                return;
            }
            let mut s = vec![0f32; rows.len()];
            let mut acc = vec![0f32; hd];
            for h in 0..heads {
                let col = (h / group) * hd;
                let qh = &qv[(r * heads + h) * hd..][..hd];
                for (sj, &(k, _, i)) in s.iter_mut().zip(&rows) {
                    let row = &k[i * width + col..][..hd];
                    *sj = scale * qh.iter().zip(row).map(|(a, b)| a * b).sum::<f32>();
                }
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                acc.fill(0.0);
                let mut z = 0f32;
                for (&sj, &(_, v, i)) in s.iter().zip(&rows) {
                    let w = (sj - m).exp();
                    z += w;
                    let row = &v[i * width + col..][..hd];
                    acc.iter_mut().zip(row).for_each(|(a, x)| *a += w * x);
                }
                // Merge with the quantized part (log-sum-exp `lq`, output already normalized).
                let lq = lse[r * heads + h];
                let ld = m + z.ln();
                let top = lq.max(ld);
                let (a, b) = ((lq - top).exp(), (ld - top).exp());
                let oh = &mut o[h * hd..][..hd];
                for (x, ac) in oh.iter_mut().zip(&acc) {
                    *x = (a * *x + b * ac / z) / (a + b);
                }
            }
        });
    Tensor::from_vec(out, (n_q, heads, hd), q.device())?.to_dtype(q.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::{attend_one, paged_attention, plan_decode};
    use super::*;
    use crate::kv::cache::CacheConfig;
    use crate::kv::format::{KvFormat, QuantFormat};
    use candle_core::Device;

    /// Rows rounded to f16, as the dense copies hold them.
    fn f16_rows(x: &Tensor) -> Tensor {
        x.to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    }

    /// Reference: each query at `p` attends positions `> p − keep` and `< sinks` through the
    /// written rows (rounded to f16) and the others through the stored rows dequantized (and
    /// rotated back), as one softmax — dense attention over a per-query mix of the two.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        cache: &PagedKvCache,
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        start: usize,
        (keep, sinks): (usize, usize),
        scale: f64,
    ) -> Tensor {
        let len = k.dim(0).unwrap();
        let slots = Tensor::from_vec(cache.slots(0, 0, 0, len).unwrap(), len, &Device::Cpu);
        let (kq, vq) = cache.gather(0, 0, &slots.unwrap(), DType::F32).unwrap();
        let (kq, vq) = match cache.rotation(0, true) {
            Some(r) => (r.unrotate(&kq).unwrap(), r.unrotate(&vq).unwrap()),
            None => (kq, vq),
        };
        let shape = kq.shape().clone();
        let (kd, vd) = (f16_rows(k), f16_rows(v));
        let (kd, vd) = (kd.reshape(&shape).unwrap(), vd.reshape(&shape).unwrap());
        let outs: Vec<Tensor> = (0..q.dim(0).unwrap())
            .map(|i| {
                let p = start + i;
                let cut = (p + 1).saturating_sub(keep);
                let mix = |quant: &Tensor, dense: &Tensor| {
                    let rows: Vec<Tensor> = (0..=p)
                        .map(|j| {
                            let from = if j >= cut || j < sinks { dense } else { quant };
                            from.narrow(0, j, 1).unwrap()
                        })
                        .collect();
                    Tensor::cat(&rows, 0).unwrap()
                };
                let qi = q.narrow(0, i, 1).unwrap();
                attend_one(&qi, &mix(&kq, &kd), &mix(&vq, &vd), p, 0, None, scale).unwrap()
            })
            .collect();
        Tensor::cat(&outs, 0).unwrap()
    }

    /// The merged attention equals the reference at 1e-4 for prompt chunks attended as decode
    /// queries and for decode steps, windows shorter and longer than the history, rotated and
    /// plain affine rows, keys one bit wider than values. (Not 4-bit keys: the 8-bit query pass
    /// the CPU takes for them differs from f32 scores by more than 1e-4.)
    #[test]
    fn merged_attention_matches_a_mixed_dense_reference() {
        let dev = Device::Cpu;
        let (kvh, h, d) = (2, 6, 64);
        let scale = 1.0 / (d as f64).sqrt();
        for (key, value, rotated) in [(8, 8, true), (5, 4, true), (3, 3, false)] {
            for (keep, sinks) in [(1, 0), (5, 0), (23, 0), (200, 0), (1, 3), (5, 19), (6, 30)] {
                let mut cfg = CacheConfig::dense(1, kvh, d, 4, 64, DType::F32);
                let (kf, vf) = (QuantFormat::new(key, 32), QuantFormat::new(value, 32));
                cfg.formats[0] = KvFormat::Affine {
                    key: kf.unwrap(),
                    value: vf.unwrap(),
                    scale_dtype: DType::F16,
                    rotated,
                };
                cfg.residual = keep;
                cfg.sinks = sinks;
                let mut cache = PagedKvCache::new(cfg, &dev).unwrap();
                cache.add_sequence(0).unwrap();
                let total = 40;
                let k = Tensor::randn(0f32, 1.0, (total, kvh * d), &dev).unwrap();
                let v = Tensor::randn(0f32, 1.0, (total, kvh * d), &dev).unwrap();
                // A prompt chunk of 17, then three decode steps, then a chunk of 20.
                let mut at = 0;
                for n in [17, 1, 1, 1, 20] {
                    cache.reserve(0, n).unwrap();
                    let (kn, vn) = (k.narrow(0, at, n).unwrap(), v.narrow(0, at, n).unwrap());
                    cache.write(0, 0, at, &kn, &vn).unwrap();
                    let q = Tensor::randn(0f32, 1.0, (n, h, d), &dev).unwrap();
                    let batch = [SeqSlice::new(&cache, 0, 0, at, n)];
                    let plan = plan_decode(&cache, &batch, true).unwrap();
                    let got = paged_attention(&q, &cache, 0, &batch, &plan, scale, None).unwrap();
                    cache.advance(0, n).unwrap();
                    let hist = (
                        k.narrow(0, 0, at + n).unwrap(),
                        v.narrow(0, 0, at + n).unwrap(),
                    );
                    let want = reference(&cache, &hist.0, &hist.1, &q, at, (keep, sinks), scale);
                    let err = crate::ops::testing::max_abs_diff(&got, &want);
                    assert!(
                        err < 1e-4,
                        "K{key}/V{value} rotated {rotated}, keep {keep}, sinks {sinks}, chunk at \
                         {at}+{n}: {err}"
                    );
                    at += n;
                }
            }
        }
    }

    /// Without dense copies (rows imported from a prompt file) every position attends
    /// quantized: the result is the plain decode kernel's.
    #[test]
    fn positions_without_copies_attend_quantized() {
        let dev = Device::Cpu;
        let (kvh, h, d) = (1, 2, 64);
        let mut cfg = CacheConfig::dense(1, kvh, d, 4, 16, DType::F32);
        cfg.formats[0] = KvFormat::affine(QuantFormat::new(8, 64).unwrap(), DType::F16, true);
        let mut with_cfg = cfg.clone();
        with_cfg.residual = 8;
        let mut plain = PagedKvCache::new(cfg, &dev).unwrap();
        let mut with = PagedKvCache::new(with_cfg, &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (12, kvh * d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (12, kvh * d), &dev).unwrap();
        plain.add_sequence(0).unwrap();
        plain.reserve(0, 12).unwrap();
        plain.write(0, 0, 0, &k, &v).unwrap();
        plain.advance(0, 12).unwrap();
        with.add_sequence(0).unwrap();
        with.import_rows(0, &plain.export_rows(0).unwrap(), 16)
            .unwrap();
        let q = Tensor::randn(0f32, 1.0, (1, h, d), &dev).unwrap();
        let out = |c: &PagedKvCache| {
            let batch = [SeqSlice::new(c, 0, 0, 11, 1)];
            let plan = plan_decode(c, &batch, true).unwrap();
            let o = paged_attention(&q, c, 0, &batch, &plan, 0.125, None).unwrap();
            o.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(out(&with), out(&plain));
    }
}
