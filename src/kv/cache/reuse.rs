//! The cache's side of automatic prefix reuse (`kvq serve`): which blocks a new sequence can
//! start on, which full blocks a prefilled prompt offers, and taking main-pool blocks when
//! parked prefix blocks may be evicted. The books are kept by [`super::prefix::PrefixIndex`].

use super::prefix::PrefixIndex;
use super::*;

impl PagedKvCache {
    /// Main-pool blocks nobody holds that still cache a prompt prefix, over all groups.
    pub fn prefix_cached_blocks(&self) -> usize {
        self.group_prefix_cached().iter().sum()
    }

    /// [`Self::prefix_cached_blocks`] of each group.
    pub fn group_prefix_cached(&self) -> Vec<usize> {
        self.groups
            .iter()
            .map(|g| g.prefix.as_ref().map_or(0, PrefixIndex::evictable))
            .collect()
    }

    /// Turns on automatic prefix reuse: full blocks of prompts registered with
    /// [`Self::register_prefix`] stay in the pool, shared by reference count, after their
    /// sequences end, until the pool needs them (least recently used first). Not available
    /// when a window drops blocks (`--max-kv-size`, or a model's sliding-window layers) or
    /// with a staging pool, whose blocks do not keep a prompt's rows.
    pub fn enable_prefix_cache(&mut self) -> Result<()> {
        if let Some(w) = self.layout.iter().find_map(|g| g.window) {
            return Err(CacheError::Rows(format!(
                "prefix reuse needs whole histories in the main pool: layers attending through a \
                 {w}-token window (the model's sliding window or --max-kv-size) let go of them"
            )));
        }
        if self.cfg.staging.is_some() {
            return Err(CacheError::Rows(
                "prefix reuse needs whole histories in the main pool: it cannot be combined \
                 with --quantized-kv-start"
                    .into(),
            ));
        }
        for (g, gp) in self.groups.iter_mut().enumerate() {
            if gp.prefix.is_none() {
                let mut p = PrefixIndex::new(gp.main.total, self.cfg.block_size);
                for s in self.seqs.values() {
                    for &b in s.tables[g].iter().flatten() {
                        p.hold(b);
                    }
                }
                gp.prefix = Some(p);
            }
        }
        Ok(())
    }

    /// Starts the new, empty sequence `id` on the cached blocks holding the longest prefix of
    /// `tokens` of at most `max_tokens` tokens (whole blocks, found in every group); returns
    /// the tokens it now holds (0 without prefix reuse or a match).
    pub fn attach_prefix(&mut self, id: SeqId, tokens: &[u32], max_tokens: usize) -> Result<usize> {
        let bs = self.cfg.block_size;
        if self.groups.iter().any(|g| g.prefix.is_none()) {
            return Ok(0);
        }
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        if s.len > 0 || s.pool != Pool::Main {
            return Err(CacheError::Rows(format!(
                "sequence {id}: a cached prefix can only start an empty sequence"
            )));
        }
        let mut blocks = max_tokens / bs;
        let found: Vec<Vec<u32>> = self
            .groups
            .iter_mut()
            .filter_map(|g| g.prefix.as_mut())
            .map(|p| p.lookup(tokens, blocks))
            .collect();
        blocks = found.iter().map(Vec::len).min().unwrap_or(0);
        let mut tables = Vec::with_capacity(found.len());
        for (g, f) in self.groups.iter_mut().zip(found) {
            let p = g.prefix.as_mut().expect("every group has an index");
            let f = f.get(..blocks).unwrap_or_default();
            for &b in f {
                p.hold(b);
            }
            tables.push(f.iter().copied().map(Some).collect());
        }
        s.tables = tables;
        s.len = blocks * bs;
        Ok(s.len)
    }

    /// Offers the full blocks of `id` holding `tokens` (its first positions, all written) to
    /// the prefix cache; nothing without prefix reuse.
    pub fn register_prefix(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let s = self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))?;
        let n = tokens.len().min(s.len);
        for (g, table) in self.groups.iter_mut().zip(&s.tables) {
            if let Some(p) = g.prefix.as_mut() {
                let blocks: Vec<u32> = table.iter().map_while(|b| *b).collect();
                p.register(&blocks, &tokens[..n]);
            }
        }
        Ok(())
    }

    /// Takes `n` main-pool blocks of group `g` for a sequence: free ones first, then parked
    /// prefix blocks, least recently used first (all-or-nothing).
    pub(super) fn take_main(&mut self, g: usize, n: usize) -> Result<Vec<u32>> {
        let gp = &mut self.groups[g];
        if let Some(p) = gp.prefix.as_mut() {
            if n <= gp.main.free.len() + p.evictable() {
                while gp.main.free.len() < n {
                    match p.evict() {
                        Some(b) => gp.main.free.push(b),
                        None => break,
                    }
                }
            }
        }
        let new = gp.main.take(n, gp.window)?;
        if let Some(p) = gp.prefix.as_mut() {
            for &b in &new {
                p.hold(b);
            }
        }
        Ok(new)
    }

    /// Free and total blocks of each group's dense staging pool (`--quantized-kv-start`);
    /// empty without staging.
    pub fn group_staging_blocks(&self) -> Vec<(usize, usize)> {
        self.groups
            .iter()
            .filter_map(|g| g.staging.as_ref().map(|p| (p.free.len(), p.total)))
            .collect()
    }
}
