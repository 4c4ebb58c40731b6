//! Automatic prefix reuse: which full main-pool blocks hold which prompt tokens, how many
//! sequences share each block, and which unshared ones to evict first.
//!
//! A block is keyed by a hash chain over the token ids of every block up to and including it,
//! so a key names a whole prefix, not a block's tokens alone (the same 16 tokens after another
//! history have other K/V). Entries keep their tokens and parent key, so a hash collision can
//! never hand out the wrong rows. Blocks are kept as stored: a quantized block stays quantized.
//!
//! Ownership: `refs[b]` counts the sequences whose table holds block `b`. A registered block
//! whose count falls to 0 is not freed but parked in the LRU list, where it stays findable until
//! the pool needs a block and nothing is on the free list; an unregistered one goes back to the
//! free list. This module only keeps the books; the cache moves the block ids.
//!
//! What the cache keeps per *first block* (`S`: `--kv-center`'s key means, a function of that
//! block's tokens) lives beside the entries of the prefixes starting with it, and goes with the
//! last of them to be evicted. What it keeps at a prefix's *end* (`E`: `--kv-residual`'s dense
//! copies of the positions before that block boundary, which a sequence starting there needs)
//! lives with that prefix's last entry, goes when it is evicted, and is bounded on its own: at
//! most `max_ends` are kept, the least recently used dropped first (they are large, and outside
//! the pool's blocks).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The key of the prefix made of `parent`'s prefix followed by `tokens`.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: stable within a run, which is all a key needs.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x6b76_7120_7072_6566, 0x6978_2063_6163_6865);
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The key of the empty prefix.
const ROOT: u64 = 0;

struct Entry {
    block: u32,
    parent: u64,
    tokens: Vec<u32>,
    /// Key of the prefix's first block.
    root: u64,
}

/// The entries of prefixes starting with one first block, and what is kept with them.
struct Root<S> {
    tokens: Vec<u32>,
    entries: usize,
    side: Option<S>,
}

/// Book-keeping of shared, cached blocks of one pool.
pub struct PrefixIndex<S = (), E = ()> {
    block_size: usize,
    refs: Vec<u32>,
    /// Key of each registered block.
    key: Vec<Option<u64>>,
    entries: HashMap<u64, Entry>,
    /// Registered blocks nobody holds, by last use (oldest first).
    lru: BTreeMap<u64, u32>,
    last_use: Vec<u64>,
    clock: u64,
    roots: HashMap<u64, Root<S>>,
    /// What is kept at the end of a prefix, by the key of its last block, with the clock of
    /// its last use; `end_use` orders them (oldest first).
    ends: HashMap<u64, (E, u64)>,
    end_use: BTreeMap<u64, u64>,
    max_ends: usize,
}

