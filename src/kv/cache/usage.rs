//! What the cache holds, in bytes: over all groups and per group.

use super::*;

impl PagedKvCache {
    /// Bytes held by the blocks sequences own now, per group (main and staging pools, partial
    /// tails included), in group order.
    pub fn group_bytes_in_use(&self) -> Vec<usize> {
        let block = self.cfg.group_block_bytes();
        let staged_row = self
            .cfg
            .staging
            .as_ref()
            .map_or(0, |s| 2 * self.cfg.width() * s.dtype.size_in_bytes());
        self.groups
            .iter()
            .zip(&self.layout)
            .zip(block)
            .map(|((g, lg), block)| {
                let main = (g.main.total - g.main.free.len()) * block;
                let staging = g.staging.as_ref().map_or(0, |p| {
                    (p.total - p.free.len()) * self.cfg.block_size * lg.layers.len() * staged_row
                });
                main + staging
            })
            .collect()
    }

    /// Bytes held by the blocks sequences own now, all groups and pools (partial tails
    /// included).
    pub fn bytes_in_use(&self) -> usize {
        self.group_bytes_in_use().iter().sum()
    }

    /// The most bytes held at once since the cache was made.
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes
    }

    /// Bytes of the tokens held in the main pools, without partial-block tails or
    /// windowed-out positions (the formats' formula).
    pub fn token_bytes(&self) -> usize {
        let bs = self.cfg.block_size;
        let per_token: Vec<usize> = self
            .layout
            .iter()
            .map(|g| self.cfg.group_bytes_per_token(g))
            .collect();
        self.seqs
            .values()
            .filter(|s| s.pool == Pool::Main)
            .flat_map(|s| {
                s.tables.iter().zip(&per_token).map(|(t, b)| {
                    let first_kept = t.iter().position(Option::is_some).unwrap_or(t.len());
                    s.len.saturating_sub(first_kept * bs) * b
                })
            })
            .sum()
    }

    /// Bytes allocated for the pools (the budget, whether used or not).
    pub fn capacity_bytes(&self) -> usize {
        self.cfg.main_bytes()
            + self.cfg.staging.as_ref().map_or(0, |s| {
                s.num_blocks * self.cfg.block_size * self.cfg.staging_bytes_per_token()
            })
    }

    pub(super) fn note_peak(&mut self) {
        self.peak_bytes = self.peak_bytes.max(self.bytes_in_use());
    }
}
