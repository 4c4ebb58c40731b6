//! The paged KV cache: fixed-size blocks of tokens taken from pools, block tables per sequence.
//!
//! Layers are split into *layer groups* by the window they attend through ([`groups`]): the
//! global layers form one group, each sliding-window size another (Gemma 2/3, Qwen2's sliding
//! layers, `--max-kv-size`). Each group owns a pool: every layer of the group has one storage
//! of `blocks * block_size` token slots per K and V ([`LayerKv`]) and a block id names the same
//! slots in each of them, so one block table per sequence and group serves all its layers (as
//! in vLLM's hybrid cache). Adding or removing a sequence only moves block ids between free
//! lists and tables: nobody else's data is copied, and the only waste is the unfilled tail of
//! each sequence's last block per group. Pools are sized up front (the memory budget, split
//! between groups by what a sequence holds in each); `reserve` fails cleanly when one is full
//! so the scheduler can wait instead of crashing.
//!
//! Policies are block-level, never special cases in the model:
//! - per-layer formats: each layer's main storage is dense or affine-quantized (`--kv-bits`,
//!   `--kv-dense-layers`), windowed layers like any other; tokens are quantized once, as they
//!   are written;
//! - `--quantized-kv-start N`: a sequence first lives in small dense *staging* pools (one per
//!   group); the write that would bring it to N tokens first moves its history into the main
//!   pools (quantizing each row exactly as a direct write would) and frees its staging blocks;
//! - windows: a group whose layers attend through a window of W positions (the model's own,
//!   capped by `--max-kv-size`) lets go of blocks whose tokens no future query can see (all
//!   positions ≤ len − W), so a sequence holds at most ⌈W / block_size⌉ + 1 of its blocks
//!   between steps, whatever its length; the global group keeps every block;
//! - [`PagedKvCache::keep_history`]: a sequence whose prompt is to be exported keeps every
//!   block of it in every group until the step after the prompt is complete.

mod center;
pub mod config;
mod export;
pub use export::PromptKv;
mod fixed;
pub use fixed::FixedWrites;
pub mod groups;
pub mod held;
mod pools;
pub mod prefix;
pub mod prompt_file;
pub mod residual;
mod reuse;
#[cfg(feature = "cuda")]
pub mod ring;
#[cfg(feature = "cuda")]
mod ring_write;
mod staging;
mod usage;

pub use config::{CacheConfig, KvOptions, ModelShape, PoolSizing, QuantScheme, Staging};
pub use groups::{Blocks, LayerGroup};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::kv::format::rotation::{Rotation, DEFAULT_SEED};
use crate::kv::format::{KvFormat, LayerKv, LayerRows, SlotRows};
use pools::{BlockPool, GroupPools};

/// Identifies one sequence in the cache (the scheduler's request number).
pub type SeqId = u64;

/// One sequence's part of a write: `(id, start, offset, n)` stores rows `offset..offset + n` of
/// the written tensors as positions `start..start + n` of `id`.
pub type WriteSpan = (SeqId, usize, usize, usize);

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("KV cache full: {needed} more blocks needed, {free} free of {total}{}", group_note(.window))]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
        /// The window of the group that is full (`None`: the global layers).
        window: Option<usize>,
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

fn group_note(window: &Option<usize>) -> String {
    window.map_or(String::new(), |w| {
        format!(" in the pool of the layers with a {w}-token window")
    })
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
    /// Per layer group: the block of each position range, in order; `None` once freed by the
    /// group's window.
    tables: Vec<Vec<Option<u32>>>,
    len: usize,
    /// Positions below this stay held in every group while `len` ≤ it ([`PagedKvCache::keep_history`]).
    keep: usize,
}

