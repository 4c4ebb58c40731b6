//! The engine thread: owns the model, tokenizer and KV cache (none of them leaves this thread),
//! takes jobs from the HTTP side between steps, and sends each job's text back as it is made.
//!
//! Between two steps it (1) tokenizes and queues every job that arrived, answering a job that
//! can never run with a rejection, (2) ends every job whose reader is gone (the client
//! disconnected: its blocks go back to the pool before the next step), (3) runs one engine step
//! and forwards its tokens as text. With nothing to do it sleeps on the job channel.

// Jobs come from HTTP bodies: no unwrap, expect or indexing that could panic on them (issue 21;
// clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Prompt};
use super::metrics::{Metrics, PoolBlocks};
use super::response::Usage;
use crate::engine::request::{Event, FinishReason, Request};
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::Engine;
use crate::engine::text_stream::TextStream;
use crate::kv::cache::SeqId;
use crate::kv::format::tag::format_label;
use crate::model::load::LoadedModel;

/// One request handed to the engine thread.
pub struct Job {
    pub prompt: Prompt,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Generate past the end-of-sequence token (`ignore_eos`, a benchmark's fixed lengths).
    pub ignore_eos: bool,
    /// Where its updates go; dropping the receiver cancels the job.
    pub updates: UnboundedSender<Update>,
}

/// What the engine thread tells a job's handler, in order: `Rejected`, or `Started`, any
/// number of `Text`, then `Done` (or `Failed`).
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Rejected(ApiError),
    Started { prompt_tokens: usize },
    Text(String),
    Done { finish: FinishReason, usage: Usage },
    Failed(String),
}

/// Jobs accepted by the HTTP side and not yet ended by the engine thread (the queue limit).
#[derive(Debug, Default)]
pub struct Outstanding(AtomicUsize);

impl Outstanding {
    /// Counts one more job unless `limit` are outstanding.
    pub fn try_acquire(&self, limit: usize) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    pub fn release(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
}

struct Live<'t> {
    updates: UnboundedSender<Update>,
    text: TextStream<'t>,
    /// Bytes of the text already sent.
    sent: usize,
    usage: Usage,
}

