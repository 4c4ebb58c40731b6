//! Flag groups shared by every subcommand: one definition each, flattened into the
//! subcommands that need them, so `--device` means the same thing everywhere.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

use crate::kv::cache::{KvOptions, QuantScheme};
use crate::kv::format::KvWidths;
use crate::model::{self, options::ModelOptions};

/// Where the computation runs.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Device: `cpu`, `cuda` / `cuda:N` (needs a `--features cuda` build), `metal` (needs
    /// `--features metal`), or `auto` (the first GPU compiled in, else the CPU).
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    pub device: String,

    /// CPU threads for the kernels (default: the physical cores; a second hardware thread of a
    /// core adds nothing to kernels bound by vector units and memory).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,

    /// On a CUDA device, replay decode steps as captured CUDA graphs (one launch per step
    /// instead of hundreds); `off` launches every kernel one by one. The outputs are the same.
    #[arg(
        long,
        value_name = "on|off",
        default_value = "on",
        value_parser = parse_on_off,
        action = clap::ArgAction::Set
    )]
    pub cuda_graphs: bool,

    /// CPU decode attention over 4-bit caches (groups of 64, head_dim 64 or 128) in f32 — the
    /// exact kernel, the reference — instead of rounding each group of 64 query values, and for
    /// 4-bit values each V tile's softmax weights, to 8 bits for integer dot products (the
    /// default where the CPU has AVX2 or AVX-512 VNNI: ~1.5x faster at 16K; its KL against the
    /// exact kernel is in README). GPUs always attend exactly.
    #[arg(long)]
    pub exact_attention: bool,
}

/// `on` / `off` for a switch flag.
fn parse_on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("'{s}' is not on or off")),
    }
}

impl DeviceArgs {
    /// Opens the device, and sizes the CPU thread pools: `--threads`, else the physical cores.
    pub fn open(&self) -> Result<Device> {
        crate::kv::attend::decode::set_exact_attention(self.exact_attention);
        let n = match self.threads {
            Some(0) => bail!("--threads must be at least 1"),
            Some(n) => {
                // candle's own pool (its elementwise ops on large tensors) reads the count from
                // RAYON_NUM_THREADS when it starts; kvq's kernels use rayon's global pool.
                std::env::set_var("RAYON_NUM_THREADS", n.to_string());
                n
            }
            None => candle_core::utils::get_num_threads(),
        };
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
        parse_device(&self.device)
    }
}

/// Parses `cpu`, `cuda`, `cuda:N`, `metal`, `metal:N` or `auto`.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim().to_ascii_lowercase();
    let (kind, ordinal) = match spec.split_once(':') {
        Some((k, n)) => {
            let n: usize = n
                .parse()
                .with_context(|| format!("invalid device ordinal in --device {spec}"))?;
            (k.to_string(), n)
        }
        None => (spec.clone(), 0),
    };
    match kind.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if !candle_core::utils::cuda_is_available() {
                bail!("--device {spec}: this kvq was built without CUDA (rebuild with --features cuda)");
            }
            crate::device::open_cuda(ordinal)
                .with_context(|| format!("cannot open --device {spec}"))
        }
        "metal" => {
            if !candle_core::utils::metal_is_available() {
                bail!("--device {spec}: this kvq was built without Metal (rebuild with --features metal)");
            }
            Device::new_metal(ordinal).with_context(|| format!("cannot open --device {spec}"))
        }
        "auto" => {
            if candle_core::utils::cuda_is_available() {
                crate::device::open_cuda(0).context("cannot open cuda:0")
            } else if candle_core::utils::metal_is_available() {
                Device::new_metal(0).context("cannot open metal:0")
            } else {
                Ok(Device::Cpu)
            }
        }
        other => {
            bail!("unknown device '{other}' for --device (allowed: cpu, cuda[:N], metal[:N], auto)")
        }
    }
}

/// Floating-point types accepted by `--dtype`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

