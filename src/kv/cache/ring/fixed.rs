//! The rings' side of a captured decode step (`engine::graphs`): where each new row goes and
//! what its query reads, the rows written in one launch, and the host's booking after the
//! replay.

use candle_core::Tensor;

use super::super::ring_write::ring_write;
use super::{CacheError, Meta, Result, RingSeq, Rings, SeqId};

/// One row of a captured decode step: what its query reads (no fresh rows: `wstart` is none)
/// and the pool rows its new row goes to — its ring row, and its sink row (the ring row again
/// when it is no sink).
#[derive(Debug, Clone, Copy)]
pub struct FixedRow {
    pub seq: RingSeq,
    pub ring_row: u32,
    pub sink_row: u32,
}

impl Rings {
    /// How often the pools have moved (captured steps of an older count are stale).
    pub(in crate::kv::cache) fn moved(&self) -> u64 {
        self.lock().moved
    }

    /// Whether every sequence of `ids` has its slot (it was written eagerly before).
    pub(in crate::kv::cache) fn has_slots(&self, ids: &[SeqId]) -> bool {
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
    pub(in crate::kv::cache) fn fixed_rows(
        &self,
        rows: &[(SeqId, usize)],
    ) -> Result<Vec<FixedRow>> {
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
                    CacheError::Rows(format!("sequence {id} has no dense copies yet"))
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
    pub(in crate::kv::cache) fn write_fixed(
        &self,
        layer: usize,
        (ring, sink): (&Tensor, &Tensor),
        means: Option<&Tensor>,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (pk, pv) = self.pools(layer)?;
        Ok(ring_write((k, v), means, (&pk, &pv), (ring, sink))?)
    }

    /// The f16 pools of `layer`'s copies (K, V), for a write that fills them itself.
    pub(in crate::kv::cache) fn pools(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        let st = self.lock();
        match st.layers.get(layer) {
            Some(Some(l)) => Ok((l.k.clone(), l.v.clone())),
            _ => Err(CacheError::Rows(format!(
                "layer {layer} keeps no dense copies"
            ))),
        }
    }

    /// Books the rows a captured step wrote (one new row per `(sequence, position)`) as
    /// [`Rings::stage`] and [`Rings::commit`] book an eager one, in every layer.
    pub(in crate::kv::cache) fn fixed_done(&self, rows: &[(SeqId, usize)]) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

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
