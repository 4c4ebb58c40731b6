//! `kvq bench-batch`: llama.cpp's `llama-batched-bench` for kvq — prompt and decode speed of B
//! sequences of PP prompt tokens generating TG tokens each, on the engine `generate`,
//! `batch-generate` and `serve` use, with the same columns, so the two are compared like with
//! like. The measurement itself lives in `bench::batch`.

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
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};

use super::args::{DeviceArgs, KvArgs, ModelArgs};
use crate::bench::batch::{self, Row, Shape};
use crate::engine::stats::{fmt_bytes, peak_rss_bytes};
use crate::kv::cache::{KvOptions, PagedKvCache, PoolSizing};
use crate::model::load::load;

/// Definitions printed under the table and in --help.
const COLUMNS_NOTE: &str = "PP prompt tokens per sequence, TG generated tokens per sequence, B \
sequences, N_KV = B*(PP+TG) cache tokens; T_PP/T_TG seconds of the prompt/decode steps (all \
prompts are prefilled before any sequence decodes; every step ends with the sampled token ids on \
the host), S_PP = B*PP/T_PP, S_TG = B*TG/T_TG, T = T_PP+T_TG, S = N_KV/T (llama-batched-bench's \
definitions)";

/// Prompt and decode throughput of B sequences decoded together (llama-batched-bench's table).
///
/// Every combination of --npp, --ntg and --npl is run on a fresh cache: B requests of exactly PP
/// synthetic token ids, prefilled first, then decoded TG steps together with greedy sampling,
/// end-of-sequence ignored. PP prompt tokens per sequence, TG generated tokens per sequence, B
/// sequences, N_KV = B*(PP+TG); T_PP / T_TG are the seconds of the prompt / decode steps (host
/// work and sampling included), S_PP = B*PP/T_PP, S_TG = B*TG/T_TG, T = T_PP+T_TG, S = N_KV/T.
/// KV is the cache's bytes holding those tokens; peak memory is the GPU's memory in use (the
/// whole device) or, on the CPU, the process's peak resident memory.
#[derive(Args, Debug, Clone)]
pub struct BenchBatchArgs {
    /// Prompt tokens per sequence (comma-separated list, e.g. 512,4096).
    #[arg(long, default_value = "512", value_name = "LIST")]
    pub npp: String,

    /// Tokens generated per sequence (comma-separated list).
    #[arg(long, default_value = "128", value_name = "LIST")]
    pub ntg: String,

    /// Sequences decoded together (comma-separated list, e.g. 1,8,32,64).
    #[arg(long, default_value = "1,8", value_name = "LIST")]
    pub npl: String,

    /// Most prompt tokens per forward pass while prefilling (llama.cpp's n_batch).
    #[arg(long, default_value_t = 2048, value_name = "N")]
    pub prefill_chunk: usize,

    /// Skip the untimed warm-up pass (a few tokens at the largest B) that loads and compiles
    /// the device kernels before the first timed shape.
    #[arg(long)]
    pub no_warmup: bool,

    /// Print one JSON object (config and one row per shape) instead of the table.
    #[arg(long)]
    pub json: bool,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub kv: KvArgs,
}

/// Parses `512,4096` for `flag`; each entry must be an integer ≥ `min`.
fn parse_list(flag: &str, s: &str, min: usize) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        match part.parse::<usize>() {
            Ok(n) if n >= min => out.push(n),
            Ok(n) => bail!("{flag} '{s}': {n} is below the minimum of {min}"),
            Err(_) => {
                bail!("{flag} '{s}': '{part}' is not a whole number (give a list like 1,8,32)")
            }
        }
    }
    Ok(out)
}

