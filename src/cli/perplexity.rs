//! `kvq perplexity`: what a KV setting costs in quality — perplexity, and KL divergence, Δp and
//! same-top-1 against the dense cache — on a text file, one table row per setting.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Args;
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use indicatif::ProgressBar;
use std::path::PathBuf;
use std::time::Instant;

use super::args::{DeviceArgs, KvArgs, LoadFormat, ModelArgs};
use crate::bench::perplexity::{evaluate, Options, Report, Setting};
use crate::kv::cache::{KvOptions, PoolSizing, QuantScheme};
use crate::kv::format::KvWidths;
use crate::model::llama::Llama;
use crate::model::load::load;

/// Perplexity of a text with one or more KV cache settings, and how far each quantized setting
/// moves the model's predictions from the dense cache (KL divergence, Δp, same top-1).
///
/// The text is tokenized as is (no chat template, no BOS) and cut into non-overlapping windows
/// of --ctx tokens over its first --max-tokens tokens. Each window is a fresh sequence fed in
/// chunks of --chunk tokens through the same model and paged cache `generate` uses: K/V are
/// stored (quantized) before the chunk's queries attend, so quantization error accumulates as it
/// does while decoding. Every position but the last of a window scores the next token.
#[derive(Args, Debug, Clone)]
pub struct PerplexityArgs {
    /// A UTF-8 text file (e.g. ../shared/reference/corpus.txt).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,

    /// Tokens per window (each window is evaluated from position 0).
    #[arg(long, default_value_t = 2048, value_name = "N")]
    pub ctx: usize,

    /// Evaluate only the first N tokens of the text (then whole windows of --ctx).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,

    /// Tokens per forward pass inside a window.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub chunk: usize,

    /// KV settings to compare, comma-separated, the reference first: `f32`, `f16`, `bf16` (a
    /// dense cache of that dtype) or BITS[:affine|:rotated][:gG][:rN][:sS][:c][:exact], BITS being
    /// one width, an average as --kv-bits takes it (`3.5` = 4-bit K / 3-bit V) or KEY/VALUE
    /// widths (e.g. `4`, `4:affine`, `3:g32`, `6/4`, `3.5:r60:s4`; scheme, group, `rN`
    /// (--kv-residual N) and `sS` (--kv-sinks S) default to their flags; `:c` centres keys as
    /// --kv-center does; `:exact` attends as --exact-attention does). Bits per value count a residual window's dense rows over --ctx.
    /// Divergences are measured against the first entry; if it is not dense, a dense cache in
    /// the compute dtype is added in front (unless --quantized-reference). Without --compare: the
    /// dense cache and the setting given by --kv-bits (and the other KV flags).
    #[arg(long, value_name = "LIST")]
    pub compare: Option<String>,

    /// Measure divergences against the first --compare entry even when it is quantized (no
    /// dense cache in front): `--compare 4:exact,4` gives what the CPU's 8-bit passes (queries,
    /// softmax weights) cost against the exact kernel.
    #[arg(long, requires = "compare")]
    pub quantized_reference: bool,

    /// One JSON object on stdout instead of the table on stderr.
    #[arg(long)]
    pub json: bool,

    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub kv: KvArgs,
}

/// One entry of --compare.
#[derive(Debug, Clone, PartialEq)]
enum Spec {
    Dense(DType),
    Quant {
        /// Key bits and value bits.
        bits: (u32, u32),
        scheme: Option<QuantScheme>,
        group: Option<usize>,
        /// Keys scored exactly on the CPU (`:exact`).
        exact: bool,
        /// Dense residual window (`:rN`; `None`: --kv-residual).
        residual: Option<usize>,
        /// Dense sinks (`:sS`; `None`: --kv-sinks).
        sinks: Option<usize>,
        /// Keys centred (`:c`, or --kv-center).
        center: bool,
    },
}

fn parse_specs(list: &str) -> Result<Vec<Spec>> {
    list.split(',')
        .map(str::trim)
        .map(|item| {
            parse_spec(item).with_context(|| {
                format!(
                    "--compare: '{item}' is not a KV setting (allowed: f32, f16, bf16, or \
                     BITS[:affine|:rotated][:gG][:rN][:sS][:c][:exact] with BITS one of \
                     2,3,4,5,6,8, an average 2.5-5.5 or KEY/VALUE bits, N the --kv-residual \
                     window, S the --kv-sinks)"
                )
            })
        })
        .collect()
}

