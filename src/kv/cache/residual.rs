//! `--kv-residual N`: dense copies of each sequence's newest rows, so every query attends its
//! newest `N` positions exactly and only older ones through their quantized rows (KIVI's
//! full-precision residual). Measured on the default model, this is where quantization error
//! costs most: a query weighs its recent positions heavily.
//!
//! The quantized rows are written as always (every position has one, so the pools' layout,
//! windows and block accounting are those of the cache without `N`; prompt files add the copies
//! a run needs to go on from them, `held`); beside them each (sequence, quantized layer) keeps the f16 rows of its newest
//! positions, `N − 1` of them between steps plus the rows being attended — what the queries at
//! positions `start..start + n` see dense is `start + 1 − N ..= start + n − 1`.
//! With `--kv-sinks S` the first `S` positions' rows are kept too, for good (attention sinks:
//! many heads put much of their weight on a sequence's first tokens, whatever the query).
//! `kv::attend::residual` merges the parts of each query's attention.

use half::f16;
use half::slice::HalfFloatSliceExt;
use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::{CacheError, KvFormat, PagedKvCache, Result, SeqId, WriteSpan};

impl PagedKvCache {
    /// Positions each query of `layer` attends through dense copies (`--kv-residual`): the
    /// setting on quantized layers, 0 on dense ones.
    pub fn residual(&self, layer: usize) -> usize {
        match self.cfg.formats.get(layer) {
            Some(KvFormat::Affine { .. }) => self.cfg.residual,
            _ => 0,
        }
    }

    /// Calls `f` with the dense copies of `id`'s newest rows in `layer` (`None`: none kept).
    pub fn with_residual<R>(
        &self,
        id: SeqId,
        layer: usize,
        f: impl FnOnce(Option<&Tail>) -> R,
    ) -> R {
        self.tails.with(id, layer, f)
    }

    /// `layer`'s device copies and, per sequence of `ids` (none when the caller has what they
    /// read already), what its queries read (`None`: the copies are in host memory,
    /// [`PagedKvCache::with_residual`]).
    #[cfg(feature = "cuda")]
    pub fn ring_view(
        &self,
        layer: usize,
        ids: &[SeqId],
    ) -> Option<(super::ring::RingView, Vec<super::ring::RingSeq>)> {
        self.tails.device.as_ref()?.view(layer, ids)
    }

    /// Commits `layer`'s rows written this step for `ids` to the device copies, once their
    /// queries have been attended (`ring`'s module doc says why not before).
    #[cfg(feature = "cuda")]
    pub fn commit_ring(&self, layer: usize, ids: &[SeqId]) -> Result<()> {
        match &self.tails.device {
            Some(r) => r.commit(layer, Some(ids)),
            None => Ok(()),
        }
    }

    /// Lets `layer`'s host copies of `id` go before position `from`, once the step's queries
    /// of that layer have attended them: a prompt chunk's rows would otherwise stay in every
    /// layer until the step ends (`advance` trims what is left).
    pub fn trim_residual(&self, id: SeqId, layer: usize, from: usize) {
        self.tails.trim(id, Some(layer), from, self.cfg.width());
    }

    /// Keeps dense copies of a write's rows (`k`, `v`: `[T, width]`, spans as
    /// [`PagedKvCache::write_spans`] takes them) where `layer` has a residual window.
    pub(super) fn keep_residual(
        &self,
        layer: usize,
        spans: &[WriteSpan],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let keep = self.residual(layer);
        if keep == 0 {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.tails.device {
            return r.stage(layer, spans, k, v);
        }
        let w = self.cfg.width();
        let rows = |x: &Tensor| x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (kf, vf) = (rows(k)?, rows(v)?);
        for &(id, start, offset, n) in spans {
            let span = offset * w..(offset + n) * w;
            let (Some(kr), Some(vr)) = (kf.get(span.clone()), vf.get(span)) else {
                return Err(CacheError::Rows(format!(
                    "write: rows {offset}..{} of a batch of {} rows",
                    offset + n,
                    kf.len() / w.max(1)
                )));
            };
            self.tails
                .push(id, layer, start, (kr, vr), w, keep, self.cfg.sinks);
        }
        Ok(())
    }
}

/// Dense copies of one (sequence, layer)'s newest K and V rows, `width` values each.
#[derive(Debug, Default, Clone)]
pub struct Tail {
    /// Position of the first row held.
    pub start: usize,
    pub k: Vec<f16>,
    pub v: Vec<f16>,
    /// Rows of positions `0..` (the sinks), up to `sinks` of them.
    pub sink_k: Vec<f16>,
    pub sink_v: Vec<f16>,
}

impl Tail {
    /// Rows held.
    pub fn len(&self, width: usize) -> usize {
        self.k.len() / width.max(1)
    }

    /// One past the last position held.
    pub fn end(&self, width: usize) -> usize {
        self.start + self.len(width)
    }

