//! Layer groups: layers that attend through the same window hold the same positions, so they
//! share one pool of blocks and one block table per sequence (vLLM's KV cache groups). A
//! model's global layers form one group that grows with the sequence; each sliding-window size
//! forms another, whose blocks go back to its pool as they leave the window. Block counts are
//! therefore per group ([`Blocks`]): the scheduler plans with them, the cache owns the blocks.

use super::config::{CacheConfig, PoolSizing};

/// The layers of one group and the window they attend through (`None`: global).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroup {
    pub window: Option<usize>,
    /// Model layer indices, ascending.
    pub layers: Vec<usize>,
}

/// A block count per layer group, in [`CacheConfig::groups`] order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Blocks(pub Vec<usize>);

impl Blocks {
    /// Blocks over all groups.
    pub fn total(&self) -> usize {
        self.0.iter().sum()
    }

    /// Group by group sum (the longer operand sets the length).
    pub fn plus(&self, o: &Blocks) -> Blocks {
        let n = self.0.len().max(o.0.len());
        Blocks(
            (0..n)
                .map(|g| self.get(g).saturating_add(o.get(g)))
                .collect(),
        )
    }

    /// Group by group difference, floored at 0.
    pub fn saturating_sub(&self, o: &Blocks) -> Blocks {
        Blocks(
            (0..self.0.len())
                .map(|g| self.get(g).saturating_sub(o.get(g)))
                .collect(),
        )
    }

    /// The first group where `self` needs more than `room` has, if any.
    pub fn first_short(&self, room: &Blocks) -> Option<usize> {
        (0..self.0.len()).find(|&g| self.get(g) > room.get(g))
    }

    /// Whether every group's count fits in `room`'s.
    pub fn fits_in(&self, room: &Blocks) -> bool {
        self.first_short(room).is_none()
    }

    pub fn get(&self, g: usize) -> usize {
        self.0.get(g).copied().unwrap_or(0)
    }
}

impl CacheConfig {
    /// The layer groups: layers keyed by the window they attend through
    /// ([`CacheConfig::layer_window`]), the global group first, then windows from the narrowest.
    pub fn groups(&self) -> Vec<LayerGroup> {
        let mut out: Vec<LayerGroup> = Vec::new();
        for l in 0..self.num_layers {
            let w = self.layer_window(l);
            match out.iter_mut().find(|g| g.window == w) {
                Some(g) => g.layers.push(l),
                None => out.push(LayerGroup {
                    window: w,
                    layers: vec![l],
                }),
            }
        }
        out.sort_by_key(|g| g.window);
        out
    }

    /// Main-pool blocks of group `g` (one entry of `pool_blocks` serves every group).
    pub fn blocks_of(&self, g: usize) -> usize {
        self.pool_blocks
            .get(g)
            .or(self.pool_blocks.last())
            .copied()
            .unwrap_or(0)
    }

    /// Main-pool blocks of every group.
    pub fn pool_sizes(&self) -> Blocks {
        Blocks(
            (0..self.groups().len())
                .map(|g| self.blocks_of(g))
                .collect(),
        )
    }

    /// Bytes one token occupies in group `group`'s layers, K and V.
    pub fn group_bytes_per_token(&self, group: &LayerGroup) -> usize {
        let w = self.width();
        group
            .layers
            .iter()
            .filter_map(|&l| self.formats.get(l))
            .map(|f| f.kv_row_bytes(w))
            .sum()
    }

    /// Bytes of one block of every group, in group order.
    pub fn group_block_bytes(&self) -> Vec<usize> {
        self.groups()
            .iter()
            .map(|g| self.block_size * self.group_bytes_per_token(g))
            .collect()
    }

    /// Bytes allocated for the main pools (the budget, whether used or not).
    pub fn main_bytes(&self) -> usize {
        self.group_block_bytes()
            .iter()
            .enumerate()
            .map(|(g, b)| b.saturating_mul(self.blocks_of(g)))
            .fold(0, usize::saturating_add)
    }

    /// Most main-pool blocks a sequence holding up to `tokens` tokens, fed in chunks of at most
    /// `chunk` tokens, can own at once in each group (a window bounds what its group holds).
    pub fn max_blocks_for(&self, tokens: usize, chunk: usize) -> Blocks {
        let all = self.blocks_for(tokens);
        Blocks(
            self.groups()
                .iter()
                .map(|g| match g.window {
                    Some(w) => all.min(self.blocks_for(w.saturating_add(chunk)) + 1),
                    None => all,
                })
                .collect(),
        )
    }

    /// [`Self::max_blocks_for`] for a sequence that keeps its first `kept` positions whole in
    /// every group until they are exported (see `PagedKvCache::keep_history`).
    pub fn max_blocks_keeping(&self, tokens: usize, chunk: usize, kept: usize) -> Blocks {
        let whole = self.blocks_for(kept.min(tokens));
        Blocks(
            self.max_blocks_for(tokens, chunk)
                .0
                .into_iter()
                .map(|b| b.max(whole))
                .collect(),
        )
    }

    /// Main-pool blocks of each group for `sizing` (see [`PoolSizing`]).
    pub(super) fn group_pool_blocks(&self, sizing: PoolSizing) -> Vec<usize> {
        let groups = self.groups();
        match sizing {
            PoolSizing::Sequences {
                tokens,
                max_batch,
                chunk,
            } => {
                let all = tokens.div_ceil(self.block_size) + max_batch;
                let most = self.max_blocks_for(usize::MAX / 2, chunk);
                (0..groups.len())
                    .map(|g| match groups[g].window {
                        // A window caps what each sequence can hold.
                        Some(_) => all.min(max_batch.saturating_mul(most.get(g))),
                        None => all,
                    })
                    .collect()
            }
            PoolSizing::Budget {
                bytes,
                tokens,
                max_batch,
                chunk,
            } => self.split_budget(bytes, tokens, max_batch, chunk),
            PoolSizing::Window { tokens, chunk } => self
                .max_blocks_for(tokens, chunk)
                .0
                .iter()
                .map(|b| b + 1)
                .collect(),
        }
    }