pub fn run(args: &BenchBatchArgs) -> Result<()> {
    let npp = parse_list("--npp", &args.npp, 1)?;
    let ntg = parse_list("--ntg", &args.ntg, 0)?;
    let npl = parse_list("--npl", &args.npl, 1)?;
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    args.kv.options(&args.model).validate()?;
    let device = args.device.open()?;
    let loaded = load(&args.model.options(), &device)?;
    let model = &loaded.model;
    let shapes = batch::shapes(&npp, &ntg, &npl);
    for &s in &shapes {
        batch::check_shape(model, s)?;
    }
    let kv = args.kv.options_for(&args.model, model);
    let run_one = |s: Shape| -> Result<Row> {
        let sizing = PoolSizing::Sequences {
            tokens: batch::cache_tokens(s),
            max_batch: s.pl,
            chunk: args.prefill_chunk,
        };
        let cfg = kv.cache_config(model.kv_shape(), model.dtype(), sizing)?;
        super::args::check_cache_memory(&cfg, model.device())?;
        let cache = PagedKvCache::new(cfg, model.device())?;
        batch::run_shape(model, cache, s, args.prefill_chunk, args.device.cuda_graphs)
    };
    if !args.no_warmup {
        let pl = npl.iter().copied().max().unwrap_or(1);
        let pp = npp.iter().copied().min().unwrap_or(1).min(16);
        run_one(Shape { pp, tg: 2, pl })?;
    }
    let kv_desc = kv_description(&kv, model);
    let dtype = format!("{:?}", model.dtype()).to_lowercase();
    let mut rows = Vec::new();
    if !args.json {
        super::print_out(&format!(
            "model: {} | device: {} | dtype: {dtype} | KV cache: {kv_desc} | prefill chunk: {}\n",
            loaded.description, args.device.device, args.prefill_chunk
        ))?;
    }
    for s in shapes {
        let row = run_one(s)?;
        if !args.json {
            eprintln!(
                "pp {} tg {} B {}: S_PP {:.1} t/s, S_TG {:.1} t/s",
                s.pp, s.tg, s.pl, row.speed_pp, row.speed_tg
            );
        }
        rows.push(row);
    }
    let peak_rss = peak_rss_bytes();
    if args.json {
        let widths = kv.quant_formats()?.map(|(k, v)| (k.bits(), v.bits()));
        let v = serde_json::json!({
            "config": {
                "model": loaded.description,
                "device": args.device.device,
                "dtype": dtype,
                "kv_cache": kv_desc,
                "kv_bits": args.kv.kv_bits.map(|b| b.json()),
                "kv_key_bits": widths.map(|w| w.0),
                "kv_value_bits": widths.map(|w| w.1),
                "kv_residual": kv.residual,
                "kv_sinks": kv.sinks,
                "kv_center": kv.center,
                "prefill_chunk": args.prefill_chunk,
                "peak_rss_bytes": peak_rss,
                "definitions": COLUMNS_NOTE,
            },
            "rows": rows,
        });
        super::print_out(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
    } else {
        let graphs: String = rows
            .iter()
            .filter_map(|r| {
                r.graph_kernels.map(|k| {
                    format!(
                        "PP {} B {}: {k} kernels per decode step, replayed as one CUDA graph.\n",
                        r.shape.pp, r.shape.pl
                    )
                })
            })
            .collect();
        super::print_out(&format!(
            "{}\n{COLUMNS_NOTE}.\n{graphs}",
            table(&rows, peak_rss)
        ))?;
    }
    Ok(())
}

/// "dense f16", "4-bit K / 3-bit V, group 64, rotated + 60 dense + 4 sinks, centred keys" and
/// the like, from the options the cache is made of.
fn kv_description(kv: &KvOptions, model: &crate::model::llama::Llama) -> String {
    match kv.quant_formats() {
        Ok(Some((k, v))) => format!(
            "{}-bit K / {}-bit V, group {}, {}{}",
            k.bits(),
            v.bits(),
            k.group_size(),
            kv.scheme_for(model.config().head_dim).name(),
            kv.window_label()
        ),
        _ => format!("dense {}", kv.dense_dtype.unwrap_or(model.dtype()).as_str()),
    }
}

fn table(rows: &[Row], peak_rss: Option<u64>) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s", "KV",
        "peak mem",
    ]);
    for r in rows {
        let peak = match (r.peak_device_bytes, peak_rss) {
            (Some(b), _) => format!("{} (GPU)", fmt_bytes(b as usize)),
            (None, Some(b)) => format!("{} (RSS)", fmt_bytes(b as usize)),
            (None, None) => "-".into(),
        };
        t.add_row(vec![
            r.shape.pp.to_string(),
            r.shape.tg.to_string(),
            r.shape.pl.to_string(),
            r.n_kv.to_string(),
            format!("{:.3}", r.t_pp),
            format!("{:.2}", r.speed_pp),
            format!("{:.3}", r.t_tg),
            format!("{:.2}", r.speed_tg),
            format!("{:.3}", r.t),
            format!("{:.2}", r.speed),
            fmt_bytes(r.kv_bytes),
            peak,
        ]);
    }
    for i in 0..10 {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::parse_list;

    #[test]
    fn lists_parse_and_refuse() {
        assert_eq!(parse_list("--npl", "1, 8,32", 1).unwrap(), vec![1, 8, 32]);
        assert_eq!(parse_list("--ntg", "0", 0).unwrap(), vec![0]);
        let e = parse_list("--npl", "1,0", 1).unwrap_err().to_string();
        assert!(e.contains("--npl") && e.contains("minimum"), "{e}");
        let e = parse_list("--npp", "512,x", 1).unwrap_err().to_string();
        assert!(e.contains("--npp") && e.contains("'x'"), "{e}");
        assert!(parse_list("--npp", "", 1).is_err());
    }
}
