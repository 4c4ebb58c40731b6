//! `kvq generate`: one prompt, streamed to stdout; statistics (or `--json`) at the end.
//!
//! This is the batch engine with a single request: the same scheduler, cache and model code
//! that `batch-generate` drives.

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
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::args::{DeviceArgs, KvArgs, ModelArgs, SamplingArgs};
use super::output_file::{check_new_file, model_files, model_inputs};
use super::prompt_cache::{check_can_save, write as write_prompt_cache, CacheFiles};
use crate::engine::request::{Event, FinishReason, Request};
use crate::engine::scheduler::{Engine, EngineConfig};
use crate::engine::stats::{fmt_bytes, peak_rss_bytes, Stats};
use crate::engine::text_stream::TextStream;
use crate::kv::cache::prompt_file::ModelIdentity;
use crate::kv::cache::{PagedKvCache, PoolSizing, SeqId};
use crate::model::chat::{read_messages, Message};
use crate::model::load::{load, LoadedModel};

/// Prompt tokens per forward pass (bounds prefill's attention scratch memory).
const PREFILL_CHUNK: usize = 512;

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt (a user message, rendered with the model's chat template unless --raw).
    #[arg(value_name = "PROMPT")]
    pub prompt: Option<String>,

    /// Read the prompt from FILE (`-`: standard input) instead of PROMPT: for prompts longer
    /// than a command line can hold. Used as is (one trailing newline dropped).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,

    /// Use the prompt as plain text: no chat template, no system message.
    #[arg(long)]
    pub raw: bool,

    /// System message for the chat template (replaces the template's default one).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,

    /// A whole conversation: a JSON array of {"role", "content"} objects (instead of PROMPT).
    #[arg(long, value_name = "FILE")]
    pub messages: Option<PathBuf>,

    /// Print one JSON object (prompt and generated token ids, text, finish reason, stats)
    /// instead of streaming text and statistics.
    #[arg(long)]
    pub json: bool,

    /// Start from a prompt cache (written by --save-prompt-cache): the K/V of the longest
    /// common prefix of its tokens and this prompt are loaded as stored, only the rest is
    /// prefilled. Refused if it was made by other weights or stores another KV format.
    #[arg(long, value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,

    /// Write the prompt's K/V, exactly as the cache stores it (quantized stays quantized), with
    /// its token ids and the model's fingerprint to FILE (safetensors) once the prompt is
    /// prefilled.
    #[arg(long, value_name = "FILE")]
    pub save_prompt_cache: Option<PathBuf>,

    /// Let --save-prompt-cache replace an existing file (never the model, a device or a FIFO).
    #[arg(long, requires = "save_prompt_cache")]
    pub force: bool,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    #[command(flatten)]
    pub kv: KvArgs,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let with_file;
    let args = match &args.prompt_file {
        Some(path) => {
            if args.prompt.is_some() {
                bail!("give either a PROMPT or --prompt-file, not both");
            }
            with_file = GenerateArgs {
                prompt: Some(read_prompt_file(path)?),
                ..args.clone()
            };
            &with_file
        }
        None => args,
    };
    check_flags(args)?;
    let device = args.device.open()?;
    let loaded = load(&args.model.options(), &device)?;
    let prompt = prompt_ids(args, &loaded)?;
    let out = generate(args, &loaded, prompt)?;
    if args.json {
        super::print_out(&format!("{}\n", serde_json::to_string(&out.json())?))?;
    } else {
        print_stats(&out);
    }
    Ok(())
}

/// The text of --prompt-file (`-`: standard input), one trailing newline dropped.
fn read_prompt_file(path: &Path) -> Result<String> {
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read the prompt from standard input")?;
    } else {
        text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "--prompt-file {}: cannot read it as UTF-8 text",
                path.display()
            )
        })?;
    }
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// Conflicting or empty inputs, refused before anything is loaded.
fn check_flags(args: &GenerateArgs) -> Result<()> {
    args.kv.options(&args.model).validate()?;
    args.sampling.validate()?;
    if args.sampling.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    match (&args.prompt, &args.messages) {
        (Some(_), Some(_)) => bail!("give either a PROMPT or --messages, not both"),
        (None, None) => bail!("no prompt: give PROMPT, --prompt-file FILE or --messages FILE"),
        (Some(p), None) if p.trim().is_empty() => bail!("the prompt is empty"),
        _ => {}
    }
    if args.raw && (args.system.is_some() || args.messages.is_some()) {
        bail!("--raw uses no chat template, so it cannot take --system or --messages");
    }
    if args.system.is_some() && args.messages.is_some() {
        bail!("--system conflicts with --messages (put the system message in the file)");
    }
    Ok(())
}

