//! Next-token sampling over one row of logits.
//!
//! Written over a plain slice because candle-transformers' `LogitsProcessor` has no min-p. The
//! order is llama.cpp's: repeat penalty (candle's semantics: positive logits divided, negative
//! multiplied, each distinct id of the last `repeat_last_n` once), temperature, top-k, top-p,
//! min-p, then a draw from the renormalised distribution. Temperature 0 is greedy argmax with the
//! first index winning exact ties, like the reference generations. Candidates are ordered by
//! (logit desc, id asc) so ties are deterministic, and each request owns its seeded RNG.

// The knobs come from the command line, JSONL lines and HTTP bodies: no unwrap, expect or
// indexing that could panic on them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The sampling knobs of one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    /// 1.0 = off.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05, no repeat penalty.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: Some(40),
            top_p: Some(0.95),
            min_p: Some(0.05),
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 299_792_458,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with everything else off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            ..Self::default()
        }
    }

    /// Checks every knob; the error names the command-line flag.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!("--temp must be a number ≥ 0 (got {})", self.temperature);
        }
        if self.top_k == Some(0) {
            bail!("--top-k must be ≥ 1 (got 0)");
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("--top-p must be in (0, 1] (got {p})");
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..1.0).contains(&p) {
                bail!("--min-p must be in [0, 1) (got {p})");
            }
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            bail!("--repeat-penalty must be > 0 (got {})", self.repeat_penalty);
        }
        Ok(())
    }
}

/// Samples token ids for one sequence.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (one per vocabulary entry); `history` holds the prompt
    /// and generated ids for the repeat penalty.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            bail!("sampling from an empty logits row");
        }
        self.params.validate()?;
        if logits.iter().any(|x| x.is_nan()) {
            bail!("the logits contain NaN (the model produced invalid numbers)");
        }
        let mut row = std::mem::take(&mut self.scratch);
        row.clear();
        row.extend_from_slice(logits);
        self.apply_repeat_penalty(&mut row, history);
        let id = if self.params.temperature == 0.0 {
            argmax(&row)
        } else {
            self.draw(&row)
        };
        self.scratch = row;
        Ok(id)
    }

    fn apply_repeat_penalty(&self, row: &mut [f32], history: &[u32]) {
        let penalty = self.params.repeat_penalty;
        if penalty == 1.0 || self.params.repeat_last_n == 0 {
            return;
        }
        let start = history.len().saturating_sub(self.params.repeat_last_n);
        let mut seen = std::collections::HashSet::new();
        for &id in history.iter().skip(start) {
            if !seen.insert(id) {
                continue;
            }
            if let Some(logit) = row.get_mut(id as usize) {
                if *logit >= 0.0 {
                    *logit /= penalty;
                } else {
                    *logit *= penalty;
                }
            }
        }
    }

    /// Temperature, top-k, top-p, min-p, then one draw.
    fn draw(&mut self, row: &[f32]) -> u32 {
        let inv_t = 1.0 / self.params.temperature;
        // Candidates in (logit desc, id asc) order; only as many as top-k keeps are sorted.
        let mut cand: Vec<(u32, f64)> = row
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l as f64 * inv_t))
            .collect();
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if let Some(k) = self.params.top_k {
            if k > 0 && k < cand.len() {
                cand.select_nth_unstable_by(k - 1, order);
                cand.truncate(k);
            }
        }
        cand.sort_unstable_by(order);

        // Softmax over the survivors (max first, so the exponent never overflows); `row` is not
        // empty, so neither is `cand`.
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut probs: Vec<f64> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);

        let mut keep = probs.len();
        if let Some(top_p) = self.params.top_p {
            let mut cum = 0.0;
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= top_p {
                    keep = keep.min(i + 1);
                    break;
                }
            }
        }
        if let Some(min_p) = self.params.min_p {
            let floor = probs.first().map_or(0.0, |p| p * min_p);
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        let kept = || cand.iter().zip(&probs).take(keep);
        let mass: f64 = kept().map(|(_, p)| p).sum();
        let mut u = self.rng.random::<f64>() * mass;
        for (c, p) in kept() {
            if u < *p {
                return c.0;
            }
            u -= p;
        }
        cand.get(keep.saturating_sub(1)).map_or(0, |c| c.0)
    }
}

/// Index of the largest value; the first one on exact ties (0 for an empty row).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = (0, row.first().copied().unwrap_or(0.0));
    for (i, &x) in row.iter().enumerate().skip(1) {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}

/// [`argmax`] of each row of `logits` (`[rows, vocab]`, any float dtype).
pub fn argmax_rows(logits: &candle_core::Tensor) -> candle_core::Result<Vec<u32>> {
    let rows: Vec<Vec<f32>> = logits.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    Ok(rows.iter().map(|r| argmax(r)).collect())
}