impl<S, E> PrefixIndex<S, E> {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            refs: vec![0; num_blocks],
            key: vec![None; num_blocks],
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            last_use: vec![0; num_blocks],
            clock: 0,
            roots: HashMap::new(),
            ends: HashMap::new(),
            end_use: BTreeMap::new(),
            max_ends: 0,
        }
    }

    /// Keeps at most `n` ends (see [`Self::keep_end`]); 0 (the default) keeps none.
    pub fn with_max_ends(mut self, n: usize) -> Self {
        self.max_ends = n;
        self
    }

    /// Blocks nobody holds that still hold a cached prefix (free for the taking).
    pub fn evictable(&self) -> usize {
        self.lru.len()
    }

    /// A sequence takes `block` (fresh from the free list, or found by [`Self::lookup`]).
    pub fn hold(&mut self, block: u32) {
        let b = block as usize;
        if self.refs[b] == 0 && self.key[b].is_some() {
            self.lru.remove(&self.last_use[b]);
        }
        self.refs[b] += 1;
    }

    /// A sequence lets go of `block`; true when the block is free again (nobody holds it and
    /// it caches nothing), false when it is still held or parked as a cached prefix.
    pub fn release(&mut self, block: u32) -> bool {
        let b = block as usize;
        self.refs[b] = self.refs[b].saturating_sub(1);
        if self.refs[b] > 0 {
            return false;
        }
        if self.key[b].is_some() {
            self.clock += 1;
            self.last_use[b] = self.clock;
            self.lru.insert(self.clock, block);
            return false;
        }
        true
    }

    /// Takes the least recently used parked block out of the index, for reuse as a fresh one.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, block) = self.lru.pop_first()?;
        let key = self.key[block as usize].take();
        if let Some(k) = key {
            self.drop_end(k);
        }
        if let Some(e) = key.and_then(|k| self.entries.remove(&k)) {
            if let Some(r) = self.roots.get_mut(&e.root) {
                r.entries -= 1;
                if r.entries == 0 {
                    self.roots.remove(&e.root);
                }
            }
        }
        Some(block)
    }

    /// The cached blocks holding the longest prefix of `tokens` made of at most `max_blocks`
    /// full blocks, in order (not yet held: call [`Self::hold`] on each).
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> Vec<u32> {
        let mut found = Vec::new();
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let k = chain(parent, chunk);
            match self.entries.get(&k) {
                Some(e) if e.parent == parent && e.tokens == chunk => found.push(e.block),
                _ => break,
            }
            parent = k;
        }
        // Used now; the deepest block gets the oldest mark, so a chain is evicted from its end.
        for &b in found.iter().rev() {
            self.touch(b);
        }
        found
    }

    /// The cached block of each of the first `max_blocks` full blocks of `tokens` (`None`
    /// where none is cached), found by the chain of every block before it (a windowed group
    /// caches only the blocks its window held). Not yet held: see [`Self::use_found`].
    pub fn present(&self, tokens: &[u32], max_blocks: usize) -> Vec<Option<u32>> {
        self.walk(tokens, max_blocks)
            .map(|(_, e)| e.map(|e| e.block))
            .collect()
    }

    /// Each of the first `max_blocks` full blocks of `tokens`: the key of the prefix it ends,
    /// and that prefix's entry where one is registered (checked against a hash collision).
    fn walk<'a>(
        &'a self,
        tokens: &'a [u32],
        max_blocks: usize,
    ) -> impl Iterator<Item = (u64, Option<&'a Entry>)> + 'a {
        let mut parent = ROOT;
        tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .map(move |chunk| {
                let k = chain(parent, chunk);
                let e = self.entries.get(&k);
                let e = e.filter(|e| e.parent == parent && e.tokens == chunk);
                parent = k;
                (k, e)
            })
    }

    /// Marks blocks found by [`Self::present`] as used now (the deepest the oldest, so a chain
    /// is evicted from its end).
    pub fn use_found(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.touch(b);
        }
    }

    /// Records that `blocks` (a sequence's table, in order; `None` where its window let go)
    /// hold the K/V of `tokens` from position 0; every full block held is registered unless an
    /// equal prefix already is.
    pub fn register(&mut self, blocks: &[Option<u32>], tokens: &[u32]) {
        self.register_with(blocks, tokens, None);
    }

    /// [`Self::register`], keeping `side` with the first block of `tokens` (unless something
    /// is kept there already) for as long as a block of a prefix starting with it is cached.
    pub fn register_with(&mut self, blocks: &[Option<u32>], tokens: &[u32], side: Option<S>) {
        let Some(first) = tokens.get(..self.block_size) else {
            return;
        };
        let root = chain(ROOT, first);
        let mut parent = ROOT;
        for (chunk, &b) in tokens.chunks_exact(self.block_size).zip(blocks) {
            let k = chain(parent, chunk);
            let Some(b) = b else {
                parent = k;
                continue;
            };
            match self.entries.get(&k) {
                // This block or an equal copy is already known: keep the first.
                Some(e) if e.parent == parent && e.tokens == chunk => {}
                Some(_) => break, // a hash collision: leave the rest unregistered
                None if self.key[b as usize].is_none() => {
                    let r = self.roots.entry(root).or_insert_with(|| Root {
                        tokens: first.to_vec(),
                        entries: 0,
                        side: None,
                    });
                    if r.tokens != first {
                        break; // a hash collision of first blocks
                    }
                    r.entries += 1;
                    self.entries.insert(
                        k,
                        Entry {
                            block: b,
                            parent,
                            tokens: chunk.to_vec(),
                            root,
                        },
                    );
                    self.key[b as usize] = Some(k);
                    self.touch(b);
                }
                None => break,
            }
            parent = k;
        }
        if let Some(r) = self.roots.get_mut(&root) {
            if r.tokens == first && r.side.is_none() {
                r.side = side;
            }
        }
    }

    /// What is kept with the first block of `tokens` (see [`Self::register_with`]).
    pub fn side(&self, tokens: &[u32]) -> Option<&S> {
        let first = tokens.get(..self.block_size)?;
        let r = self.roots.get(&chain(ROOT, first))?;
        (r.tokens == first).then_some(r.side.as_ref()).flatten()
    }

    /// The key of the prefix made of the first `blocks` full blocks of `tokens`, if its last
    /// block is registered (a windowed group need not hold the ones before).
    fn key_of(&self, tokens: &[u32], blocks: usize) -> Option<u64> {
        let (i, (k, e)) = self.walk(tokens, blocks).enumerate().last()?;
        (i + 1 == blocks && e.is_some()).then_some(k)
    }

    /// Keeps `end` with the registered prefix made of the first `blocks` full blocks of
    /// `tokens`, for as long as its last block is cached (unless something is kept there
    /// already, or that prefix is not registered); beyond `max_ends` the least recently used
    /// end is dropped.
    pub fn keep_end(&mut self, tokens: &[u32], blocks: usize, end: E) {
        let Some(k) = self.key_of(tokens, blocks) else {
            return;
        };
        if self.max_ends == 0 || self.ends.contains_key(&k) {
            return;
        }
        if self.ends.len() >= self.max_ends {
            if let Some((_, old)) = self.end_use.pop_first() {
                self.ends.remove(&old);
            }
        }
        self.clock += 1;
        self.end_use.insert(self.clock, k);
        self.ends.insert(k, (end, self.clock));
    }

    /// What is kept at the end of the prefix made of the first `blocks` full blocks of
    /// `tokens` (see [`Self::keep_end`]), marked as used now.
    pub fn end(&mut self, tokens: &[u32], blocks: usize) -> Option<&E> {
        let k = self.key_of(tokens, blocks)?;
        let (_, used) = self.ends.get(&k)?;
        self.end_use.remove(used);
        self.clock += 1;
        self.end_use.insert(self.clock, k);
        let e = self.ends.get_mut(&k)?;
        e.1 = self.clock;
        Some(&e.0)
    }

    /// Whether something is kept at the end of each of the first `max_blocks` whole-block
    /// prefixes of `tokens` (entry `m − 1` for the first `m` blocks), in one pass.
    pub fn ends_along(&self, tokens: &[u32], max_blocks: usize) -> Vec<bool> {
        self.walk(tokens, max_blocks)
            .map(|(k, e)| e.is_some() && self.ends.contains_key(&k))
            .collect()
    }

    fn drop_end(&mut self, key: u64) {
        if let Some((_, used)) = self.ends.remove(&key) {
            self.end_use.remove(&used);
        }
    }

    fn touch(&mut self, block: u32) {
        let b = block as usize;
        self.clock += 1;
        if self.refs[b] == 0 && self.key[b].is_some() {
            self.lru.remove(&self.last_use[b]);
            self.lru.insert(self.clock, block);
        }
        self.last_use[b] = self.clock;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_blocks_are_found_by_prefix_and_parked_when_released() {
        let mut p: PrefixIndex = PrefixIndex::new(8, 2);
        // A sequence holds blocks 0,1,2 with tokens [1,2 | 3,4 | 5] (the last one partial).
        for b in [0, 1, 2] {
            p.hold(b);
        }
        p.register(&[Some(0), Some(1), Some(2)], &[1, 2, 3, 4, 5]);
        assert_eq!(p.lookup(&[1, 2, 3, 4, 9, 9], 8), vec![0, 1]);
        assert_eq!(p.lookup(&[1, 2, 7, 4], 8), vec![0]); // diverges in the second block
        assert_eq!(p.lookup(&[3, 4], 8), Vec::<u32>::new()); // same tokens, other history
        assert_eq!(p.lookup(&[1, 2, 3, 4], 1), vec![0]); // capped
                                                         // Released: the registered blocks are parked, the partial one is free.
        assert!(!p.release(0));
        assert!(!p.release(1));
        assert!(p.release(2));
        assert_eq!(p.evictable(), 2);
        // Found again and held by a second sequence: no longer evictable.
        let got = p.lookup(&[1, 2, 3, 4], 8);
        for &b in &got {
            p.hold(b);
        }
        assert_eq!(p.evictable(), 0);
        assert!(p.evict().is_none());
        for &b in got.iter().rev() {
            assert!(!p.release(b)); // the cache releases a table from its end
        }
        // Eviction takes the chain's end first and forgets it.
        assert_eq!(p.evict(), Some(1));
        assert_eq!(p.lookup(&[1, 2, 3, 4], 8), vec![0]);
        assert_eq!(p.evict(), Some(0));
        assert_eq!(p.lookup(&[1, 2, 3, 4], 8), Vec::<u32>::new());
        assert_eq!(p.evictable(), 0);
    }

    #[test]
    fn equal_prefixes_register_once_and_lru_order_follows_use() {
        let mut p: PrefixIndex = PrefixIndex::new(8, 2);
        for b in 0..4 {
            p.hold(b);
        }
        p.register(&[Some(0)], &[1, 2]);
        p.register(&[Some(1)], &[1, 2]); // an equal copy: stays unregistered
        p.register(&[Some(2)], &[5, 6]);
        assert!(!p.release(0));
        assert!(p.release(1));
        assert!(!p.release(2));
        // [5,6] was parked last, then [1,2] is used again: [5,6] is now the older one.
        assert_eq!(p.lookup(&[1, 2], 8), vec![0]);
        assert_eq!(p.evict(), Some(2));
        assert_eq!(p.evict(), Some(0));
        assert!(p.release(3));
    }

    /// What is kept with a first block is found through any prompt starting with it, is
    /// not replaced by a later registration, and goes with the last cached block of its
    /// prefixes.
    #[test]
    fn a_first_blocks_side_lives_as_long_as_its_prefixes() {
        let mut p: PrefixIndex<&str> = PrefixIndex::new(8, 2);
        for b in 0..3 {
            p.hold(b);
        }
        p.register_with(&[Some(0), Some(1)], &[1, 2, 3, 4], Some("a"));
        p.register_with(&[Some(0), Some(2)], &[1, 2, 5, 6], Some("b"));
        assert_eq!(p.side(&[1, 2, 9]), Some(&"a"));
        assert_eq!(p.side(&[1, 3, 9]), None);
        assert_eq!(p.side(&[1]), None);
        for b in [1, 2, 0] {
            assert!(!p.release(b));
        }
        // Parked in release order 1, 2, 0: block 0 (the first block) goes last.
        assert_eq!(p.evict(), Some(1));
        assert_eq!(p.evict(), Some(2));
        assert_eq!(p.side(&[1, 2]), Some(&"a"));
        assert_eq!(p.evict(), Some(0));
        assert_eq!(p.side(&[1, 2]), None);
        // Registered again without one: nothing kept.
        p.hold(3);
        p.register(&[Some(3)], &[1, 2]);
        assert_eq!(p.side(&[1, 2]), None);
    }

    /// What is kept at a prefix's end is found only through that whole prefix, goes with its
    /// last block, and beyond the limit the least recently used one is dropped.
    #[test]
    fn ends_live_with_their_last_block_and_are_bounded() {
        let mut p: PrefixIndex<(), &str> = PrefixIndex::new(8, 2).with_max_ends(2);
        for b in 0..4 {
            p.hold(b);
        }
        p.register(&[Some(0), Some(1)], &[1, 2, 3, 4]);
        p.keep_end(&[1, 2, 3, 4, 9], 2, "a");
        p.keep_end(&[1, 2, 3, 4], 2, "again"); // one is kept already
        p.keep_end(&[1, 2, 5, 6], 2, "x"); // not registered: nothing kept
        assert_eq!(p.end(&[1, 2, 3, 4, 7], 2), Some(&"a"));
        assert_eq!(p.ends_along(&[1, 2, 5, 6], 8), vec![false, false]);
        p.keep_end(&[1, 2], 1, "b");
        p.register(&[Some(2), Some(3)], &[5, 6, 7, 8]);
        p.end(&[1, 2, 3, 4], 2); // "a" used last: "b" goes first
        p.keep_end(&[5, 6, 7, 8], 2, "c");
        assert_eq!(p.ends_along(&[1, 2, 3, 4, 5], 8), vec![false, true]);
        assert_eq!(p.end(&[5, 6, 7, 8], 2), Some(&"c"));
        // Evicting a prefix's last block drops its end.
        for b in [1, 0, 3, 2] {
            assert!(!p.release(b));
        }
        assert_eq!(p.evict(), Some(1));
        assert_eq!(p.ends_along(&[1, 2, 3, 4], 8), vec![false, false]);
        assert_eq!(p.ends_along(&[5, 6, 7, 8], 8), vec![false, true]);
    }

    #[test]
    fn a_windowed_table_registers_the_blocks_it_still_holds() {
        let mut p: PrefixIndex = PrefixIndex::new(8, 2);
        for b in [3, 4] {
            p.hold(b);
        }
        // Blocks 0 and 1 of the sequence left its window; 2 and 3 are held as ids 3 and 4.
        p.register(&[None, None, Some(3), Some(4)], &[1, 2, 3, 4, 5, 6, 7, 8]);
        let found = p.present(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 8);
        assert_eq!(found, vec![None, None, Some(3), Some(4)]);
        // Another history before them: nothing matches.
        assert_eq!(p.present(&[0, 2, 3, 4, 5, 6], 8), vec![None; 3]);
        p.use_found(&[3, 4]);
        assert!(!p.release(3) && !p.release(4));
        assert_eq!(p.evictable(), 2);
    }
}