/// Runs the engine until the job channel closes (the server stopped). `ready` is called once
/// `/metrics` has the pools, before the first job is taken.
pub fn run(
    m: &LoadedModel,
    mut engine: Engine<'_>,
    jobs: Receiver<Job>,
    metrics: &Metrics,
    outstanding: &Outstanding,
    ready: impl FnOnce(),
) {
    let window = m.model.config().max_position_embeddings;
    let mut live: HashMap<SeqId, Live<'_>> = HashMap::new();
    let mut rate = Rate::default();
    let pools = pool_labels(&engine);
    publish(&engine, &pools, &rate, metrics);
    ready();
    loop {
        // 1. New jobs: block only when there is nothing else to do.
        let mut arrived = Vec::new();
        if !engine.has_work() {
            match jobs.recv_timeout(Duration::from_millis(500)) {
                Ok(j) => arrived.push(j),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        arrived.extend(jobs.try_iter());
        for job in arrived {
            match admit(m, &mut engine, window, &job) {
                Ok((id, prompt_tokens)) => {
                    let _ = job.updates.send(Update::Started { prompt_tokens });
                    live.insert(
                        id,
                        Live {
                            text: TextStream::new(&m.tokenizer, job.stop),
                            updates: job.updates,
                            sent: 0,
                            usage: Usage {
                                prompt_tokens,
                                ..Usage::default()
                            },
                        },
                    );
                    metrics.update(|s| s.prompt_tokens += prompt_tokens as u64);
                }
                Err(e) => {
                    metrics.update(|s| s.requests_rejected += 1);
                    outstanding.release();
                    let _ = job.updates.send(Update::Rejected(e));
                }
            }
        }
        // 2. Readers gone: end their requests now.
        let gone: Vec<SeqId> = live
            .iter()
            .filter(|(_, l)| l.updates.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            engine.finish(id);
            engine.take_reused_tokens(id);
            live.remove(&id);
            outstanding.release();
            metrics.update(|s| s.requests_cancelled += 1);
        }
        // 3. One step.
        if engine.has_work() {
            match engine.step() {
                Ok(events) => {
                    // Metrics first: a client that hears its request ended finds it counted.
                    let n = events
                        .iter()
                        .filter(|e| matches!(e, Event::Token { .. }))
                        .count();
                    rate.add(n);
                    metrics.update(|s| s.generated_tokens += n as u64);
                    publish(&engine, &pools, &rate, metrics);
                    forward(&mut engine, &mut live, events, metrics, outstanding);
                }
                Err(e) => {
                    // A fault of the engine ends the requests in flight, not the server.
                    let msg = format!("the engine failed: {}", one_line(&e));
                    for (id, l) in live.drain() {
                        engine.finish(id);
                        engine.take_reused_tokens(id);
                        let _ = l.updates.send(Update::Failed(msg.clone()));
                        outstanding.release();
                    }
                }
            }
        }
        publish(&engine, &pools, &rate, metrics);
    }
}

/// Tokenizes a job's prompt and queues it; the error says which field to fix.
fn admit(
    m: &LoadedModel,
    engine: &mut Engine<'_>,
    window: usize,
    job: &Job,
) -> Result<(SeqId, usize), ApiError> {
    let field = job.prompt.field();
    let prompt = match &job.prompt {
        Prompt::Chat(msgs) => m.encode_chat(msgs),
        Prompt::Text(t) => m.tokenizer.encode(t, true),
        Prompt::Tokens(ids) => {
            let vocab = m.tokenizer.vocab_size();
            match ids.iter().find(|&&t| t as usize >= vocab) {
                Some(t) => Err(anyhow::anyhow!(
                    "token id {t} is outside the vocabulary (0..{vocab})"
                )),
                None => Ok(ids.clone()),
            }
        }
    }
    .map_err(|e| ApiError::invalid(field, one_line(&e)))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(field, "the prompt has no tokens"));
    }
    if prompt.len() >= window {
        return Err(ApiError::invalid(
            field,
            format!(
                "this model's context window is {window} tokens and the prompt has {} \
                 (at least one must be left to generate)",
                prompt.len()
            ),
        ));
    }
    let n = prompt.len();
    let req = Request {
        prompt,
        params: job.params.clone(),
        max_tokens: job.max_tokens,
        eos: if job.ignore_eos {
            Vec::new()
        } else {
            m.tokenizer.eos_token_ids().to_vec()
        },
    };
    // What remains refused here is a request too big for the whole KV budget.
    let id = engine
        .add(req)
        .map_err(|e| ApiError::invalid("max_tokens", one_line(&e)))?;
    Ok((id, n))
}

/// Sends a step's tokens to their jobs as text.
fn forward<'t>(
    engine: &mut Engine<'_>,
    live: &mut HashMap<SeqId, Live<'t>>,
    events: Vec<Event>,
    metrics: &Metrics,
    outstanding: &Outstanding,
) {
    let mut ended: Vec<(SeqId, FinishReason)> = Vec::new();
    for ev in events {
        match ev {
            Event::Token { id, token } => {
                let Some(l) = live.get_mut(&id) else {
                    continue;
                };
                l.usage.completion_tokens += 1;
                match l.text.push(token) {
                    Ok((text, stopped)) => {
                        if !text.is_empty() {
                            l.sent += text.len();
                            let _ = l.updates.send(Update::Text(text));
                        }
                        if stopped {
                            engine.finish(id);
                            ended.push((id, FinishReason::Stop));
                        }
                    }
                    Err(e) => {
                        engine.finish(id);
                        engine.take_reused_tokens(id);
                        let _ = l.updates.send(Update::Failed(one_line(&e)));
                        live.remove(&id);
                        outstanding.release();
                    }
                }
            }
            Event::Finished { id, reason } => ended.push((id, reason)),
        }
    }
    for (id, finish) in ended {
        let Some(l) = live.remove(&id) else {
            continue; // ended by a stop string earlier in this step
        };
        let mut usage = l.usage;
        usage.cached_tokens = engine.take_reused_tokens(id);
        outstanding.release();
        metrics.update(|s| s.requests_finished += 1);
        let updates = l.updates;
        match l.text.finish() {
            Ok(full) => {
                // The tail held back for a possible stop string or partial character.
                if let Some(tail) = full.get(l.sent..).filter(|t| !t.is_empty()) {
                    let _ = updates.send(Update::Text(tail.to_string()));
                }
                let _ = updates.send(Update::Done { finish, usage });
            }
            Err(e) => {
                let _ = updates.send(Update::Failed(one_line(&e)));
            }
        }
    }
}

