//! The paged KV cache: fixed-size blocks of tokens taken from a pool, a block table per sequence.
//!
//! Every layer owns one storage of `num_blocks * block_size` token slots per K and V
//! ([`LayerKv`]); a block id names the same slots in every layer, so one block table per
//! sequence serves all layers (as in vLLM). Adding or removing a sequence only moves block ids
//! between a free list and a table: nobody else's data is copied, and the only waste is the
//! unfilled tail of each sequence's last block. Pools are sized up front (the memory budget);
//! `reserve` fails cleanly when one is full so the scheduler can wait instead of crashing.
//!
//! Policies are block-level, never special cases in the model:
//! - per-layer formats: each layer's main pool is dense or affine-quantized (`--kv-bits`,
//!   `--kv-dense-layers`); tokens are quantized once, as they are written;
//! - `--quantized-kv-start N`: a sequence first lives in a small dense *staging* pool; the
//!   write that would bring it to N tokens first moves its history into the main pool
//!   (quantizing each row exactly as a direct write would) and frees its staging blocks;
//! - `--max-kv-size W`: blocks whose tokens no future query can see (all positions ≤ len − W)
//!   go back to the pool, so a sequence holds at most ⌈W / block_size⌉ + 1 blocks;
//! - per-layer windows (the model's sliding-window layers, [`CacheConfig::layer_windows`]):
//!   each layer attends through its own window, capped by `--max-kv-size`; blocks go back once
//!   no layer can see them (while one block table serves all layers, a model with any global
//!   layer keeps every block).

pub mod config;
mod export;
pub mod prefix;
pub mod prompt_file;
mod reuse;

pub use config::{CacheConfig, KvOptions, ModelShape, PoolSizing, QuantScheme, Staging};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::kv::format::rotation::{Rotation, DEFAULT_SEED};
use crate::kv::format::{KvFormat, LayerKv, LayerRows, SlotRows};

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
    /// Stored rows that cannot be exported or imported as they are (window, format, shape).
    #[error("{0}")]
    Rows(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, CacheError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Staging,
    Main,
}

#[derive(Debug, Clone)]
struct SeqState {
    pool: Pool,
    /// Block of each position range, in order; `None` once freed by the sliding window.
    blocks: Vec<Option<u32>>,
    len: usize,
}

struct BlockPool {
    layers: Vec<LayerKv>,
    free: Vec<u32>,
    total: usize,
}

impl BlockPool {
    fn new(
        formats: &[KvFormat],
        blocks: usize,
        block_size: usize,
        width: usize,
        dev: &Device,
    ) -> Result<Self> {
        let layers = formats
            .iter()
            .map(|f| LayerKv::zeros(*f, blocks * block_size, width, dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            // Pop from the end: hand out low block ids first.
            free: (0..blocks as u32).rev().collect(),
            total: blocks,
        })
    }

    fn take(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
                total: self.total,
            });
        }
        Ok((0..n).filter_map(|_| self.free.pop()).collect())
    }
}

pub struct PagedKvCache {
    cfg: CacheConfig,
    device: Device,
    main: BlockPool,
    staging: Option<BlockPool>,
    seqs: HashMap<SeqId, SeqState>,
    peak_bytes: usize,
    /// Built when any main-pool layer is rotated (one rotation serves every layer and head).
    rotation: Option<Rotation>,
    /// The slots of the last write, per pool written: every layer of a step writes the same
    /// ones, so they are uploaded to the device once per step, not once per layer.
    last_slots: Mutex<Vec<Arc<SlotRows>>>,
    /// Automatic prefix reuse of main-pool blocks (see [`prefix`]), when enabled.
    prefix: Option<prefix::PrefixIndex>,
}

