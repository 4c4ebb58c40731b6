//! `kvq batch-generate`: many prompts from a file through the continuous-batching engine, one
//! JSON line per request as it finishes, resumable, stoppable with Ctrl-C.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use clap::Args;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use indicatif::ProgressBar;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::args::{DeviceArgs, KvArgs, ModelArgs, SamplingArgs};
use super::kv_budget::{group_bytes, PoolBudget};
use super::output_file::{check_not_read, model_files, model_inputs, open_batch_output};
use super::prompt_cache::CacheFiles;
use crate::engine::batch::{Batch, BatchOutcome, BatchRequest};
use crate::engine::batch_io::{
    decode_input, id_key, line_hashes, line_key, parse_bytes, parse_input, InputFormat,
    InputRecord, InvalidLine, PromptSpec, Sink,
};
use crate::engine::request::{CachedPrefix, Request};
use crate::engine::scheduler::{Engine, EngineConfig};
use crate::engine::stats::{fmt_bytes, peak_rss_bytes};
use crate::kv::cache::{PagedKvCache, PoolSizing};
use crate::model::chat::Message;
use crate::model::load::{load, LoadedModel};

#[derive(Args, Debug, Clone)]
pub struct BatchGenerateArgs {
    /// Prompt file: one prompt per line, or JSONL objects with "id", "prompt" or "messages", and
    /// optional "raw", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop" (these
    /// override the flags for that request) and "prompt_cache" (a file written by `generate
    /// --save-prompt-cache` to start from). `-` reads standard input.
    #[arg(value_name = "INPUT")]
    pub input: String,

    /// Output JSONL file (default: standard output). One line per request as it finishes: id,
    /// text, tokens, finish_reason, prompt_tokens, generated_tokens, ttft_ms, total_ms.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// How to read INPUT: `auto` takes JSONL when the first non-blank line starts with `{`.
    #[arg(long, value_enum, default_value = "auto")]
    pub input_format: InputFormat,

    /// Continue a previous run: skip requests whose id already has a line in --output and append
    /// the rest (lines of cancelled requests and a torn last line are dropped and redone).
    #[arg(long)]
    pub resume: bool,

    /// Overwrite an existing --output file (without it, an existing non-empty file is refused).
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,

    /// Write an error record (`"finish_reason": "error"`) for a malformed or unrunnable line and go
    /// on, instead of stopping with FILE:LINE before generating anything.
    #[arg(long)]
    pub skip_invalid: bool,

    /// Most requests running at once (prefilling or decoding in the same forward passes).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub max_batch: usize,

    /// Most prompt tokens per step, shared by the prefilling requests; decode tokens of running
    /// requests ride along in the same step.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub prefill_chunk: usize,

    /// KV cache budget in bytes (e.g. 512M, 2G). Requests wait for room instead of failing.
    /// Default: enough for --max-batch of the longest requests, at most half the available memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub kv_memory: Option<usize>,

    /// Send prompts as plain text: no chat template (a request's "raw" overrides it).
    #[arg(long)]
    pub raw: bool,

    /// System message for prompts given as text (not for "messages" requests or --raw).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,

    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    #[command(flatten)]
    pub kv: KvArgs,
}