/// Which model to run and how to load it.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A .gguf file, a directory with config.json + *.safetensors + tokenizer.json, or a
    /// Hugging Face repo id (fetched with hf-hub; honours HF_HOME, HF_ENDPOINT,
    /// HF_HUB_OFFLINE). Default: SmolLM2-135M-Instruct Q4_1, fetched once into KVQ_HOME.
    #[arg(long, value_name = "PATH|REPO")]
    pub model: Option<String>,

    /// `auto` loads real weights; `dummy` makes random weights of the shape in --config (for
    /// speed runs only: the text is noise).
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormat,

    /// config.json giving the model shape for --load-format dummy.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Tokenizer file (tokenizer.json) to use instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,

    /// Activation / dense-weight dtype (default f32 on CPU, f16 on GPUs).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,

    /// Load GGUF weights as dense --dtype tensors instead of keeping them in their blocks (with
    /// --dtype f32: the exact float math the transformers references use). On the CPU the
    /// default keeps the blocks and multiplies them with kvq's own kernels, which compute the
    /// same f32 product (same summation order) at a sixth of the bytes. On a CUDA GPU the
    /// default dequantizes whenever the dense weights take at most a quarter of the free device
    /// memory (batched decode then runs on tensor cores); --keep-quantized keeps the blocks.
    #[arg(long, conflicts_with = "keep_quantized")]
    pub dequantize: bool,

    /// Multiply GGUF weights with candle's quantized matmul (activations rounded to 8-bit
    /// blocks) instead of kvq's exact CPU block kernels, or on a GPU instead of dequantizing
    /// them (less device memory; faster for one sequence, slower for batches).
    #[arg(long)]
    pub keep_quantized: bool,

    /// Context window in tokens, instead of the model's own (like llama.cpp's `-c`): longer
    /// runs are allowed, but past the window the model was trained for its quality is not
    /// promised.
    #[arg(long, value_name = "N")]
    pub ctx_size: Option<usize>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFormat {
    Auto,
    Dummy,
}

impl ModelArgs {
    /// The flags as the model loader's plain options.
    pub fn options(&self) -> ModelOptions {
        ModelOptions {
            model: self.model.clone(),
            load_format: match self.load_format {
                LoadFormat::Auto => model::options::LoadFormat::Auto,
                LoadFormat::Dummy => model::options::LoadFormat::Dummy,
            },
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            dtype: self.dtype.map(DTypeArg::dtype),
            dequantize: self.dequantize,
            keep_quantized: self.keep_quantized,
            ctx_size: self.ctx_size,
        }
    }
}

/// How the next token is chosen, and when generation ends.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy (always the most likely token).
    #[arg(
        long = "temp",
        default_value_t = 0.8,
        value_name = "T",
        allow_negative_numbers = true
    )]
    pub temperature: f64,

    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40, value_name = "K")]
    pub top_k: usize,

    /// Keep the smallest set of tokens whose probability adds up to P (1 = off).
    #[arg(
        long,
        default_value_t = 0.95,
        value_name = "P",
        allow_negative_numbers = true
    )]
    pub top_p: f64,

    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(
        long,
        default_value_t = 0.05,
        value_name = "P",
        allow_negative_numbers = true
    )]
    pub min_p: f64,

    /// Penalise tokens seen in the last --repeat-last-n tokens (1 = off).
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "X",
        allow_negative_numbers = true
    )]
    pub repeat_penalty: f32,

    /// How many recent tokens --repeat-penalty looks at.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub repeat_last_n: usize,

    /// Random seed of the sampler (each request owns its generator).
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,

    /// Most tokens to generate (the end-of-sequence token counts).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_tokens: usize,

    /// Stop when the output contains this text (repeatable); the stop text is not printed.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
}

/// Refuses a --top-p outside (0, 1] (1 = off), NaN included.
pub fn check_top_p(p: f64, name: &str) -> Result<()> {
    if !(p > 0.0 && p <= 1.0) {
        bail!("{name} must be in (0, 1], 1 = off (got {p})");
    }
    Ok(())
}