fn parse_spec(item: &str) -> Result<Spec> {
    match item {
        "f32" => return Ok(Spec::Dense(DType::F32)),
        "f16" => return Ok(Spec::Dense(DType::F16)),
        "bf16" => return Ok(Spec::Dense(DType::BF16)),
        _ => {}
    }
    let mut parts = item.split(':');
    let width = parts.next().unwrap_or_default();
    let w = KvWidths::parse_pair(width).map_err(anyhow::Error::msg)?;
    let bits = (w.key, w.value);
    let (mut scheme, mut group, mut exact) = (None, None, false);
    let (mut residual, mut sinks, mut center) = (None, None, false);
    for p in parts {
        match p {
            "exact" if !exact => exact = true,
            "c" if !center => center = true,
            "affine" if scheme.is_none() => scheme = Some(QuantScheme::Affine),
            "rotated" if scheme.is_none() => scheme = Some(QuantScheme::Rotated),
            g if g.starts_with('g') && group.is_none() => {
                group = Some(g.get(1..).unwrap_or_default().parse()?)
            }
            r if r.starts_with('r') && residual.is_none() => {
                residual = Some(r.get(1..).unwrap_or_default().parse()?)
            }
            s if s.starts_with('s') && sinks.is_none() => {
                sinks = Some(s.get(1..).unwrap_or_default().parse()?)
            }
            other => bail!("unexpected '{other}'"),
        }
    }
    // Checked here, so a bad width is blamed on --compare, not on the flag it is passed as.
    for b in [bits.0, bits.1] {
        crate::kv::format::QuantFormat::new(b, group.unwrap_or(64))?;
    }
    Ok(Spec::Quant {
        bits,
        scheme,
        group,
        exact,
        residual,
        sinks,
        center,
    })
}

/// The cache configuration of one spec: the KV flags with this entry's overrides.
fn setting(spec: &Spec, base: &KvOptions, model: &Llama, sizing: PoolSizing) -> Result<Setting> {
    let mut kv = base.clone();
    match spec {
        Spec::Dense(dt) => {
            kv.bits = None;
            kv.key_bits = None;
            kv.value_bits = None;
            kv.group_size = None;
            kv.scheme = None;
            kv.dense_layers = None;
            kv.quantized_kv_start = 0;
            kv.residual = 0;
            kv.sinks = 0;
            kv.center = false;
            let mut cfg = kv.cache_config(model.kv_shape(), model.dtype(), sizing)?;
            for f in cfg.formats.iter_mut() {
                *f = crate::kv::format::KvFormat::Dense(*dt);
            }
            Ok(Setting {
                label: format!("{} (dense)", dt.as_str()),
                config: cfg,
                exact_attention: false,
            })
        }
        Spec::Quant {
            bits,
            scheme,
            group,
            exact,
            residual,
            sinks,
            center,
        } => {
            kv.bits = None;
            kv.center |= *center;
            if let Some(r) = residual {
                kv.residual = *r;
            }
            if let Some(s) = sinks {
                kv.sinks = *s;
            }
            kv.key_bits = Some(bits.0);
            kv.value_bits = Some(bits.1);
            if group.is_some() {
                kv.group_size = *group;
            }
            if scheme.is_some() {
                kv.scheme = *scheme;
            }
            let cfg = kv.cache_config(model.kv_shape(), model.dtype(), sizing)?;
            let scheme = kv.scheme_for(model.config().head_dim);
            let width = KvWidths {
                key: bits.0,
                value: bits.1,
            };
            let group = kv.group_size.unwrap_or(64);
            let mut label = format!("{width}-bit g{group} {}", scheme.name());
            if kv.dense_layers.is_some() || kv.quantized_kv_start > 0 {
                label += " (+dense parts)";
            }
            label += &kv.window_label();
            // Where the CPU kernel would round the query (and weights) to 8 bits for these
            // formats, say which way this row attended.
            let hd = model.config().head_dim;
            let int8 = model.device().is_cpu()
                && cfg
                    .formats
                    .iter()
                    .any(|f| crate::kv::attend::decode::cpu_int8_attention(f, hd));
            if int8 {
                let exact_attention = *exact || crate::kv::attend::decode::exact_attention();
                label += if exact_attention {
                    ", exact attention"
                } else {
                    ", 8-bit attention"
                };
            }
            Ok(Setting {
                label,
                config: cfg,
                exact_attention: *exact,
            })
        }
    }
}