    /// Sink rows held (positions `0..sinks_held`).
    pub fn sinks_held(&self, width: usize) -> usize {
        self.sink_k.len() / width.max(1)
    }

    /// Keeps the rows of positions below `sinks` among `start..start + n` (after dropping any at
    /// or after `start`: a rewound sequence); a gap leaves the sinks as they are (short).
    fn push_sinks(&mut self, start: usize, k: &[f32], v: &[f32], width: usize, sinks: usize) {
        let held = self.sinks_held(width);
        if start > held || start >= sinks {
            return;
        }
        self.sink_k.truncate(start * width);
        self.sink_v.truncate(start * width);
        let n = (k.len() / width.max(1)).min(sinks - start);
        extend_f16(&mut self.sink_k, &k[..n * width]);
        extend_f16(&mut self.sink_v, &v[..n * width]);
    }

    /// Takes rows `k`, `v` (`n × width`, f32) as positions `start..start + n`, keeping the
    /// `keep − 1` positions before `start` that the new queries still see dense. Rows at or
    /// after `start` (a rewound sequence) are dropped first; a gap before `start` empties the
    /// tail (those positions have no dense copies, so they attend quantized).
    fn push(&mut self, start: usize, k: &[f32], v: &[f32], width: usize, keep: usize) {
        let first = (start + 1).saturating_sub(keep);
        if self.end(width) < start || self.k.is_empty() || start < self.start {
            self.k.clear();
            self.v.clear();
            self.start = start;
        }
        let held = start.min(self.end(width));
        self.k.truncate((held - self.start) * width);
        self.v.truncate((held - self.start) * width);
        self.drop_before(first, width);
        extend_f16(&mut self.k, k);
        extend_f16(&mut self.v, v);
    }

    /// Drops the window's rows of positions before `from`, and the room a prompt chunk's rows
    /// took (else every layer would keep a whole chunk's capacity for good: tens of MiB for a
    /// 2,048-token chunk on the default model).
    fn drop_before(&mut self, from: usize, width: usize) {
        if from > self.start {
            let n = (from - self.start).min(self.len(width));
            self.k.drain(..n * width);
            self.v.drain(..n * width);
            self.start += n;
            for x in [&mut self.k, &mut self.v] {
                if x.capacity() > 2 * x.len() + 16 * width {
                    x.shrink_to(x.len() + width);
                }
            }
        }
    }
}

/// Appends `x` rounded to f16 (one slice conversion: F16C where the CPU has it).
fn extend_f16(dst: &mut Vec<f16>, x: &[f32]) {
    let at = dst.len();
    dst.resize(at + x.len(), f16::ZERO);
    dst[at..].convert_from_f32_slice(x);
}

/// The tails of every sequence of a cache, by layer: in host memory for the CPU's kernel, or
/// on the device (`ring`) for CUDA's.
#[derive(Default)]
pub(super) struct Tails {
    host: Mutex<HashMap<SeqId, Vec<Tail>>>,
    #[cfg(feature = "cuda")]
    pub(super) device: Option<super::ring::Rings>,
}

impl Tails {
    /// Tails for `cfg`'s layers on `device`: rings on a CUDA device, host rows otherwise.
    pub(super) fn new(cfg: &super::CacheConfig, device: &candle_core::Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if cfg.residual > 0 && device.is_cuda() {
            let quantized: Vec<bool> = cfg
                .formats
                .iter()
                .map(|f| matches!(f, KvFormat::Affine { .. }))
                .collect();
            let rings =
                super::ring::Rings::new(&quantized, cfg.width(), cfg.residual, cfg.sinks, device)?;
            return Ok(Tails {
                device: Some(rings),
                ..Default::default()
            });
        }
        let _ = (cfg, device);
        Ok(Tails::default())
    }

    /// Takes rows of positions `start..` of `id` in `layer`: `keep` newest (the window) and the
    /// first `sinks`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &self,
        id: SeqId,
        layer: usize,
        start: usize,
        (k, v): (&[f32], &[f32]),
        width: usize,
        keep: usize,
        sinks: usize,
    ) {
        let mut m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let layers = m.entry(id).or_default();
        if layers.len() <= layer {
            layers.resize_with(layer + 1, Tail::default);
        }
        let t = &mut layers[layer];
        if sinks > 0 {
            t.push_sinks(start, k, v, width, sinks);
        }
        t.push(start, k, v, width, keep);
    }

    /// Makes `tail` the copies of `id` in `layer` (imported ones: [`PagedKvCache::import_held`]).
    pub(super) fn install(&self, id: SeqId, layer: usize, tail: Tail) {
        let mut m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let layers = m.entry(id).or_default();
        if layers.len() <= layer {
            layers.resize_with(layer + 1, Tail::default);
        }
        layers[layer] = tail;
    }