impl SamplingArgs {
    /// Checks every value as given (before `params` maps the "off" values away), then the
    /// parameters themselves.
    pub fn validate(&self) -> Result<()> {
        check_top_p(self.top_p, "--top-p")?;
        if !(0.0..1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1), 0 = off (got {})", self.min_p);
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "--temp must be a number ≥ 0, 0 = greedy (got {})",
                self.temperature
            );
        }
        self.params().validate()
    }

    pub fn params(&self) -> crate::engine::sampler::SamplingParams {
        crate::engine::sampler::SamplingParams {
            temperature: self.temperature,
            top_k: (self.top_k > 0).then_some(self.top_k),
            top_p: (self.top_p < 1.0).then_some(self.top_p),
            min_p: (self.min_p > 0.0).then_some(self.min_p),
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

/// KV cache layout and format.
#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    /// Quantize the KV cache to this many bits per value (2, 3, 4, 5, 6 or 8; affine groups,
    /// MLX-compatible), or to an average of 2.5, 3.5, 4.5 or 5.5: keys one bit wider than values
    /// (3.5 = 4-bit K / 3-bit V), the split that measures best, since keys are the sensitive
    /// half. 4 and 3 given without --kv-key-bits, --kv-value-bits, --kv-residual, --kv-sinks or
    /// --kv-center are budgets: the best setting of that many bits per value (4 = 4-bit keys,
    /// 3-bit values, centred keys, the newest 60 and first 4 positions dense; KL divergence
    /// ~9x lower than plain 4-bit on the default model), plain where it cannot run (a notice
    /// says why); `--kv-bits 4 --kv-residual 0` is plain 4-bit. Absent: a dense cache
    /// (--kv-dtype).
    #[arg(long, value_name = "BITS")]
    pub kv_bits: Option<KvWidths>,

    /// Bits of the keys only (overrides --kv-bits for K). Keys are the sensitive half: on the
    /// default model 6-bit keys with 4-bit values lose about what 8-bit does.
    #[arg(long, value_name = "BITS")]
    pub kv_key_bits: Option<u32>,

    /// Bits of the values only (overrides --kv-bits for V).
    #[arg(long, value_name = "BITS")]
    pub kv_value_bits: Option<u32>,

    /// Values per quantization group along the head dimension (32, 64 or 128; must divide
    /// head_dim). Default 64. Needs --kv-bits.
    #[arg(long, value_name = "G")]
    pub kv_group_size: Option<usize>,

    /// Keep each sequence dense until it holds N tokens; its history is then quantized once and
    /// it continues quantized (per sequence, also in a batch). 0 = quantize from the start.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub quantized_kv_start: usize,

    /// Layers kept dense when --kv-bits is set: `last`, `first`, or a comma-separated list of
    /// indices (negative counts from the end, e.g. `0,-1`).
    #[arg(long, value_name = "LAYERS")]
    pub kv_dense_layers: Option<String>,

    /// Sliding window: attend to at most the W most recent tokens; older blocks are freed, so
    /// the cache stops growing (dense and quantized alike).
    #[arg(long, value_name = "W")]
    pub max_kv_size: Option<usize>,

    /// Dense residual window: each query attends its newest N positions (itself included)
    /// through f16 copies of their K/V rows, older ones through the quantized rows (which are
    /// still written for every token). Where quantization error costs most — a query weighs
    /// its recent tokens heavily: on the default model N = 64 cuts 4-bit's KL divergence ~5x —
    /// for N f16 rows per sequence and layer. CPU and CUDA. Needs --kv-bits; 0 = off (the
    /// default, except under the --kv-bits 4 / 3 budgets: 60).
    #[arg(long, value_name = "N")]
    pub kv_residual: Option<usize>,

    /// Attention sinks: every query also attends the first S positions of its sequence through
    /// f16 copies (many heads put much of their weight there; on the default model 4 sinks cut
    /// --kv-residual 60's KL divergence by a third). Needs --kv-residual; 0 = off (the default,
    /// except under the --kv-bits 4 / 3 budgets: 4).
    #[arg(long, value_name = "S")]
    pub kv_sinks: Option<usize>,

    /// Store each key minus its sequence's mean key (per channel, from the sequence's first
    /// block, per layer): the offset every key shares stops taking up the quantization range,
    /// and attention is unchanged (softmax ignores a shift common to a query's scores). On the
    /// default model it cuts 4-bit's KL divergence by ~15%. Needs --kv-bits; prompt-cache files
    /// keep the means (use a file saved with it only with it); not with --quantized-kv-start or
    /// soft-capped models. On by default under the --kv-bits 4 / 3 budgets.
    #[arg(long)]
    pub kv_center: bool,

    /// Tokens per KV cache block (the paging unit; memory is allocated a block at a time).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub kv_block_size: usize,

    /// How quantized K/V are formed. `rotated`: each head vector is rotated by a seeded
    /// randomized Hadamard transform before affine quantization (spreads outlier channels,
    /// roughly a third of plain affine's KL divergence at 4 bits; queries and outputs are
    /// rotated to match; needs a power-of-two head_dim). `affine`: plain MLX-compatible affine
    /// groups. Default: rotated where head_dim is a power of two, else affine. Needs --kv-bits.
    #[arg(long, value_enum, value_name = "SCHEME")]
    pub kv_quant_scheme: Option<QuantSchemeArg>,

    /// dtype of a dense cache, and of the dense layers and --quantized-kv-start staging of a
    /// quantized one. Default: the --dtype given, else f16 — also on the CPU, which computes in
    /// f32 but stores K and V in f16 as llama.cpp does (half the bytes every decode step
    /// reads); --dtype f32 keeps an f32 cache (the exact reference arithmetic).
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_dtype: Option<DTypeArg>,
}

/// `--kv-quant-scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantSchemeArg {
    Affine,
    Rotated,
}

