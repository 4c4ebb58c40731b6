//! `kvq bench-kv-cache`: memory, compression, error and speed of quantized KV caches against the
//! dense cache, as a table (default), JSON (`--json`) or CSV (`--csv`).

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use crate::bench::kv_cache::{self, BenchConfig, Progress, Report};
use crate::cli::args::{DTypeArg, DeviceArgs};
use crate::kv::format::KvWidths;
use anyhow::{bail, Result};
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use indicatif::{ProgressBar, ProgressStyle};

/// Throughput note printed under the table and in --help.
const GBPS_NOTE: &str = "GB/s = (bytes read + bytes written) / median time, 1 GB = 1e9 B: quantize reads the \
dense K/V and writes codes+scales+biases, dequantize the reverse; memcpy copies the dense K/V (same threads/device, \
same run); ratios are against that memcpy";

/// Measure what a quantized KV cache costs and saves: memory, error, quantize/dequantize time.
///
/// Times are medians over --repeats of quantizing (resp. dequantizing) K and V of every layer,
/// device-synchronised. GB/s = (bytes read + bytes written) / time (1 GB = 1e9 B); the baseline
/// row's GB/s is a copy of the dense K/V measured in the same run, and each quantized row shows
/// quantize / dequantize GB/s and their ratio to that copy.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchKvCacheArgs {
    /// Transformer layers (each has one K and one V tensor).
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// Tokens per sequence: one length, or a comma-separated list (e.g. 1024,4096,16384). The
    /// memory/quantize table uses the first; the decode-attention table measures every one.
    #[arg(long, default_value = "512", value_name = "LIST")]
    pub seq_len: String,
    /// Query heads per KV head (grouped-query attention) in the attention measurement.
    #[arg(long, default_value_t = 4)]
    pub gqa: usize,
    /// Tokens per cache block in the attention measurement (blocks are handed out shuffled).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Decode-attention step: this many layers (each with its own cache pool) run back to back
    /// and are synchronised once; the time shown is per layer. 1 = one call, synchronised alone
    /// (host launch latency included); more = what a layer costs inside a decode step, where
    /// the next layer's launch overlaps this one's work.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub attn_layers: usize,
    /// Skip the decode-attention measurement.
    #[arg(long)]
    pub no_attention: bool,
    /// Also measure the rotated scheme (randomized Hadamard, as `--kv-quant-scheme rotated`)
    /// in the attention table: query rotation and output un-rotation included in its time.
    /// Needs a power-of-two --head-dim.
    #[arg(long)]
    pub rotated: bool,
    /// Also time each quantized setting with a dense residual window (as `--kv-residual N`):
    /// a whole cache of --attn-layers layers, each sequence's newest N positions attended
    /// through f16 copies, the rest through the quantized rows, merged (CPU and CUDA). 0 = off.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub residual: usize,
    /// With --residual: also the first S positions through f16 copies (as `--kv-sinks S`).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub sinks: usize,
    /// With --residual: keys stored centred (as `--kv-center`).
    #[arg(long)]
    pub center: bool,
    /// KV heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// Head dimension (a multiple of --group-size).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Sequences.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Comma-separated settings, one table row each: a bit width for K and V (2, 3, 4, 5, 6,
    /// 8), an average as `--kv-bits` takes it (2.5, 3.5, 4.5, 5.5: keys one bit wider than
    /// values, 4.5 = K5/V4), or KEY/VALUE widths (e.g. 6/4).
    #[arg(long, default_value = "8,4", value_name = "LIST")]
    pub bits: String,
    /// Values per scale/bias group (allowed: 32, 64, 128).
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
    /// dtype of the dense cache and of the scales/biases.
    #[arg(long, value_enum, default_value = "f16")]
    pub dtype: DTypeArg,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Seed of the N(0,1) K/V data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Untimed runs before the timed ones.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed runs; times are their medians.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Print one JSON object instead of the table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print CSV (one header line, one line per row) instead of the table.
    #[arg(long)]
    pub csv: bool,
}

