//! The command line: one file per subcommand plus the shared flag groups in `args`.

pub mod args;
pub mod batch_generate;
pub mod bench_kv_cache;
pub mod generate;
pub mod perplexity;
pub mod prompt_cache;

/// An error as one line: each cause of the chain (first line only, so backtraces that candle
/// appends to its messages stay out), joined with ": ".
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let line = cause
            .to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        if !line.is_empty() && !parts.iter().any(|p| p.contains(&line)) {
            parts.push(line);
        }
    }
    parts.join(": ")
}