    /// Drops the rows of `id` before position `from` in every layer, or in `layer` alone.
    pub(super) fn trim(&self, id: SeqId, layer: Option<usize>, from: usize, width: usize) {
        let mut m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let layers = m.get_mut(&id).into_iter().flatten().enumerate();
        for (_, t) in layers.filter(|(l, _)| layer.is_none_or(|x| x == *l)) {
            t.drop_before(from, width);
        }
    }

    pub(super) fn with<R>(&self, id: SeqId, layer: usize, f: impl FnOnce(Option<&Tail>) -> R) -> R {
        let m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        f(m.get(&id).and_then(|layers| layers.get(layer)))
    }

    pub(super) fn remove(&self, id: SeqId) {
        let mut m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(&id);
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.device {
            r.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(from: usize, n: usize) -> Vec<f32> {
        (from..from + n).map(|p| p as f32).collect()
    }

    /// Width 1, rows valued by their position: what the tail holds after each push.
    #[test]
    fn keeps_the_newest_rows_a_query_sees_dense() {
        let mut t = Tail::default();
        let push = |t: &mut Tail, start: usize, n: usize| {
            t.push(start, &rows(start, n), &rows(start, n), 1, 4)
        };
        let held = |t: &Tail| {
            (
                t.start,
                t.k.iter().map(|x| x.to_f32() as usize).collect::<Vec<_>>(),
            )
        };
        push(&mut t, 0, 6); // a prompt chunk: all its rows
        assert_eq!(held(&t), (0, (0..6).collect()));
        push(&mut t, 6, 1); // a decode step sees 3..=6
        assert_eq!(held(&t), (3, vec![3, 4, 5, 6]));
        push(&mut t, 7, 2);
        assert_eq!(held(&t), (4, vec![4, 5, 6, 7, 8]));
        push(&mut t, 6, 1); // rewound to 6: rows 6.. replaced
        assert_eq!(held(&t), (4, vec![4, 5, 6]));
        push(&mut t, 20, 1); // a gap: nothing before 20 is held
        assert_eq!(held(&t), (20, vec![20]));
        push(&mut t, 2, 1); // rewound before the tail
        assert_eq!(held(&t), (2, vec![2]));
    }

    /// The first rows stay whatever the window does, across chunk boundaries; a rewind into
    /// them replaces them; a sequence that starts past them (imported rows) holds none.
    #[test]
    fn sinks_keep_the_first_rows() {
        let tails = Tails::default();
        let push = |start: usize, n: usize| {
            tails.push(1, 0, start, (&rows(start, n), &rows(start, n)), 1, 2, 3)
        };
        let sinks = || {
            tails.with(1, 0, |t| {
                t.unwrap()
                    .sink_k
                    .iter()
                    .map(|x| x.to_f32() as usize)
                    .collect::<Vec<_>>()
            })
        };
        push(0, 2);
        assert_eq!(sinks(), [0, 1]);
        push(2, 5);
        assert_eq!(sinks(), [0, 1, 2]);
        push(7, 1);
        assert_eq!(sinks(), [0, 1, 2]);
        push(1, 1); // rewound to 1
        assert_eq!(sinks(), [0, 1]);
        tails.push(2, 0, 5, (&rows(5, 2), &rows(5, 2)), 1, 2, 3);
        tails.with(2, 0, |t| assert_eq!(t.unwrap().sinks_held(1), 0));
    }

    /// After a step only the rows the next query sees dense stay, in every layer of the
    /// sequence; other sequences keep theirs.
    #[test]
    fn trimming_keeps_what_the_next_query_sees() {
        let tails = Tails::default();
        for layer in 0..2 {
            tails.push(7, layer, 0, (&rows(0, 10), &rows(0, 10)), 1, 4, 0);
            tails.push(8, layer, 0, (&rows(0, 10), &rows(0, 10)), 1, 4, 0);
        }
        tails.trim(7, None, 7, 1); // next query at 10 sees 7..=10
        for layer in 0..2 {
            tails.with(7, layer, |t| {
                let t = t.unwrap();
                assert_eq!(t.start, 7);
                assert_eq!(t.k.len(), 3);
                assert_eq!(t.v[0].to_f32(), 7.0);
            });
            tails.with(8, layer, |t| assert_eq!(t.unwrap().k.len(), 10));
        }
        tails.remove(7);
        tails.with(7, 0, |t| assert!(t.is_none()));
    }

    /// Trimmed after a long prompt chunk, a tail gives back the room the chunk's rows took.
    #[test]
    fn trimming_a_chunk_gives_its_room_back() {
        let tails = Tails::default();
        let width = 8;
        tails.push(1, 0, 0, (&rows(0, 4096), &rows(0, 4096)), width, 4, 0);
        tails.trim(1, Some(0), 509, width);
        tails.with(1, 0, |t| {
            let t = t.unwrap();
            assert_eq!((t.start, t.len(width)), (509, 3));
            assert!(t.k.capacity() <= 4 * width && t.v.capacity() <= 4 * width);
        });
    }
}