/// Refreshes the `/metrics` snapshot from the engine.
fn publish(engine: &Engine<'_>, pools: &[PoolLabel], rate: &Rate, metrics: &Metrics) {
    let cache = engine.cache();
    let free = cache.free_blocks();
    let cached = cache.group_prefix_cached();
    let staging = cache.group_staging_blocks();
    metrics.update(|s| {
        s.running = engine.num_running();
        s.waiting = engine.num_waiting();
        s.tokens_per_second = rate.per_second();
        s.prefix_cache_hits = engine.stats().prefix_hits as u64;
        s.prefix_cache_tokens = engine.stats().prefix_tokens as u64;
        s.pools = pools
            .iter()
            .map(|p| {
                let (free, cached) = if p.staging {
                    (staging.get(p.group).map_or(0, |s| s.0), 0)
                } else {
                    (free.get(p.group), cached.get(p.group).copied().unwrap_or(0))
                };
                PoolBlocks {
                    pool: p.name.clone(),
                    format: p.format.clone(),
                    free,
                    total: p.total,
                    cached,
                }
            })
            .collect();
    });
}

/// One pool as `/metrics` labels it.
struct PoolLabel {
    name: String,
    format: String,
    total: usize,
    /// Its layer group, and whether it is the group's staging pool.
    group: usize,
    staging: bool,
}

/// The pools as `/metrics` labels them: each layer group's main pool (and staging pool).
fn pool_labels(engine: &Engine<'_>) -> Vec<PoolLabel> {
    let cache = engine.cache();
    let cfg = cache.config();
    let mut out = Vec::new();
    for (g, lg) in cache.groups().iter().enumerate() {
        let suffix = lg.window.map_or(String::new(), |w| format!("-window-{w}"));
        let mut names: Vec<String> = lg
            .layers
            .iter()
            .filter_map(|&l| cfg.formats.get(l).map(format_label))
            .collect();
        names.dedup();
        let main = if names.len() == 1 {
            names.remove(0)
        } else {
            format!("mixed-{}", names.join("+"))
        };
        out.push(PoolLabel {
            name: format!("main{suffix}"),
            format: main,
            total: cfg.blocks_of(g),
            group: g,
            staging: false,
        });
        if let Some(s) = &cfg.staging {
            out.push(PoolLabel {
                name: format!("staging{suffix}"),
                format: format!("dense-{:?}", s.dtype).to_lowercase(),
                total: s.num_blocks,
                group: g,
                staging: true,
            });
        }
    }
    out
}

/// An error chain on one line (candle appends backtraces on later lines).
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Generated tokens per second over a sliding 10-second window (0 after 10 idle seconds).
#[derive(Default)]
struct Rate {
    steps: VecDeque<(Instant, usize)>,
}

impl Rate {
    const SPAN: Duration = Duration::from_secs(10);

    fn add(&mut self, n: usize) {
        self.add_at(Instant::now(), n);
    }

    fn add_at(&mut self, now: Instant, n: usize) {
        self.steps.push_back((now, n));
        while self
            .steps
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Self::SPAN)
        {
            self.steps.pop_front();
        }
    }

    fn per_second(&self) -> f64 {
        self.per_second_at(Instant::now())
    }

    /// Tokens of the steps at most SPAN before `now`, over the time since the first of them
    /// (at least a second, so one step alone does not read as a burst).
    fn per_second_at(&self, now: Instant) -> f64 {
        let recent = || {
            self.steps
                .iter()
                .filter(move |(t, _)| now.duration_since(*t) <= Self::SPAN)
        };
        let Some((first, _)) = recent().next() else {
            return 0.0;
        };
        let span = now.duration_since(*first).as_secs_f64().max(1.0);
        recent().map(|(_, n)| n).sum::<usize>() as f64 / span
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_counts_the_last_ten_seconds_only() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = Rate::default();
        assert_eq!(r.per_second_at(t0), 0.0);
        r.add_at(at(0), 100);
        assert_eq!(r.per_second_at(at(0)), 100.0); // one step: over a second
        r.add_at(at(1), 100);
        r.add_at(at(4), 200);
        assert_eq!(r.per_second_at(at(4)), 100.0); // 400 tokens in 4 s
        assert_eq!(r.per_second_at(at(11)), 30.0); // the first step has left
        assert_eq!(r.per_second_at(at(15)), 0.0); // idle
        r.add_at(at(30), 50);
        assert_eq!(r.steps.len(), 1);
        assert_eq!(r.per_second_at(at(32)), 25.0);
    }
}
