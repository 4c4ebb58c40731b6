//! The cache's side of automatic prefix reuse (`kvq serve`): which blocks a new sequence can
//! start on, which full blocks a prefilled prompt offers, and taking main-pool blocks when
//! parked prefix blocks may be evicted. The books are kept by [`super::prefix::PrefixIndex`].

use super::prefix::PrefixIndex;
use super::*;

impl PagedKvCache {
    /// Main-pool blocks nobody holds that still cache a prompt prefix.
    pub fn prefix_cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixIndex::evictable)
    }

    /// Turns on automatic prefix reuse: full blocks of prompts registered with
    /// [`Self::register_prefix`] stay in the pool, shared by reference count, after their
    /// sequences end, until the pool needs them (least recently used first). Not available
    /// when a window drops blocks or with a staging pool, whose blocks do not keep a prompt's
    /// rows.
    pub fn enable_prefix_cache(&mut self) -> Result<()> {
        if self.cfg.kept_window().is_some() || self.cfg.staging.is_some() {
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
    pub(super) fn take_main(&mut self, n: usize) -> Result<Vec<u32>> {
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
}
