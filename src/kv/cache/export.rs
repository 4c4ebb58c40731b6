//! A sequence's rows out of the cache and back in (prompt-cache files, MLX-style extract /
//! merge): rows exactly as stored, so nothing is re-quantized.

use super::*;

/// A sequence's prompt as stored, for a prompt-cache file: its rows per layer, where keys are
/// stored centred their means ([`PagedKvCache::export_centers`]), and under `--kv-residual` the
/// dense copies it holds ([`PagedKvCache::export_held`]).
#[derive(Debug, Clone)]
pub struct PromptKv {
    pub rows: Vec<LayerRows>,
    pub centers: Vec<Option<Vec<f32>>>,
    pub held: Option<super::held::HeldRows>,
}

impl PagedKvCache {
    /// The stored rows of positions `0..len` of `id`, per layer, exactly as kept (codes stay
    /// codes). Fails if a window already let go of some of them (see [`Self::keep_history`]).
    pub fn export_rows(&self, id: SeqId) -> Result<Vec<LayerRows>> {
        let s = self.seq(id)?;
        let bs = self.cfg.block_size;
        let mut out: Vec<Option<LayerRows>> = vec![None; self.cfg.num_layers];
        for (g, (lg, table)) in self.layout.iter().zip(&s.tables).enumerate() {
            // A window only ever drops leading blocks.
            let dropped = table.iter().take_while(|b| b.is_none()).count();
            if dropped > 0 {
                return Err(CacheError::Rows(format!(
                    "sequence {id}: its first {} positions already left the {}-token window \
                     (--max-kv-size or the model's sliding window) of layer {}, so its history \
                     cannot be exported",
                    (dropped * bs).min(s.len),
                    lg.window.unwrap_or(0),
                    lg.layers.first().copied().unwrap_or(0),
                )));
            }
            let slots = Tensor::from_vec(self.slots(id, g, 0, s.len)?, s.len, &self.device)?;
            let pool = self.groups[g].pool(s.pool);
            for (at, &l) in lg.layers.iter().enumerate() {
                out[l] = Some(pool.layers[at].read_rows(&slots)?);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// The format of each layer in which a new sequence keeps its first `n` tokens (see
    /// [`CacheConfig::formats_for_prefix`]).
    pub fn formats_for_prefix(&self, n: usize) -> Vec<KvFormat> {
        self.cfg.formats_for_prefix(n)
    }

    /// Makes stored rows (one entry per layer, `n` rows each) positions `0..n` of the empty
    /// sequence `id`, writing them as they are — no conversion, no re-quantization — so they
    /// must be in the formats [`Self::formats_for_prefix`] gives for `n`. Rows go in runs of at
    /// most `chunk` tokens, each reserved and advanced like a prefill chunk, so the sliding
    /// window frees blocks as it would there and the sequence never holds more blocks than a
    /// prefill of the same tokens would. Centred keys (`--kv-center`) need their means first
    /// ([`Self::import_centers`]).
    pub fn import_rows(&mut self, id: SeqId, rows: &[LayerRows], chunk: usize) -> Result<()> {
        self.check_centred_import(id)?;
        let s = self.seq(id)?;
        if s.len != 0 {
            return Err(CacheError::Rows(format!(
                "sequence {id} already holds {} tokens; rows import only into an empty sequence",
                s.len
            )));
        }
        if rows.len() != self.cfg.num_layers {
            return Err(CacheError::Rows(format!(
                "{} layers of rows for a {}-layer cache",
                rows.len(),
                self.cfg.num_layers
            )));
        }
        let n = rows.first().map_or(Ok(0), LayerRows::len)?;
        let want = self.formats_for_prefix(n);
        for (l, (r, w)) in rows.iter().zip(&want).enumerate() {
            if r.len()? != n {
                return Err(CacheError::Rows(format!(
                    "layer {l} has {} rows, layer 0 has {n}",
                    r.len()?
                )));
            }
            if r.format() != *w {
                return Err(CacheError::Rows(format!(
                    "layer {l}: rows stored as {:?}, but this cache keeps the first {n} tokens \
                     as {w:?}",
                    r.format()
                )));
            }
        }
        if n == 0 {
            return Ok(());
        }
        if s.pool == Pool::Staging && !self.cfg.prefix_in_staging(n) {
            // Past the threshold: the sequence starts in the main pool (it holds nothing yet).
            self.promote(id)?;
        }
        let chunk = chunk.max(1);
        let mut start = 0;
        while start < n {
            let c = chunk.min(n - start);
            self.reserve(id, c)?;
            let pool = self.seq(id)?.pool;
            for (g, lg) in self.layout.iter().enumerate() {
                let slots = self.slots(id, g, start, start + c)?;
                let slots = Tensor::from_vec(slots, c, &self.device)?;
                for (at, &l) in lg.layers.iter().enumerate() {
                    let layer = &self.groups[g].pool(pool).layers[at];
                    layer.write_rows(&slots, &rows[l].narrow(start, c)?)?;
                }
            }
            self.advance(id, c)?;
            start += c;
        }
        Ok(())
    }
}
