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

use super::decode::{self, HostTables, HostView, StepTables};
use super::plan::{DecodeGroup, GroupTables, SeqSlice};
use crate::kv::cache::residual::Tail;
use crate::kv::cache::{PagedKvCache, SeqId};

/// Most (query, KV head) tasks of a sequence's dense part run on the calling thread (each is
/// at most `N + S` rows of one head: microseconds).
const SERIAL_TASKS: usize = 16;

/// What one sequence's tail holds, read before the quantized part is cut short.
#[derive(Clone, Copy)]
struct Held {
    /// First position of the window's rows, and one past its last.
    start: usize,
    end: usize,
    /// Sink rows held (positions `0..sinks`).
    sinks: usize,
}

#[cfg(feature = "cuda")]
pub(super) mod gpu;

/// Attention of decode group `g`'s queries `q` (`[Q, H, D]`, unrotated) over `layer`, whose
/// newest `cache.residual(layer)` positions per query are attended dense. `t`: the group's
/// tables in the layer's group. Returns `[Q, H, D]`. On a CUDA cache the copies and the whole
/// merge stay on the device (`gpu`).
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
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return gpu::attend(q, cache, layer, g, t, batch, scale);
    }
    let cfg = cache.config();
    let (n_q, heads, hd) = q.dims3()?;
    let width = cfg.width();
    let keep = cache.residual(layer);
    let kvh = cfg.num_kv_heads.max(1);
    // Each query's sequence, and what each member sequence's tail holds.
    let (seq_of, ids) = members(g, batch, n_q)?;
    let held: Vec<Option<Held>> = ids
        .iter()
        .map(|&id| {
            cache.with_residual(id, layer, |tail| {
                tail.map(|t| Held {
                    start: t.start,
                    end: t.end(width),
                    sinks: t.sinks_held(width),
                })
            })
        })
        .collect();
    let host = &t.host;
    let (qs, lo) = parts(host, &seq_of, &held, keep);
    let starts_q = Tensor::new(qs.as_slice(), q.device())?;
    let lens_q = Tensor::new(lo.as_slice(), q.device())?;
    let step = cut_step(t, (&starts_q, &lens_q), (&qs, &lo));
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
    // Per sequence, under its tail's lock: one task per (query, KV head); a few run here, since
    // waking the pool for them costs more than they do (a decode step's 3 at the default model).
    for (&(_, at, n), &id) in g.members.iter().zip(&ids) {
        let rows_out = &mut out[at * heads * hd..(at + n) * heads * hd];
        cache.with_residual(id, layer, |tail| {
            let Some(tail) = tail else { return };
            let task = |(task, o): (usize, &mut [f32])| {
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
            };
            let chunk = dims.group * hd;
            if n * kvh <= SERIAL_TASKS {
                rows_out.chunks_mut(chunk).enumerate().for_each(task);
            } else {
                rows_out.par_chunks_mut(chunk).enumerate().for_each(task);
            }
        });
        // A prompt chunk's rows go now, but for what its last query saw: a chunk is attended
        // once per layer and step, and a decode step attended again sees the same (`advance`
        // trims the rest).
        if let Some(&last) = host.lens.get(at + n - 1) {
            cache.trim_residual(id, layer, (last as usize).saturating_sub(keep));
        }
    }
    Tensor::from_vec(out, (n_q, heads, hd), q.device())?.to_dtype(q.dtype())
}

/// Each query's member of `g` (its index in `g.members`) and each member's sequence.
fn members(g: &DecodeGroup, batch: &[SeqSlice], n_q: usize) -> Result<(Vec<usize>, Vec<SeqId>)> {
    let mut seq_of = vec![0usize; n_q];
    let mut ids = Vec::with_capacity(g.members.len());
    for (m, &(i, at, n)) in g.members.iter().enumerate() {
        seq_of[at..at + n].fill(m);
        let s = batch
            .get(i)
            .ok_or_else(|| candle_core::Error::Msg(format!("residual: no batch entry {i}")))?;
        ids.push(s.seq);
    }
    Ok((seq_of, ids))
}

