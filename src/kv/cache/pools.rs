//! The block pools of one layer group: a free list over `total` blocks, and each layer's
//! storage of those blocks' slots.

use candle_core::Device;

use super::center::KeyMeans;
use super::held::HeldRows;
use super::prefix::PrefixIndex;
use super::{CacheError, Pool, Result};
use crate::kv::format::{KvFormat, LayerKv};

pub(super) struct BlockPool {
    pub(super) layers: Vec<LayerKv>,
    pub(super) free: Vec<u32>,
    pub(super) total: usize,
}

impl BlockPool {
    pub(super) fn new(
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

    pub(super) fn take(&mut self, n: usize, window: Option<usize>) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
                total: self.total,
                window,
            });
        }
        Ok((0..n).filter_map(|_| self.free.pop()).collect())
    }
}

/// One layer group's pools.
pub(super) struct GroupPools {
    pub(super) window: Option<usize>,
    pub(super) main: BlockPool,
    pub(super) staging: Option<BlockPool>,
    /// Automatic prefix reuse of main-pool blocks (see [`prefix`]), when enabled; with
    /// `--kv-center`, each first block keeps the key means its prefixes were stored with; with
    /// `--kv-residual`, a prefix's last block may keep the dense copies a sequence starting
    /// after it needs.
    pub(super) prefix: Option<PrefixIndex<KeyMeans, HeldRows>>,
}

impl GroupPools {
    pub(super) fn pool(&self, p: Pool) -> &BlockPool {
        match p {
            Pool::Main => &self.main,
            Pool::Staging => self.staging.as_ref().expect("staging pool exists"),
        }
    }

    pub(super) fn pool_mut(&mut self, p: Pool) -> &mut BlockPool {
        match p {
            Pool::Main => &mut self.main,
            Pool::Staging => self.staging.as_mut().expect("staging pool exists"),
        }
    }

    /// Blocks that `take` could hand out now from pool `p`.
    pub(super) fn room(&self, p: Pool) -> usize {
        match p {
            Pool::Main => self.main.free.len() + self.prefix.as_ref().map_or(0, |x| x.evictable()),
            Pool::Staging => self.pool(p).free.len(),
        }
    }

    /// Gives `blocks` of a sequence in pool `p` back (in table order; shared or cached blocks
    /// of the prefix cache stay where they are, the chain's end parked first).
    pub(super) fn give_back(&mut self, p: Pool, blocks: Vec<u32>) {
        match (&mut self.prefix, p) {
            (Some(x), Pool::Main) => {
                let freed: Vec<u32> = blocks.into_iter().rev().filter(|&b| x.release(b)).collect();
                self.main.free.extend(freed);
            }
            _ => self.pool_mut(p).free.extend(blocks.into_iter().rev()),
        }
    }
}
