//! What a KV setting costs in quality: teacher-forced perplexity, and KL divergence, Δp and
//! same-top-1 against a reference setting (the dense cache), window by window.
//!
//! Each window of `ctx` tokens is an independent sequence from position 0, fed through the
//! model in prompt chunks exactly as `generate` prefills: every chunk's K/V are written to the
//! cache (quantized as they are stored) before its queries attend, so a query sees the cached,
//! quantized history and its own quantized K/V — the error real decoding accumulates. Position
//! `j` scores token `j + 1`, so a window gives `ctx − 1` targets. All settings advance chunk by
//! chunk together, so only one chunk of reference log-probabilities is ever held.

// The tokens come from a text file: no unwrap, expect or indexing that could panic on them
// (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::DType;
use rayon::prelude::*;

use crate::engine::sampler::argmax;
use crate::kv::attend::decode;
use crate::kv::cache::{CacheConfig, PagedKvCache, PoolSizing};
use crate::model::llama::{Llama, LogitsFor, SeqInput};

/// One KV setting to evaluate.
#[derive(Debug, Clone)]
pub struct Setting {
    pub label: String,
    /// Cache geometry and formats; the pools are sized here for one window.
    pub config: CacheConfig,
    /// Attend exactly on the CPU (`kv::attend::decode::set_exact_attention`) for this setting,
    /// whatever the process-wide choice.
    pub exact_attention: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Tokens per window.
    pub ctx: usize,
    /// Tokens per forward pass.
    pub chunk: usize,
}

/// Results of one setting; divergences are against the first setting.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub label: String,
    pub bits_per_value: f64,
    pub kv_bytes_per_token: usize,
    /// Scored targets.
    pub tokens: usize,
    pub ppl: f64,
    /// Standard error of `ppl` (from the spread of the per-token NLL).
    pub ppl_err: f64,
    /// Perplexity over the second half of each window's targets only (llama-perplexity's
    /// convention).
    pub ppl_second_half: f64,
    /// Against the reference; `None` for the reference itself.
    pub vs_reference: Option<Divergence>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Divergence {
    pub kl_mean: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    /// Mean of p(target) − p_ref(target), in percentage points.
    pub delta_p_mean_pct: f64,
    /// Positions whose most likely token equals the reference's, in percent.
    pub same_top1_pct: f64,
}

/// Per-target measurements of one setting.
#[derive(Default)]
struct Acc {
    nll: Vec<f64>,
    second_half_nll: (f64, usize),
    kl: Vec<f64>,
    dp_sum: f64,
    same: usize,
}