pub struct PagedKvCache {
    cfg: CacheConfig,
    device: Device,
    layout: Vec<LayerGroup>,
    groups: Vec<GroupPools>,
    /// Group of each layer and its index among the group's layers.
    layer_at: Vec<(usize, usize)>,
    seqs: HashMap<SeqId, SeqState>,
    peak_bytes: usize,
    /// Built when any main-pool layer is rotated (one rotation serves every layer and head).
    rotation: Option<Rotation>,
    /// The slots of the last write per group, per pool written: every layer of a group writes
    /// the same ones in a step, so they are uploaded to the device once per step and group.
    last_slots: Mutex<Vec<Vec<Arc<SlotRows>>>>,
    /// `--kv-residual`: dense copies of each sequence's newest rows per quantized layer.
    tails: residual::Tails,
    /// `--kv-center`: each sequence's key means per layer.
    centers: center::Centers,
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
        if cfg.residual > 0 && !(device.is_cpu() || device.is_cuda()) {
            return Err(CacheError::Rows(
                "--kv-residual runs on the CPU and CUDA only (its merge with the quantized part \
                 needs their decode kernels' log-sum-exp); run without it on this device"
                    .into(),
            ));
        }
        let rotation = if cfg.formats.iter().any(KvFormat::is_rotated) {
            Rotation::check(cfg.head_dim).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            Some(Rotation::new(cfg.head_dim, DEFAULT_SEED, device)?)
        } else {
            None
        };
        let w = cfg.width();
        let layout = cfg.groups();
        let mut layer_at = vec![(0, 0); cfg.num_layers];
        let mut groups = Vec::with_capacity(layout.len());
        for (g, lg) in layout.iter().enumerate() {
            for (i, &l) in lg.layers.iter().enumerate() {
                layer_at[l] = (g, i);
            }
            let formats: Vec<KvFormat> = lg.layers.iter().map(|&l| cfg.formats[l]).collect();
            let main = BlockPool::new(&formats, cfg.blocks_of(g), cfg.block_size, w, device)?;
            let staging = match &cfg.staging {
                Some(s) => Some(BlockPool::new(
                    &vec![KvFormat::Dense(s.dtype); lg.layers.len()],
                    s.num_blocks,
                    cfg.block_size,
                    w,
                    device,
                )?),
                None => None,
            };
            groups.push(GroupPools {
                window: lg.window,
                main,
                staging,
                prefix: None,
            });
        }
        let tails = residual::Tails::new(&cfg, device)?;
        Ok(Self {
            device: device.clone(),
            last_slots: Mutex::new(vec![Vec::new(); layout.len()]),
            cfg,
            layout,
            groups,
            layer_at,
            seqs: HashMap::new(),
            peak_bytes: 0,
            rotation,
            tails,
            centers: center::Centers::default(),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The layer groups, in the order every per-group value follows.
    pub fn groups(&self) -> &[LayerGroup] {
        &self.layout
    }

    /// The group `layer` belongs to.
    pub fn group_of(&self, layer: usize) -> usize {
        self.layer_at.get(layer).map_or(0, |&(g, _)| g)
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
                tables: vec![Vec::new(); self.groups.len()],
                len: 0,
                keep: 0,
            },
        );
        Ok(())
    }

    /// Drops a sequence and returns its blocks to their pools at once.
    pub fn remove_sequence(&mut self, id: SeqId) {
        self.tails.remove(id);
        self.centers.remove(id);
        if let Some(s) = self.seqs.remove(&id) {
            for (g, table) in self.groups.iter_mut().zip(s.tables) {
                g.give_back(s.pool, table.into_iter().flatten().collect());
            }
        }
    }