impl PagedKvCache {
    pub fn new(cfg: CacheConfig, device: &Device) -> Result<Self> {
        if cfg.formats.len() != cfg.num_layers {
            return Err(candle_core::Error::Msg(format!(
                "{} layer formats for {} layers",
                cfg.formats.len(),
                cfg.num_layers
            ))
            .into());
        }
        let rotation = if cfg.formats.iter().any(KvFormat::is_rotated) {
            Rotation::check(cfg.head_dim).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            Some(Rotation::new(cfg.head_dim, DEFAULT_SEED, device)?)
        } else {
            None
        };
        let w = cfg.width();
        let main = BlockPool::new(&cfg.formats, cfg.num_blocks, cfg.block_size, w, device)?;
        let staging = match &cfg.staging {
            Some(s) => Some(BlockPool::new(
                &vec![KvFormat::Dense(s.dtype); cfg.num_layers],
                s.num_blocks,
                cfg.block_size,
                w,
                device,
            )?),
            None => None,
        };
        Ok(Self {
            cfg,
            device: device.clone(),
            main,
            staging,
            seqs: HashMap::new(),
            peak_bytes: 0,
            rotation,
            last_slots: Mutex::default(),
            prefix: None,
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
        let pool = match &self.cfg.staging {
            Some(s) if s.tokens > 0 => Pool::Staging,
            _ => Pool::Main,
        };
        self.seqs.insert(
            id,
            SeqState {
                pool,
                blocks: Vec::new(),
                len: 0,
            },
        );
        Ok(())
    }

    /// Drops a sequence and returns its blocks to their pool at once.
    pub fn remove_sequence(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            let blocks = s.blocks.into_iter().flatten().rev();
            match (&mut self.prefix, s.pool) {
                // Shared or cached blocks stay; from the table's end, so a parked chain is
                // evicted from its end.
                (Some(p), Pool::Main) => {
                    let freed: Vec<u32> = blocks.filter(|&b| p.release(b)).collect();
                    self.main.free.extend(freed);
                }
                _ => self.pool_mut(s.pool).free.extend(blocks),
            }
        }
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Tokens the sequence holds (positions written so far).
    pub fn seq_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// Free blocks in the main pool.
    pub fn free_blocks(&self) -> usize {
        self.main.free.len() + self.prefix_cached_blocks()
    }

    /// Main-pool blocks `id` owns now.
    pub fn owned_blocks(&self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(if s.pool == Pool::Main {
            s.blocks.iter().flatten().count()
        } else {
            0
        })
    }

    /// Makes room for `n_new` more tokens of `id` (all-or-nothing). A staging sequence that
    /// would reach the quantization threshold moves to the main pool first.
    pub fn reserve(&mut self, id: SeqId, n_new: usize) -> Result<()> {
        let s = self.seq(id)?;
        if s.pool == Pool::Staging {
            let threshold = self.cfg.staging.as_ref().map_or(0, |st| st.tokens);
            if s.len + n_new >= threshold {
                self.promote(id)?;
            }
        }
        let bs = self.cfg.block_size;
        let s = self.seq(id)?;
        let needed = self
            .cfg
            .blocks_for(s.len + n_new)
            .saturating_sub(s.blocks.len());
        let pool = s.pool;
        let new = match pool {
            Pool::Main => self.take_main(needed)?,
            Pool::Staging => self.pool_mut(pool).take(needed)?,
        };
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        s.blocks.extend(new.into_iter().map(Some));
        debug_assert!(s.blocks.len() * bs >= s.len + n_new);
        self.note_peak();
        Ok(())
    }

    /// Moves a staging sequence's history into the main pool (quantizing it if the layer's
    /// format says so) and frees its staging blocks.
    fn promote(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?.clone();
        let new = self.main.take(self.cfg.blocks_for(s.len))?;
        let bs = self.cfg.block_size;
        if s.len > 0 {
            let staging = self
                .staging
                .as_ref()
                .expect("staging sequence has a staging pool");
            let src_slots: Vec<u32> = (0..s.len)
                .map(|p| {
                    s.blocks[p / bs].expect("staging blocks are never windowed") * bs as u32
                        + (p % bs) as u32
                })
                .collect();
            let src_slots = Tensor::from_vec(src_slots, s.len, &self.device)?;
            let dst_slots = SlotRows::new(
                (0..s.len)
                    .map(|p| new[p / bs] * bs as u32 + (p % bs) as u32)
                    .collect(),
            );
            for (l, dst) in self.main.layers.iter().enumerate() {
                let (k, v) =
                    staging.layers[l].gather(&src_slots, staging_dtype(&staging.layers[l]))?;
                let (k, v) = match self.rotation(l, true) {
                    Some(r) => (r.rotate(&k)?, r.rotate(&v)?),
                    None => (k, v),
                };
                dst.write_slots(&dst_slots, &k, &v)?;
            }
        }
        let staging = self.staging.as_mut().expect("staging pool");
        staging.free.extend(s.blocks.iter().flatten().rev());
        let st = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        st.pool = Pool::Main;
        st.blocks = new.into_iter().map(Some).collect();
        Ok(())
    }

    /// The window `layer` attends through (see [`CacheConfig::layer_window`]).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.cfg.layer_window(layer)
    }

    /// First position a query at `pos` can see in any layer.
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.cfg.kept_window() {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// Slot index of each position in `from..to` of `id` (the gather list for attention).
    pub fn slots(&self, id: SeqId, from: usize, to: usize) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        let bs = self.cfg.block_size;
        (from..to)
            .map(|p| {
                let b = s.blocks.get(p / bs).copied().flatten().ok_or_else(|| {
                    CacheError::Candle(candle_core::Error::Msg(format!(
                        "sequence {id}: position {p} is not in the cache"
                    )))
                })?;
                Ok(b * bs as u32 + (p % bs) as u32)
            })
            .collect()
    }

    /// Writes the K and V rows (`[n, kv_heads * head_dim]`) of positions `start..start + n` of
    /// `id` into `layer`, one run per block touched. Space must be reserved.
    pub fn write(
        &self,
        layer: usize,
        id: SeqId,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let n = k.dim(0)?;
        self.write_spans(layer, &[(id, start, 0, n)], k, v)
    }

    /// Writes one layer's new K/V rows of a whole batch: `k`, `v` are `[T, width]` and each
    /// span `(id, start, offset, n)` stores rows `offset..offset + n` as positions
    /// `start..start + n` of `id`. A rotated layer rotates the batch's rows once, not once per
    /// sequence; sequences still in dense staging take the rows unrotated.
    pub fn write_spans(
        &self,
        layer: usize,
        spans: &[(SeqId, usize, usize, usize)],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        // The main pool's rows are rotated on the way in (fused with the quantization where a
        // kernel does both); staging keeps them as they are.
        let rot = self.rotation(layer, true);
        // Per pool: which rows of k/v go to which slots, so each pool takes one write per
        // layer (one fused launch per tensor on CUDA) instead of one per sequence and block.
        let bs = self.cfg.block_size;
        let mut plan: Vec<(Pool, Vec<u32>, Vec<u32>)> = Vec::new();
        for &(id, start, offset, n) in spans {
            let s = self.seq(id)?;
            let at = match plan.iter().position(|(p, ..)| *p == s.pool) {
                Some(i) => i,
                None => {
                    plan.push((s.pool, Vec::new(), Vec::new()));
                    plan.len() - 1
                }
            };
            let (_, src, dst) = &mut plan[at];
            for i in 0..n {
                let pos = start + i;
                let block = s.blocks.get(pos / bs).copied().flatten().ok_or_else(|| {
                    candle_core::Error::Msg(format!("sequence {id}: position {pos} not reserved"))
                })?;
                src.push((offset + i) as u32);
                dst.push(block * bs as u32 + (pos % bs) as u32);
            }
        }
        let total = k.dim(0)?;
        let mut last = self.last_slots.lock().expect("poisoned slot cache");
        let mut used = Vec::with_capacity(plan.len());
        for (pool, src, dst) in plan {
            let slots = match last.iter().find(|s| s.as_slice() == dst.as_slice()) {
                Some(s) => s.clone(),
                None => Arc::new(SlotRows::new(dst)),
            };
            let (k, v) =
                if src.len() == total && src.iter().enumerate().all(|(i, &r)| r == i as u32) {
                    (k.clone(), v.clone())
                } else {
                    let idx = Tensor::from_slice(&src, src.len(), k.device())?;
                    (k.index_select(&idx, 0)?, v.index_select(&idx, 0)?)
                };
            let dst = &self.pool(pool).layers[layer];
            match (rot, pool) {
                (Some(r), Pool::Main) => dst.write_slots_rotated(&slots, &k, &v, r)?,
                _ => dst.write_slots(&slots, &k, &v)?,
            }
            used.push(slots);
        }
        *last = used;
        Ok(())
    }

    /// Writes a decode step's new rows `k`, `v` (`[n, width]`, row `i` into slot `slots[i]`,
    /// every sequence in the main pool) through the slots' device copy only
    /// ([`LayerKv::write_slots_on_device`]): what a captured CUDA graph of the step replays.
    pub fn write_fixed(
        &self,
        layer: usize,
        slots: &SlotRows,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let rot = self.rotation(layer, true);
        Ok(self.pool(Pool::Main).layers[layer].write_slots_on_device(slots, k, v, rot)?)
    }

    /// The K and V pools of `layer` in the main pool when they are dense rows of `dtype`
    /// stored as they come (no rotation): what a fused kernel may write new rows into itself.
    pub fn dense_layer(&self, layer: usize, dtype: DType) -> Option<(&Tensor, &Tensor)> {
        match &self.pool(Pool::Main).layers[layer] {
            LayerKv::Dense { k, v }
                if k.dtype() == dtype && self.rotation(layer, true).is_none() =>
            {
                Some((k, v))
            }
            _ => None,
        }
    }

    /// Records that `n` tokens were appended to `id` (after every layer wrote them), and lets
    /// go of blocks that slid out of the window.
    pub fn advance(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let window = self.cfg.kept_window();
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        if s.len + n > s.blocks.len() * bs {
            return Err(candle_core::Error::Msg(format!(
                "sequence {id}: advancing past its reserved blocks"
            ))
            .into());
        }
        s.len += n;
        let mut freed = Vec::new();
        if let Some(w) = window {
            // The next query is at position len; it sees positions > len - w.
            let keep_from = (s.len + 1).saturating_sub(w);
            for (b, slot) in s.blocks.iter_mut().enumerate() {
                if (b + 1) * bs <= keep_from {
                    if let Some(id) = slot.take() {
                        freed.push(id);
                    }
                }
            }
        }
        let pool = s.pool;
        self.pool_mut(pool).free.extend(freed);
        Ok(())
    }

    /// K and V of `slots` of `id` in `layer` as dense `[n, kv_heads, head_dim]` of `dtype`.
    pub fn gather(
        &self,
        layer: usize,
        id: SeqId,
        slots: &Tensor,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.seq(id)?;
        let n = slots.dim(0)?;
        let shape = (n, self.cfg.num_kv_heads, self.cfg.head_dim);
        let (k, v) = self.pool(s.pool).layers[layer].gather(slots, dtype)?;
        Ok((k.reshape(shape)?, v.reshape(shape)?))
    }

    /// Whether `id` lives in the main pool (else in dense staging).
    pub fn in_main_pool(&self, id: SeqId) -> Result<bool> {
        Ok(self.seq(id)?.pool == Pool::Main)
    }

    /// Block ids of `id` in position order; blocks freed by the window read as 0 (never
    /// visited: they lie before the first visible position).
    pub fn block_table(&self, id: SeqId) -> Result<Vec<u32>> {
        Ok(self
            .seq(id)?
            .blocks
            .iter()
            .map(|b| b.unwrap_or(0))
            .collect())
    }

    /// The rotation a layer's rows are stored in, in the main pool (`main`) or staging (never
    /// rotated): attention rotates its queries by it and rotates its output back.
    pub fn rotation(&self, layer: usize, main: bool) -> Option<&Rotation> {
        if main
            && self
                .cfg
                .formats
                .get(layer)
                .is_some_and(KvFormat::is_rotated)
        {
            self.rotation.as_ref()
        } else {
            None
        }
    }

    /// One layer's storage in the main pool (`main`) or the staging pool.
    pub fn layer_storage(&self, layer: usize, main: bool) -> &LayerKv {
        let pool = if main { Pool::Main } else { Pool::Staging };
        &self.pool(pool).layers[layer]
    }

    /// Bytes held by the blocks sequences own now, both pools (partial tails included).
    pub fn bytes_in_use(&self) -> usize {
        let main = (self.main.total - self.main.free.len()) * self.cfg.bytes_per_block();
        let staging = self.staging.as_ref().map_or(0, |p| {
            (p.total - p.free.len()) * self.cfg.block_size * self.cfg.staging_bytes_per_token()
        });
        main + staging
    }

    /// The most bytes held at once since the cache was made.
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes
    }

