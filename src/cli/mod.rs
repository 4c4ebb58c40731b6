//! The command line: one file per subcommand plus the shared flag groups in `args`.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

pub mod args;
pub mod batch_generate;
pub mod bench_batch;
pub mod bench_kv_cache;
pub mod generate;
pub mod kv_budget;
pub mod output_file;
pub mod perplexity;
pub mod prompt_cache;
pub mod serve;

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

/// Writes `text` to standard output and flushes it. A closed pipe or a full disk is an error
/// (one line, exit 1), never a panic as `println!` would give.
pub fn print_out(text: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to standard output")
}

/// A progress bar on stderr counting `unit` (e.g. "requests") up to `total`, with a message
/// slot for rates; drawn nowhere when `hidden`.
pub(crate) fn counter_bar(total: usize, hidden: bool, unit: &str) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let target = if hidden {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let bar = ProgressBar::with_draw_target(Some(total as u64), target);
    let template = format!("{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit} | {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
