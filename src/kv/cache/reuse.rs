//! The cache's side of automatic prefix reuse (`kvq serve`): which blocks a new sequence can
//! start on, which full blocks a prefilled prompt offers, and taking main-pool blocks when
//! parked prefix blocks may be evicted. The books are kept by [`super::prefix::PrefixIndex`].

use super::prefix::PrefixIndex;
use super::*;

/// Most prefix ends whose dense copies (`--kv-residual`) are kept for reuse, over all prompts;
/// each holds what one sequence's window holds (`N − 1 + S` rows per quantized layer, f16),
/// outside `--kv-memory` like the running sequences' own copies.
pub const MAX_KEPT_WINDOWS: usize = 32;

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
    /// sequences end, until the pool needs them (least recently used first). A windowed group
    /// caches the blocks its window still held when the prompt was registered, and a prefix is
    /// reused only where every group holds what the next token can see. With `--kv-center` a
    /// prefix comes with the key means its blocks were stored with (`center`). With
    /// `--kv-residual` the first token after a shared prefix attends the dense copies of the
    /// `N − 1` positions before it, which the blocks do not hold and which prefilling a few
    /// positions again cannot make exactly (`held`): a prefix is reused only up to a block
    /// boundary where a sequence kept its copies ([`Self::register_prefix`]), at most
    /// [`MAX_KEPT_WINDOWS`] of them. Not available with a staging pool, whose blocks do not keep
    /// a prompt's rows.
    pub fn enable_prefix_cache(&mut self) -> Result<()> {
        if self.cfg.staging.is_some() {
            return Err(CacheError::Rows(
                "prefix reuse needs whole histories in the main pool: it cannot be combined \
                 with --quantized-kv-start"
                    .into(),
            ));
        }
        for (g, gp) in self.groups.iter_mut().enumerate() {
            if gp.prefix.is_none() {
                let ends = if self.cfg.residual > 0 && g == 0 {
                    MAX_KEPT_WINDOWS
                } else {
                    0
                };
                let mut p =
                    PrefixIndex::new(gp.main.total, self.cfg.block_size).with_max_ends(ends);
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
    /// `tokens` of at most `max_tokens` tokens (whole blocks) that every group can serve: the
    /// global groups from position 0, a windowed group the blocks its window would still hold
    /// after that prefix. Returns the tokens it now holds (0 without prefix reuse or a match).
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
        let most = max_tokens / bs;
        let present: Vec<Vec<Option<u32>>> = self
            .groups
            .iter()
            .filter_map(|g| g.prefix.as_ref())
            .map(|p| p.present(tokens, most))
            .collect();
        // First block of a prefix of `m` blocks that group `g` must hold (as `advance` keeps).
        let from =
            |g: &GroupPools, m: usize| g.window.map_or(0, |w| (m * bs + 1).saturating_sub(w) / bs);
        let held = |g: usize, m: usize| {
            let f = from(&self.groups[g], m);
            present[g]
                .get(f..m)
                .is_some_and(|b| b.iter().all(Option::is_some))
        };
        // Under the window, only where the copies of the positions before it were kept.
        let window = self.cfg.residual > 0;
        // The copies are kept once, in the first group's index (`register_prefix`).
        let ends = match (window, self.groups[0].prefix.as_ref()) {
            (true, Some(p)) => p.ends_along(tokens, most),
            _ => Vec::new(),
        };
        let kept = |m: usize| !window || ends.get(m - 1) == Some(&true);
        let mut m = present.iter().map(Vec::len).min().unwrap_or(0);
        while m > 0 && !((0..self.groups.len()).all(|g| held(g, m)) && kept(m)) {
            m -= 1;
        }
        let copies = match (window, m > 0, self.groups[0].prefix.as_mut()) {
            (true, true, Some(p)) => p.end(tokens, m).cloned(),
            _ => None,
        };
        // Centred keys: the blocks mean something only with the means they were stored with.
        let means = self
            .groups
            .iter()
            .find_map(|g| g.prefix.as_ref().and_then(|p| p.side(tokens)).cloned());
        if self.cfg.center && means.is_none() {
            m = 0;
        }
        let mut tables = Vec::with_capacity(self.groups.len());
        for (g, found) in self.groups.iter_mut().zip(present) {
            let f = from(g, m);
            let blocks: Vec<u32> = found.iter().take(m).skip(f).flatten().copied().collect();
            let p = g.prefix.as_mut().expect("every group has an index");
            for &b in &blocks {
                p.hold(b);
            }
            p.use_found(&blocks);
            let mut table = vec![None; f];
            table.extend(blocks.into_iter().map(Some));
            tables.push(table);
        }
        s.tables = tables;
        s.len = m * bs;
        let len = s.len;
        if let (true, Some(means)) = (m > 0 && self.cfg.center, means) {
            self.take_prefix_means(id, &means);
        }
        if let Some(copies) = copies {
            self.import_held(id, &copies, len)?;
        }
        Ok(len)
    }

    /// Offers the full blocks of `id` holding `tokens` (its first positions, all written) to
    /// the prefix cache (in a windowed group, those its window still holds); nothing without
    /// prefix reuse. With `--kv-center`, only blocks whose key means came from a whole first
    /// block, kept with them. With `--kv-residual`, when `id` holds exactly `tokens` and they
    /// end on a block boundary, the dense copies it holds now are kept with the last block:
    /// a later sequence can start there (see [`Self::prefix_point`]).
    pub fn register_prefix(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        if self.groups.iter().all(|g| g.prefix.is_none()) {
            return Ok(());
        }
        let means = match self.cfg.center {
            true => match self.prefix_means(id) {
                Some(m) => Some(m),
                None => return Ok(()),
            },
            false => None,
        };
        let s = self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))?;
        let n = tokens.len().min(s.len);
        let bs = self.cfg.block_size;
        let at_boundary = n == s.len && n == tokens.len() && n > 0 && n % bs == 0;
        let copies = match at_boundary {
            true => self.export_held(id)?,
            false => None,
        };
        let s = self.seqs.get(&id).ok_or(CacheError::UnknownSeq(id))?;
        for (g, table) in self.groups.iter_mut().zip(&s.tables) {
            if let Some(p) = g.prefix.as_mut() {
                p.register_with(table, &tokens[..n], means.clone());
            }
        }
        // Once, in the first group's index: every group registers the same prefixes.
        if let (Some(c), Some(p)) = (copies, self.groups[0].prefix.as_mut()) {
            p.keep_end(tokens, n / bs, c);
        }
        Ok(())
    }

    /// Under `--kv-residual` with prefix reuse on, the block boundary at which a prompt that may
    /// be reused up to `max_reuse` tokens should stop once, so that [`Self::register_prefix`]
    /// keeps its dense copies there (the last whole block within `max_reuse`); `None` where
    /// nothing needs to be kept.
    pub fn prefix_point(&self, max_reuse: usize) -> Option<usize> {
        let on = self.cfg.residual > 0 && self.groups.iter().all(|g| g.prefix.is_some());
        let at = max_reuse / self.cfg.block_size * self.cfg.block_size;
        (on && at > 0).then_some(at)
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
