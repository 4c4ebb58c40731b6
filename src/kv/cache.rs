//! The paged KV cache: fixed-size blocks of tokens taken from a pool, a block table per sequence.
//!
//! Every layer owns one storage of `num_blocks * block_size` token slots per K and V; a block id
//! names the same slots in every layer, so one block table per sequence serves all layers (as in
//! vLLM). Adding or removing a sequence only moves block ids between the free list and a table:
//! nobody else's data is copied, and the only waste is the unfilled tail of each sequence's last
//! block. The pool size is fixed up front (the memory budget); `reserve` fails cleanly when it is
//! full so the scheduler can wait instead of crashing.
//!
//! Storage layout per layer and K/V: `[num_blocks * block_size, kv_heads * head_dim]`; slot
//! `block * block_size + i` holds the i-th token of that block.

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;

/// Identifies one sequence in the cache (the scheduler's request number).
pub type SeqId = u64;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("KV cache full: {needed} more blocks needed, {free} free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("unknown sequence {0} in the KV cache")]
    UnknownSeq(SeqId),
    #[error("sequence {0} is already in the KV cache")]
    DuplicateSeq(SeqId),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, CacheError>;

/// Shape and budget of a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool (the memory budget).
    pub num_blocks: usize,
    /// Element type of dense blocks.
    pub dtype: DType,
}