pub fn run(args: &BatchGenerateArgs) -> Result<()> {
    check_flags(args)?;
    let input = read_records(args)?;
    let (input_name, hashes) = (input.name, input.hashes);
    let (mut records, mut invalid) = (input.records, input.invalid);
    refuse_invalid(args, &input_name, &invalid)?;

    let mut output = match &args.output {
        Some(path) => {
            check_not_read("--output", path, &inputs_before_load(args))?;
            Some(open_batch_output(path, args.resume, args.force)?)
        }
        None => None,
    };
    let total_input = records.len() + invalid.len();
    let skipped = match output.as_mut().and_then(|o| o.done.take()) {
        Some(done) => skip_done(&done, &hashes, &mut records, &mut invalid),
        None => 0,
    };

    let device = args.device.open()?;
    let loaded = load(&args.model.options(), &device)?;
    if let Some(path) = &args.output {
        check_not_read("--output", path, &model_files(&loaded))?;
    }
    let model = &loaded.model;
    let kv = args.kv.options_for(&args.model, model);
    let sizing = |bytes, tokens| PoolSizing::Budget {
        bytes,
        tokens,
        max_batch: args.max_batch,
        chunk: args.prefill_chunk,
    };
    let probe = kv.cache_config(model.kv_shape(), model.dtype(), sizing(0, 1))?;
    let requests = build_requests(args, &loaded, records, &probe, &mut invalid)?;
    refuse_invalid(args, &input_name, &invalid)?;

    let window = model.config().max_position_embeddings;
    let longest = requests
        .iter()
        .map(|(_, b, _)| b.request.cache_tokens(window))
        .max()
        .unwrap_or(1);
    let bytes = budget_bytes(args, &probe, longest)?;
    let cfg = kv.cache_config(model.kv_shape(), model.dtype(), sizing(bytes, longest))?;
    super::args::check_cache_memory(&cfg, model.device())?;
    let kv_budget = cfg.main_bytes() + super::args::staging_bytes(&cfg)?;
    let cache = PagedKvCache::new(cfg, model.device())?;
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: args.max_batch,
            prefill_chunk: args.prefill_chunk,
            cuda_graphs: args.device.cuda_graphs,
        },
    )?;

    let mut batch = Batch::new(&mut engine, &loaded.tokenizer);
    for (line, b, prefix) in requests {
        let id = b.id.clone();
        if let Err(e) = batch.add_with_prefix(b, prefix) {
            invalid.push(InvalidLine {
                line,
                id: Some(id),
                error: crate::cli::one_line(&e),
            });
        }
    }
    refuse_invalid(args, &input_name, &invalid)?;
    // The run is under way: only now may --force empty the old output.
    let mut sink = match (output, &args.output) {
        (Some(mut out), Some(path)) => {
            out.start(path)?;
            Sink::new(Box::new(out))
        }
        _ => Sink::new(Box::new(std::io::stdout())),
    };
    invalid.sort_by_key(|e| e.line);
    for e in &invalid {
        let hash = hashes.get(e.line.wrapping_sub(1)).map(String::as_str);
        sink.write(&error_record(e, hash))
            .context("writing the output")?;
    }

    let cancel = Arc::new(AtomicBool::new(false));
    install_ctrl_c(cancel.clone())?;
    let to_run = batch.pending();
    let bar = progress_bar(args, to_run);
    let t0 = Instant::now();
    let outcome = batch.run(
        &cancel,
        |r| {
            sink.write(&r.to_json()).context("writing the output")?;
            bar.inc(1);
            Ok(())
        },
        |engine, _| {
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "{:.1} tok/s | running {} waiting {}",
                engine.stats().generated_tokens as f64 / secs,
                engine.num_running(),
                engine.num_waiting()
            ));
        },
    );
    bar.finish_and_clear();
    let outcome = outcome?;
    let counts = Counts {
        input: total_input,
        skipped,
        invalid: invalid.len(),
    };
    print_summary(&engine, &outcome, &counts, kv_budget);
    if cancel.load(Ordering::SeqCst) {
        eprintln!(
            "interrupted: {} finished, {} cancelled, {} not started; run again with --resume to complete",
            outcome.finished, outcome.cancelled, outcome.not_started
        );
        std::process::exit(130);
    }
    Ok(())
}

fn check_flags(args: &BatchGenerateArgs) -> Result<()> {
    args.kv.options(&args.model).validate()?;
    args.sampling.validate()?;
    if args.sampling.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.raw && args.system.is_some() {
        bail!("--raw uses no chat template, so it cannot take --system");
    }
    if args.resume && args.output.is_none() {
        bail!("--resume needs --output FILE (it reads the ids already written there)");
    }
    Ok(())
}

/// The input's bytes (decoded line by line later, so a bad byte names its line).
fn read_input(spec: &str) -> Result<(String, Vec<u8>)> {
    if spec == "-" {
        let mut s = Vec::new();
        std::io::stdin()
            .read_to_end(&mut s)
            .context("reading prompts from standard input")?;
        return Ok(("<stdin>".into(), s));
    }
    let bytes = std::fs::read(spec).with_context(|| format!("cannot read {spec}"))?;
    Ok((spec.to_string(), bytes))
}

/// Without --skip-invalid the first bad line stops the run before anything is generated.
fn refuse_invalid(args: &BatchGenerateArgs, name: &str, invalid: &[InvalidLine]) -> Result<()> {
    if args.skip_invalid {
        return Ok(());
    }
    if let Some(e) = invalid.iter().min_by_key(|e| e.line) {
        let more = match invalid.len() {
            1 => String::new(),
            n => format!(
                " ({} more invalid lines; --skip-invalid writes error records instead)",
                n - 1
            ),
        };
        bail!("{name}:{}: {}{more}", e.line, e.error);
    }
    Ok(())
}

/// An error record: the line's own id if it has one no valid line has (else null), its line
/// number and the digest of its text, which is what `--resume` keys it by.
fn error_record(e: &InvalidLine, hash: Option<&str>) -> Value {
    json!({
        "id": e.id.clone().unwrap_or(Value::Null),
        "line": e.line,
        "line_hash": hash,
        "finish_reason": "error",
        "error": e.error,
    })
}

