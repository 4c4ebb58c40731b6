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
use crate::kv::cache::residual::Tail;
use crate::kv::cache::PagedKvCache;

/// What one sequence's tail holds, read before the quantized part is cut short.
#[derive(Clone, Copy)]
struct Held {
    /// First position of the window's rows, and one past its last.
    start: usize,
    end: usize,
    /// Sink rows held (positions `0..sinks`).
    sinks: usize,
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
    let width = cfg.width();
    let keep = cache.residual(layer);
    let kvh = cfg.num_kv_heads.max(1);
    // Each query's sequence, and what each member sequence's tail holds.
    let mut seq_of = vec![0usize; n_q];
    let mut ids = Vec::with_capacity(g.members.len());
    let mut held: Vec<Option<Held>> = Vec::with_capacity(g.members.len());
    for (m, &(i, at, n)) in g.members.iter().enumerate() {
        seq_of[at..at + n].fill(m);
        let id = batch
            .get(i)
            .ok_or_else(|| candle_core::Error::Msg(format!("residual: no batch entry {i}")))?
            .seq;
        ids.push(id);
        held.push(cache.with_residual(id, layer, |tail| {
            tail.map(|t| Held {
                start: t.start,
                end: t.end(width),
                sinks: t.sinks_held(width),
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
        let h = held[seq_of[r]];
        let hs = h.map_or(0, |h| h.sinks.min(len));
        let q0 = st.max(hs);
        let l = match h {
            Some(h) if h.end >= len => len.saturating_sub(keep).max(h.start).max(q0),
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
        cfg.num_kv_heads,
        scale,
        cache.rotation(layer, g.main),
    )?;
    let mut out: Vec<f32> = oq.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let qv: Vec<f32> = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let dims = Dims {
        group: heads / kvh,
        hd,
        width,
        scale,
    };
    // Per sequence, under its tail's lock: one task per (query, KV head).
    for (&(_, at, n), &id) in g.members.iter().zip(&ids) {
        let rows_out = &mut out[at * heads * hd..(at + n) * heads * hd];
        cache.with_residual(id, layer, |tail| {
            let Some(tail) = tail else { return };
            rows_out
                .par_chunks_mut(dims.group * hd)
                .enumerate()
                .for_each(|(task, o)| {
                    let (r, kh) = (at + task / kvh, task % kvh);
                    let span = (
                        host.starts[r] as usize,
                        lo[r] as usize,
                        host.lens[r] as usize,
                    );
                    let h0 = r * heads + kh * dims.group;
                    let qh = &qv[h0 * hd..][..dims.group * hd];
                    let lq = &lse[h0..][..dims.group];
                    dense_part(tail, kh, span, qh, lq, dims, o);
                });
        });
    }
    Tensor::from_vec(out, (n_q, heads, hd), q.device())?.to_dtype(q.dtype())
}

/// Shapes of the dense part.
#[derive(Clone, Copy)]
struct Dims {
    /// Query heads per KV head.
    group: usize,
    hd: usize,
    width: usize,
    scale: f32,
}

/// One query's KV head `kh` over its dense rows — the sinks among `start..` and the window
/// `lo..len` (`span`) of `tail` — merged into `o` (the group's query heads, `[G, hd]`, holding
/// the quantized part normalized; its log-sum-exp per head in `lq`). `qh`: the group's queries.
fn dense_part(
    tail: &Tail,
    kh: usize,
    (st, lo, len): (usize, usize, usize),
    qh: &[f32],
    lq: &[f32],
    d: Dims,
    o: &mut [f32],
) {
    let (hd, w, g) = (d.hd, d.width, d.group);
    let sinks = st..tail.sinks_held(w).min(len);
    // Where each dense row's head slice starts: sinks, then the window.
    let at: Vec<(bool, usize)> = sinks
        .map(|p| (true, p * w + kh * hd))
        .chain((lo..len).map(|p| (false, (p - tail.start) * w + kh * hd)))
        .collect();
    if at.is_empty() {
        return;
    }
    let n = at.len();
    let row = |(sink, i): (bool, usize), k: bool, buf: &mut [f32]| {
        let src = match (sink, k) {
            (true, true) => &tail.sink_k,
            (true, false) => &tail.sink_v,
            (false, true) => &tail.k,
            (false, false) => &tail.v,
        };
        src[i..i + hd].convert_to_f32_slice(buf);
    };
    let mut buf = vec![0f32; hd];
    // Scores `[G, n]`, each row converted once for the group's heads.
    let mut s = vec![0f32; g * n];
    for (j, &a) in at.iter().enumerate() {
        row(a, true, &mut buf);
        for (jj, q) in qh.chunks_exact(hd).enumerate() {
            s[jj * n + j] = d.scale * dot(q, &buf);
        }
    }
    // Softmax numerators in place; each head's max and sum.
    let mut mz = vec![(0f32, 0f32); g];
    for (sj, mzj) in s.chunks_exact_mut(n).zip(mz.iter_mut()) {
        let m = sj.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for x in sj.iter_mut() {
            *x = (*x - m).exp();
            z += *x;
        }
        *mzj = (m, z);
    }
    let mut acc = vec![0f32; g * hd];
    for (j, &a) in at.iter().enumerate() {
        row(a, false, &mut buf);
        for (jj, acc) in acc.chunks_exact_mut(hd).enumerate() {
            let wgt = s[jj * n + j];
            acc.iter_mut().zip(&buf).for_each(|(x, v)| *x += wgt * v);
        }
    }
    // Merge with the quantized part (log-sum-exp `lq`, output already normalized).
    for (jj, oh) in o.chunks_exact_mut(hd).enumerate() {
        let (m, z) = mz[jj];
        let ld = m + z.ln();
        let top = lq[jj].max(ld);
        let (a, b) = ((lq[jj] - top).exp(), (ld - top).exp());
        for (x, ac) in oh.iter_mut().zip(&acc[jj * hd..][..hd]) {
            *x = (a * *x + b * ac / z) / (a + b);
        }
    }
}

/// `Σ a·b` in eight running sums (so it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    s.iter().sum::<f32>() + rest
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