/// Evaluates `settings` on the non-overlapping `ctx`-token windows of `tokens` (a trailing
/// partial window is dropped). `progress` is told how many tokens each forward pass consumed.
pub fn evaluate(
    model: &Llama,
    tokens: &[u32],
    settings: &[Setting],
    opts: Options,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<Report>> {
    if settings.is_empty() {
        bail!("no KV setting to evaluate");
    }
    if opts.ctx < 3 || opts.chunk == 0 {
        bail!(
            "a window needs at least 3 tokens and a chunk at least 1 (got {} and {})",
            opts.ctx,
            opts.chunk
        );
    }
    let windows = tokens.len() / opts.ctx;
    if windows == 0 {
        bail!(
            "the text has {} tokens, fewer than one window of {} (lower --ctx)",
            tokens.len(),
            opts.ctx
        );
    }
    let mut caches = settings
        .iter()
        .map(|s| {
            let mut cfg = s.config.clone();
            cfg.size_pools(PoolSizing::Window {
                tokens: opts.ctx,
                chunk: opts.chunk,
            });
            PagedKvCache::new(cfg, model.device())
                .with_context(|| format!("KV setting {}", s.label))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut accs: Vec<Acc> = settings.iter().map(|_| Acc::default()).collect();
    // The process-wide choice, put back however this returns.
    let exact = ExactAttention(decode::exact_attention());
    let second_half_from = opts.ctx - 1 - (opts.ctx - 1) / 2;

    for win in tokens.chunks_exact(opts.ctx) {
        for c in caches.iter_mut() {
            c.add_sequence(0)?;
        }
        let mut reference: Vec<f32> = Vec::new();
        for c0 in (0..opts.ctx).step_by(opts.chunk) {
            let n = opts.chunk.min(opts.ctx - c0);
            // Rows of this chunk with a target inside the window.
            let m = n.min(opts.ctx - 1 - c0);
            let (Some(chunk), Some(targets)) = (win.get(c0..c0 + n), win.get(c0 + 1..c0 + 1 + m))
            else {
                bail!("window chunk {c0}..{} outside the window", c0 + n);
            };
            for (i, (cache, acc)) in caches.iter_mut().zip(accs.iter_mut()).enumerate() {
                cache.reserve(0, n)?;
                let input = [SeqInput {
                    seq: 0,
                    tokens: chunk.to_vec(),
                }];
                decode::set_exact_attention(
                    exact.0 || settings.get(i).is_some_and(|s| s.exact_attention),
                );
                let logits = model.forward(&input, cache, LogitsFor::All)?;
                progress(n);
                if m == 0 {
                    continue;
                }
                let mut lp: Vec<f32> = logits
                    .narrow(0, 0, m)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1()?;
                let vocab = lp.len() / m;
                lp.par_chunks_mut(vocab).for_each(log_softmax);
                let rows: Vec<RowStats> = if i == 0 {
                    lp.par_chunks(vocab)
                        .zip(targets.par_iter())
                        .map(|(row, &t)| RowStats::alone(row, t))
                        .collect::<Result<_>>()?
                } else {
                    lp.par_chunks(vocab)
                        .zip(reference.par_chunks(vocab))
                        .zip(targets.par_iter())
                        .map(|((row, r), &t)| RowStats::against(row, r, t))
                        .collect::<Result<_>>()?
                };
                for (j, r) in rows.iter().enumerate() {
                    acc.nll.push(r.nll);
                    if c0 + j >= second_half_from {
                        acc.second_half_nll.0 += r.nll;
                        acc.second_half_nll.1 += 1;
                    }
                    if i > 0 {
                        acc.kl.push(r.kl);
                        acc.dp_sum += r.dp;
                        acc.same += r.same as usize;
                    }
                }
                if i == 0 {
                    reference = lp;
                }
            }
        }
        for c in caches.iter_mut() {
            c.remove_sequence(0);
        }
    }
    Ok(settings
        .iter()
        .zip(accs)
        .enumerate()
        .map(|(i, (s, a))| report(s, a, i > 0, opts.ctx))
        .collect())
}

/// Puts the process-wide exact-attention choice back when dropped.
struct ExactAttention(bool);

impl Drop for ExactAttention {
    fn drop(&mut self) {
        decode::set_exact_attention(self.0);
    }
}

/// In place: `x ← x − log Σ exp x` (f64 sum).
fn log_softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    for x in row.iter_mut() {
        *x = (*x as f64 - lse) as f32;
    }
}

struct RowStats {
    nll: f64,
    kl: f64,
    dp: f64,
    same: bool,
}

/// The log-probability of `target` in `lp`; a token the logits do not cover is refused.
fn logprob(lp: &[f32], target: u32) -> Result<f64> {
    match lp.get(target as usize) {
        Some(&x) => Ok(x as f64),
        None => bail!(
            "token id {target} is outside the model's {} logits (the tokenizer does not match \
             the model)",
            lp.len()
        ),
    }
}

impl RowStats {
    fn alone(lp: &[f32], target: u32) -> Result<Self> {
        Ok(Self {
            nll: -logprob(lp, target)?,
            kl: 0.0,
            dp: 0.0,
            same: true,
        })
    }

    /// KL(ref ‖ this) = Σ p_ref (log p_ref − log p), in f64.
    fn against(lp: &[f32], reference: &[f32], target: u32) -> Result<Self> {
        let kl: f64 = reference
            .iter()
            .zip(lp)
            .map(|(&r, &q)| {
                let r = r as f64;
                r.exp() * (r - q as f64)
            })
            .sum();
        let (p, p_ref) = (logprob(lp, target)?, logprob(reference, target)?);
        Ok(Self {
            nll: -p,
            // Rounding can make a tiny divergence come out a hair below zero.
            kl: kl.max(0.0),
            dp: p.exp() - p_ref.exp(),
            same: argmax(lp) == argmax(reference),
        })
    }
}

/// `ctx`: tokens per window, over which a dense residual window's bytes are spread.
fn report(s: &Setting, a: Acc, compared: bool, ctx: usize) -> Report {
    let n = a.nll.len();
    let mean = a.nll.iter().sum::<f64>() / n as f64;
    let var = a.nll.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
    let ppl = mean.exp();
    let vs_reference = compared.then(|| {
        let mut kl = a.kl;
        kl.sort_by(f64::total_cmp);
        let k = kl.len();
        Divergence {
            kl_mean: kl.iter().sum::<f64>() / k as f64,
            kl_p99: kl
                .get(((k as f64 * 0.99).ceil() as usize).clamp(1, k) - 1)
                .copied()
                .unwrap_or(0.0),
            kl_max: kl.last().copied().unwrap_or(0.0),
            delta_p_mean_pct: 100.0 * a.dp_sum / k as f64,
            same_top1_pct: 100.0 * a.same as f64 / k as f64,
        }
    });
    let bpv = {
        let w = s.config.width();
        let bits: f64 = s
            .config
            .formats
            .iter()
            .map(|f| f.kv_row_bytes(w) as f64 * 4.0 / w as f64)
            .sum();
        // The residual window's dense copies, held beside the quantized rows of every
        // position, averaged over a window's tokens.
        let residual = s.config.residual_bytes() as f64 * 8.0 / (2 * w * ctx.max(1)) as f64;
        (bits + residual) / s.config.formats.len().max(1) as f64
    };
    Report {
        label: s.label.clone(),
        bits_per_value: bpv,
        kv_bytes_per_token: s.config.bytes_per_token() + s.config.residual_bytes() / ctx.max(1),
        tokens: n,
        ppl,
        ppl_err: ppl * (var / n as f64).sqrt(),
        ppl_second_half: (a.second_half_nll.0 / a.second_half_nll.1.max(1) as f64).exp(),
        vs_reference,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalizes() {
        let mut row = vec![1.0f32, 2.0, 3.0, -50.0];
        log_softmax(&mut row);
        let total: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!((row[2] - row[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn row_stats_against_hand_computed_values() {
        // p_ref = [0.5, 0.25, 0.25], p = [0.25, 0.5, 0.25], target 1.
        let reference: Vec<f32> = [0.5f64, 0.25, 0.25].iter().map(|p| p.ln() as f32).collect();
        let lp: Vec<f32> = [0.25f64, 0.5, 0.25].iter().map(|p| p.ln() as f32).collect();
        let r = RowStats::against(&lp, &reference, 1).unwrap();
        let kl = 0.5 * (0.5f64 / 0.25).ln() + 0.25 * (0.25f64 / 0.5).ln();
        assert!((r.kl - kl).abs() < 1e-6, "{} vs {kl}", r.kl);
        assert!((r.nll - 2f64.ln()).abs() < 1e-6);
        assert!((r.dp - 0.25).abs() < 1e-6);
        assert!(!r.same);
        let same = RowStats::against(&reference, &reference, 0).unwrap();
        assert_eq!(same.kl, 0.0);
        assert!(same.same);
    }

    #[test]
    fn report_statistics() {
        let cfg = CacheConfig::dense(1, 1, 4, 16, 0, DType::F32);
        let s = Setting {
            label: "x".into(),
            config: cfg,
            exact_attention: false,
        };
        let a = Acc {
            nll: vec![1.0, 3.0],
            second_half_nll: (3.0, 1),
            kl: vec![0.5, 0.1, 0.2, 0.0],
            dp_sum: -0.02,
            same: 3,
        };
        let r = report(&s, a, true, 4);
        assert!((r.ppl - 2f64.exp()).abs() < 1e-9);
        // var = 2, n = 2: err = ppl * sqrt(2 / 2).
        assert!((r.ppl_err - r.ppl).abs() < 1e-9);
        assert!((r.ppl_second_half - 3f64.exp()).abs() < 1e-9);
        let d = r.vs_reference.unwrap();
        assert!((d.kl_mean - 0.2).abs() < 1e-12);
        assert_eq!(d.kl_max, 0.5);
        assert_eq!(d.kl_p99, 0.5);
        assert!((d.same_top1_pct - 75.0).abs() < 1e-12);
        assert!((d.delta_p_mean_pct + 0.5).abs() < 1e-12);
        assert_eq!(r.bits_per_value, 32.0);
    }
}
