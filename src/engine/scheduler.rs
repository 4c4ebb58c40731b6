//! The engine: owns requests from admission to finish and drives the model one step at a time.
//!
//! Life of a request: waiting → prefilling (the prompt in chunks of at most `prefill_chunk`
//! tokens per step, in the same forward pass as the running sequences' decode tokens, so they
//! keep producing) → decoding → finished. A request is admitted only when the cache can hold its
//! whole future (prompt + max_tokens, capped by the context window) on top of what the running
//! ones may still claim; so a full pool makes requests wait, never fail or evict half-way.
//! Finished requests free their blocks at once and waiting ones join at the next step.
//! `generate` is this engine with one request.
//!
//! Prompt caches: a request added with a [`CachedPrefix`] gets those prompt tokens' stored K/V
//! rows imported into its fresh sequence when it is admitted (in chunks, like a prefill, so
//! admission's block promise still holds) and prefills only the rest; a saved history thus
//! joins a running batch like any other request. With the cache's automatic prefix reuse on
//! ([`PagedKvCache::enable_prefix_cache`]), a request starts on the cached blocks that hold
//! the longest whole-block prefix of its prompt and prefills only the rest; every prompt's full
//! blocks are offered to that cache once prefilled (under `--kv-residual`, also once at the
//! prompt's stop point, with the dense copies held there: `chunks`). A request marked with
//! [`Engine::keep_prompt_kv`] has its prompt's rows exported the moment its prefill completes.

use anyhow::{bail, Result};
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use super::chunks::chunk_take;
use super::device_greedy::{greedy_picks, is_plain_greedy, nan_error};
use super::request::{CachedPrefix, Event, FinishReason, Request};
use super::sampler::Sampler;
use super::stats::Stats;
use crate::kv::cache::{Blocks, PagedKvCache, PromptKv, SeqId};
use crate::model::llama::{Llama, LogitsFor, SeqInput};

/// Scheduling limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences in flight (prefilling or decoding) at once.
    pub max_batch: usize,
    /// Most prompt tokens processed per step, over all prefilling sequences.
    pub prefill_chunk: usize,
    /// Replay decode steps as CUDA graphs on a CUDA device (`engine::graphs`); off: every
    /// kernel launched one by one (same outputs).
    pub cuda_graphs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 1,
            prefill_chunk: 512,
            cuda_graphs: true,
        }
    }
}

struct Running {
    id: SeqId,
    req: Request,
    sampler: Sampler,
    /// Prompt followed by generated tokens.
    history: Vec<u32>,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// A block boundary the prefill ends a step on, to offer the prefix there with what the
    /// cache keeps for it (`--kv-residual`: `chunks`).
    point: Option<usize>,
    generated: usize,
    /// Most main-pool blocks this request may own at once per layer group (its admission
    /// promise).
    lifetime_blocks: Blocks,
}

pub struct Engine<'m> {
    model: &'m Llama,
    cache: PagedKvCache,
    cfg: EngineConfig,
    next_id: SeqId,
    waiting: VecDeque<(SeqId, Request)>,
    running: Vec<Running>,
    stats: Stats,
    /// Prompt-cache prefixes of waiting requests, imported on admission.
    prefixes: HashMap<SeqId, CachedPrefix>,
    /// Requests whose prompt rows are to be exported once prefilled, and those exported.
    keep_prompt: HashSet<SeqId>,
    prompt_kv: HashMap<SeqId, PromptKv>,
    /// Why requests that ended with [`FinishReason::Error`] failed (taken by the front end).
    errors: HashMap<SeqId, String>,
    /// Decode no sequence while another is still prefilling (see [`Engine::prefill_first`]).
    prefill_first: bool,
    /// Prompt tokens each request took from the automatic prefix cache (when any).
    reused: HashMap<SeqId, usize>,
    /// Captured decode steps (CUDA device, `cuda_graphs` on).
    #[cfg(feature = "cuda")]
    graphs: Option<super::graphs::DecodeGraphs>,
}

/// A step's results before sampling: greedy picks made on the device (`None` for a row with a
/// NaN), or every row's logits for the host sampler.
enum StepOut {
    Picks(Vec<Option<u32>>),
    Rows(Vec<Vec<f32>>),
}