/// Renders (or not) and tokenizes the prompt.
fn prompt_ids(args: &GenerateArgs, m: &LoadedModel) -> Result<Vec<u32>> {
    if args.raw {
        let text = args.prompt.as_deref().unwrap_or_default();
        return m.tokenizer.encode(text, true);
    }
    let mut messages = Vec::new();
    if let Some(path) = &args.messages {
        messages = read_messages(path)?;
    } else {
        if let Some(s) = &args.system {
            messages.push(Message::new("system", s.clone()));
        }
        messages.push(Message::new(
            "user",
            args.prompt.clone().unwrap_or_default(),
        ));
    }
    m.encode_chat(&messages)
}

struct Output {
    prompt: Vec<u32>,
    /// Prompt tokens taken from --prompt-cache.
    cached: usize,
    tokens: Vec<u32>,
    text: String,
    finish: FinishReason,
    stats: Stats,
    kv_bytes: usize,
    kv_bytes_per_token: usize,
    /// The sequence's f16 copies of its newest and first rows (`--kv-residual`, `--kv-sinks`):
    /// a fixed size beside the blocks.
    kv_window_bytes: usize,
    /// Per layer group: its window, layer count, most bytes held after a step, bytes per token.
    kv_groups: Vec<(Option<usize>, usize, usize, usize)>,
    peak_memory: Option<u64>,
}

impl Output {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish,
            "stats": {
                "prompt_tokens": self.stats.prompt_tokens,
                "cached_tokens": self.cached,
                "prompt_tps": self.stats.prompt_tps(),
                "generated_tokens": self.stats.generated_tokens,
                "decode_tps": self.stats.decode_tps(),
                "prefill_seconds": self.stats.prefill_seconds,
                "decode_seconds": self.stats.decode_seconds,
                "kv_bytes": self.kv_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_window_bytes": self.kv_window_bytes,
                "kv_groups": self.kv_groups.iter().map(|&(window, layers, bytes, per_token)| {
                    serde_json::json!({
                        "window": window,
                        "layers": layers,
                        "kv_bytes": bytes,
                        "kv_bytes_per_token": per_token,
                    })
                }).collect::<Vec<_>>(),
                "peak_memory_bytes": self.peak_memory,
            }
        })
    }
}

/// A generation under way: the engine holding the one request, how many prompt tokens came from
/// --prompt-cache, and the model's identity when a prompt cache is read or written.
struct Started<'m> {
    engine: Engine<'m>,
    id: SeqId,
    cached: usize,
    identity: Option<ModelIdentity>,
    bytes_per_token: usize,
}

/// Sizes the cache for one sequence, checks --save-prompt-cache's path and reads
/// --prompt-cache's prefix, then queues the request.
fn start<'m>(args: &GenerateArgs, m: &'m LoadedModel, prompt: &[u32]) -> Result<Started<'m>> {
    let model = &m.model;
    let window = model.config().max_position_embeddings;
    crate::engine::request::check_fits(prompt.len(), window)?;
    let max_tokens = args.sampling.max_tokens;
    let lifetime = (prompt.len() + max_tokens).min(window);
    let sizing = PoolSizing::Sequences {
        tokens: lifetime,
        max_batch: 1,
        chunk: PREFILL_CHUNK,
    };
    let cfg = args.kv.options_for(&args.model, model).cache_config(
        model.kv_shape(),
        model.dtype(),
        sizing,
    )?;
    super::args::check_cache_memory(&cfg, model.device())?;
    let cache = PagedKvCache::new(cfg, model.device())?;
    let bytes_per_token = cache.config().bytes_per_token();
    let identity = if args.prompt_cache.is_some() || args.save_prompt_cache.is_some() {
        Some(m.identity()?)
    } else {
        None
    };
    if let Some(path) = &args.save_prompt_cache {
        let mut read = model_inputs(&args.model);
        read.extend(model_files(m));
        check_new_file("--save-prompt-cache", path, &read, args.force)?;
        check_can_save(cache.config(), prompt.len())?;
    }
    let prefix = match (&args.prompt_cache, &identity) {
        (Some(path), Some(id)) => {
            Some(CacheFiles::default().prefix_for(path, prompt, id, cache.config())?)
        }
        _ => None,
    };
    let cached = prefix.as_ref().map_or(0, |p| p.tokens);
    let mut engine = Engine::new(
        model,
        cache,
        EngineConfig {
            max_batch: 1,
            prefill_chunk: PREFILL_CHUNK,
            cuda_graphs: args.device.cuda_graphs,
        },
    )?;
    let request = Request {
        prompt: prompt.to_vec(),
        params: args.sampling.params(),
        max_tokens,
        eos: m.tokenizer.eos_token_ids().to_vec(),
    };
    let id = match prefix {
        Some(p) => engine.add_with_prefix(request, p)?,
        None => engine.add(request)?,
    };
    if let (Some(path), Some(_)) = (&args.prompt_cache, &identity) {
        if !args.json {
            eprintln!(
                "prompt cache: {cached} of {} prompt tokens from {}",
                prompt.len(),
                path.display()
            );
        }
    }
    if args.save_prompt_cache.is_some() {
        engine.keep_prompt_kv(id);
    }

    Ok(Started {
        engine,
        id,
        cached,
        identity,
        bytes_per_token,
    })
}

