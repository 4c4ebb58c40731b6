//! Many requests through one `Engine`: text per request, results handed out as each finishes,
//! and a clean stop when asked (Ctrl-C).
//!
//! This is the library half of `kvq batch-generate`; the CLI adds files, flags and the display.
//! Results never depend on submission order beyond scheduling: each request has its own sampler,
//! seed, stop strings and detokenizer.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::request::{CachedPrefix, Event, FinishReason, Request};
use super::scheduler::Engine;
use super::text_stream::TextStream;
use crate::kv::cache::SeqId;
use crate::model::tokenizer::TextTokenizer;

/// One request of a batch: the engine request plus what only text handling needs.
#[derive(Debug, Clone)]
pub struct BatchRequest {
    /// The caller's id, echoed in the result.
    pub id: Value,
    pub request: Request,
    pub stop: Vec<String>,
}

/// A finished (or cancelled) request.
#[derive(Debug, Clone)]
pub struct BatchResult {
    pub id: Value,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from a prompt cache (`None`: the request named none).
    pub cached_tokens: Option<usize>,
    /// Generated token ids (the EOS or stop-string token that ended it included).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// From the start of the run (all requests are submitted then) to the first token.
    pub ttft_ms: f64,
    /// From the start of the run to the end of this request.
    pub total_ms: f64,
    /// Why it failed, when `finish_reason` is `error`.
    pub error: Option<String>,
}

impl BatchResult {
    /// The output line's object.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "id": self.id,
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.tokens.len(),
            "ttft_ms": round_ms(self.ttft_ms),
            "total_ms": round_ms(self.total_ms),
        });
        if let Some(n) = self.cached_tokens {
            v["cached_tokens"] = Value::from(n);
        }
        if let Some(e) = &self.error {
            v["error"] = Value::from(e.as_str());
        }
        v
    }
}

fn round_ms(ms: f64) -> f64 {
    (ms * 1000.0).round() / 1000.0
}

/// How a run ended.
#[derive(Debug, Clone, Default)]
pub struct BatchOutcome {
    pub finished: usize,
    /// Running requests stopped by a cancel (results written with finish_reason "cancelled").
    pub cancelled: usize,
    /// Requests dropped by a cancel before their first token (no result written).
    pub not_started: usize,
    pub wall_seconds: f64,
}

struct InFlight<'t> {
    id: Value,
    prompt_tokens: usize,
    cached_tokens: Option<usize>,
    tokens: Vec<u32>,
    text: TextStream<'t>,
    first_token_ms: Option<f64>,
}

/// Drives an engine over a set of requests.
pub struct Batch<'e, 'm, 't> {
    engine: &'e mut Engine<'m>,
    tokenizer: &'t TextTokenizer,
    live: HashMap<SeqId, InFlight<'t>>,
}

impl<'e, 'm, 't> Batch<'e, 'm, 't> {
    pub fn new(engine: &'e mut Engine<'m>, tokenizer: &'t TextTokenizer) -> Self {
        Self {
            engine,
            tokenizer,
            live: HashMap::new(),
        }
    }

    /// Queues a request; an error means it can never run (empty, too long, too big for the cache).
    pub fn add(&mut self, r: BatchRequest) -> Result<()> {
        self.add_with_prefix(r, None)
    }

    /// Queues a request whose prompt starts with a prompt cache's tokens (see
    /// [`Engine::add_with_prefix`]).
    pub fn add_with_prefix(&mut self, r: BatchRequest, prefix: Option<CachedPrefix>) -> Result<()> {
        let prompt_tokens = r.request.prompt.len();
        let cached_tokens = prefix.as_ref().map(|p| p.tokens);
        let seq = match prefix {
            Some(p) => self.engine.add_with_prefix(r.request, p)?,
            None => self.engine.add(r.request)?,
        };
        self.live.insert(
            seq,
            InFlight {
                id: r.id,
                prompt_tokens,
                cached_tokens,
                tokens: Vec::new(),
                text: TextStream::new(self.tokenizer, r.stop),
                first_token_ms: None,
            },
        );
        Ok(())
    }

    /// Requests queued or running.
    pub fn pending(&self) -> usize {
        self.live.len()
    }

    /// Runs until every request is done or `cancel` is set. `on_result` gets each result as it
    /// finishes (write it out there); `on_step` sees the engine after every step (progress).
    pub fn run(
        mut self,
        cancel: &AtomicBool,
        mut on_result: impl FnMut(BatchResult) -> Result<()>,
        mut on_step: impl FnMut(&Engine<'m>, usize),
    ) -> Result<BatchOutcome> {
        let start = Instant::now();
        let ms = |t: Instant| t.duration_since(start).as_secs_f64() * 1000.0;
        let mut outcome = BatchOutcome::default();
        while !self.live.is_empty() {
            if cancel.load(Ordering::SeqCst) {
                break;
            }
            if !self.engine.has_work() {
                bail!(
                    "internal error: the engine has no work but {} requests are unfinished",
                    self.live.len()
                );
            }
            let events = self.engine.step()?;
            let now = Instant::now();
            for ev in events {
                match ev {
                    Event::Token { id, token } => {
                        let Some(f) = self.live.get_mut(&id) else {
                            continue; // already ended by a stop string this step
                        };
                        f.tokens.push(token);
                        f.first_token_ms.get_or_insert(ms(now));
                        let (_, stopped) = f.text.push(token)?;
                        if stopped {
                            self.engine.finish(id);
                            self.complete(id, FinishReason::Stop, ms(now), &mut on_result)?;
                            outcome.finished += 1;
                        }
                    }
                    Event::Finished { id, reason } => {
                        if self.live.contains_key(&id) {
                            self.complete(id, reason, ms(now), &mut on_result)?;
                            outcome.finished += 1;
                        }
                    }
                }
            }
            on_step(&*self.engine, outcome.finished);
        }
        // Cancelled: end what is left.
        let now = ms(Instant::now());
        let mut left: Vec<SeqId> = self.live.keys().copied().collect();
        left.sort_unstable();
        for id in left {
            self.engine.finish(id);
            if self.live[&id].tokens.is_empty() {
                self.live.remove(&id);
                outcome.not_started += 1;
            } else {
                self.complete(id, FinishReason::Cancelled, now, &mut on_result)?;
                outcome.cancelled += 1;
            }
        }
        outcome.wall_seconds = start.elapsed().as_secs_f64();
        Ok(outcome)
    }

    fn complete(
        &mut self,
        id: SeqId,
        reason: FinishReason,
        now_ms: f64,
        on_result: &mut impl FnMut(BatchResult) -> Result<()>,
    ) -> Result<()> {
        let f = self
            .live
            .remove(&id)
            .context("finished request not in flight")?;
        let text = f.text.finish()?;
        let error = match reason {
            FinishReason::Error => Some(
                self.engine
                    .take_error(id)
                    .unwrap_or_else(|| "the request failed".into()),
            ),
            _ => None,
        };
        on_result(BatchResult {
            error,
            id: f.id,
            prompt_tokens: f.prompt_tokens,
            cached_tokens: f.cached_tokens,
            ttft_ms: f.first_token_ms.unwrap_or(now_ms),
            total_ms: now_ms,
            tokens: f.tokens,
            text,
            finish_reason: reason,
        })
    }
}
