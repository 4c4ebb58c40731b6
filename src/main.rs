//! kvq: parse the command line and dispatch; everything else lives in the library.

use clap::{Parser, Subcommand};
use kvq::cli;

#[derive(Parser, Debug)]
#[command(name = "kvq", version, about = "LLM generation with a quantized, paged KV cache", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text for one prompt, streamed to stdout.
    Generate(Box<cli::generate::GenerateArgs>),
    /// Generate for many prompts from a file (continuous batching); one JSON line per request.
    BatchGenerate(Box<cli::batch_generate::BatchGenerateArgs>),
    /// Prompt and decode throughput of B sequences decoded together (llama-batched-bench's
    /// table for kvq).
    BenchBatch(Box<cli::bench_batch::BenchBatchArgs>),
    /// Memory, compression, error and latency of f16 vs quantized KV caches.
    BenchKvCache(cli::bench_kv_cache::BenchKvCacheArgs),
    /// Perplexity of a text, and KL divergence / same-top-1 of quantized KV caches against the
    /// dense cache.
    Perplexity(Box<cli::perplexity::PerplexityArgs>),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming),
    /// with continuous batching and the same KV options as generate.
    Serve(Box<cli::serve::ServeArgs>),
}

fn main() {
    // A bug must still end in one readable line, not a Rust panic dump.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {l}"))
            .unwrap_or_default();
        eprintln!("error: internal error (a bug in kvq, please report it): {msg}{at}");
    }));
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate(a) => cli::generate::run(a),
        Command::BatchGenerate(a) => cli::batch_generate::run(a),
        Command::BenchBatch(a) => cli::bench_batch::run(a),
        Command::BenchKvCache(a) => cli::bench_kv_cache::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
        Command::Serve(a) => cli::serve::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", cli::one_line(&e));
        std::process::exit(1);
    }
}