impl<'m> Engine<'m> {
    pub fn new(model: &'m Llama, cache: PagedKvCache, cfg: EngineConfig) -> Result<Self> {
        if cfg.max_batch == 0 || cfg.prefill_chunk == 0 {
            bail!("--max-batch and --prefill-chunk must be at least 1");
        }
        #[cfg(feature = "cuda")]
        let cache_is_cuda = cache.device().is_cuda();
        Ok(Self {
            model,
            cache,
            next_id: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: Stats::default(),
            prefixes: HashMap::new(),
            keep_prompt: HashSet::new(),
            prompt_kv: HashMap::new(),
            errors: HashMap::new(),
            prefill_first: false,
            reused: HashMap::new(),
            #[cfg(feature = "cuda")]
            graphs: (cfg.cuda_graphs && cache_is_cuda)
                .then(|| super::graphs::DecodeGraphs::new(cfg.max_batch, cfg.prefill_chunk)),
            cfg,
        })
    }

    /// With `on`, sequences whose prompt is done wait (their first token already sampled) until
    /// no running sequence is prefilling, so steps are either all prompt or all decode: the
    /// phases `kvq bench-batch` times apart, as llama.cpp's batched bench runs them. Off (the
    /// default), decode tokens ride along with prompt chunks so running requests keep producing.
    pub fn prefill_first(&mut self, on: bool) {
        self.prefill_first = on;
    }

    /// Tokens a request may occupy in the cache at most.
    fn lifetime_tokens(&self, req: &Request) -> usize {
        req.cache_tokens(self.model.config().max_position_embeddings)
    }

    /// Queues a request; returns its id. Refuses what can never run.
    pub fn add(&mut self, req: Request) -> Result<SeqId> {
        let window = self.model.config().max_position_embeddings;
        if req.prompt.is_empty() {
            bail!("the prompt is empty (0 tokens)");
        }
        crate::engine::request::check_fits(req.prompt.len(), window)?;
        if req.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        req.params.validate()?;
        let need = self.lifetime_blocks(&req, false);
        let total = self.cache.config().pool_sizes();
        if let Some(g) = need.first_short(&total) {
            bail!(
                "one request needs {} KV blocks ({} tokens) {}but the cache holds only {} \
                 blocks there; raise the KV memory budget or lower --max-tokens",
                need.get(g),
                self.lifetime_tokens(&req),
                self.group_name(g),
                total.get(g)
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, req));
        Ok(id)
    }

    /// Queues a request whose first `prefix.tokens` prompt tokens come from a prompt cache
    /// (the file's tokens must equal them; at least one prompt token is left to prefill, two
    /// keep the rest on the prefill path: see `reusable_prefix`).
    pub fn add_with_prefix(&mut self, req: Request, prefix: CachedPrefix) -> Result<SeqId> {
        let n = prefix.tokens;
        if n >= req.prompt.len() {
            bail!(
                "a prompt cache can cover at most {} of this prompt's {} tokens (the last one \
                 must be computed), not {n}",
                req.prompt.len().saturating_sub(1),
                req.prompt.len()
            );
        }
        if prefix.file.tokens().get(..n) != Some(&req.prompt[..n]) {
            bail!(
                "the first {n} prompt tokens are not those saved in {}",
                prefix.file.path().display()
            );
        }
        let id = self.add(req)?;
        if n > 0 {
            self.prefixes.insert(id, prefix);
        }
        Ok(id)
    }

    /// Asks for the stored K/V rows of request `id`'s prompt, taken when its prefill completes
    /// (see [`Self::take_prompt_kv`]).
    pub fn keep_prompt_kv(&mut self, id: SeqId) {
        self.keep_prompt.insert(id);
    }

    /// The prompt rows of `id`, once its prefill has completed (per layer, as stored).
    pub fn take_prompt_kv(&mut self, id: SeqId) -> Option<PromptKv> {
        self.prompt_kv.remove(&id)
    }

    /// Prompt tokens request `id` took from the automatic prefix cache (0 if none); asked
    /// once, when it ends.
    pub fn take_reused_tokens(&mut self, id: SeqId) -> usize {
        self.reused.remove(&id).unwrap_or(0)
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Ends a request now (stop string seen, Ctrl-C); frees its blocks.
    /// Why request `id` ended with [`FinishReason::Error`], once.
    pub fn take_error(&mut self, id: SeqId) -> Option<String> {
        self.errors.remove(&id)
    }

    pub fn finish(&mut self, id: SeqId) {
        self.waiting.retain(|(w, _)| *w != id);
        self.prefixes.remove(&id);
        self.keep_prompt.remove(&id);
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.running.swap_remove(i);
            self.cache.remove_sequence(id);
        }
    }

    /// Main-pool blocks a request may own at once over its life, per layer group (`keep`: its
    /// prompt is held whole until exported).
    fn lifetime_blocks(&self, req: &Request, keep: bool) -> Blocks {
        let (tokens, chunk) = (self.lifetime_tokens(req), self.cfg.prefill_chunk);
        let cfg = self.cache.config();
        if keep {
            cfg.max_blocks_keeping(tokens, chunk, req.prompt.len())
        } else {
            cfg.max_blocks_for(tokens, chunk)
        }
    }