fn generate(args: &GenerateArgs, m: &LoadedModel, prompt: Vec<u32>) -> Result<Output> {
    let Started {
        mut engine,
        id,
        cached,
        identity,
        bytes_per_token,
    } = start(args, m, &prompt)?;
    let mut stream = TextStream::new(&m.tokenizer, args.sampling.stop.clone());
    let mut tokens = Vec::new();
    let mut printed = 0; // bytes of the text already on stdout
    let mut finish = FinishReason::Length;
    let print = |s: &str| -> Result<()> {
        if !args.json && !s.is_empty() {
            let mut lock = std::io::stdout().lock();
            lock.write_all(s.as_bytes())?;
            lock.flush()?;
        }
        Ok(())
    };
    let mut kv_bytes = 0;
    let mut group_bytes = vec![0; engine.cache().groups().len()];
    'run: while engine.has_work() {
        let events = engine.step()?;
        kv_bytes = kv_bytes.max(engine.cache().bytes_in_use());
        for (most, now) in group_bytes
            .iter_mut()
            .zip(engine.cache().group_bytes_in_use())
        {
            *most = (*most).max(now);
        }
        if let (Some(path), Some(ident)) = (&args.save_prompt_cache, &identity) {
            if let Some(kv) = engine.take_prompt_kv(id) {
                write_prompt_cache(path, m, ident, &prompt, &kv)?;
                if !args.json {
                    eprintln!(
                        "prompt cache: saved {} tokens to {}",
                        prompt.len(),
                        path.display()
                    );
                }
            }
        }
        for ev in events {
            match ev {
                Event::Token { id, token } => {
                    tokens.push(token);
                    let (out, stopped) = stream.push(token)?;
                    print(&out)?;
                    printed += out.len();
                    if stopped {
                        finish = FinishReason::Stop;
                        engine.finish(id);
                        break 'run;
                    }
                }
                Event::Finished { id, reason } => {
                    if reason == FinishReason::Error {
                        let why = engine.take_error(id).unwrap_or_default();
                        bail!("generation failed after {} tokens: {why}", tokens.len());
                    }
                    finish = reason
                }
            }
        }
    }
    // Whatever was held back (a partial character, a possible stop-string prefix) comes last.
    let text = stream.finish()?;
    print(&text[printed..])?;
    if !args.json && !text.ends_with('\n') {
        super::print_out("\n")?;
    }
    Ok(Output {
        prompt,
        cached,
        tokens,
        text,
        finish,
        stats: engine.stats().clone(),
        kv_bytes,
        kv_bytes_per_token: bytes_per_token,
        kv_window_bytes: engine.cache().config().residual_bytes(),
        kv_groups: engine
            .cache()
            .groups()
            .iter()
            .zip(group_bytes)
            .map(|(g, bytes)| {
                let per_token = engine.cache().config().group_bytes_per_token(g);
                (g.window, g.layers.len(), bytes, per_token)
            })
            .collect(),
        peak_memory: peak_rss_bytes(),
    })
}

fn print_stats(o: &Output) {
    let s = &o.stats;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | finish: {:?}",
        s.prompt_tokens,
        s.prompt_tps(),
        s.generated_tokens,
        s.decode_tps(),
        o.finish
    );
    let window = match o.kv_window_bytes {
        0 => String::new(),
        b => format!(" + {} of dense window copies", fmt_bytes(b)),
    };
    eprintln!(
        "KV cache: {} ({} per token){window} | peak memory: {}",
        fmt_bytes(o.kv_bytes),
        fmt_bytes(o.kv_bytes_per_token),
        o.peak_memory
            .map(|b| fmt_bytes(b as usize))
            .unwrap_or_else(|| "n/a".into())
    );
    if o.kv_groups.len() > 1 {
        let groups: Vec<String> = o
            .kv_groups
            .iter()
            .map(|&(window, layers, bytes, _)| {
                let kind = window.map_or("global".to_string(), |w| format!("{w}-token window"));
                format!("{kind} ({layers} layers) {}", fmt_bytes(bytes))
            })
            .collect();
        eprintln!("KV cache by layer group: {}", groups.join(", "));
    }
}
