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
//!   go back to the pool, so a sequence holds at most ⌈W / block_size⌉ + 1 blocks.

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::layer::{KvFormat, LayerKv, LayerRows};
use super::prefix::PrefixIndex;
use super::quant::SlotRows;
use super::rotation::{Rotation, DEFAULT_SEED};

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

/// Dense staging for `--quantized-kv-start`.
#[derive(Debug, Clone, PartialEq)]
pub struct Staging {
    /// A sequence moves to the main pool before it reaches this many tokens.
    pub tokens: usize,
    pub dtype: DType,
    pub num_blocks: usize,
}

/// Shape, formats and budget of a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the main pool (the memory budget).
    pub num_blocks: usize,
    /// Main-pool format of each layer.
    pub formats: Vec<KvFormat>,
    pub staging: Option<Staging>,
    /// Sliding window: a query sees at most this many most recent positions (itself included).
    pub window: Option<usize>,
}

impl CacheConfig {
    /// A cache with every layer in one dense dtype.
    pub fn dense(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: DType,
    ) -> Self {
        Self {
            num_layers,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            formats: vec![KvFormat::Dense(dtype); num_layers],
            staging: None,
            window: None,
        }
    }

    /// Values in one K (or V) row: all KV heads of one token.
    pub fn width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes one token occupies in the main pool over all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        let w = self.width();
        self.formats.iter().map(|f| f.kv_row_bytes(w)).sum()
    }

    /// Bytes one token occupies in the staging pool.
    pub fn staging_bytes_per_token(&self) -> usize {
        self.staging.as_ref().map_or(0, |s| {
            self.num_layers * 2 * self.width() * s.dtype.size_in_bytes()
        })
    }

    /// Bytes of one main-pool block over all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.block_size * self.bytes_per_token()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The format of each layer in which a new sequence keeps its first `n` tokens: dense
    /// staging below the `--quantized-kv-start` threshold, else the main pool's formats.
    pub fn formats_for_prefix(&self, n: usize) -> Vec<KvFormat> {
        match &self.staging {
            Some(st) if self.prefix_in_staging(n) => {
                vec![KvFormat::Dense(st.dtype); self.num_layers]
            }
            _ => self.formats.clone(),
        }
    }

    /// Whether a new sequence of `n` tokens still lives in the dense staging pool.
    pub fn prefix_in_staging(&self, n: usize) -> bool {
        matches!(&self.staging, Some(st) if st.tokens > 0 && n < st.tokens)
    }

    /// Most main-pool blocks a sequence holding up to `tokens` tokens, fed in chunks of at most
    /// `chunk` tokens, can own at once (the sliding window bounds it).
    pub fn max_blocks_for(&self, tokens: usize, chunk: usize) -> usize {
        let all = self.blocks_for(tokens);
        match self.window {
            Some(w) => all.min(self.blocks_for(w + chunk) + 1),
            None => all,
        }
    }
}

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
    /// Automatic prefix reuse of main-pool blocks (see `kv::prefix`), when enabled.
    prefix: Option<PrefixIndex>,
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

    /// Free blocks in the main pool (blocks parked by the prefix cache included: they are
    /// evicted when needed).
    pub fn free_blocks(&self) -> usize {
        self.main.free.len() + self.prefix_cached_blocks()
    }

    /// Main-pool blocks nobody holds that still cache a prompt prefix.
    pub fn prefix_cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixIndex::evictable)
    }

    /// Turns on automatic prefix reuse: full blocks of prompts registered with
    /// [`Self::register_prefix`] stay in the pool, shared by reference count, after their
    /// sequences end, until the pool needs them (least recently used first). Not available
    /// with a sliding window or a staging pool, whose blocks do not keep a prompt's rows.
    pub fn enable_prefix_cache(&mut self) -> Result<()> {
        if self.cfg.window.is_some() || self.cfg.staging.is_some() {
            return Err(CacheError::Rows(
                "prefix reuse needs whole histories in the main pool: it cannot be combined \
                 with a sliding window (--max-kv-size) or --quantized-kv-start"
                    .into(),
            ));
        }
        if self.prefix.is_none() {
            let mut p = PrefixIndex::new(self.cfg.num_blocks, self.cfg.block_size);
            for s in self.seqs.values() {
                for &b in s.blocks.iter().flatten() {
                    p.hold(b);
                }
            }
            self.prefix = Some(p);
        }
        Ok(())
    }

    /// Starts the new, empty sequence `id` on the cached blocks holding the longest prefix of
    /// `tokens` of at most `max_tokens` tokens (whole blocks); returns the tokens it now holds
    /// (0 without prefix reuse or a match).
    pub fn attach_prefix(&mut self, id: SeqId, tokens: &[u32], max_tokens: usize) -> Result<usize> {
        let bs = self.cfg.block_size;
        let Some(p) = self.prefix.as_mut() else {
            return Ok(0);
        };
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        if s.len > 0 || s.pool != Pool::Main {
            return Err(CacheError::Rows(format!(
                "sequence {id}: a cached prefix can only start an empty sequence"
            )));
        }
        let found = p.lookup(tokens, max_tokens / bs);
        for &b in &found {
            p.hold(b);
        }
        s.len = found.len() * bs;
        s.blocks = found.into_iter().map(Some).collect();
        Ok(s.len)
    }

    /// Offers the full blocks of `id` holding `tokens` (its first positions, all written) to
    /// the prefix cache; nothing without prefix reuse.
    pub fn register_prefix(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let Some(p) = self.prefix.as_mut() else {
            return Ok(());
        };
        let s = self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))?;
        let n = tokens.len().min(s.len);
        let blocks: Vec<u32> = s.blocks.iter().map_while(|b| *b).collect();
        p.register(&blocks, &tokens[..n]);
        Ok(())
    }

    /// Takes `n` main-pool blocks for a sequence: free ones first, then parked prefix blocks,
    /// least recently used first (all-or-nothing).
    fn take_main(&mut self, n: usize) -> Result<Vec<u32>> {
        if let Some(p) = self.prefix.as_mut() {
            if n <= self.main.free.len() + p.evictable() {
                while self.main.free.len() < n {
                    match p.evict() {
                        Some(b) => self.main.free.push(b),
                        None => break,
                    }
                }
            }
        }
        let new = self.main.take(n)?;
        if let Some(p) = self.prefix.as_mut() {
            for &b in &new {
                p.hold(b);
            }
        }
        Ok(new)
    }

    /// Free and total blocks of the dense staging pool (`--quantized-kv-start`), if any.
    pub fn staging_blocks(&self) -> Option<(usize, usize)> {
        self.staging.as_ref().map(|p| (p.free.len(), p.total))
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

    /// First position a query at `pos` can see.
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.cfg.window {
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

    /// Records that `n` tokens were appended to `id` (after every layer wrote them), and lets
    /// go of blocks that slid out of the window.
    pub fn advance(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let window = self.cfg.window;
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

/// Moving a sequence's stored rows out of and into the pools (prompt caches).
impl PagedKvCache {
    /// The stored rows of positions `0..len` of `id`, per layer, exactly as kept (codes stay
    /// codes). Fails if the sliding window already let go of some of them.
    pub fn export_rows(&self, id: SeqId) -> Result<Vec<LayerRows>> {
        let s = self.seq(id)?;
        let bs = self.cfg.block_size;
        // The window only ever drops leading blocks.
        let dropped = s.blocks.iter().take_while(|b| b.is_none()).count();
        if dropped > 0 {
            return Err(CacheError::Rows(format!(
                "sequence {id}: its first {} positions already left the --max-kv-size window, \
                 so its history cannot be exported",
                (dropped * bs).min(s.len)
            )));
        }
        let slots = Tensor::from_vec(self.slots(id, 0, s.len)?, s.len, &self.device)?;
        Ok(self
            .pool(s.pool)
            .layers
            .iter()
            .map(|l| l.read_rows(&slots))
            .collect::<candle_core::Result<Vec<_>>>()?)
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
    /// prefill of the same tokens would.
    pub fn import_rows(&mut self, id: SeqId, rows: &[LayerRows], chunk: usize) -> Result<()> {
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
            let slots = Tensor::from_vec(self.slots(id, start, start + c)?, c, &self.device)?;
            let pool = self.pool(self.seq(id)?.pool);
            for (layer, r) in pool.layers.iter().zip(rows) {
                layer.write_rows(&slots, &r.narrow(start, c)?)?;
            }
            self.advance(id, c)?;
            start += c;
        }
        Ok(())
    }
}

fn staging_dtype(l: &LayerKv) -> DType {
    match l {
        LayerKv::Dense { k, .. } => k.dtype(),
        LayerKv::Affine { k, .. } => k.scales.dtype(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::quant::QuantFormat;

    fn cfg(num_blocks: usize) -> CacheConfig {
        CacheConfig::dense(2, 2, 32, 4, num_blocks, DType::F32)
    }

    fn rows(n: usize, base: f32) -> Tensor {
        Tensor::arange(0f32, (n * 64) as f32, &Device::Cpu)
            .unwrap()
            .affine(0.01, base as f64)
            .unwrap()
            .reshape((n, 64))
            .unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
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
    }

    fn gather_all(c: &PagedKvCache, id: SeqId, from: usize, to: usize) -> (Tensor, Tensor) {
        let slots = c.slots(id, from, to).unwrap();
        let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
        c.gather(0, id, &slots, DType::F32).unwrap()
    }

    #[test]
    fn write_then_gather_round_trips_across_blocks() {
        let mut c = PagedKvCache::new(cfg(8), &Device::Cpu).unwrap();
        c.add_sequence(1).unwrap();
        c.add_sequence(2).unwrap();
        // Interleave growth so the two sequences' blocks are not contiguous.
        c.reserve(1, 3).unwrap();
        c.reserve(2, 6).unwrap();
        c.reserve(1, 9).unwrap(); // room for 9 tokens in all: a second block
        let (k1, v1) = (rows(9, 0.0), rows(9, 10.0));
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
        c.write(0, 2, 0, &rows(6, 5.0), &rows(6, 6.0)).unwrap();
        c.advance(1, 9).unwrap();
        let (k, v) = gather_all(&c, 1, 0, 9);
        assert_eq!(max_diff(&k, &k1), 0.0);
        assert_eq!(max_diff(&v, &v1), 0.0);
    }

    #[test]
    fn reserve_is_all_or_nothing_and_remove_frees() {
        let mut c = PagedKvCache::new(cfg(3), &Device::Cpu).unwrap();
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

    #[test]
    fn sliding_window_frees_blocks_and_keeps_bytes_flat() {
        let mut config = cfg(16);
        config.window = Some(6);
        let mut c = PagedKvCache::new(config, &Device::Cpu).unwrap();
        c.add_sequence(0).unwrap();
        let mut held = Vec::new();
        for pos in 0..40 {
            c.reserve(0, 1).unwrap();
            c.write(0, 0, pos, &rows(1, pos as f32), &rows(1, 0.0))
                .unwrap();
            c.advance(0, 1).unwrap();
            held.push(c.bytes_in_use());
        }
        // At most ceil(6/4) + 1 = 3 blocks once the window is full.
        let max_after = held[10..].iter().max().unwrap();
        assert!(*max_after <= 3 * c.config().bytes_per_block(), "{held:?}");
        // The window's positions are still readable and hold what was written.
        let (k, _) = gather_all(&c, 0, c.first_visible(40), 40);
        let want =
            Tensor::cat(&(35..40).map(|p| rows(1, p as f32)).collect::<Vec<_>>(), 0).unwrap();
        assert_eq!(max_diff(&k, &want), 0.0);
    }

    #[test]
    fn staging_promotes_to_quantized_with_the_same_codes_as_direct_writes() {
        let fmt = QuantFormat::new(4, 32).unwrap();
        let quant = KvFormat::affine(fmt, DType::F32, false);
        let mut direct = cfg(8);
        direct.formats = vec![quant; 2];
        let mut staged = direct.clone();
        staged.staging = Some(Staging {
            tokens: 6,
            dtype: DType::F32,
            num_blocks: 4,
        });
        let mut a = PagedKvCache::new(direct, &Device::Cpu).unwrap();
        let mut b = PagedKvCache::new(staged, &Device::Cpu).unwrap();
        for c in [&mut a, &mut b] {
            c.add_sequence(0).unwrap();
            for pos in 0..9 {
                c.reserve(0, 1).unwrap();
                c.write(
                    0,
                    0,
                    pos,
                    &rows(1, pos as f32 * 0.3),
                    &rows(1, -(pos as f32)),
                )
                .unwrap();
                c.advance(0, 1).unwrap();
            }
        }
        let (ka, va) = gather_all(&a, 0, 0, 9);
        let (kb, vb) = gather_all(&b, 0, 0, 9);
        assert_eq!(max_diff(&ka, &kb), 0.0);
        assert_eq!(max_diff(&va, &vb), 0.0);
        // Quantized, not exact, and the staging blocks were given back.
        assert!(
            max_diff(
                &ka,
                &Tensor::cat(
                    &(0..9).map(|p| rows(1, p as f32 * 0.3)).collect::<Vec<_>>(),
                    0
                )
                .unwrap()
            ) > 0.0
        );
        assert_eq!(b.staging.as_ref().unwrap().free.len(), 4);
    }

    fn affine(bits: u32) -> KvFormat {
        KvFormat::affine(QuantFormat::new(bits, 32).unwrap(), DType::F32, false)
    }

    /// Every stored tensor of `rows`, flattened to f32 (codes as their u32 values) per layer.
    fn raw(rows: &[LayerRows]) -> Vec<Vec<Vec<f64>>> {
        let flat = |t: &Tensor| -> Vec<f64> {
            t.flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        rows.iter()
            .map(|r| match r {
                LayerRows::Dense { k, v } => vec![flat(k), flat(v)],
                LayerRows::Affine { k, v, .. } => [k, v]
                    .iter()
                    .flat_map(|q| [flat(&q.codes), flat(&q.scales), flat(&q.biases)])
                    .collect(),
            })
            .collect()
    }

    /// Writes `n` tokens of seq `id` in steps of `step`, in both layers, values seeded by `base`.
    fn fill(c: &mut PagedKvCache, id: SeqId, n: usize, step: usize, base: f32) {
        let (k, v) = (rows(n, base), rows(n, -base).sqr().unwrap());
        let mut at = 0;
        while at < n {
            let m = step.min(n - at);
            c.reserve(id, m).unwrap();
            for l in 0..2 {
                c.write(
                    l,
                    id,
                    at,
                    &k.narrow(0, at, m).unwrap(),
                    &v.narrow(0, at, m).unwrap(),
                )
                .unwrap();
            }
            c.advance(id, m).unwrap();
            at += m;
        }
    }

    #[test]
    fn exported_rows_import_bit_for_bit_into_another_layout() {
        for fmt in [KvFormat::Dense(DType::F32), affine(4), affine(8)] {
            let mut config = cfg(16);
            config.formats = vec![fmt; 2];
            let mut a = PagedKvCache::new(config.clone(), &Device::Cpu).unwrap();
            a.add_sequence(1).unwrap();
            a.add_sequence(2).unwrap();
            fill(&mut a, 2, 5, 5, 3.0);
            fill(&mut a, 1, 11, 3, 0.5);
            let saved = a.export_rows(1).unwrap();
            assert_eq!(saved[0].len().unwrap(), 11);
            assert_eq!(saved[0].format(), fmt);

            // Another cache whose free blocks come in another order.
            let mut b = PagedKvCache::new(config, &Device::Cpu).unwrap();
            b.add_sequence(9).unwrap();
            fill(&mut b, 9, 7, 7, 1.0);
            b.add_sequence(4).unwrap();
            b.import_rows(4, &saved, 4).unwrap();
            assert_eq!(b.seq_len(4).unwrap(), 11);
            assert_eq!(raw(&b.export_rows(4).unwrap()), raw(&saved), "{fmt:?}");
            let (ka, va) = gather_all(&a, 1, 0, 11);
            let (kb, vb) = gather_all(&b, 4, 0, 11);
            assert_eq!(max_diff(&ka, &kb), 0.0);
            assert_eq!(max_diff(&va, &vb), 0.0);
            // The other sequence is untouched.
            assert_eq!(
                raw(&b.export_rows(9).unwrap()),
                raw(&{
                    let mut c = PagedKvCache::new(b.config().clone(), &Device::Cpu).unwrap();
                    c.add_sequence(9).unwrap();
                    fill(&mut c, 9, 7, 7, 1.0);
                    c.export_rows(9).unwrap()
                })
            );
        }
    }

    #[test]
    fn quantized_codes_do_not_depend_on_what_else_is_in_the_cache() {
        // Alone, written in one run...
        let mut config = cfg(64);
        config.formats = vec![affine(4); 2];
        let mut alone = PagedKvCache::new(config.clone(), &Device::Cpu).unwrap();
        alone.add_sequence(0).unwrap();
        fill(&mut alone, 0, 30, 30, 0.25);
        // ...and among other sequences, in chunks and decode-sized steps, blocks interleaved.
        let mut busy = PagedKvCache::new(config, &Device::Cpu).unwrap();
        for id in [5, 0, 6] {
            busy.add_sequence(id).unwrap();
        }
        fill(&mut busy, 5, 9, 2, 7.0);
        fill(&mut busy, 0, 13, 13, 0.25);
        fill(&mut busy, 6, 40, 16, -2.0);
        let (k, v) = (rows(30, 0.25), rows(30, -0.25).sqr().unwrap());
        for pos in 13..30 {
            busy.reserve(0, 1).unwrap();
            for l in 0..2 {
                busy.write(
                    l,
                    0,
                    pos,
                    &k.narrow(0, pos, 1).unwrap(),
                    &v.narrow(0, pos, 1).unwrap(),
                )
                .unwrap();
            }
            busy.advance(0, 1).unwrap();
        }
        assert_eq!(
            raw(&alone.export_rows(0).unwrap()),
            raw(&busy.export_rows(0).unwrap())
        );
        // The kernel itself: a row's codes are the same whichever rows share the call.
        let fmt = QuantFormat::new(4, 32).unwrap();
        let x = rows(300, -1.5);
        let all = crate::kv::quant::quantize(&x, fmt).unwrap();
        for (at, n) in [(0, 1), (17, 5), (123, 150), (299, 1)] {
            let part = crate::kv::quant::quantize(&x.narrow(0, at, n).unwrap(), fmt).unwrap();
            let cut = |t: &Tensor| t.narrow(0, at, n).unwrap();
            let whole = LayerRows::Affine {
                kfmt: fmt,
                vfmt: fmt,
                rotated: false,
                k: crate::kv::quant::Quantized {
                    codes: cut(&all.codes),
                    scales: cut(&all.scales),
                    biases: cut(&all.biases),
                },
                v: part.clone(),
            };
            let r = raw(&[whole]);
            assert_eq!(r[0][..3], r[0][3..], "rows {at}..{}", at + n);
        }
    }

    #[test]
    fn import_refuses_other_formats_and_respects_staging_and_window() {
        let mut q4 = cfg(16);
        q4.formats = vec![affine(4); 2];
        let mut a = PagedKvCache::new(q4.clone(), &Device::Cpu).unwrap();
        a.add_sequence(0).unwrap();
        fill(&mut a, 0, 10, 10, 1.0);
        let saved = a.export_rows(0).unwrap();

        let mut q8 = q4.clone();
        q8.formats = vec![affine(8); 2];
        let mut b = PagedKvCache::new(q8, &Device::Cpu).unwrap();
        b.add_sequence(0).unwrap();
        let e = b.import_rows(0, &saved, 4).unwrap_err().to_string();
        assert!(
            e.contains("layer 0") && e.contains("bits: 4") && e.contains("bits: 8"),
            "{e}"
        );
        assert_eq!(b.seq_len(0).unwrap(), 0);
        assert_eq!(b.free_blocks(), 16);

        // Below --quantized-kv-start a sequence is dense: quantized rows do not fit, dense do.
        let mut staged = q4.clone();
        staged.staging = Some(Staging {
            tokens: 12,
            dtype: DType::F32,
            num_blocks: 4,
        });
        let mut c = PagedKvCache::new(staged.clone(), &Device::Cpu).unwrap();
        c.add_sequence(0).unwrap();
        assert!(c.import_rows(0, &saved, 4).is_err());
        let mut dense = PagedKvCache::new(cfg(16), &Device::Cpu).unwrap();
        dense.add_sequence(0).unwrap();
        fill(&mut dense, 0, 10, 10, 1.0);
        c.import_rows(0, &dense.export_rows(0).unwrap(), 4).unwrap();
        assert!(!c.in_main_pool(0).unwrap());
        // Past the threshold the quantized rows go straight to the main pool.
        let mut d = PagedKvCache::new(
            CacheConfig {
                staging: Some(Staging {
                    tokens: 8,
                    ..staged.staging.clone().unwrap()
                }),
                ..staged
            },
            &Device::Cpu,
        )
        .unwrap();
        d.add_sequence(0).unwrap();
        d.import_rows(0, &saved, 4).unwrap();
        assert!(d.in_main_pool(0).unwrap());
        assert_eq!(raw(&d.export_rows(0).unwrap()), raw(&saved));

        // A window: chunks free what slid out, and export then refuses.
        let mut long = PagedKvCache::new(cfg(32), &Device::Cpu).unwrap();
        long.add_sequence(0).unwrap();
        fill(&mut long, 0, 40, 8, 0.1);
        let mut w = cfg(32);
        w.window = Some(6);
        let mut win = PagedKvCache::new(w, &Device::Cpu).unwrap();
        win.add_sequence(0).unwrap();
        win.import_rows(0, &long.export_rows(0).unwrap(), 4)
            .unwrap();
        assert!(win.owned_blocks(0).unwrap() <= win.config().max_blocks_for(40, 4));
        let (k, _) = gather_all(&win, 0, win.first_visible(40), 40);
        assert_eq!(max_diff(&k, &rows(40, 0.1).narrow(0, 35, 5).unwrap()), 0.0);
        let e = win.export_rows(0).unwrap_err().to_string();
        assert!(e.contains("--max-kv-size"), "{e}");
    }
}
