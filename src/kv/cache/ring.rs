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

use super::ring_write::ring_write;
use super::{Result, SeqId, WriteSpan};
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

/// One row of a captured decode step: what its query reads (no fresh rows: `wstart` is none)
/// and the pool rows its new row goes to — its ring row, and its sink row (the ring row again
/// when it is no sink).
#[derive(Debug, Clone, Copy)]
pub struct FixedRow {
    pub seq: RingSeq,
    pub ring_row: u32,
    pub sink_row: u32,
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

    /// How often the pools have moved (captured steps of an older count are stale).
    pub(super) fn moved(&self) -> u64 {
        self.lock().moved
    }

    /// Whether every sequence of `ids` has its slot (it was written eagerly before).
    pub(super) fn has_slots(&self, ids: &[SeqId]) -> bool {
        let st = self.lock();
        ids.iter().all(|id| st.slots.contains_key(id))
    }

    /// A captured decode step of one new row per `(sequence, position)`: what each row's query
    /// reads and where its row goes ([`FixedRow`]). It is what [`Rings::stage`] of that row
    /// followed by [`Rings::view`] gives, except that the row is put into the rings before the
    /// attention instead of after it — safe for one row: ring row `p mod R` held `p − R`, which
    /// the query at `p` no longer sees. Every layer of a step holds the same positions, so the
    /// first quantized layer answers for all. Whatever earlier writes left pending is committed
    /// first. Errors for a sequence with no slot.
    pub(super) fn fixed_rows(&self, rows: &[(SeqId, usize)]) -> Result<Vec<FixedRow>> {
        let mut st = self.lock();
        for l in 0..st.layers.len() {
            self.commit_in(&mut st, l, None)?;
            if let Some(Some(layer)) = st.layers.get_mut(l) {
                layer.pending = None;
            }
        }
        let first = st.layers.iter().position(Option::is_some).unwrap_or(0);
        let per = self.sinks + self.ring;
        rows.iter()
            .map(|&(id, p)| {
                let slot = st.slots.get(&id).copied().ok_or_else(|| {
                    super::CacheError::Rows(format!("sequence {id} has no dense copies yet"))
                })?;
                let mut m = st
                    .meta
                    .get(&id)
                    .and_then(|m| m.get(first))
                    .copied()
                    .unwrap_or_default();
                let start = m.joined(p);
                m.stage(p, 1, self.sinks);
                let base = slot * per;
                let ring_row = (base + self.sinks + p % self.ring) as u32;
                Ok(FixedRow {
                    seq: RingSeq {
                        base: base as u32,
                        start,
                        end: p + 1,
                        sinks: m.sinks,
                        wstart: u32::MAX,
                        woff: 0,
                    },
                    ring_row,
                    sink_row: if p < m.sinks {
                        (base + p) as u32
                    } else {
                        ring_row
                    },
                })
            })
            .collect()
    }

    /// Writes a captured step's new rows `k`, `v` (`[rows, width]`; keys minus `means` where
    /// they are centred) of `layer` into its rings, row `i` at rows `ring[i]` and `sink[i]` (u32
    /// on the device; equal when it is no sink), in one launch. Returns the keys as written,
    /// for the pool's write.
    pub(super) fn write_fixed(
        &self,
        layer: usize,
        (ring, sink): (&Tensor, &Tensor),
        means: Option<&Tensor>,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let st = self.lock();
        let Some(Some(l)) = st.layers.get(layer) else {
            return Err(super::CacheError::Rows(format!(
                "layer {layer} keeps no dense copies"
            )));
        };
        Ok(ring_write((k, v), means, (&l.k, &l.v), (ring, sink))?)
    }

