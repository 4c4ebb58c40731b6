//! The cache's side of a captured CUDA decode step (`engine::graphs`): writes that address the
//! pools through device copies of their slots only, and the dense pools a fused kernel may
//! write into itself. Under `--kv-center` the step brings each row's key means, and under
//! `--kv-residual` the ring rows its new rows go to (`ring::FixedRow`), both device buffers
//! filled before the replay; the host books the rings' rows after it ([`PagedKvCache::fixed_done`]).

use std::sync::Arc;

use candle_core::{DType, Tensor};

#[cfg(feature = "cuda")]
use super::SeqId;
use super::{CacheError, PagedKvCache, Result};
use crate::kv::format::{DenseCopies, LayerKv, SideWrites, SlotRows};

/// Where a captured decode step's rows go, on the device (`kv::attend::FixedStep` fills them).
pub struct FixedWrites {
    /// The pool slot of each row.
    pub slots: Arc<SlotRows>,
    /// `--kv-residual`: each row's ring row and sink row (its ring row again when it is no
    /// sink) in the layers' rings, u32 `[rows]` on the device.
    pub rings: Option<(Tensor, Tensor)>,
    /// `--kv-center`: each row's key mean per layer, `[layers, rows, width]` (in the keys'
    /// dtype: no cast in the step).
    pub means: Option<Tensor>,
}

impl PagedKvCache {
    /// Writes a decode step's new rows `k`, `v` (`[n, width]`, row `i` into slot `slots[i]`,
    /// every sequence in the main pool) through device copies only
    /// ([`LayerKv::write_slots_on_device`]): what a captured CUDA graph of the step replays.
    /// Keys are centred by `w.means` and kept dense in the rings at `w.rings` where the layer
    /// does that.
    pub fn write_fixed(&self, layer: usize, w: &FixedWrites, k: &Tensor, v: &Tensor) -> Result<()> {
        let means = match (self.centers_keys(layer), &w.means) {
            (false, _) => None,
            (true, Some(m)) => Some(m.get(layer)?),
            (true, None) => {
                return Err(CacheError::Rows(
                    "a captured decode step of centred keys (--kv-center) needs their means".into(),
                ))
            }
        };
        let rot = self.rotation(layer, true);
        let storage = self.layer_storage(layer, true);
        if let Some(r) = rot {
            // One launch: the pool's rows, the centring and the dense copies together.
            let pools = self.fixed_copies(layer)?;
            let copies = match (&pools, &w.rings) {
                (Some((pk, pv)), Some((ring, sink))) => Some(DenseCopies {
                    k: pk,
                    v: pv,
                    rows: ring,
                    sinks: sink,
                }),
                _ => None,
            };
            // (Copies without their ring rows: the path below says what is missing.)
            if pools.is_none() || copies.is_some() {
                let side = SideWrites {
                    means: means.as_ref(),
                    copies,
                };
                if storage.write_slots_fused(&w.slots, k, v, r, side)? {
                    return Ok(());
                }
            }
        }
        let k = match self.residual(layer) {
            0 => match &means {
                // As `centred`: the means in the keys' dtype (already), then the difference.
                Some(m) => (k - m)?,
                None => k.clone(),
            },
            _ => self.write_rings_fixed(layer, w, means.as_ref(), k, v)?,
        };
        Ok(storage.write_slots_on_device(&w.slots, &k, v, rot)?)
    }

    /// The f16 pools of `layer`'s dense copies (`None` where it keeps none).
    fn fixed_copies(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        if self.residual(layer) == 0 {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.tails.device {
            return r.pools(layer).map(Some);
        }
        Ok(None)
    }

    /// The dense copies' part of [`Self::write_fixed`]: the rows into the rings (keys centred
    /// by `means` on the way), returning the keys as written.
    fn write_rings_fixed(
        &self,
        layer: usize,
        w: &FixedWrites,
        means: Option<&Tensor>,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Some(r), Some((ring, sink))) = (&self.tails.device, &w.rings) {
            return r.write_fixed(layer, (ring, sink), means, k, v);
        }
        let _ = (layer, w, means, k, v);
        Err(CacheError::Rows(
            "a captured decode step of --kv-residual needs the rows' ring rows on the device"
                .into(),
        ))
    }

    /// The ring rows of a captured decode step of one new row per `(sequence, position)`
    /// (`None` without device copies), whatever earlier writes left pending committed first.
    #[cfg(feature = "cuda")]
    pub fn fixed_rows(
        &self,
        rows: &[(SeqId, usize)],
    ) -> Result<Option<Vec<super::ring::FixedRow>>> {
        self.tails
            .device
            .as_ref()
            .map(|r| r.fixed_rows(rows))
            .transpose()
    }

    /// Books a captured decode step's rows in the device copies, as an eager step's writes do.
    #[cfg(feature = "cuda")]
    pub fn fixed_done(&self, rows: &[(SeqId, usize)]) {
        if let Some(r) = &self.tails.device {
            r.fixed_done(rows);
        }
    }

    /// How often the device copies' pools have moved: a captured step of another count reads
    /// freed memory.
    #[cfg(feature = "cuda")]
    pub fn rings_moved(&self) -> u64 {
        self.tails.device.as_ref().map_or(0, |r| r.moved())
    }

    /// Whether sequences `ids` can decode in a captured step: their key means fixed and their
    /// device copies given a slot (each was written eagerly first) where the cache keeps them.
    #[cfg(feature = "cuda")]
    pub fn fixed_ready(&self, ids: &[SeqId]) -> bool {
        let rings = match &self.tails.device {
            Some(r) => r.has_slots(ids),
            None => self.cfg.residual == 0,
        };
        rings && (!self.cfg.center || self.has_means(ids))
    }

    /// The K and V pools of `layer` in the main pool when they are dense rows of `dtype`
    /// stored as they come (no rotation): what a fused kernel may write new rows into itself.
    pub fn dense_layer(&self, layer: usize, dtype: DType) -> Option<(&Tensor, &Tensor)> {
        match self.layer_storage(layer, true) {
            LayerKv::Dense { k, v }
                if k.dtype() == dtype && self.rotation(layer, true).is_none() =>
            {
                Some((k, v))
            }
            _ => None,
        }
    }
}