/// The input, read and parsed: every line's digest, its valid requests and its broken lines.
struct Input {
    name: String,
    hashes: Vec<String>,
    records: Vec<InputRecord>,
    invalid: Vec<InvalidLine>,
}

fn read_records(args: &BatchGenerateArgs) -> Result<Input> {
    let (name, bytes) = read_input(&args.input)?;
    let hashes = line_hashes(&bytes);
    let (text, mut invalid) = decode_input(&bytes);
    let mut records: Vec<InputRecord> = Vec::new();
    for p in parse_input(&text, args.input_format) {
        match p {
            Ok(r) => records.push(r),
            Err(e) => invalid.push(e),
        }
    }
    // A broken line's record never carries the id of a valid line (one id, one request).
    let valid_ids: HashSet<String> = records.iter().map(|r| id_key(&r.id)).collect();
    for e in &mut invalid {
        if e.id
            .as_ref()
            .is_some_and(|id| valid_ids.contains(&id_key(id)))
        {
            e.id = None;
        }
    }
    Ok(Input {
        name,
        hashes,
        records,
        invalid,
    })
}

/// Files this run reads that are known before the model loads: the input, and what --model
/// and --tokenizer name (the rest is checked once the model has loaded).
fn inputs_before_load(args: &BatchGenerateArgs) -> Vec<(&'static str, PathBuf)> {
    let mut read = model_inputs(&args.model);
    if args.input != "-" {
        read.push(("the input file", PathBuf::from(&args.input)));
    }
    read
}

/// With --resume: drops the requests the output already answers (by id) and the lines whose
/// error record is for the line as it is now (by number and digest; a line fixed since runs).
/// Returns how many were dropped.
fn skip_done(
    done: &HashSet<String>,
    hashes: &[String],
    records: &mut Vec<InputRecord>,
    invalid: &mut Vec<InvalidLine>,
) -> usize {
    let hash = |line: usize| hashes.get(line.wrapping_sub(1)).map(String::as_str);
    let before = records.len() + invalid.len();
    records.retain(|r| {
        !done.contains(&id_key(&r.id)) && !done.contains(&line_key(r.line, hash(r.line)))
    });
    // A line still broken as it was is not reported again.
    invalid.retain(|e| {
        !done.contains(&line_key(e.line, hash(e.line))) && !done.contains(&line_key(e.line, None))
    });
    before - records.len() - invalid.len()
}

/// Bytes of main-pool blocks to allocate: the --kv-memory budget (less the dense staging pool
/// of --quantized-kv-start, which the budget includes), or by default room for --max-batch of
/// the longest request, capped at half the available memory but never below one longest
/// request. A budget that cannot hold the longest request, or that the machine does not have,
/// is refused. The layer groups share the bytes by what a longest request holds in each.
fn budget_bytes(
    args: &BatchGenerateArgs,
    probe: &crate::kv::cache::CacheConfig,
    longest: usize,
) -> Result<usize> {
    let one_blocks = probe.max_blocks_for(longest, args.prefill_chunk);
    let one = group_bytes(probe, &one_blocks);
    PoolBudget {
        kv_memory: args.kv_memory,
        one_blocks,
        one_tokens: longest,
        one_what: "the longest request",
        want: one
            .saturating_add(probe.bytes_per_block())
            .saturating_mul(args.max_batch),
        floor: one,
        share: 2,
        sequences: args.max_batch,
    }
    .bytes(probe)
}

/// Tokenizes every request and opens the prompt caches they name; a request that cannot run
/// goes to `invalid` with its line.
fn build_requests(
    args: &BatchGenerateArgs,
    loaded: &LoadedModel,
    records: Vec<InputRecord>,
    probe: &crate::kv::cache::CacheConfig,
    invalid: &mut Vec<InvalidLine>,
) -> Result<Vec<(usize, BatchRequest, Option<CachedPrefix>)>> {
    // The weights are fingerprinted only when some request names a prompt cache.
    let identity = if records.iter().any(|r| r.prompt_cache.is_some()) {
        Some(loaded.identity()?)
    } else {
        None
    };
    let mut cache_files = CacheFiles::default();
    let mut requests = Vec::new();
    for r in records {
        let built = build_request(args, loaded, &r).and_then(|b| {
            let prefix = match (&r.prompt_cache, &identity) {
                (Some(path), Some(id)) => {
                    Some(cache_files.prefix_for(path, &b.request.prompt, id, probe)?)
                }
                _ => None,
            };
            Ok((b, prefix))
        });
        match built {
            Ok((b, prefix)) => requests.push((r.line, b, prefix)),
            Err(e) => invalid.push(InvalidLine {
                line: r.line,
                id: Some(r.id.clone()),
                error: crate::cli::one_line(&e),
            }),
        }
    }
    Ok(requests)
}