    /// Books the rows a captured step wrote (one new row per `(sequence, position)`) as
    /// [`Rings::stage`] and [`Rings::commit`] book an eager one, in every layer.
    pub(super) fn fixed_done(&self, rows: &[(SeqId, usize)]) {
        let mut st = self.lock();
        let quantized: Vec<bool> = st.layers.iter().map(Option::is_some).collect();
        for &(id, p) in rows {
            let metas = st
                .meta
                .entry(id)
                .or_insert_with(|| vec![Meta::default(); quantized.len()]);
            for (m, &q) in metas.iter_mut().zip(&quantized) {
                if !q {
                    continue;
                }
                m.stage(p, 1, self.sinks);
                // As `commit_in`: the next query sees the write's last R − 1 rows.
                m.commit(p.max((p + 2).saturating_sub(self.ring)), p + 1, self.ring);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows `[n, 4]` f16 on `dev` whose values name their position (`p + 0.25·j`).
    fn rows(dev: &Device, start: usize, n: usize) -> Tensor {
        let v: Vec<f32> = (start..start + n)
            .flat_map(|p| (0..4).map(move |j| p as f32 + 0.25 * j as f32))
            .collect();
        Tensor::from_vec(v, (n, 4), dev)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
    }

    /// The copies' rows the meta of `id` declares intact (sinks, then `lo..hi`), by position.
    fn intact(r: &Rings, id: SeqId) -> (Meta, Vec<Vec<f32>>) {
        let st = r.lock();
        let m = st.meta[&id][0];
        let base = st.slots[&id] * (r.sinks + r.ring);
        let k: Vec<Vec<f32>> = st.layers[0]
            .as_ref()
            .unwrap()
            .k
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2()
            .unwrap();
        let got = (0..m.sinks)
            .map(|p| k[base + p].clone())
            .chain((m.lo..m.hi).map(|p| k[base + r.sinks + p % r.ring].clone()))
            .collect();
        (m, got)
    }

    #[test]
    fn cuda_a_captured_step_reads_and_books_what_an_eager_step_does() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        // Prompts shorter than the sinks, between sinks and ring, and longer than both.
        for (prompt, ring) in [(2, 8), (6, 8), (30, 8), (9, 1), (3, 2)] {
            let (eager, fixed) = (
                Rings::new(&[true], 4, ring, 4, &dev).unwrap(),
                Rings::new(&[true], 4, ring, 4, &dev).unwrap(),
            );
            let x = rows(&dev, 0, prompt);
            for r in [&eager, &fixed] {
                r.stage(0, &[(7, 0, 0, prompt)], &x, &x).unwrap();
                r.commit(0, Some(&[7])).unwrap();
            }
            for p in prompt..prompt + 12 {
                // Keys centred by a mean of 0.3 on odd steps, as the eager write subtracts it.
                let shift = if p % 2 == 1 { 0.3 } else { 0.0 };
                let x = rows(&dev, p, 1);
                let mu = Tensor::new(&[[shift; 4]], &dev)
                    .unwrap()
                    .to_dtype(DType::F16)
                    .unwrap();
                let centred = (&x - &mu).unwrap();
                eager.stage(0, &[(7, p, 0, 1)], &centred, &x).unwrap();
                let (_, seqs) = eager.view(0, &[7]).unwrap();
                eager.commit(0, Some(&[7])).unwrap();

                let got = fixed.fixed_rows(&[(7, p)]).unwrap()[0];
                let want = RingSeq {
                    wstart: u32::MAX,
                    woff: 0,
                    ..seqs[0]
                };
                let case = (prompt, ring, p);
                assert_eq!(format!("{:?}", got.seq), format!("{want:?}"), "{case:?}");
                let to = |r: u32| Tensor::new(&[r], &dev).unwrap();
                let means = (shift > 0.0).then_some(&mu);
                let k = fixed
                    .write_fixed(0, (&to(got.ring_row), &to(got.sink_row)), means, &x, &x)
                    .unwrap();
                fixed.fixed_done(&[(7, p)]);
                let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(bits(&k), bits(&centred), "{case:?}: the keys as written");
                let (me, re) = intact(&eager, 7);
                let (mf, rf) = intact(&fixed, 7);
                assert_eq!(me, mf, "{case:?}: booked positions");
                assert_eq!(re, rf, "{case:?}: their rows");
                assert_eq!(me.sinks, 4.min(p + 1), "{case:?}: sinks kept");
            }
        }
    }
}