    /// "in the layers with a W-token window " for a windowed group, else nothing.
    fn group_name(&self, g: usize) -> String {
        match self.cache.groups().get(g).and_then(|x| x.window) {
            Some(w) => format!("in the layers with a {w}-token window "),
            None => String::new(),
        }
    }

    /// Blocks the running requests may still claim beyond what they hold, per group.
    fn promised_blocks(&self) -> Blocks {
        self.running.iter().fold(Blocks::default(), |acc, r| {
            let owned = self.cache.owned_blocks(r.id).unwrap_or_default();
            acc.plus(&r.lifetime_blocks.saturating_sub(&owned))
        })
    }

    fn admit(&mut self) -> Result<()> {
        while self.running.len() < self.cfg.max_batch {
            let Some((id, req)) = self.waiting.front() else {
                break;
            };
            let keep = self.keep_prompt.contains(id);
            let need = self.lifetime_blocks(req, keep);
            if !need
                .plus(&self.promised_blocks())
                .fits_in(&self.cache.free_blocks())
            {
                break; // waits for running requests to finish
            }
            let (id, req) = self.waiting.pop_front().expect("front exists");
            self.cache.add_sequence(id)?;
            if keep {
                self.cache.keep_history(id, req.prompt.len())?;
            }
            let prefilled = match self.prefixes.remove(&id) {
                Some(p) => {
                    if let Err(e) = self.import_prefix(id, &p) {
                        self.cache.remove_sequence(id);
                        return Err(e);
                    }
                    p.tokens
                }
                // Leave two tokens to prefill: a lone token would take the decode path, whose
                // rounding differs (see `chunks::prefill_take`).
                None => {
                    let max = req.prompt.len().saturating_sub(2);
                    let n = match self.cache.attach_prefix(id, &req.prompt, max) {
                        Ok(n) => n,
                        Err(e) => {
                            self.cache.remove_sequence(id);
                            return Err(e.into());
                        }
                    };
                    if n > 0 {
                        self.stats.prefix_hits += 1;
                        self.stats.prefix_tokens += n;
                        self.reused.insert(id, n);
                    }
                    n
                }
            };
            let lifetime_blocks = self.lifetime_blocks(&req, keep);
            let point = self
                .cache
                .prefix_point(req.prompt.len().saturating_sub(2))
                .filter(|&p| p > prefilled);
            self.running.push(Running {
                id,
                sampler: Sampler::new(req.params.clone()),
                history: req.prompt.clone(),
                prefilled,
                point,
                generated: 0,
                lifetime_blocks,
                req,
            });
        }
        Ok(())
    }