    /// Keeps every block of `id`'s first `tokens` positions in every group until the step after
    /// the sequence holds them all (windows free nothing of them before), so they can be
    /// exported ([`Self::export_rows`]); admission counts them with
    /// [`CacheConfig::max_blocks_keeping`].
    pub fn keep_history(&mut self, id: SeqId, tokens: usize) -> Result<()> {
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        s.keep = tokens;
        Ok(())
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Tokens the sequence holds (positions written so far).
    pub fn seq_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// Blocks each group's main pool could hand out now (free, or parked prefix blocks).
    pub fn free_blocks(&self) -> Blocks {
        Blocks(self.groups.iter().map(|g| g.room(Pool::Main)).collect())
    }

    /// Main-pool blocks `id` owns now, per group.
    pub fn owned_blocks(&self, id: SeqId) -> Result<Blocks> {
        let s = self.seq(id)?;
        Ok(Blocks(
            s.tables
                .iter()
                .map(|t| {
                    if s.pool == Pool::Main {
                        t.iter().flatten().count()
                    } else {
                        0
                    }
                })
                .collect(),
        ))
    }

    /// Makes room for `n_new` more tokens of `id` in every group (all-or-nothing). A staging
    /// sequence that would reach the quantization threshold moves to the main pools first.
    pub fn reserve(&mut self, id: SeqId, n_new: usize) -> Result<()> {
        let s = self.seq(id)?;
        if s.pool == Pool::Staging {
            let threshold = self.cfg.staging.as_ref().map_or(0, |st| st.tokens);
            if s.len + n_new >= threshold {
                self.promote(id)?;
            }
        }
        let s = self.seq(id)?;
        let want = self.cfg.blocks_for(s.len + n_new);
        let pool = s.pool;
        let needed: Vec<usize> = s
            .tables
            .iter()
            .map(|t| want.saturating_sub(t.len()))
            .collect();
        for (g, &n) in self.groups.iter().zip(&needed) {
            if n > g.room(pool) {
                return Err(CacheError::OutOfBlocks {
                    needed: n,
                    free: g.room(pool),
                    total: g.pool(pool).total,
                    window: g.window,
                });
            }
        }
        for (g, &n) in needed.iter().enumerate() {
            let new = match pool {
                Pool::Main => self.take_main(g, n)?,
                Pool::Staging => {
                    let gp = &mut self.groups[g];
                    let w = gp.window;
                    gp.pool_mut(pool).take(n, w)?
                }
            };
            let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
            s.tables[g].extend(new.into_iter().map(Some));
        }
        self.note_peak();
        Ok(())
    }

    /// The window `layer` attends through (see [`CacheConfig::layer_window`]).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.cfg.layer_window(layer)
    }

