//! `kvq serve`: flags → [`crate::server::ServeOptions`] and a loader for the engine thread.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};
use clap::Args;

use super::args::{DeviceArgs, KvArgs, ModelArgs, SamplingArgs};
use super::kv_budget::{group_bytes, window_copies_bytes, PoolBudget};
use crate::engine::batch_io::parse_bytes;
use crate::engine::scheduler::EngineConfig;
use crate::kv::cache::{Blocks, CacheConfig, PagedKvCache, PoolSizing};
use crate::model::load::load;
use crate::server::api::Defaults;
use crate::server::{serve, ServeOptions};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1", value_name = "ADDR")]
    pub host: String,

    /// Port to listen on (0: any free port; the one taken is printed on stderr).
    #[arg(long, default_value_t = 8080, value_name = "PORT")]
    pub port: u16,

    /// Most requests running at once (prefilling or decoding in the same forward passes).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub max_batch: usize,

    /// Most requests waiting for a place in the batch; beyond it requests get 429 with
    /// Retry-After.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_queue: usize,

    /// Largest request body (e.g. 1M); larger ones get 413.
    #[arg(long, default_value = "1M", value_name = "SIZE", value_parser = parse_bytes)]
    pub max_body: usize,

    /// Require `Authorization: Bearer KEY` on /v1/* (also read from KVQ_API_KEY).
    #[arg(long, env = "KVQ_API_KEY", value_name = "KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Most prompt tokens per step, shared by the prefilling requests; decode tokens of running
    /// requests ride along in the same step.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub prefill_chunk: usize,

    /// KV cache budget in bytes (e.g. 512M, 2G), allocated at start. Requests wait for room
    /// instead of failing. Default: --max-batch requests of the whole context window, at most
    /// a quarter of the available memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub kv_memory: Option<usize>,

    /// Do not keep prompts' KV blocks for reuse: every request prefills its whole prompt.
    /// (By default full blocks of prompts stay in the pool, shared by reference count and
    /// evicted least recently used, and a request starting with cached blocks prefills only
    /// the rest.)
    #[arg(long)]
    pub no_prefix_cache: bool,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    #[command(flatten)]
    pub kv: KvArgs,
}

pub fn run(args: &ServeArgs) -> Result<()> {
    args.kv.options(&args.model).validate()?;
    args.sampling.validate()?;
    let params = args.sampling.params();
    if args.sampling.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.api_key.as_deref() == Some("") {
        bail!("--api-key must not be empty");
    }
    let opts = ServeOptions {
        host: args.host.clone(),
        port: args.port,
        max_queue: args.max_queue,
        max_body: args.max_body,
        api_key: args.api_key.clone(),
        engine: EngineConfig {
            max_batch: args.max_batch,
            prefill_chunk: args.prefill_chunk,
            cuda_graphs: args.device.cuda_graphs,
        },
        model_name: model_name(&args.model),
        defaults: Defaults {
            params,
            max_tokens: args.sampling.max_tokens,
            stop: args.sampling.stop.clone(),
        },
        prefix_cache: !args.no_prefix_cache,
    };
    let a = args.clone();
    serve(
        opts,
        Box::new(move || {
            let device = a.device.open()?;
            let loaded = load(&a.model.options(), &device)?;
            let model = &loaded.model;
            let kv = a.kv.options_for(&a.model, model);
            let window = model.config().max_position_embeddings;
            let sizing = |bytes| PoolSizing::Budget {
                bytes,
                tokens: window,
                max_batch: a.max_batch,
                chunk: a.prefill_chunk,
            };
            let probe = kv.cache_config(model.kv_shape(), model.dtype(), sizing(0))?;
            let bytes = budget(&a, window, &probe)?;
            let cfg = kv.cache_config(model.kv_shape(), model.dtype(), sizing(bytes))?;
            super::args::check_cache_memory(&cfg, &device)?;
            let blocks = cfg.pool_sizes();
            let held = match blocks.0.as_slice() {
                [one] => format!("{one} blocks"),
                many => format!(
                    "{} blocks per layer group",
                    many.iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(" + ")
                ),
            };
            let staging = match super::args::staging_bytes(&cfg)? {
                0 => String::new(),
                b => format!(" + {} MiB of dense staging", b >> 20),
            };
            let staging = match window_copies_bytes(&cfg, a.max_batch) {
                0 => staging,
                b => format!(
                    "{staging} + {} MiB of dense window copies for {} sequences",
                    b >> 20,
                    a.max_batch
                ),
            };
            eprintln!(
                "kvq serve: {} | KV cache {held} of {} tokens ({} MiB{staging})",
                loaded.description,
                probe.block_size,
                cfg.main_bytes() >> 20
            );
            let cache = PagedKvCache::new(cfg, &device)?;
            Ok((loaded, cache))
        }),
    )
}

/// The name requests use: --model as given, else the default model's.
fn model_name(m: &ModelArgs) -> String {
    match &m.model {
        Some(s) => s.clone(),
        None => crate::model::fetch::DEFAULT_MODEL_FILE
            .trim_end_matches(".gguf")
            .to_string(),
    }
}

/// Bytes of main-pool blocks to allocate, checked as batch-generate checks them
/// ([`PoolBudget`]): --kv-memory less the dense staging pool, which must hold at least one
/// request of --max-tokens tokens (longer ones are refused one by one when they come); by
/// default room for --max-batch requests of the whole window (one partial block each), capped
/// at a quarter of the available memory but never below one such request.
fn budget(a: &ServeArgs, window: usize, probe: &CacheConfig) -> Result<usize> {
    let tokens = a.sampling.max_tokens.min(window);
    // A request of the whole window, one partial block more in each group.
    let whole_blocks = probe.max_blocks_for(window, a.prefill_chunk);
    let whole = group_bytes(
        probe,
        &Blocks(whole_blocks.0.iter().map(|n| n.saturating_add(1)).collect()),
    );
    let what = format!("one request of --max-tokens {}", a.sampling.max_tokens);
    PoolBudget {
        kv_memory: a.kv_memory,
        one_blocks: probe.max_blocks_for(tokens, a.prefill_chunk),
        one_tokens: tokens,
        one_what: &what,
        want: whole.saturating_mul(a.max_batch),
        floor: whole,
        share: 4,
        sequences: a.max_batch,
    }
    .bytes(probe)
}
