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
    Generate(cli::generate::GenerateArgs),
    /// Memory, compression, error and latency of f16 vs quantized KV caches.
    BenchKvCache(cli::bench_kv_cache::BenchKvCacheArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate(a) => cli::generate::run(a),
        Command::BenchKvCache(a) => cli::bench_kv_cache::run(a),
    };
    if let Err(e) = result {
        // One line: the cause chain joined, no backtrace.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