    /// Shares `bytes` between the groups in proportion to what one sequence of `tokens` tokens
    /// holds in each; with a global group, windowed groups get at most what `max_batch` such
    /// sequences can hold and the global group the rest. One group gets `bytes / block bytes`.
    fn split_budget(
        &self,
        bytes: usize,
        tokens: usize,
        max_batch: usize,
        chunk: usize,
    ) -> Vec<usize> {
        let groups = self.groups();
        let block_bytes = self.group_block_bytes();
        let one = self.max_blocks_for(tokens.max(1), chunk);
        let per_seq: u128 = (0..groups.len())
            .map(|g| one.get(g) as u128 * block_bytes[g] as u128)
            .sum::<u128>()
            .max(1);
        let share = |g: usize| -> usize {
            let b = bytes as u128 * one.get(g) as u128 / per_seq;
            usize::try_from(b).unwrap_or(usize::MAX)
        };
        let global = groups.iter().position(|g| g.window.is_none());
        let mut out: Vec<usize> = (0..groups.len())
            .map(|g| match (global, groups[g].window) {
                (Some(_), Some(_)) => share(g).min(max_batch.saturating_mul(one.get(g))),
                _ => share(g),
            })
            .collect();
        if let Some(gl) = global {
            let windowed: usize = (0..groups.len())
                .filter(|&g| g != gl)
                .map(|g| out[g].saturating_mul(block_bytes[g]))
                .sum();
            out[gl] = bytes.saturating_sub(windowed) / block_bytes[gl].max(1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// Six layers like Gemma 3: five windowed (8 tokens) to one global, blocks of 4.
    fn hybrid() -> CacheConfig {
        let mut c = CacheConfig::dense(6, 1, 8, 4, 0, DType::F32);
        c.layer_windows = (0..6).map(|l| (l % 6 != 5).then_some(8)).collect();
        c
    }

    #[test]
    fn layers_group_by_window_global_first() {
        let mut c = hybrid();
        let g = c.groups();
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].window, g[0].layers.clone()), (None, vec![5]));
        assert_eq!(
            (g[1].window, g[1].layers.clone()),
            (Some(8), vec![0, 1, 2, 3, 4])
        );
        // --max-kv-size caps every layer: the global layer joins a window of its own.
        c.window = Some(6);
        let g = c.groups();
        assert_eq!(g.iter().map(|g| g.window).collect::<Vec<_>>(), [Some(6)]);
        // No windows at all: one global group of every layer.
        let plain = CacheConfig::dense(3, 1, 8, 4, 0, DType::F32);
        assert_eq!(plain.groups().len(), 1);
        assert_eq!(plain.groups()[0].layers, vec![0, 1, 2]);
    }

    #[test]
    fn windowed_groups_hold_a_bounded_number_of_blocks() {
        let c = hybrid();
        // 100 tokens in chunks of 4: 25 global blocks; the window holds ceil(12/4)+1 = 4.
        assert_eq!(c.max_blocks_for(100, 4), Blocks(vec![25, 4]));
        assert_eq!(c.max_blocks_for(6, 4), Blocks(vec![2, 2]));
        // Keeping a 40-token prompt whole until it is exported.
        assert_eq!(c.max_blocks_keeping(100, 4, 40), Blocks(vec![25, 10]));
        let a = Blocks(vec![3, 1]);
        assert!(a.fits_in(&Blocks(vec![3, 1])));
        assert_eq!(
            a.plus(&Blocks(vec![1, 1])).first_short(&Blocks(vec![4, 1])),
            Some(1)
        );
        assert_eq!(a.saturating_sub(&Blocks(vec![5, 0])), Blocks(vec![0, 1]));
    }

    #[test]
    fn budgets_split_by_what_a_sequence_holds() {
        let c = hybrid();
        let bb = c.group_block_bytes();
        // One global layer, five windowed: a block of the windowed group is five times larger.
        assert_eq!(bb[1], 5 * bb[0]);
        // A sequence of 100 tokens holds 25 global blocks and 4 windowed ones.
        let per_seq = 25 * bb[0] + 4 * bb[1];
        let sized = |bytes, max_batch| {
            c.group_pool_blocks(PoolSizing::Budget {
                bytes,
                tokens: 100,
                max_batch,
                chunk: 4,
            })
        };
        assert_eq!(sized(2 * per_seq, 8), vec![50, 8]);
        // The windowed group never gets more than max_batch sequences' worth; the global
        // group takes the rest.
        let got = sized(10 * per_seq, 2);
        assert_eq!(got[1], 8);
        assert_eq!(got[0], (10 * per_seq - 8 * bb[1]) / bb[0]);
        // A model with one group gets bytes / block bytes, as before groups.
        let plain = CacheConfig::dense(3, 1, 8, 4, 0, DType::F32);
        let b = plain.group_block_bytes()[0];
        let got = plain.group_pool_blocks(PoolSizing::Budget {
            bytes: 10 * b + 3,
            tokens: 100,
            max_batch: 1,
            chunk: 4,
        });
        assert_eq!(got, vec![10]);
    }
}