pub fn run(args: &PerplexityArgs) -> Result<()> {
    args.kv.options(&args.model).validate()?;
    if args.model.load_format == LoadFormat::Dummy {
        bail!(
            "perplexity of random weights (--load-format dummy) means nothing: run it on a real \
             model"
        );
    }
    if args.ctx < 3 {
        bail!(
            "--ctx must be at least 3 (got {}): a window of N tokens scores N-1 next tokens, \
             and the second-half perplexity needs one of them",
            args.ctx
        );
    }
    if args.chunk == 0 {
        bail!("--chunk must be at least 1");
    }
    if args.max_tokens.is_some_and(|m| m < args.ctx) {
        bail!(
            "--max-tokens {} is less than one window of --ctx {}",
            args.max_tokens.unwrap_or(0),
            args.ctx
        );
    }
    let mut specs = match &args.compare {
        Some(list) => parse_specs(list)?,
        None => vec![],
    };
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let device = args.device.open()?;
    let loaded = load(&args.model.options(), &device)?;
    let model = &loaded.model;
    if args.ctx > model.config().max_position_embeddings {
        bail!(
            "--ctx {} exceeds the model's context window of {}",
            args.ctx,
            model.config().max_position_embeddings
        );
    }
    if args.compare.is_none() {
        // The KV flags' own setting, a --kv-bits budget resolved for this model.
        let own = args.kv.options_for(&args.model, model);
        if let Some((k, val)) = own.quant_formats()? {
            specs.push(Spec::Quant {
                bits: (k.bits(), val.bits()),
                scheme: None,
                group: None,
                exact: false,
                residual: Some(own.residual),
                sinks: Some(own.sinks),
                center: own.center,
            });
        }
    }
    if !matches!(specs.first(), Some(Spec::Dense(_))) && !args.quantized_reference {
        specs.insert(0, Spec::Dense(model.dtype()));
    }
    // --compare entries name their parts: the flags are their defaults, never a budget's preset.
    let kv = KvOptions {
        preset: false,
        ..args.kv.options(&args.model)
    };
    let settings = specs
        .iter()
        .map(|s| {
            let sizing = PoolSizing::Window {
                tokens: args.ctx,
                chunk: args.chunk,
            };
            setting(s, &kv, model, sizing)
        })
        .collect::<Result<Vec<_>>>()?;

    let mut tokens = loaded.tokenizer.encode(&text, false)?;
    let available = tokens.len();
    if let Some(m) = args.max_tokens {
        tokens.truncate(m);
    }
    let windows = tokens.len() / args.ctx;
    if windows == 0 {
        bail!(
            "{} has {available} tokens, fewer than one window of --ctx {}",
            args.file.display(),
            args.ctx
        );
    }
    let total = windows * args.ctx * settings.len();
    let bar = progress_bar(args.no_progress, total);
    let started = Instant::now();
    let mut done = 0usize;
    let reports = evaluate(
        model,
        tokens.get(..windows * args.ctx).unwrap_or_default(),
        &settings,
        Options {
            ctx: args.ctx,
            chunk: args.chunk,
        },
        &mut |n| {
            done += n;
            bar.set_position(done as u64);
            bar.set_message(format!(
                "{:.0} tok/s",
                done as f64 / started.elapsed().as_secs_f64().max(1e-9)
            ));
        },
    )?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let out = serde_json::json!({
            "model": loaded.description,
            "file": args.file.display().to_string(),
            "ctx": args.ctx,
            "windows": windows,
            "tokens_evaluated": windows * args.ctx,
            "seconds": seconds,
            "settings": reports,
        });
        super::print_out(&format!("{}\n", serde_json::to_string(&out)?))?;
    } else {
        eprintln!("{}", table(&reports));
        eprintln!(
            "{}: {windows} windows x {} tokens ({} scored per setting) | {} | {:.1} s, {:.0} tok/s",
            args.file.display(),
            args.ctx,
            reports.first().map_or(0, |r| r.tokens),
            loaded.description,
            seconds,
            total as f64 / seconds.max(1e-9)
        );
        eprintln!(
            "KL, delta-p and same-top-1 are against the first row; PPL (all) scores every \
             position, 2nd half only the last half of each window's targets."
        );
    }
    Ok(())
}

