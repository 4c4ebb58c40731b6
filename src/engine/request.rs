//! A generation request and what the engine reports about it.

// Requests come from the command line, JSONL files and HTTP bodies: no unwrap, expect or indexing
// that could panic on them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;

use super::sampler::SamplingParams;
use crate::kv::cache::prompt_file::PromptCacheFile;

/// What one caller asks for, in tokens (text handling stays with the caller).
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Upper bound on generated tokens (the EOS that ends generation counts).
    pub max_tokens: usize,
    /// Token ids that end generation; the ending id is reported like any other token.
    pub eos: Vec<u32>,
}

/// Refuses a prompt longer than the model's context window (`window` positions): the one
/// check and message of every front end.
pub fn check_fits(prompt_len: usize, window: usize) -> anyhow::Result<()> {
    if prompt_len > window {
        anyhow::bail!(
            "the prompt has {prompt_len} tokens but the model's context window is {window} tokens"
        );
    }
    Ok(())
}

impl Request {
    /// Most tokens this request can hold in the KV cache in a window of `window` positions:
    /// the prompt and every generated token but the last, which is never fed back.
    pub fn cache_tokens(&self, window: usize) -> usize {
        (self.prompt.len() + self.max_tokens.saturating_sub(1)).min(window)
    }
}

/// The first `tokens` prompt tokens of a request, already computed: their K/V rows are taken
/// from a prompt-cache file instead of being prefilled.
#[derive(Debug, Clone)]
pub struct CachedPrefix {
    pub file: Arc<PromptCacheFile>,
    pub tokens: usize,
}

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` generated, or the context window is full.
    Length,
    /// Cancelled by the caller (Ctrl-C, error elsewhere).
    Cancelled,
    /// This request failed (e.g. its logits became NaN); the engine says why
    /// (`Engine::take_error`), and the other requests go on.
    Error,
}

/// Engine output, in the order things happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token { id: u64, token: u32 },
    Finished { id: u64, reason: FinishReason },
}
