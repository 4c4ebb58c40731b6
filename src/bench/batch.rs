//! The driver behind `kvq bench-batch`: llama.cpp's `llama-batched-bench` on kvq's engine, so
//! the two are compared at the same shapes and with the same definitions.
//!
//! For each (prompt length PP, generated tokens TG, sequences B): B requests of exactly PP
//! synthetic token ids are queued together, all prompts are prefilled (in steps of at most
//! `prefill_chunk` tokens, no decoding meanwhile), then all B sequences decode TG steps
//! together, greedy, end-of-sequence ignored. T_PP is the time of the prompt steps, T_TG that of
//! the decode steps (host work, sampling and device synchronisation included: every step ends
//! with the sampled tokens on the host); S_PP = B·PP / T_PP, S_TG = B·TG / T_TG, N_KV = B·(PP +
//! TG) and S = N_KV / (T_PP + T_TG), as llama.cpp defines them. Each shape gets a fresh cache.

// Shapes come from the command line: no unwrap, expect or indexing that could panic on them (issue
// 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};
use serde::Serialize;
use std::time::Instant;

use crate::engine::request::Request;
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::{Engine, EngineConfig};
use crate::kv::cache::PagedKvCache;
use crate::model::llama::Llama;

/// One shape to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Prompt tokens per sequence.
    pub pp: usize,
    /// Generated (decode) tokens per sequence.
    pub tg: usize,
    /// Sequences.
    pub pl: usize,
}

/// The figures of one shape (llama-batched-bench's columns plus memory).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    #[serde(flatten)]
    pub shape: Shape,
    pub n_kv: usize,
    pub t_pp: f64,
    pub speed_pp: f64,
    pub t_tg: f64,
    pub speed_tg: f64,
    pub t: f64,
    pub speed: f64,
    /// Decode steps taken (TG when TG > 0).
    pub decode_steps: usize,
    /// Most KV cache bytes held at once (the blocks of all B·(PP+TG) rows, partial tails
    /// included).
    pub kv_bytes: usize,
    /// Highest device memory in use seen after any step (the whole GPU; `None` on the CPU).
    pub peak_device_bytes: Option<u64>,
    /// Kernels per replayed decode step (one CUDA graph launch each), counted from the graph;
    /// `None` where decode steps ran op by op.
    pub graph_kernels: Option<usize>,
}

/// Every (pp, tg, pl) combination, in llama-batched-bench's order (pp, then tg, then pl).
pub fn shapes(npp: &[usize], ntg: &[usize], npl: &[usize]) -> Vec<Shape> {
    let mut out = Vec::new();
    for &pp in npp {
        for &tg in ntg {
            for &pl in npl {
                out.push(Shape { pp, tg, pl });
            }
        }
    }
    out
}

/// Synthetic prompt `seq` of `len` ids below `vocab`: spread over the vocabulary, different per
/// sequence, the same in every run.
pub fn synthetic_prompt(seq: usize, len: usize, vocab: usize) -> Vec<u32> {
    let vocab = vocab.max(1) as u64;
    (0..len as u64)
        .map(|j| ((j * 7_919 + seq as u64 * 104_729 + 13) % vocab) as u32)
        .collect()
}

/// Checks a shape against the model before anything is allocated.
pub fn check_shape(model: &Llama, s: Shape) -> Result<()> {
    if s.pp == 0 || s.pl == 0 {
        bail!(
            "--npp and --npl values must be at least 1 (got pp {}, pl {})",
            s.pp,
            s.pl
        );
    }
    let window = model.config().max_position_embeddings;
    if s.pp + s.tg > window {
        bail!(
            "pp {} + tg {} = {} tokens exceeds the model's context window of {window}",
            s.pp,
            s.tg,
            s.pp + s.tg
        );
    }
    Ok(())
}

/// Runs one shape. `cache` must hold `pl` sequences of `pp + tg` tokens (see
/// [`cache_tokens`]); it is consumed (each shape starts empty).
pub fn run_shape(
    model: &Llama,
    cache: PagedKvCache,
    s: Shape,
    prefill_chunk: usize,
    cuda_graphs: bool,
) -> Result<Row> {
    check_shape(model, s)?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: s.pl,
            prefill_chunk,
            cuda_graphs,
        },
    )?;
    engine.prefill_first(true);
    let vocab = model.config().vocab_size;
    for i in 0..s.pl {
        engine.add(Request {
            prompt: synthetic_prompt(i, s.pp, vocab),
            params: SamplingParams::greedy(),
            // The first token comes from the prompt's last position; TG decode steps follow.
            max_tokens: s.tg + 1,
            eos: Vec::new(),
        })?;
    }
    let dev = model.device().clone();
    let mut peak = crate::device::used_bytes(&dev);
    let (mut t_pp, mut t_tg) = (0.0f64, 0.0f64);
    let mut decode_steps = 0;
    while engine.has_work() {
        let before = engine.stats().prompt_tokens;
        let t0 = Instant::now();
        engine.step()?;
        let dt = t0.elapsed().as_secs_f64();
        if engine.stats().prompt_tokens > before {
            t_pp += dt;
        } else {
            t_tg += dt;
            decode_steps += 1;
        }
        if let Some(used) = crate::device::used_bytes(&dev) {
            peak = Some(peak.map_or(used, |p| p.max(used)));
        }
    }
    if engine.stats().prompt_tokens != s.pp * s.pl {
        bail!(
            "internal error: {} prompt tokens prefilled, expected {}",
            engine.stats().prompt_tokens,
            s.pp * s.pl
        );
    }
    let kv_bytes = engine.cache().peak_bytes();
    let n_kv = s.pl * (s.pp + s.tg);
    let t = t_pp + t_tg;
    Ok(Row {
        shape: s,
        n_kv,
        t_pp,
        speed_pp: rate(s.pl * s.pp, t_pp),
        t_tg,
        speed_tg: rate(s.pl * s.tg, t_tg),
        t,
        speed: rate(n_kv, t),
        decode_steps,
        kv_bytes,
        peak_device_bytes: peak,
        graph_kernels: engine.stats().graph_kernels,
    })
}

/// Tokens the cache must hold for a shape (every sequence's prompt and generated tokens).
pub fn cache_tokens(s: Shape) -> usize {
    s.pl * (s.pp + s.tg)
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_in_llama_order() {
        let s = shapes(&[8, 16], &[4], &[1, 2]);
        let got: Vec<_> = s.iter().map(|s| (s.pp, s.tg, s.pl)).collect();
        assert_eq!(got, vec![(8, 4, 1), (8, 4, 2), (16, 4, 1), (16, 4, 2)]);
    }

    #[test]
    fn prompts_are_in_vocab_and_differ_per_sequence() {
        let a = synthetic_prompt(0, 100, 50);
        let b = synthetic_prompt(1, 100, 50);
        assert_eq!(a.len(), 100);
        assert!(a.iter().chain(&b).all(|&t| t < 50));
        assert_ne!(a, b);
        assert_eq!(a, synthetic_prompt(0, 100, 50));
    }
}