impl CacheConfig {
    /// Bytes one token occupies over all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.row_bytes()
    }

    /// Bytes of one K (or V) row of one layer: all KV heads of one token.
    pub fn row_bytes(&self) -> usize {
        self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes of one block over all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.block_size * self.bytes_per_token()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

struct LayerStore {
    k: Tensor,
    v: Tensor,
}

#[derive(Debug, Clone, Default)]
struct SeqState {
    blocks: Vec<u32>,
    len: usize,
}

pub struct PagedKvCache {
    cfg: CacheConfig,
    device: Device,
    layers: Vec<LayerStore>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, SeqState>,
    peak_blocks: usize,
}

impl PagedKvCache {
    pub fn new(cfg: CacheConfig, device: &Device) -> Result<Self> {
        let slots = cfg.num_blocks * cfg.block_size;
        let row = cfg.num_kv_heads * cfg.head_dim;
        let layers = (0..cfg.num_layers)
            .map(|_| {
                Ok(LayerStore {
                    k: Tensor::zeros((slots, row), cfg.dtype, device)?,
                    v: Tensor::zeros((slots, row), cfg.dtype, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Pop from the end: hand out low block ids first.
        let free = (0..cfg.num_blocks as u32).rev().collect();
        Ok(Self {
            cfg,
            device: device.clone(),
            layers,
            free,
            seqs: HashMap::new(),
            peak_blocks: 0,
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn add_sequence(&mut self, id: SeqId) -> Result<()> {
        if self.seqs.contains_key(&id) {
            return Err(CacheError::DuplicateSeq(id));
        }
        self.seqs.insert(id, SeqState::default());
        Ok(())
    }

    /// Drops a sequence and returns its blocks to the pool at once.
    pub fn remove_sequence(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            self.free.extend(s.blocks.into_iter().rev());
        }
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Tokens the sequence holds.
    pub fn seq_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// Free blocks in the pool.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks `id` would need to grow by `n_new` tokens.
    pub fn blocks_needed(&self, id: SeqId, n_new: usize) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(self
            .cfg
            .blocks_for(s.len + n_new)
            .saturating_sub(s.blocks.len()))
    }

    /// Makes room for `n_new` more tokens of `id`; all-or-nothing.
    pub fn reserve(&mut self, id: SeqId, n_new: usize) -> Result<()> {
        let needed = self.blocks_needed(id, n_new)?;
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.free.len(),
                total: self.cfg.num_blocks,
            });
        }
        let new: Vec<u32> = (0..needed).filter_map(|_| self.free.pop()).collect();
        self.seqs
            .get_mut(&id)
            .ok_or(CacheError::UnknownSeq(id))?
            .blocks
            .extend(new);
        self.peak_blocks = self.peak_blocks.max(self.cfg.num_blocks - self.free.len());
        Ok(())
    }

    /// Slot index of every token position `0..len` of `id` (the gather list for attention).
    pub fn slots(&self, id: SeqId, len: usize) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        let bs = self.cfg.block_size;
        if len > s.blocks.len() * bs {
            return Err(candle_core::Error::Msg(format!(
                "sequence {id}: {len} positions asked, {} reserved",
                s.blocks.len() * bs
            ))
            .into());
        }
        Ok((0..len)
            .map(|p| s.blocks[p / bs] * bs as u32 + (p % bs) as u32)
            .collect())
    }

    /// Writes the K and V rows (`[n, kv_heads * head_dim]`) of positions `start..start + n` of
    /// `id` into `layer`, one contiguous copy per block touched. Space must be reserved.
    pub fn write(
        &self,
        layer: usize,
        id: SeqId,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let s = self.seq(id)?;
        let bs = self.cfg.block_size;
        let n = k.dim(0)?;
        let store = &self.layers[layer];
        let mut done = 0;
        while done < n {
            let pos = start + done;
            let run = (bs - pos % bs).min(n - done);
            let block = *s.blocks.get(pos / bs).ok_or_else(|| {
                candle_core::Error::Msg(format!("sequence {id}: position {pos} not reserved"))
            })? as usize;
            let slot = block * bs + pos % bs;
            store
                .k
                .slice_set(&k.narrow(0, done, run)?.contiguous()?, 0, slot)?;
            store
                .v
                .slice_set(&v.narrow(0, done, run)?.contiguous()?, 0, slot)?;
            done += run;
        }
        Ok(())
    }

    /// Records that `n` tokens were appended to `id` (after every layer wrote them).
    pub fn advance(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        if s.len + n > s.blocks.len() * bs {
            return Err(candle_core::Error::Msg(format!(
                "sequence {id}: advancing past its reserved blocks"
            ))
            .into());
        }
        s.len += n;
        Ok(())
    }

    /// K and V of the given slots in `layer`: `[slots, kv_heads, head_dim]` each.
    pub fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let store = &self.layers[layer];
        let n = slots.dim(0)?;
        let shape = (n, self.cfg.num_kv_heads, self.cfg.head_dim);
        let k = store.k.index_select(slots, 0)?.reshape(shape)?;
        let v = store.v.index_select(slots, 0)?.reshape(shape)?;
        Ok((k, v))
    }

    /// Bytes held by the blocks sequences own now (full blocks, partial tails included).
    pub fn bytes_in_use(&self) -> usize {
        (self.cfg.num_blocks - self.free.len()) * self.cfg.bytes_per_block()
    }

    /// The most bytes held at once since the cache was made.
    pub fn peak_bytes(&self) -> usize {
        self.peak_blocks * self.cfg.bytes_per_block()
    }

    /// Bytes of the tokens themselves (no partial-block tail).
    pub fn token_bytes(&self) -> usize {
        self.seqs.values().map(|s| s.len).sum::<usize>() * self.cfg.bytes_per_token()
    }

    fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(num_blocks: usize) -> PagedKvCache {
        let cfg = CacheConfig {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 4,
            num_blocks,
            dtype: DType::F32,
        };
        PagedKvCache::new(cfg, &Device::Cpu).unwrap()
    }

    fn rows(n: usize, base: f32) -> Tensor {
        Tensor::arange(0f32, (n * 8) as f32, &Device::Cpu)
            .unwrap()
            .affine(1.0, base as f64)
            .unwrap()
            .reshape((n, 8))
            .unwrap()
    }

    #[test]
    fn write_then_gather_round_trips_across_blocks() {
        let mut c = cache(8);
        c.add_sequence(1).unwrap();
        c.add_sequence(2).unwrap();
        // Interleave growth so the two sequences' blocks are not contiguous.
        c.reserve(1, 3).unwrap();
        c.reserve(2, 6).unwrap();
        c.reserve(1, 6).unwrap();
        let k1 = rows(9, 0.0);
        let v1 = rows(9, 1000.0);
        c.write(
            0,
            1,
            0,
            &k1.narrow(0, 0, 3).unwrap(),
            &v1.narrow(0, 0, 3).unwrap(),
        )
        .unwrap();
        c.write(
            0,
            1,
            3,
            &k1.narrow(0, 3, 6).unwrap(),
            &v1.narrow(0, 3, 6).unwrap(),
        )
        .unwrap();
        c.write(0, 2, 0, &rows(6, 500.0), &rows(6, 600.0)).unwrap();
        c.advance(1, 9).unwrap();
        let slots = c.slots(1, 9).unwrap();
        let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
        let (k, v) = c.gather(0, &slots).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            a.flatten_all()
                .unwrap()
                .sub(&b.flatten_all().unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(diff(&k, &k1), 0.0);
        assert_eq!(diff(&v, &v1), 0.0);
    }

    #[test]
    fn reserve_is_all_or_nothing_and_remove_frees() {
        let mut c = cache(3);
        c.add_sequence(7).unwrap();
        c.reserve(7, 8).unwrap(); // 2 blocks
        assert_eq!(c.free_blocks(), 1);
        c.add_sequence(8).unwrap();
        let err = c.reserve(8, 5).unwrap_err(); // needs 2, 1 free
        assert!(matches!(
            err,
            CacheError::OutOfBlocks {
                needed: 2,
                free: 1,
                total: 3
            }
        ));
        assert_eq!(c.free_blocks(), 1);
        c.remove_sequence(7);
        assert_eq!(c.free_blocks(), 3);
        c.reserve(8, 5).unwrap();
        assert_eq!(c.bytes_in_use(), 2 * c.config().bytes_per_block());
        assert_eq!(c.peak_bytes(), 2 * c.config().bytes_per_block());
    }
}