impl QuantSchemeArg {
    pub fn scheme(self) -> QuantScheme {
        match self {
            QuantSchemeArg::Affine => QuantScheme::Affine,
            QuantSchemeArg::Rotated => QuantScheme::Rotated,
        }
    }
}

impl KvArgs {
    /// The dtype of dense pools for a model run with `model`'s flags: --kv-dtype, else its
    /// --dtype, else f16.
    pub fn dense_dtype(&self, model: &ModelArgs) -> DType {
        self.kv_dtype
            .or(model.dtype)
            .map_or(DType::F16, DTypeArg::dtype)
    }

    /// The flags as the cache's plain options, for a model run with `model`'s flags.
    pub fn options(&self, model: &ModelArgs) -> KvOptions {
        // An average names the values' width; its wider key width is a default --kv-key-bits.
        let wider_key = self.kv_bits.filter(|b| b.key != b.value).map(|b| b.key);
        KvOptions {
            bits: self.kv_bits.map(|b| b.value),
            key_bits: self.kv_key_bits.or(wider_key),
            value_bits: self.kv_value_bits,
            group_size: self.kv_group_size,
            quantized_kv_start: self.quantized_kv_start,
            dense_layers: self.kv_dense_layers.clone(),
            max_kv_size: self.max_kv_size,
            block_size: self.kv_block_size,
            scheme: self.kv_quant_scheme.map(QuantSchemeArg::scheme),
            dense_dtype: Some(self.dense_dtype(model)),
            residual: self.kv_residual.unwrap_or(0),
            sinks: self.kv_sinks.unwrap_or(0),
            center: self.kv_center,
            preset: self
                .kv_bits
                .is_some_and(|b| b.key == b.value && crate::kv::preset::BUDGETS.contains(&b.key))
                && self.kv_key_bits.is_none()
                && self.kv_value_bits.is_none()
                && self.kv_residual.is_none()
                && self.kv_sinks.is_none()
                && !self.kv_center,
        }
    }

    /// [`KvArgs::options`] for the loaded `model`, a `--kv-bits` budget resolved to its best
    /// setting there (`kv::preset`); a fallback's reason goes to stderr, once per call.
    pub fn options_for(&self, flags: &ModelArgs, model: &crate::model::llama::Llama) -> KvOptions {
        use crate::kv::preset::{resolve, Backend, Target};
        let target = Target {
            head_dim: model.config().head_dim,
            soft_capped: model.config().attn_softcap.is_some(),
            backend: Backend::of(model.device()),
            dtype: model.dtype(),
        };
        let r = resolve(&self.options(flags), &target);
        if let Some(n) = r.notice {
            eprintln!("note: {n}");
        }
        r.options
    }
}

/// Bytes of the dense staging pool (`--quantized-kv-start`), overflow-checked.
pub fn staging_bytes(cfg: &crate::kv::cache::CacheConfig) -> Result<usize> {
    let Some(s) = &cfg.staging else {
        return Ok(0);
    };
    s.num_blocks
        .checked_mul(cfg.block_size)
        .and_then(|t| t.checked_mul(cfg.staging_bytes_per_token()))
        .with_context(|| format!("--quantized-kv-start {} is too large", s.tokens))
}

