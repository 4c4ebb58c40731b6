//! `--kv-memory` → KV blocks, the same way for every front end that takes a budget
//! (`batch-generate`, `serve`): the budget includes the dense staging pool of
//! `--quantized-kv-start` and the dense window copies of `--kv-residual` / `--kv-sinks` (for
//! `--max-batch` sequences), must hold at least one request, and must exist on the machine.

// Data here comes from the command line: no unwrap, expect or indexing that could panic on it
// (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};

use crate::engine::stats::fmt_bytes;
use crate::kv::cache::{Blocks, CacheConfig};

/// What the main pools must hold, and what they get without `--kv-memory`, in bytes (the layer
/// groups of a model with windowed layers share them by what a request holds in each).
#[derive(Debug, Clone)]
pub struct PoolBudget<'a> {
    /// `--kv-memory` in bytes, if given.
    pub kv_memory: Option<usize>,
    /// Main-pool blocks per layer group of the smallest useful pool: one request of
    /// `one_tokens` tokens.
    pub one_blocks: Blocks,
    pub one_tokens: usize,
    /// That request in words, for the refusal ("the longest request").
    pub one_what: &'a str,
    /// Without `--kv-memory`: the bytes wanted, capped at `1/share` of the available memory
    /// (staging included) but never below `floor` bytes.
    pub want: usize,
    pub floor: usize,
    pub share: usize,
    /// Sequences decoded at once (`--max-batch`): each holds its own dense window copies.
    pub sequences: usize,
}

/// Bytes of the dense window copies (`--kv-residual`, `--kv-sinks`) of `sequences` sequences
/// decoded at once: beside the main pools, inside the budget.
pub fn window_copies_bytes(cfg: &CacheConfig, sequences: usize) -> usize {
    cfg.residual_bytes().saturating_mul(sequences)
}

/// Bytes of `blocks` (per layer group, at least one each) at each group's block size.
pub fn group_bytes(probe: &CacheConfig, blocks: &Blocks) -> usize {
    blocks
        .0
        .iter()
        .zip(probe.group_block_bytes())
        .map(|(&n, b)| n.max(1).saturating_mul(b))
        .fold(0, usize::saturating_add)
        .max(1)
}

impl PoolBudget<'_> {
    /// Main-pool bytes for a cache shaped like `probe` (its staging pool sized already).
    /// A budget that cannot hold one request plus the staging pool and the window copies, or
    /// that is more than the memory available now, is refused with the allowed minimum.
    pub fn bytes(&self, probe: &CacheConfig) -> Result<usize> {
        let staging = super::args::staging_bytes(probe)?;
        let copies = window_copies_bytes(probe, self.sequences);
        // Beside the main pools, whatever they hold.
        let fixed = staging.saturating_add(copies);
        let one = group_bytes(probe, &self.one_blocks);
        let available = crate::device::available_memory_bytes();
        let Some(bytes) = self.kv_memory else {
            let cap = (available / self.share.max(1)).saturating_sub(fixed);
            return Ok(self.want.min(cap).max(self.floor).max(one));
        };
        if bytes > available {
            bail!(
                "--kv-memory {} is more than the {} of memory available now",
                fmt_bytes(bytes),
                fmt_bytes(available)
            );
        }
        let need = one.saturating_add(fixed);
        if bytes < need {
            let staged = match staging {
                0 => String::new(),
                s => format!(
                    " plus {} of dense staging for --quantized-kv-start",
                    fmt_bytes(s)
                ),
            };
            let staged = match copies {
                0 => staged,
                c => format!(
                    "{staged} plus {} of dense window copies for --max-batch {} sequences \
                     (--kv-residual, --kv-sinks)",
                    fmt_bytes(c),
                    self.sequences
                ),
            };
            bail!(
                "--kv-memory {} cannot hold {} ({} tokens: {} blocks of {} tokens, {}{staged}); \
                 allowed: at least {need} bytes",
                fmt_bytes(bytes),
                self.one_what,
                self.one_tokens,
                self.one_blocks.total(),
                probe.block_size,
                fmt_bytes(one),
            );
        }
        Ok(bytes - fixed)
    }
}