    /// Bytes of the tokens held in the main pool, without partial-block tails or windowed-out
    /// positions (the format's formula).
    pub fn token_bytes(&self) -> usize {
        let bs = self.cfg.block_size;
        self.seqs
            .values()
            .filter(|s| s.pool == Pool::Main)
            .map(|s| {
                let first_kept = s
                    .blocks
                    .iter()
                    .position(Option::is_some)
                    .unwrap_or(s.blocks.len());
                s.len.saturating_sub(first_kept * bs)
            })
            .sum::<usize>()
            * self.cfg.bytes_per_token()
    }

    /// Bytes allocated for the pools (the budget, whether used or not).
    pub fn capacity_bytes(&self) -> usize {
        self.cfg.num_blocks * self.cfg.bytes_per_block()
            + self.cfg.staging.as_ref().map_or(0, |s| {
                s.num_blocks * self.cfg.block_size * self.cfg.staging_bytes_per_token()
            })
    }

    fn note_peak(&mut self) {
        self.peak_bytes = self.peak_bytes.max(self.bytes_in_use());
    }

    fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))
    }

    fn pool(&self, p: Pool) -> &BlockPool {
        match p {
            Pool::Main => &self.main,
            Pool::Staging => self.staging.as_ref().expect("staging pool exists"),
        }
    }

    fn pool_mut(&mut self, p: Pool) -> &mut BlockPool {
        match p {
            Pool::Main => &mut self.main,
            Pool::Staging => self.staging.as_mut().expect("staging pool exists"),
        }
    }
}

/// The dtype a layer's rows are read back in (dense: its values; affine: its scales).
fn staging_dtype(l: &LayerKv) -> DType {
    match l {
        LayerKv::Dense { k, .. } => k.dtype(),
        LayerKv::Affine { k, .. } => k.scales.dtype(),
    }
}

#[cfg(test)]
mod tests;