/// Parses `1024,4096` into context lengths; rejects empty or non-numeric entries.
fn parse_seq_lens(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|part| {
            let part = part.trim();
            part.parse::<usize>().map_err(|_| {
                anyhow::anyhow!(
                    "--seq-len '{s}': '{part}' is not a token count (give e.g. 1024,4096)"
                )
            })
        })
        .collect()
}

/// What `--bits` entries may be, for messages.
const BITS_ALLOWED: &str =
    "allowed: 2, 3, 4, 5, 6, 8, the averages 2.5, 3.5, 4.5, 5.5, or KEY/VALUE like 6/4";

/// Parses `8,4.5,6/4` into settings; rejects empty or malformed entries (widths are checked
/// against the formats by [`BenchConfig::validate`]).
fn parse_bits(s: &str) -> Result<Vec<KvWidths>> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            bail!("--bits '{s}': empty entry (give a list like 8,4; {BITS_ALLOWED})");
        }
        match KvWidths::parse_pair(part) {
            Ok(w) => out.push(w),
            Err(_) => bail!("--bits '{s}': '{part}' is not a bit width ({BITS_ALLOWED})"),
        }
    }
    Ok(out)
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn start(&self, total: u64) {
        self.0.set_length(total);
    }
    fn step(&self, msg: &str) {
        self.0.set_message(msg.to_string());
        self.0.inc(1);
    }
}

pub fn run(args: &BenchKvCacheArgs) -> Result<()> {
    let seq_lens = parse_seq_lens(&args.seq_len)?;
    let cfg = BenchConfig {
        layers: args.layers,
        attn_layers: args.attn_layers,
        seq_len: seq_lens.first().copied().unwrap_or_default(),
        seq_lens: if args.no_attention {
            Vec::new()
        } else {
            seq_lens
        },
        gqa: args.gqa,
        block_size: args.block_size,
        heads: args.heads,
        head_dim: args.head_dim,
        batch: args.batch,
        bits: parse_bits(&args.bits)?,
        group_size: args.group_size,
        dtype: args.dtype.dtype(),
        seed: args.seed,
        warmup: args.warmup,
        repeats: args.repeats,
        rotated: args.rotated,
        residual: args.residual,
        sinks: args.sinks,
        center: args.center,
    };
    cfg.validate()?;
    let device = args.device.open()?;
    let bar = ProgressBar::new(0);
    if let Ok(style) = ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    let report = kv_cache::run(&cfg, &device, &Bar(bar.clone()));
    bar.finish_and_clear();
    let report = report?;
    let text = if args.json {
        format!("{}\n", serde_json::to_string_pretty(&json(&report)?)?)
    } else if args.csv {
        csv(&report)
    } else {
        let mut t = format!("{}\n{}\n{GBPS_NOTE}.\n", header(&report), table(&report));
        if !report.attention.is_empty() {
            t += &format!("\n{}\n{}\n", attn_header(&report), attn_table(&report));
        }
        t
    };
    super::print_out(&text)
}

