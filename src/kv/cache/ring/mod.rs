//! `--kv-residual` on a GPU: the dense copies of each sequence's newest and first rows kept on
//! the device, so a decode step reads nothing back to the host (`residual` keeps them in host
//! memory for the CPU's kernel).
//!
//! Each quantized layer has one f16 pool per K and V of `slots × (S + R)` rows: a sequence's
//! slot holds its `S` sink rows (positions `0..S`), then a ring of `R = N` rows where position
//! `p` sits at row `p mod R`. A write's rows are not put in the ring at once: they stay
//! *pending* (the step's own f16 rows) until the layer has been attended, because a long prompt
//! chunk would overwrite ring rows that its first queries still read. The attention reads rows
//! before the write's start from the ring and the others from the pending rows; afterwards the
//! write's last `N − 1` rows (all the next query can see) and its sink rows are committed.
//! A captured decode step (one new row per sequence, `engine::graphs`) cannot commit on the
//! host: it writes its rows into the rings before the attention instead ([`Rings::fixed_rows`]
//! says why that is safe for one row) and the host books them after the replay.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

mod fixed;
pub use fixed::FixedRow;

use super::held::HeldLayer;
use super::{CacheError, Result, SeqId, WriteSpan};
use crate::kv::format::ops::SlotRows;
use crate::kv::format::scatter::scatter_rows;

/// Positions of one (sequence, layer) whose copies are where the attention can read them.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Meta {
    /// Ring rows of positions `lo..hi` are intact.
    lo: usize,
    hi: usize,
    /// Sink rows held: positions `0..sinks`.
    sinks: usize,
}

impl Meta {
    /// A write of positions `start..start + n` staged: sinks as the CPU's tails keep them —
    /// replaced from a rewind into them, extended by a write that continues them, unchanged
    /// after a gap.
    fn stage(&mut self, start: usize, n: usize, sinks: usize) {
        if sinks > 0 && start <= self.sinks && start < sinks {
            self.sinks = (start + n).min(sinks);
        }
    }

    /// Rows of `from..end` committed to a ring of `r` rows; they overwrote `from − r .. end − r`.
    /// Older intact rows stay usable only if they join on (no gap) and were not overwritten by
    /// positions past `end` (a rewind): the last `r` before were intact.
    fn commit(&mut self, from: usize, end: usize, r: usize) {
        self.lo = if from > self.hi || self.lo >= self.hi {
            from
        } else {
            self.lo
                .max(self.hi.saturating_sub(r))
                .max(end.saturating_sub(r))
                .min(from)
        };
        self.hi = end;
    }

    /// The first position of the copies a write starting at `ws` joins on to: ring rows join
    /// its rows only without a gap before it.
    fn joined(&self, ws: usize) -> usize {
        if self.lo < self.hi && self.lo <= ws && ws <= self.hi {
            self.lo
        } else {
            ws
        }
    }
}

/// A layer's write not yet committed to its rings: rows `[T, width]` f16, and per span whether
/// it is committed.
struct Pending {
    k: Tensor,
    v: Tensor,
    spans: Vec<(WriteSpan, bool)>,
}

struct LayerRing {
    k: Tensor,
    v: Tensor,
    pending: Option<Pending>,
}

/// What the attention of one sequence in one layer reads: its slot's first row, its copies'
/// positions, and where this step's write sits among the pending rows.
#[derive(Debug, Clone, Copy)]
pub struct RingSeq {
    pub base: u32,
    /// Dense copies exist for positions `start..end` (ring, then pending rows) and for `0..sinks`.
    pub start: usize,
    pub end: usize,
    pub sinks: usize,
    /// First position of this step's write (`u32::MAX`: none) and its first pending row.
    pub wstart: u32,
    pub woff: u32,
}

/// A layer's rings and pending rows, as the attention reads them (tensors share storage).
pub struct RingView {
    pub k: Tensor,
    pub v: Tensor,
    /// The pending rows (the rings themselves when there are none: never read then).
    pub new_k: Tensor,
    pub new_v: Tensor,
    /// Sink rows per slot, then the ring's rows.
    pub sinks: usize,
    pub ring: usize,
}