/// The quantized part's step: the plan's block tables `t` with each query's cut span
/// (`starts`, `lens` on the device; `qs`, `lo` their host copies).
fn cut_step<'a>(
    t: &'a GroupTables,
    (starts, lens): (&'a Tensor, &'a Tensor),
    (qs, lo): (&'a [u32], &'a [u32]),
) -> StepTables<'a> {
    StepTables {
        tables: &t.tables,
        starts,
        lens,
        host: Some(HostView {
            tables: &t.host.tables,
            starts: qs,
            lens: lo,
        }),
    }
}

/// Each query's parts, of the positions `[start, len)` it sees (`host`): the sinks held
/// `[start, hs)`, the quantized rows `[qs, lo)` (`qs = max(start, hs)`) and the window
/// `[lo, len)` — its newest `keep` positions, where copies are held. `held`: what the tail of
/// each member sequence holds; `seq_of`: each query's member. Returns `(qs, lo)`.
fn parts(
    host: &HostTables,
    seq_of: &[usize],
    held: &[Option<Held>],
    keep: usize,
) -> (Vec<u32>, Vec<u32>) {
    let n_q = seq_of.len();
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
    (qs, lo)
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
    use crate::kv::cache::{CacheConfig, SeqId};
    use crate::kv::format::{KvFormat, QuantFormat};
    use candle_core::Device;
    use std::collections::HashMap;

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
        seq: SeqId,
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        start: usize,
        (keep, sinks): (usize, usize),
        scale: f64,
    ) -> Tensor {
        let len = k.dim(0).unwrap();
        let slots = Tensor::from_vec(cache.slots(seq, 0, 0, len).unwrap(), len, k.device());
        let (kq, vq) = cache.gather(0, seq, &slots.unwrap(), DType::F32).unwrap();
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
    /// plain affine rows, keys one bit wider than values. (Not 4-bit keys on the CPU: the 8-bit
    /// query pass it takes for them differs from f32 scores by more than 1e-4.)
    #[test]
    fn merged_attention_matches_a_mixed_dense_reference() {
        check_merged(&Device::Cpu, DType::F16, &[(8, 8), (5, 4), (3, 3)]);
    }

    /// The same on the CUDA warp kernels, which attend the window as more splits of their
    /// launch (windows of 1 to 230 rows: one window block to several); f32 scales, so the warp
    /// kernel keeps the queries f32 (it reads them in the scales' type).
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_merged_attention_matches_a_mixed_dense_reference() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        check_merged(&dev, DType::F32, &[(8, 8), (5, 4), (4, 4), (4, 3), (3, 3)]);
    }

    /// f32 queries over f16 scales take the block-wide kernels, whose merge returns the
    /// log-sum-exp `residual_merge` needs (the warp kernels attend the window themselves).
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_block_wide_kernels_merge_the_window_after() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        check_merged(&dev, DType::F16, &[(8, 8), (4, 4)]);
    }

    /// [`merged_attention_matches_a_mixed_dense_reference`] on `dev`, scales in `sdt`, for
    /// each (key bits, value bits); the 3-bit case unrotated.
    fn check_merged(dev: &Device, sdt: DType, widths: &[(u32, u32)]) {
        let dev = dev.clone();
        let (kvh, h, d) = (2, 6, 64);
        let scale = 1.0 / (d as f64).sqrt();
        for &(key, value) in widths {
            let rotated = key != 3;
            for (keep, sinks) in [(1, 0), (5, 0), (23, 0), (200, 0), (1, 3), (5, 19), (6, 30)] {
                let mut cfg = CacheConfig::dense(1, kvh, d, 4, 64, DType::F32);
                let (kf, vf) = (QuantFormat::new(key, 32), QuantFormat::new(value, 32));
                cfg.formats[0] = KvFormat::Affine {
                    key: kf.unwrap(),
                    value: vf.unwrap(),
                    scale_dtype: sdt,
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
                    // A decode step attended again (as `bench-kv-cache` repeats one): the same.
                    // (A prompt chunk's rows go once attended: its earlier queries could not
                    // be attended again.)
                    if n == 1 {
                        let again = paged_attention(&q, &cache, 0, &batch, &plan, scale, None);
                        let again = crate::ops::testing::max_abs_diff(&got, &again.unwrap());
                        assert_eq!(again, 0.0, "a repeated call at {at}+{n}");
                    }
                    cache.advance(0, n).unwrap();
                    let hist = (
                        k.narrow(0, 0, at + n).unwrap(),
                        v.narrow(0, 0, at + n).unwrap(),
                    );
                    let want = reference(&cache, 0, &hist.0, &hist.1, &q, at, (keep, sinks), scale);
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

    /// Sequences decoded together, their rows written as one batch (each at its own offset),
    /// after prompts of their own; one removed and its place taken by another, and more
    /// sequences than the first copies had room for: every query still equals its own
    /// sequence's reference at 1e-4.
    #[test]
    fn batched_sequences_attend_their_own_copies() {
        check_batched(&Device::Cpu, DType::F16, (8, 8));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_batched_sequences_attend_their_own_copies() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        check_batched(&dev, DType::F32, (4, 3));
    }

    fn check_batched(dev: &Device, sdt: DType, (key, value): (u32, u32)) {
        let (kvh, h, d, keep, sinks) = (2, 4, 64, 6, 2);
        let scale = 0.125;
        let mut cfg = CacheConfig::dense(1, kvh, d, 4, 128, DType::F32);
        cfg.formats[0] = KvFormat::Affine {
            key: QuantFormat::new(key, 32).unwrap(),
            value: QuantFormat::new(value, 32).unwrap(),
            scale_dtype: sdt,
            rotated: true,
        };
        (cfg.residual, cfg.sinks) = (keep, sinks);
        let mut cache = PagedKvCache::new(cfg, dev).unwrap();
        let w = kvh * d;
        let mut hist: HashMap<SeqId, (Tensor, Tensor)> = HashMap::new();
        let rows = |n: usize| Tensor::randn(0f32, 1.0, (n, w), dev).unwrap();
        // A step: `steps` (sequence, n) written as one batch, then attended together.
        let mut step = |cache: &mut PagedKvCache, steps: &[(SeqId, usize)]| {
            let total: usize = steps.iter().map(|s| s.1).sum();
            let (k, v) = (rows(total), rows(total));
            let mut spans = Vec::new();
            let mut batch_at = Vec::new();
            let mut off = 0;
            for &(id, n) in steps {
                if !cache.contains(id) {
                    cache.add_sequence(id).unwrap();
                }
                let at = cache.seq_len(id).unwrap();
                cache.reserve(id, n).unwrap();
                spans.push((id, at, off, n));
                batch_at.push((id, off, at, n));
                let e = hist.entry(id).or_insert_with(|| (rows(0), rows(0)));
                let cat = |a: &Tensor, b: Tensor| Tensor::cat(&[a, &b], 0).unwrap();
                *e = (
                    cat(&e.0, k.narrow(0, off, n).unwrap()),
                    cat(&e.1, v.narrow(0, off, n).unwrap()),
                );
                off += n;
            }
            cache.write_spans(0, &spans, &k, &v).unwrap();
            let q = Tensor::randn(0f32, 1.0, (total, h, d), dev).unwrap();
            let batch: Vec<SeqSlice> = batch_at
                .iter()
                .map(|&(id, off, at, n)| SeqSlice::new(cache, id, off, at, n))
                .collect();
            let plan = plan_decode(cache, &batch, true).unwrap();
            let got = paged_attention(&q, cache, 0, &batch, &plan, scale, None).unwrap();
            for &(id, off, at, n) in &batch_at {
                let (hk, hv) = &hist[&id];
                let qs = q.narrow(0, off, n).unwrap();
                let want = reference(cache, id, hk, hv, &qs, at, (keep, sinks), scale);
                let err = crate::ops::testing::max_abs_diff(&got.narrow(0, off, n).unwrap(), &want);
                assert!(err < 1e-4, "sequence {id} at {at}+{n}: {err}");
            }
            for &(id, n) in steps {
                cache.advance(id, n).unwrap();
            }
        };
        step(&mut cache, &[(0, 9)]);
        step(&mut cache, &[(1, 13)]);
        for _ in 0..3 {
            step(&mut cache, &[(0, 1), (1, 1)]);
        }
        step(&mut cache, &[(0, 5), (1, 1)]);
        cache.remove_sequence(0);
        step(&mut cache, &[(2, 3), (3, 11), (1, 1)]);
        for _ in 0..8 {
            step(&mut cache, &[(1, 1), (2, 1), (3, 1)]);
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