/// `{"config": {...}, "rows": [...]}`: the run's settings plus device, threads and memcpy figures
/// in `config`.
fn json(r: &Report) -> Result<serde_json::Value> {
    let mut config = serde_json::to_value(&r.config)?;
    let extra = serde_json::json!({
        "device": r.device,
        "threads": r.threads,
        "values": r.config.values(),
        "memcpy_ms": r.memcpy_ms,
        "memcpy_gbps": r.memcpy_gbps,
        "gbps_definition": GBPS_NOTE,
    });
    if let (Some(c), serde_json::Value::Object(e)) = (config.as_object_mut(), extra) {
        c.extend(e);
    }
    Ok(serde_json::json!({ "config": config, "rows": r.rows, "attention": r.attention }))
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn header(r: &Report) -> String {
    let c = &r.config;
    format!(
        "KV cache: {} layers x {} tokens x {} heads x head_dim {} x batch {}, K and V = {} values of {} \
         (scales/biases {}), group {}; device {} ({} threads); medians of {} runs after {} warm-up",
        c.layers,
        c.seq_len,
        c.heads,
        c.head_dim,
        c.batch,
        c.values(),
        c.dtype.as_str(),
        c.dtype.as_str(),
        c.group_size,
        r.device,
        r.threads,
        c.repeats,
        c.warmup
    )
}

fn table(r: &Report) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "Mode",
        "Memory",
        "Compression",
        "Bits/value",
        "Mean Err",
        "Max Err",
        "Quantize",
        "Dequantize",
        "GB/s",
    ]);
    for row in &r.rows {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2} ms"));
        let gbps = match (row.quantize_gbps, row.dequantize_gbps) {
            (Some(q), Some(d)) => format!(
                "{q:.1} / {d:.1} ({:.2}x / {:.2}x memcpy)",
                q / r.memcpy_gbps,
                d / r.memcpy_gbps
            ),
            _ => format!("{:.1} (memcpy {:.2} ms)", row.gbps, r.memcpy_ms),
        };
        t.add_row([
            row.mode.clone(),
            mib(row.bytes),
            format!("{:.2}x", row.compression),
            format!("{:.2}", row.bits_per_value),
            format!("{:.5}", row.mean_error),
            format!("{:.5}", row.max_error),
            ms(row.quantize_ms),
            ms(row.dequantize_ms),
            gbps,
        ]);
    }
    for i in 1..9 {
        if let Some(col) = t.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

fn attn_header(r: &Report) -> String {
    let c = &r.config;
    format!(
        "Decode attention, time per layer of a step of {} layer(s) run back to back: batch {} x {} query heads ({} KV heads, GQA {}) x head_dim {}, \
         blocks of {} tokens {}; cache {} (scales/biases {}), group {}; device {} ({} threads); \
         medians of {} runs after {} warm-up; error = max |out - dense out|; GB/s = K+V bytes of the context / time",
        c.attn_layers,
        c.batch,
        c.heads * c.gqa,
        c.heads,
        c.gqa,
        c.head_dim,
        c.block_size,
        if c.residual > 0 {
            "in a whole KV cache's order (--residual: every row through the cache's attention)"
        } else {
            "in shuffled order"
        },
        c.dtype.as_str(),
        c.dtype.as_str(),
        c.group_size,
        r.device,
        r.threads,
        c.repeats,
        c.warmup
    )
}

fn attn_table(r: &Report) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "Context",
        "Mode",
        "Time",
        "Speedup vs dense",
        "Max Err",
        "K+V read",
        "GB/s",
    ]);
    for a in &r.attention {
        t.add_row([
            a.seq_len.to_string(),
            a.mode.clone(),
            format!("{:.3} ms", a.ms),
            format!("{:.2}x", a.speedup_vs_dense),
            format!("{:.5}", a.max_abs_error),
            mib(a.kv_bytes),
            format!("{:.1}", a.kv_gbps),
        ]);
    }
    for i in [0, 2, 3, 4, 5, 6] {
        if let Some(col) = t.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// A setting in the CSV's `bits` column: the width, or the average as `--kv-bits` names it
/// (the mode column says which widths).
fn csv_bits(w: KvWidths) -> String {
    w.json().to_string()
}

/// The table's rows, then (if measured) a blank line and the attention rows with their own header.
fn csv(r: &Report) -> String {
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
    let mut out = String::from(
        "mode,bits,bytes,compression,bits_per_value,mean_error,max_error,quantize_ms,dequantize_ms,gbps,\
         quantize_gbps,dequantize_gbps,memcpy_gbps\n",
    );
    for row in &r.rows {
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            row.mode,
            row.bits.map_or(String::new(), csv_bits),
            row.bytes,
            row.compression,
            row.bits_per_value,
            row.mean_error,
            row.max_error,
            opt(row.quantize_ms),
            opt(row.dequantize_ms),
            row.gbps,
            opt(row.quantize_gbps),
            opt(row.dequantize_gbps),
            r.memcpy_gbps
        ));
    }
    if !r.attention.is_empty() {
        out.push_str("\nseq_len,mode,bits,ms,speedup_vs_dense,max_abs_error,kv_bytes,kv_gbps\n");
        for a in &r.attention {
            out.push_str(&format!(
                "{},{},{},{},{},{},{},{}\n",
                a.seq_len,
                a.mode,
                a.bits.map_or(String::new(), csv_bits),
                a.ms,
                a.speedup_vs_dense,
                a.max_abs_error,
                a.kv_bytes,
                a.kv_gbps
            ));
        }
    }
    out
}