struct State {
    slots: HashMap<SeqId, usize>,
    free: Vec<usize>,
    nslots: usize,
    layers: Vec<Option<LayerRing>>,
    meta: HashMap<SeqId, Vec<Meta>>,
    /// The last commit's rows (pending rows → pool rows) and their device indices: every layer
    /// of a step commits the same ones, so only the first uploads them (the gather's only when
    /// a commit gathers).
    last: Option<Moves>,
    /// Bumped whenever the pools move (they grow): captured steps hold their addresses.
    moved: u64,
}

/// Rows moved by a commit: pending row `src[i]` to pool row `dst[i]`, both also on the device
/// (`src` once a commit has gathered).
type Moves = (Vec<u32>, Vec<u32>, Option<Tensor>, Arc<SlotRows>);

/// The device copies of every sequence of a cache (see the module doc).
pub(super) struct Rings {
    state: Mutex<State>,
    width: usize,
    sinks: usize,
    ring: usize,
    device: Device,
}

impl Rings {
    /// Rings for the layers where `quantized[l]`, `keep` (N) positions each plus `sinks`.
    pub(super) fn new(
        quantized: &[bool],
        width: usize,
        keep: usize,
        sinks: usize,
        device: &Device,
    ) -> Result<Self> {
        let per = sinks + keep;
        let layers = quantized
            .iter()
            .map(|&q| {
                q.then(|| -> Result<LayerRing> {
                    Ok(LayerRing {
                        k: Tensor::zeros((per, width), DType::F16, device)?,
                        v: Tensor::zeros((per, width), DType::F16, device)?,
                        pending: None,
                    })
                })
                .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Rings {
            state: Mutex::new(State {
                slots: HashMap::new(),
                free: Vec::new(),
                nslots: 1,
                layers,
                meta: HashMap::new(),
                last: None,
                moved: 0,
            }),
            width,
            sinks,
            ring: keep,
            device: device.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a write's rows (`k`, `v`: `[T, width]`, spans as the cache's writes take them)
    /// as `layer`'s pending rows, committing what an earlier write left pending first.
    pub(super) fn stage(
        &self,
        layer: usize,
        spans: &[WriteSpan],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let mut st = self.lock();
        self.commit_in(&mut st, layer, None)?;
        for &(id, start, _, n) in spans {
            self.slot_of(&mut st, id)?;
            let nl = st.layers.len();
            let m = &mut st
                .meta
                .entry(id)
                .or_insert_with(|| vec![Meta::default(); nl])[layer];
            m.stage(start, n, self.sinks);
        }
        let f16 = |x: &Tensor| x.to_dtype(DType::F16)?.contiguous();
        if let Some(Some(l)) = st.layers.get_mut(layer) {
            l.pending = Some(Pending {
                k: f16(k)?,
                v: f16(v)?,
                spans: spans.iter().map(|&s| (s, false)).collect(),
            });
        }
        Ok(())
    }

    /// Commits `layer`'s pending rows of the sequences `ids` (all: `None`) to their rings.
    pub(super) fn commit(&self, layer: usize, ids: Option<&[SeqId]>) -> Result<()> {
        let mut st = self.lock();
        self.commit_in(&mut st, layer, ids)
    }

    fn commit_in(&self, st: &mut State, layer: usize, ids: Option<&[SeqId]>) -> Result<()> {
        let Some(Some(l)) = st.layers.get_mut(layer) else {
            return Ok(());
        };
        let Some(p) = l.pending.as_mut() else {
            return Ok(());
        };
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        let mut done = Vec::new();
        for (span, committed) in p.spans.iter_mut() {
            let (id, start, offset, n) = *span;
            if *committed || ids.is_some_and(|ids| !ids.contains(&id)) {
                continue;
            }
            *committed = true;
            let Some(&slot) = st.slots.get(&id) else {
                continue;
            };
            let base = slot * (self.sinks + self.ring);
            let end = start + n;
            let meta = st.meta.get(&id).and_then(|m| m.get(layer)).copied();
            let sinks_held = meta.map_or(0, |m| m.sinks);
            for pos in start..end.min(sinks_held) {
                src.push((offset + pos - start) as u32);
                dst.push((base + pos) as u32);
            }
            // The next query (at `end`) sees `end + 1 − N ..`: the write's last N − 1 rows.
            let from = start.max((end + 1).saturating_sub(self.ring));
            for pos in from..end {
                src.push((offset + pos - start) as u32);
                dst.push((base + self.sinks + pos % self.ring) as u32);
            }
            done.push((id, from, end));
        }
        if !src.is_empty() {
            // A decode step commits every row it wrote, in order: no gather.
            let whole =
                src.len() == p.k.dim(0)? && src.iter().enumerate().all(|(i, &s)| s as usize == i);
            if !matches!(&st.last, Some((s, d, ..)) if *s == src && *d == dst) {
                let to = Arc::new(SlotRows::new(dst.clone()));
                st.last = Some((src, dst, None, to));
            }
            if let Some((src, _, idx, to)) = st.last.as_mut() {
                let (rk, rv) = if whole {
                    (p.k.clone(), p.v.clone())
                } else {
                    // The gather's indices, uploaded by the first commit that needs them.
                    let idx = match idx {
                        Some(i) => i.clone(),
                        None => idx
                            .insert(Tensor::new(src.as_slice(), &self.device)?)
                            .clone(),
                    };
                    (p.k.index_select(&idx, 0)?, p.v.index_select(&idx, 0)?)
                };
                scatter_rows(&l.k, to, &rk)?;
                scatter_rows(&l.v, to, &rv)?;
            }
        }
        let r = self.ring;
        for (id, from, end) in done {
            let Some(m) = st.meta.get_mut(&id).and_then(|m| m.get_mut(layer)) else {
                continue;
            };
            m.commit(from, end, r);
        }
        Ok(())
    }

    /// The slot of `id`, given one (and the pools grown) if it has none.
    fn slot_of(&self, st: &mut State, id: SeqId) -> Result<usize> {
        if let Some(&s) = st.slots.get(&id) {
            return Ok(s);
        }
        let s = match st.free.pop() {
            Some(s) => s,
            None => {
                let used = st.slots.len();
                if used >= st.nslots {
                    // Doubling: rows keep their indices, the new slots start zeroed.
                    let add = st.nslots * (self.sinks + self.ring);
                    for l in st.layers.iter_mut().flatten() {
                        let z = Tensor::zeros((add, self.width), DType::F16, &self.device)?;
                        l.k = Tensor::cat(&[&l.k, &z], 0)?;
                        l.v = Tensor::cat(&[&l.v, &z], 0)?;
                    }
                    st.nslots *= 2;
                    st.moved += 1;
                }
                used
            }
        };
        st.slots.insert(id, s);
        Ok(s)
    }

    /// `layer`'s rings and, per sequence of `ids`, what its queries read.
    pub(super) fn view(&self, layer: usize, ids: &[SeqId]) -> Option<(RingView, Vec<RingSeq>)> {
        let st = self.lock();
        let l = st.layers.get(layer)?.as_ref()?;
        let (new_k, new_v) = match &l.pending {
            Some(p) => (p.k.clone(), p.v.clone()),
            None => (l.k.clone(), l.v.clone()),
        };
        let seqs = ids
            .iter()
            .map(|id| {
                let m = st
                    .meta
                    .get(id)
                    .and_then(|m| m.get(layer))
                    .copied()
                    .unwrap_or_default();
                let base = st.slots.get(id).map_or(0, |s| s * (self.sinks + self.ring));
                let span = l.pending.as_ref().and_then(|p| {
                    p.spans
                        .iter()
                        .find(|((sid, ..), committed)| sid == id && !committed)
                });
                let (start, end, wstart, woff) = match span {
                    Some(&((_, ws, off, n), _)) => (m.joined(ws), ws + n, ws as u32, off as u32),
                    None => (m.lo, m.hi, u32::MAX, 0),
                };
                RingSeq {
                    base: base as u32,
                    start,
                    end,
                    sinks: m.sinks,
                    wstart,
                    woff,
                }
            })
            .collect();
        let view = RingView {
            k: l.k.clone(),
            v: l.v.clone(),
            new_k,
            new_v,
            sinks: self.sinks,
            ring: self.ring,
        };
        Some((view, seqs))
    }

    /// Pool rows of `id`'s slot holding its first `sinks` positions and positions `from..to`.
    fn rows_of(&self, slot: usize, sinks: usize, (from, to): (usize, usize)) -> Vec<u32> {
        let base = slot * (self.sinks + self.ring);
        (0..sinks)
            .map(|p| base + p)
            .chain((from..to).map(|p| base + self.sinks + p % self.ring))
            .map(|r| r as u32)
            .collect()
    }

    /// `id`'s copies in `layer` of a sequence of `len` positions: its first `ns` sink rows and
    /// the last `nw` positions' rows, on the host (see `held`).
    pub(super) fn export(
        &self,
        id: SeqId,
        layer: usize,
        len: usize,
        (ns, nw): (usize, usize),
    ) -> Result<HeldLayer> {
        let mut st = self.lock();
        self.commit_in(&mut st, layer, Some(&[id]))?;
        let m = st.meta.get(&id).and_then(|m| m.get(layer)).copied();
        let (Some(&slot), Some(m), Some(Some(l))) = (st.slots.get(&id), m, st.layers.get(layer))
        else {
            return Err(CacheError::Rows(format!(
                "sequence {id}, layer {layer}: no dense copies kept"
            )));
        };
        // Intact: ring rows of `lo..hi` (at most the last R), sinks `0..sinks`.
        if m.sinks < ns || m.hi != len || m.lo + nw > len || nw > self.ring {
            return Err(CacheError::Rows(format!(
                "sequence {id}, layer {layer}: dense copies of positions {}..{} and {} sinks \
                 kept, {}..{len} and {ns} sinks wanted",
                m.lo,
                m.hi,
                m.sinks,
                len - nw
            )));
        }
        let rows = self.rows_of(slot, ns, (len - nw, len));
        let cpu = Device::Cpu;
        let (k, v) = if rows.is_empty() {
            let z = Tensor::zeros((0, self.width), DType::F16, &cpu)?;
            (z.clone(), z)
        } else {
            let idx = Tensor::new(rows.as_slice(), &self.device)?;
            (
                l.k.index_select(&idx, 0)?.to_device(&cpu)?,
                l.v.index_select(&idx, 0)?.to_device(&cpu)?,
            )
        };
        Ok(HeldLayer {
            sink_k: k.narrow(0, 0, ns)?,
            sink_v: v.narrow(0, 0, ns)?,
            window_k: k.narrow(0, ns, nw)?,
            window_v: v.narrow(0, ns, nw)?,
        })
    }

    /// Makes `sinks` (`[s, width]` each, positions `0..s`) and `window` (the positions just
    /// before `at`) `id`'s copies in `layer`, as if it had written them: rows in its slot, held.
    pub(super) fn install(
        &self,
        id: SeqId,
        layer: usize,
        at: usize,
        sinks: (&Tensor, &Tensor),
        window: (&Tensor, &Tensor),
    ) -> Result<()> {
        let mut st = self.lock();
        let slot = self.slot_of(&mut st, id)?;
        let (ns, nw) = (sinks.0.dim(0)?, window.0.dim(0)?);
        if ns > self.sinks || nw > self.ring || nw > at {
            return Err(CacheError::Rows(format!(
                "{ns} sink rows and {nw} window rows for {} sinks and a ring of {}",
                self.sinks, self.ring
            )));
        }
        let rows = self.rows_of(slot, ns, (at - nw, at));
        if let (false, Some(Some(l))) = (rows.is_empty(), st.layers.get(layer)) {
            let to = SlotRows::new(rows);
            // One of them may be empty (no sinks, or a sequence shorter than the sinks).
            let up = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
                let rows = match (a.dim(0)?, b.dim(0)?) {
                    (0, _) => b.clone(),
                    (_, 0) => a.clone(),
                    _ => Tensor::cat(&[a, b], 0)?,
                };
                Ok(rows.to_device(&self.device)?)
            };
            scatter_rows(&l.k, &to, &up(sinks.0, window.0)?)?;
            scatter_rows(&l.v, &to, &up(sinks.1, window.1)?)?;
        }
        let nl = st.layers.len();
        let m = st
            .meta
            .entry(id)
            .or_insert_with(|| vec![Meta::default(); nl]);
        if let Some(m) = m.get_mut(layer) {
            *m = Meta {
                lo: at - nw,
                hi: at,
                sinks: ns,
            };
        }
        Ok(())
    }

    pub(super) fn remove(&self, id: SeqId) {
        let mut st = self.lock();
        st.meta.remove(&id);
        // Its pending rows go too: a later sequence in its slot must not take them.
        for l in st.layers.iter_mut().flatten() {
            for (span, committed) in l.pending.iter_mut().flat_map(|p| p.spans.iter_mut()) {
                *committed |= span.0 == id;
            }
        }
        if let Some(s) = st.slots.remove(&id) {
            st.free.push(s);
        }
    }
}