/// Tokenizes one request and merges its overrides into the command-line defaults.
fn build_request(
    args: &BatchGenerateArgs,
    m: &LoadedModel,
    r: &InputRecord,
) -> Result<BatchRequest> {
    let raw = r.raw.unwrap_or(args.raw);
    let prompt = match &r.prompt {
        PromptSpec::Text(t) if raw => m.tokenizer.encode(t, true)?,
        PromptSpec::Text(t) => {
            let mut msgs = Vec::new();
            if let Some(s) = &args.system {
                msgs.push(Message::new("system", s.clone()));
            }
            msgs.push(Message::new("user", t.clone()));
            m.encode_chat(&msgs)?
        }
        PromptSpec::Messages(_) if raw => {
            bail!("\"raw\" uses no chat template, so it cannot take \"messages\"")
        }
        PromptSpec::Messages(msgs) => m.encode_chat(msgs)?,
    };
    let mut params = args.sampling.params();
    if let Some(t) = r.temperature {
        if !(t.is_finite() && t >= 0.0) {
            bail!("\"temperature\" must be a number ≥ 0, 0 = greedy (got {t})");
        }
        params.temperature = t;
    }
    if let Some(p) = r.top_p {
        super::args::check_top_p(p, "\"top_p\"")?;
        params.top_p = (p < 1.0).then_some(p);
    }
    if let Some(k) = r.top_k {
        params.top_k = (k > 0).then_some(k);
    }
    if let Some(s) = r.seed {
        params.seed = s;
    }
    params.validate()?;
    let max_tokens = r.max_tokens.unwrap_or(args.sampling.max_tokens);
    if max_tokens == 0 {
        bail!("\"max_tokens\" must be at least 1");
    }
    Ok(BatchRequest {
        id: r.id.clone(),
        request: Request {
            prompt,
            params,
            max_tokens,
            eos: m.tokenizer.eos_token_ids().to_vec(),
        },
        stop: r.stop.clone().unwrap_or_else(|| args.sampling.stop.clone()),
    })
}

/// First Ctrl-C: stop admitting and end the running requests; second: leave at once.
fn install_ctrl_c(flag: Arc<AtomicBool>) -> Result<()> {
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted again: exiting now");
            std::process::exit(130);
        }
        eprintln!(
            "\nCtrl-C: stopping; finished results are written, running ones marked cancelled"
        );
    })
    .context("cannot install the Ctrl-C handler")
}

fn progress_bar(args: &BatchGenerateArgs, total: usize) -> ProgressBar {
    super::counter_bar(total, args.no_progress, "requests")
}

struct Counts {
    input: usize,
    skipped: usize,
    invalid: usize,
}

/// Prefilled prompt tokens, and those taken from prompt caches if any.
fn prompt_tokens(s: &crate::engine::stats::Stats) -> String {
    match s.cached_tokens {
        0 => s.prompt_tokens.to_string(),
        c => format!("{} (+{c} from prompt caches)", s.prompt_tokens),
    }
}

fn print_summary(engine: &Engine, o: &BatchOutcome, c: &Counts, kv_budget: usize) {
    let s = engine.stats();
    let wall = o.wall_seconds.max(1e-9);
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["batch-generate", "value"]);
    let mut requests = format!("{} finished", o.finished);
    if o.cancelled + o.not_started > 0 {
        requests += &format!(", {} cancelled, {} not started", o.cancelled, o.not_started);
    }
    if c.invalid > 0 {
        requests += &format!(", {} invalid", c.invalid);
    }
    if c.skipped > 0 {
        requests += &format!(", {} already done (--resume)", c.skipped);
    }
    requests += &format!(" of {}", c.input);
    let rows: Vec<(&str, String)> = vec![
        ("requests", requests),
        ("prompt tokens", prompt_tokens(s)),
        ("prefill tok/s", format!("{:.1}", s.prompt_tps())),
        ("generated tokens", s.generated_tokens.to_string()),
        ("decode tok/s", format!("{:.1}", s.decode_tps())),
        (
            "total tok/s (prompt + generated)",
            format!(
                "{:.1}",
                (s.prompt_tokens + s.generated_tokens) as f64 / wall
            ),
        ),
        (
            "generated tok/s (wall)",
            format!("{:.1}", s.generated_tokens as f64 / wall),
        ),
        ("wall time", format!("{:.2} s", o.wall_seconds)),
        ("KV bytes (peak)", fmt_bytes(engine.cache().peak_bytes())),
        ("KV budget", fmt_bytes(kv_budget)),
        (
            "peak memory (RSS)",
            peak_rss_bytes()
                .map(|b| fmt_bytes(b as usize))
                .unwrap_or_else(|| "n/a".into()),
        ),
    ];
    for (k, v) in rows {
        t.add_row(vec![k.to_string(), v]);
    }
    eprintln!("{t}");
}