    /// First position a query at `pos` can see in the layers of `group`.
    pub fn first_visible(&self, group: usize, pos: usize) -> usize {
        match self.layout.get(group).and_then(|g| g.window) {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// Slot index of each position in `from..to` of `id` in `group`'s pool (the gather list
    /// for attention in that group's layers).
    pub fn slots(&self, id: SeqId, group: usize, from: usize, to: usize) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        let table = s.tables.get(group).ok_or_else(|| no_group(group))?;
        let bs = self.cfg.block_size;
        (from..to)
            .map(|p| {
                let b = table.get(p / bs).copied().flatten().ok_or_else(|| {
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
        spans: &[WriteSpan],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        // The main pool's rows are rotated on the way in (fused with the quantization where a
        // kernel does both); staging keeps them as they are.
        let rot = self.rotation(layer, true);
        let (g, at) = self.layer_place(layer)?;
        let centred;
        let k = if self.centers_keys(layer) {
            centred = self.centred(layer, spans, k)?;
            &centred
        } else {
            k
        };
        self.keep_residual(layer, spans, k, v)?;
        // Per pool: which rows of k/v go to which slots, so each pool takes one write per
        // layer (one fused launch per tensor on CUDA) instead of one per sequence and block.
        let bs = self.cfg.block_size;
        let mut plan: Vec<(Pool, Vec<u32>, Vec<u32>)> = Vec::new();
        for &(id, start, offset, n) in spans {
            let s = self.seq(id)?;
            let i = match plan.iter().position(|(p, ..)| *p == s.pool) {
                Some(i) => i,
                None => {
                    plan.push((s.pool, Vec::new(), Vec::new()));
                    plan.len() - 1
                }
            };
            let (_, src, dst) = &mut plan[i];
            for i in 0..n {
                let pos = start + i;
                let block = s.tables[g]
                    .get(pos / bs)
                    .copied()
                    .flatten()
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "sequence {id}: position {pos} not reserved"
                        ))
                    })?;
                src.push((offset + i) as u32);
                dst.push(block * bs as u32 + (pos % bs) as u32);
            }
        }
        let total = k.dim(0)?;
        let mut last = self.last_slots.lock().expect("poisoned slot cache");
        let mut used = Vec::with_capacity(plan.len());
        for (pool, src, dst) in plan {
            let slots = match last[g].iter().find(|s| s.as_slice() == dst.as_slice()) {
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
            let dst = &self.groups[g].pool(pool).layers[at];
            match (rot, pool) {
                (Some(r), Pool::Main) => dst.write_slots_rotated(&slots, &k, &v, r)?,
                _ => dst.write_slots(&slots, &k, &v)?,
            }
            used.push(slots);
        }
        last[g] = used;
        Ok(())
    }

    /// Records that `n` tokens were appended to `id` (after every layer wrote them), and lets
    /// go of each windowed group's blocks that slid out of its window.
    pub fn advance(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        let reserved = s.tables.iter().map(Vec::len).min().unwrap_or(0);
        if s.len + n > reserved * bs {
            return Err(candle_core::Error::Msg(format!(
                "sequence {id}: advancing past its reserved blocks"
            ))
            .into());
        }
        s.len += n;
        if self.cfg.residual > 0 {
            // The next query is at position len: it sees the dense copies of positions
            // > len - residual; a prompt chunk's other rows go.
            let from = (s.len + 1).saturating_sub(self.cfg.residual);
            self.tails.trim(id, None, from, self.cfg.width());
        }
        if s.len <= s.keep {
            return Ok(()); // its history is kept whole until it is exported
        }
        for (g, table) in self.groups.iter_mut().zip(s.tables.iter_mut()) {
            let Some(w) = g.window else { continue };
            // The next query is at position len; it sees positions > len - w.
            let keep_from = (s.len + 1).saturating_sub(w);
            let freed: Vec<u32> = table
                .iter_mut()
                .take(keep_from / bs)
                .filter_map(Option::take)
                .collect();
            g.give_back(s.pool, freed);
        }
        Ok(())
    }

    /// K and V of `slots` (of `layer`'s group) of `id` in `layer` as dense
    /// `[n, kv_heads, head_dim]` of `dtype`.
    pub fn gather(
        &self,
        layer: usize,
        id: SeqId,
        slots: &Tensor,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.seq(id)?;
        let (g, at) = self.layer_place(layer)?;
        let n = slots.dim(0)?;
        let shape = (n, self.cfg.num_kv_heads, self.cfg.head_dim);
        let (k, v) = self.groups[g].pool(s.pool).layers[at].gather(slots, dtype)?;
        Ok((k.reshape(shape)?, v.reshape(shape)?))
    }

    /// Whether `id` lives in the main pools (else in dense staging).
    pub fn in_main_pool(&self, id: SeqId) -> Result<bool> {
        Ok(self.seq(id)?.pool == Pool::Main)
    }

    /// Block ids of `id` in `group`, in position order; blocks freed by the group's window read
    /// as 0 (never visited: they lie before the first visible position).
    pub fn block_table(&self, id: SeqId, group: usize) -> Result<Vec<u32>> {
        Ok(self
            .seq(id)?
            .tables
            .get(group)
            .ok_or_else(|| no_group(group))?
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

    /// One layer's storage in its group's main pool (`main`) or staging pool.
    pub fn layer_storage(&self, layer: usize, main: bool) -> &LayerKv {
        let pool = if main { Pool::Main } else { Pool::Staging };
        let (g, at) = self.layer_at[layer];
        &self.groups[g].pool(pool).layers[at]
    }

    fn layer_place(&self, layer: usize) -> Result<(usize, usize)> {
        self.layer_at.get(layer).copied().ok_or_else(|| {
            CacheError::Candle(candle_core::Error::Msg(format!(
                "layer {layer} is not in a {}-layer cache",
                self.cfg.num_layers
            )))
        })
    }

    fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))
    }
}

fn no_group(group: usize) -> CacheError {
    CacheError::Candle(candle_core::Error::Msg(format!(
        "no layer group {group} in the KV cache"
    )))
}

#[cfg(test)]
mod tests;