fn progress_bar(hidden: bool, total: usize) -> ProgressBar {
    super::counter_bar(total, hidden, "tokens")
}

fn table(reports: &[Report]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "KV cache",
        "bits/value",
        "KV bytes/token",
        "PPL (all)",
        "PPL (2nd half)",
        "mean KL",
        "KL p99",
        "KL max",
        "mean Δp",
        "same top-1",
    ]);
    for r in reports {
        let mut row = vec![
            r.label.clone(),
            format!("{:.2}", r.bits_per_value),
            r.kv_bytes_per_token.to_string(),
            format!("{:.4} ± {:.4}", r.ppl, r.ppl_err),
            format!("{:.4}", r.ppl_second_half),
        ];
        match &r.vs_reference {
            Some(d) => row.extend([
                format!("{:.5}", d.kl_mean),
                format!("{:.4}", d.kl_p99),
                format!("{:.3}", d.kl_max),
                format!("{:+.3}%", d.delta_p_mean_pct),
                format!("{:.2}%", d.same_top1_pct),
            ]),
            None => row.extend([
                "reference".to_string(),
                "".into(),
                "".into(),
                "".into(),
                "".into(),
            ]),
        }
        t.add_row(row);
    }
    for c in 1..10 {
        if let Some(col) = t.column_mut(c) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_compare_lists() {
        let v = parse_specs("f16, 8,4:rotated,3:rotated:g32,4:g32,6/4").unwrap();
        assert_eq!(v[0], Spec::Dense(DType::F16));
        assert_eq!(
            v[1],
            Spec::Quant {
                bits: (8, 8),
                scheme: None,
                group: None,
                exact: false,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            v[3],
            Spec::Quant {
                bits: (3, 3),
                scheme: Some(QuantScheme::Rotated),
                group: Some(32),
                exact: false,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            v[4],
            Spec::Quant {
                bits: (4, 4),
                scheme: None,
                group: Some(32),
                exact: false,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            v[5],
            Spec::Quant {
                bits: (6, 4),
                scheme: None,
                group: None,
                exact: false,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            parse_specs("3.5:g32").unwrap()[0],
            Spec::Quant {
                bits: (4, 3),
                scheme: None,
                group: Some(32),
                exact: false,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            parse_specs("4:rotated:exact").unwrap()[0],
            Spec::Quant {
                bits: (4, 4),
                scheme: Some(QuantScheme::Rotated),
                group: None,
                exact: true,
                residual: None,
                sinks: None,
                center: false,
            }
        );
        assert_eq!(
            parse_specs("3.5:r60:s4:c").unwrap()[0],
            Spec::Quant {
                bits: (4, 3),
                scheme: None,
                group: None,
                exact: false,
                residual: Some(60),
                sinks: Some(4),
                center: true,
            }
        );
        assert_eq!(
            parse_specs("3.5:r64").unwrap()[0],
            Spec::Quant {
                bits: (4, 3),
                scheme: None,
                group: None,
                exact: false,
                residual: Some(64),
                sinks: None,
                center: false,
            }
        );
        for bad in [
            "4:exact:exact",
            "q4",
            "6.5",
            "3.25",
            "4:fast",
            "4:r",
            "4:r64:r64",
            "4:r60:s4:s4",
            "4:c:c",
            "4:s",
            "4:g",
            "f8",
            "",
            "4:rotated:affine",
            "6/",
            "/4",
        ] {
            let e = parse_specs(bad).unwrap_err();
            assert!(format!("{e:#}").contains("--compare"), "{bad}: {e:#}");
        }
    }
}
