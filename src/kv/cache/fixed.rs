//! The cache's side of a captured CUDA decode step (`engine::graphs`): writes that address the
//! pools through device copies of their slots only, and the dense pools a fused kernel may
//! write into itself.

use candle_core::{DType, Tensor};

use super::{CacheError, PagedKvCache, Result};
use crate::kv::format::{LayerKv, SlotRows};

impl PagedKvCache {
    /// Writes a decode step's new rows `k`, `v` (`[n, width]`, row `i` into slot `slots[i]`,
    /// every sequence in the main pool) through the slots' device copy only
    /// ([`LayerKv::write_slots_on_device`]): what a captured CUDA graph of the step replays.
    /// Not with `--kv-center` (its means are per sequence; such steps run eagerly).
    pub fn write_fixed(
        &self,
        layer: usize,
        slots: &SlotRows,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        if self.centers_keys(layer) {
            return Err(CacheError::Rows(
                "a captured decode step cannot centre keys (--kv-center)".into(),
            ));
        }
        if self.residual(layer) > 0 {
            return Err(CacheError::Rows(
                "a captured decode step cannot keep dense copies (--kv-residual)".into(),
            ));
        }
        let rot = self.rotation(layer, true);
        Ok(self
            .layer_storage(layer, true)
            .write_slots_on_device(slots, k, v, rot)?)
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