    /// Puts a prompt cache's rows into the new sequence `id`.
    fn import_prefix(&mut self, id: SeqId, p: &CachedPrefix) -> Result<()> {
        let rows = p.file.load_rows(p.tokens, self.cache.device())?;
        let centers = &p.file.meta().centers;
        if !centers.is_empty() {
            self.cache
                .import_centers(id, centers)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.file.path().display()))?;
        }
        self.cache
            .import_rows(id, &rows, self.cfg.prefill_chunk)
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.file.path().display()))?;
        // Under --kv-residual the rows attend through the copies the saving run held.
        if self.cache.config().residual > 0 {
            if let Some(held) = p.file.load_held(self.cache.device())? {
                self.cache
                    .import_held(id, &held, p.tokens)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.file.path().display()))?;
            }
        }
        self.stats.cached_tokens += p.tokens;
        Ok(())
    }

    /// One forward pass over every running sequence: decode tokens first, then prompt chunks.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.admit()?;
        if self.running.is_empty() {
            if let Some((_, req)) = self.waiting.front() {
                bail!(
                    "request of {} prompt tokens cannot be admitted: the KV cache is too small",
                    req.prompt.len()
                );
            }
            return Ok(Vec::new());
        }
        let mut inputs = Vec::new();
        let mut owners = Vec::new(); // index into running, per input row
        let mut prefill_tokens = 0;
        let mut decode_tokens = 0;
        let hold = self.prefill_first
            && self
                .running
                .iter()
                .any(|r| r.prefilled < r.req.prompt.len());
        for (i, r) in self.running.iter().enumerate() {
            if r.prefilled == r.req.prompt.len() && !hold {
                inputs.push(SeqInput {
                    seq: r.id,
                    tokens: vec![*r.history.last().expect("history has the prompt")],
                });
                owners.push(i);
                decode_tokens += 1;
            }
        }
        let mut budget = self.cfg.prefill_chunk;
        for (i, r) in self.running.iter().enumerate() {
            if r.prefilled < r.req.prompt.len() && budget > 0 {
                let n = chunk_take(
                    r.req.prompt.len(),
                    r.prefilled,
                    r.point,
                    budget,
                    self.cfg.prefill_chunk,
                );
                if n == 0 {
                    continue;
                }
                budget -= n;
                inputs.push(SeqInput {
                    seq: r.id,
                    tokens: r.req.prompt[r.prefilled..r.prefilled + n].to_vec(),
                });
                owners.push(i);
                prefill_tokens += n;
            }
        }
        for inp in &inputs {
            self.cache.reserve(inp.seq, inp.tokens.len())?;
        }
        let t0 = Instant::now();
        let all_greedy = owners
            .iter()
            .all(|&i| is_plain_greedy(self.running[i].sampler.params()));
        let out = self.run_step(&inputs, all_greedy)?;
        let elapsed = t0.elapsed();
        self.stats
            .record_step(prefill_tokens, decode_tokens, elapsed);
        self.stats.observe_kv(self.cache.bytes_in_use());

        let window = self.model.config().max_position_embeddings;
        let mut events = Vec::new();
        let mut done = Vec::new();
        let mut prefilled_now = Vec::new();
        for (j, (inp, &i)) in inputs.iter().zip(&owners).enumerate() {
            let r = &mut self.running[i];
            let n = inp.tokens.len();
            if r.prefilled < r.req.prompt.len() {
                r.prefilled += n;
                if r.point == Some(r.prefilled) {
                    self.cache
                        .register_prefix(r.id, &r.req.prompt[..r.prefilled])?;
                }
                if r.prefilled < r.req.prompt.len() {
                    continue; // mid-prompt chunk: its logits are not a prediction we use
                }
                prefilled_now.push(r.id);
            }
            // A request whose logits cannot be sampled (NaN) ends alone; the others go on.
            let sampled = match &out {
                StepOut::Picks(ids) => ids[j].ok_or_else(nan_error),
                StepOut::Rows(rows) => r.sampler.sample(&rows[j], &r.history),
            };
            let tok = match sampled {
                Ok(t) => t,
                Err(e) => {
                    self.errors.insert(r.id, format!("{e:#}"));
                    events.push(Event::Finished {
                        id: r.id,
                        reason: FinishReason::Error,
                    });
                    done.push(r.id);
                    continue;
                }
            };
            r.history.push(tok);
            r.generated += 1;
            self.stats.generated_tokens += 1;
            events.push(Event::Token {
                id: r.id,
                token: tok,
            });
            let reason = if r.req.eos.contains(&tok) {
                Some(FinishReason::Stop)
            } else if r.generated >= r.req.max_tokens || r.history.len() >= window {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                events.push(Event::Finished { id: r.id, reason });
                done.push(r.id);
            }
        }
        // Before finishing anything: a request may end on its first token.
        for id in prefilled_now {
            if let Some(r) = self.running.iter().find(|r| r.id == id) {
                self.cache.register_prefix(id, &r.req.prompt)?;
            }
            if self.keep_prompt.remove(&id) {
                let kv = PromptKv {
                    rows: self.cache.export_rows(id)?,
                    centers: self.cache.export_centers(id)?,
                    held: self.cache.export_held(id)?,
                };
                self.prompt_kv.insert(id, kv);
            }
        }
        for id in done {
            self.finish(id);
        }
        Ok(events)
    }
}

impl Engine<'_> {
    /// The forward pass of a step: replayed as a CUDA graph where one applies, else launched
    /// op by op. On a GPU an all-greedy step brings back token ids only
    /// (engine::device_greedy).
    fn run_step(&mut self, inputs: &[SeqInput], all_greedy: bool) -> Result<StepOut> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self
            .graphs
            .as_mut()
            .filter(|g| g.takes(self.model, &self.cache, inputs))
        {
            let s = g.step(self.model, inputs, &mut self.cache, !all_greedy)?;
            self.stats.graph_kernels = g.kernels();
            return Ok(match s.logits {
                Some(rows) if !all_greedy => StepOut::Rows(rows),
                _ => StepOut::Picks(s.picks),
            });
        }
        let logits = self
            .model
            .forward(inputs, &mut self.cache, LogitsFor::Last)?;
        Ok(if !logits.device().is_cpu() && all_greedy {
            StepOut::Picks(greedy_picks(&logits)?)
        } else {
            StepOut::Rows(logits.to_vec2()?)
        })
    }
}
