//! `--kv-memory` → KV blocks, the same way for every front end that takes a budget
//! (`batch-generate`, `serve`): the budget includes the dense staging pool of
//! `--quantized-kv-start`, must hold at least one request, and must exist on the machine.

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
use crate::kv::cache::CacheConfig;

/// What a pool must hold, and what it gets without `--kv-memory`.
#[derive(Debug, Clone)]
pub struct PoolBudget<'a> {
    /// `--kv-memory` in bytes, if given.
    pub kv_memory: Option<usize>,
    /// Main-pool blocks the smallest useful pool holds: one request of `one_tokens` tokens.
    pub one_blocks: usize,
    pub one_tokens: usize,
    /// That request in words, for the refusal ("the longest request").
    pub one_what: &'a str,
    /// Without `--kv-memory`: the blocks wanted, capped at `1/share` of the available memory
    /// (staging included) but never below `floor` blocks.
    pub want: usize,
    pub floor: usize,
    pub share: usize,
}

impl PoolBudget<'_> {
    /// Main-pool blocks for a cache shaped like `probe` (its staging pool sized already).
    /// A budget that cannot hold one request plus the staging pool, or that is more than the
    /// memory available now, is refused with the allowed minimum.
    pub fn blocks(&self, probe: &CacheConfig) -> Result<usize> {
        let block_bytes = probe.bytes_per_block().max(1);
        let staging = super::args::staging_bytes(probe)?;
        let one = self.one_blocks.max(1);
        let available = crate::device::available_memory_bytes();
        let Some(bytes) = self.kv_memory else {
            let cap = (available / self.share.max(1)).saturating_sub(staging) / block_bytes;
            return Ok(self.want.min(cap).max(self.floor).max(one));
        };
        if bytes > available {
            bail!(
                "--kv-memory {} is more than the {} of memory available now",
                fmt_bytes(bytes),
                fmt_bytes(available)
            );
        }
        let need = one
            .checked_mul(block_bytes)
            .and_then(|b| b.checked_add(staging))
            .unwrap_or(usize::MAX);
        if bytes < need {
            let staged = match staging {
                0 => String::new(),
                s => format!(
                    " plus {} of dense staging for --quantized-kv-start",
                    fmt_bytes(s)
                ),
            };
            bail!(
                "--kv-memory {} cannot hold {} ({} tokens: {one} blocks of {} tokens, {}{staged}); \
                 allowed: at least {need} bytes",
                fmt_bytes(bytes),
                self.one_what,
                self.one_tokens,
                probe.block_size,
                fmt_bytes(one.saturating_mul(block_bytes)),
            );
        }
        Ok((bytes - staging) / block_bytes)
    }
}