/// Refuses a CPU cache larger than the memory the OS can give now, before anything is
/// allocated (an allocation that fails aborts the process instead of reporting).
pub fn check_cache_memory(cfg: &crate::kv::cache::CacheConfig, device: &Device) -> Result<()> {
    let main = cfg
        .group_block_bytes()
        .iter()
        .enumerate()
        .try_fold(0usize, |sum, (g, b)| {
            b.checked_mul(cfg.blocks_of(g))?.checked_add(sum)
        })
        .context("the KV cache size overflows")?;
    let staging = staging_bytes(cfg)?;
    let total = main.saturating_add(staging);
    let available = crate::device::available_memory_bytes();
    if device.is_cpu() && total > available {
        use crate::engine::stats::fmt_bytes;
        let staged = match (&cfg.staging, staging) {
            (Some(s), b) if b > 0 => format!(
                " and {} of dense staging for --quantized-kv-start {}",
                fmt_bytes(b),
                s.tokens
            ),
            _ => String::new(),
        };
        bail!(
            "the KV cache needs {} ({} of blocks{staged}), more than the {} of memory available \
             now; lower --kv-memory, --max-batch, --max-tokens or --quantized-kv-start",
            fmt_bytes(total),
            fmt_bytes(main),
            fmt_bytes(available)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        kv: KvArgs,
        #[command(flatten)]
        model: ModelArgs,
    }

    fn options(args: &[&str]) -> std::result::Result<KvOptions, clap::Error> {
        let f = Flags::try_parse_from(std::iter::once("kvq").chain(args.iter().copied()))?;
        Ok(f.kv.options(&f.model))
    }

    /// `--kv-bits 4` / `3` alone ask for the budget's preset; any part given by hand does not.
    #[test]
    fn kv_bits_4_and_3_alone_are_budgets() {
        let preset = |a: &[&str]| options(a).unwrap().preset;
        assert!(preset(&["--kv-bits", "4"]));
        assert!(preset(&["--kv-bits", "3", "--kv-group-size", "32"]));
        for hand in [
            &["--kv-bits", "4", "--kv-residual", "0"][..],
            &["--kv-bits", "4", "--kv-sinks", "0"],
            &["--kv-bits", "4", "--kv-center"],
            &["--kv-bits", "4", "--kv-key-bits", "4"],
            &["--kv-bits", "3", "--kv-value-bits", "3"],
            &["--kv-bits", "3.5"],
            &["--kv-bits", "8"],
            &["--kv-bits", "2"],
            &[],
        ] {
            assert!(!preset(hand), "{hand:?}");
        }
    }

    /// An average names keys one bit wider than values; an explicit per-side width still wins;
    /// whole widths pass through unchanged (checked where the format is made).
    #[test]
    fn kv_bits_take_whole_widths_and_half_averages() {
        let o = options(&["--kv-bits", "3.5"]).unwrap();
        assert_eq!((o.bits, o.key_bits, o.value_bits), (Some(3), Some(4), None));
        let (k, v) = o.quant_formats().unwrap().unwrap();
        assert_eq!((k.bits(), v.bits()), (4, 3));
        let o = options(&["--kv-bits", "4.5", "--kv-key-bits", "8"]).unwrap();
        assert_eq!((o.bits, o.key_bits), (Some(4), Some(8)));
        let o = options(&["--kv-bits", "4"]).unwrap();
        assert_eq!((o.bits, o.key_bits, o.value_bits), (Some(4), None, None));
        assert_eq!(options(&["--kv-bits", "2.5"]).unwrap().key_bits, Some(3));
        assert_eq!(options(&["--kv-bits", "5.5"]).unwrap().key_bits, Some(6));
        for bad in ["1.5", "6.5", "3.25", "4.0", "x", ""] {
            let e = options(&["--kv-bits", bad]).expect_err(bad).to_string();
            assert!(e.contains("--kv-bits") && e.contains("3.5"), "{bad}: {e}");
        }
        let j = |s: &str| s.parse::<KvWidths>().unwrap().json();
        assert_eq!(
            (j("3.5"), j("8")),
            (serde_json::json!(3.5), serde_json::json!(8))
        );
    }
}
