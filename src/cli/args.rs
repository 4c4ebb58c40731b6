//! Flag groups shared by every subcommand: one definition each, flattened into the
//! subcommands that need them, so `--device` means the same thing everywhere.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Where the computation runs.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Device: `cpu`, `cuda` / `cuda:N` (needs a `--features cuda` build), `metal` (needs
    /// `--features metal`), or `auto` (the first GPU compiled in, else the CPU).
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    pub device: String,

    /// CPU threads for the kernels (default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

impl DeviceArgs {
    /// Opens the device, and sizes the CPU thread pools when `--threads` is given.
    pub fn open(&self) -> Result<Device> {
        if let Some(n) = self.threads {
            if n == 0 {
                bail!("--threads must be at least 1");
            }
            // Both candle's gemm/ops (RAYON_NUM_THREADS) and our own rayon kernels use rayon.
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build_global();
        }
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

    /// Load GGUF weights as dense --dtype tensors instead of keeping them quantized (exact
    /// float math, as the transformers references use). On the CPU this is also the default
    /// for models whose weight types candle has no SIMD kernel for (Q4_1, Q5_0, Q5_1) when the
    /// dense copy fits in half the available memory: dense matmuls are several times faster.
    #[arg(long, conflicts_with = "keep_quantized")]
    pub dequantize: bool,

    /// Keep GGUF weights quantized (candle's QMatMul, activations rounded to 8-bit blocks)
    /// even where the CPU default would dequantize them.
    #[arg(long)]
    pub keep_quantized: bool,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFormat {
    Auto,
    Dummy,
}

impl ModelArgs {
    /// The dtype to compute in: `--dtype` if given, else f32 on CPU and f16 elsewhere.
    pub fn dtype_for(&self, device: &Device) -> DType {
        match (self.dtype, device) {
            (Some(d), _) => d.dtype(),
            (None, Device::Cpu) => DType::F32,
            (None, _) => DType::F16,
        }
    }
}

/// How the next token is chosen, and when generation ends.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy (always the most likely token).
    #[arg(long = "temp", default_value_t = 0.8, value_name = "T")]
    pub temperature: f64,

    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40, value_name = "K")]
    pub top_k: usize,

    /// Keep the smallest set of tokens whose probability adds up to P (1 = off).
    #[arg(long, default_value_t = 0.95, value_name = "P")]
    pub top_p: f64,

    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05, value_name = "P")]
    pub min_p: f64,

    /// Penalise tokens seen in the last --repeat-last-n tokens (1 = off).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
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
    /// MLX-compatible). Absent: a dense cache in the compute dtype.
    #[arg(long, value_name = "BITS")]
    pub kv_bits: Option<u32>,

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

    /// Tokens per KV cache block (the paging unit; memory is allocated a block at a time).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub kv_block_size: usize,

    /// How quantized K/V are formed. `rotated`: each head vector is rotated by a seeded
    /// randomized Hadamard transform before affine quantization (spreads outlier channels,
    /// roughly a third of plain affine's KL divergence at 4 bits; queries and outputs are
    /// rotated to match; needs a power-of-two head_dim). `affine`: plain MLX-compatible affine
    /// groups. Default: rotated where head_dim is a power of two, else affine. Needs --kv-bits.
    #[arg(long, value_enum, value_name = "SCHEME")]
    pub kv_quant_scheme: Option<QuantScheme>,
}

/// `--kv-quant-scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantScheme {
    Affine,
    Rotated,
}

impl QuantScheme {
    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Affine => "affine",
            QuantScheme::Rotated => "rotated",
        }
    }
}

impl KvArgs {
    /// Checks the flags on their own (model-independent).
    pub fn validate(&self) -> Result<()> {
        if self.kv_block_size == 0 || self.kv_block_size > 4096 {
            bail!(
                "--kv-block-size must be between 1 and 4096 (got {})",
                self.kv_block_size
            );
        }
        if !self.is_quantized() {
            for (set, flag) in [
                (self.kv_group_size.is_some(), "--kv-group-size"),
                (self.quantized_kv_start > 0, "--quantized-kv-start"),
                (self.kv_dense_layers.is_some(), "--kv-dense-layers"),
                (self.kv_quant_scheme.is_some(), "--kv-quant-scheme"),
            ] {
                if set {
                    bail!("{flag} only applies to a quantized cache: add --kv-bits");
                }
            }
        }
        self.quant_formats()?;
        if self.max_kv_size == Some(0) {
            bail!("--max-kv-size must be at least 1");
        }
        Ok(())
    }

    /// The scheme for a model with this head_dim: --kv-quant-scheme, else rotated where the
    /// Hadamard transform applies.
    pub fn scheme_for(&self, head_dim: usize) -> QuantScheme {
        self.kv_quant_scheme
            .unwrap_or(if head_dim.is_power_of_two() {
                QuantScheme::Rotated
            } else {
                QuantScheme::Affine
            })
    }

    /// Whether any of --kv-bits, --kv-key-bits, --kv-value-bits asks for a quantized cache.
    pub fn is_quantized(&self) -> bool {
        self.kv_bits.is_some() || self.kv_key_bits.is_some() || self.kv_value_bits.is_some()
    }

    /// The key and value formats, or `None` for a dense cache.
    pub fn quant_formats(
        &self,
    ) -> Result<Option<(crate::kv::quant::QuantFormat, crate::kv::quant::QuantFormat)>> {
        if !self.is_quantized() {
            return Ok(None);
        }
        let g = self.kv_group_size.unwrap_or(64);
        let side = |own: Option<u32>, flag: &str| -> Result<crate::kv::quant::QuantFormat> {
            let (bits, from) = match (own, self.kv_bits) {
                (Some(b), _) => (b, flag),
                (None, Some(b)) => (b, "--kv-bits"),
                (None, None) => bail!(
                    "{flag} is missing: give --kv-bits for both halves, or both \
                     --kv-key-bits and --kv-value-bits"
                ),
            };
            crate::kv::quant::QuantFormat::new(bits, g)
                .map_err(|e| anyhow::anyhow!("{from} {bits} --kv-group-size {g}: {e}"))
        };
        Ok(Some((
            side(self.kv_key_bits, "--kv-key-bits")?,
            side(self.kv_value_bits, "--kv-value-bits")?,
        )))
    }

    /// The layers `--kv-dense-layers` names, resolved against `n` layers.
    fn dense_layers(&self, n: usize) -> Result<Vec<usize>> {
        let Some(spec) = &self.kv_dense_layers else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for part in spec.split(',').map(str::trim) {
            let idx: i64 = match part {
                "last" => -1,
                "first" => 0,
                p => p.parse().map_err(|_| {
                    anyhow::anyhow!(
                        "--kv-dense-layers: '{p}' is not a layer index (use last, first or integers)"
                    )
                })?,
            };
            let l = if idx < 0 { n as i64 + idx } else { idx };
            if l < 0 || l >= n as i64 {
                bail!("--kv-dense-layers: layer {idx} is out of range for a {n}-layer model");
            }
            out.push(l as usize);
        }
        Ok(out)
    }

    /// A cache for `model` able to hold `capacity_tokens` tokens (plus one partial block per
    /// sequence) for up to `max_batch` sequences at once, fed in prompt chunks of
    /// `prefill_chunk` tokens, in the formats these flags ask for.
    pub fn build_cache(
        &self,
        model: &crate::model::llama::Llama,
        capacity_tokens: usize,
        max_batch: usize,
        prefill_chunk: usize,
    ) -> Result<crate::kv::cache::PagedKvCache> {
        let mut cfg = self.cache_config(model, 0, max_batch)?;
        let mut blocks = capacity_tokens.div_ceil(cfg.block_size) + max_batch;
        if cfg.window.is_some() {
            // A window caps what each sequence can hold.
            blocks = blocks.min(max_batch * cfg.max_blocks_for(usize::MAX / 2, prefill_chunk));
        }
        cfg.num_blocks = blocks;
        check_cache_memory(&cfg, model.device())?;
        Ok(crate::kv::cache::PagedKvCache::new(cfg, model.device())?)
    }

    /// The cache geometry these flags ask for, with `num_blocks` main-pool blocks and dense
    /// staging (for --quantized-kv-start) sized for `max_batch` sequences. Allocates nothing.
    pub fn cache_config(
        &self,
        model: &crate::model::llama::Llama,
        num_blocks: usize,
        max_batch: usize,
    ) -> Result<crate::kv::cache::CacheConfig> {
        use crate::kv::cache::{CacheConfig, Staging};
        use crate::kv::layer::KvFormat;
        self.validate()?;
        let c = model.config();
        let dtype = model.dtype();
        let bs = self.kv_block_size;
        let mut cfg = CacheConfig::dense(c.num_layers, c.num_kv_heads, c.head_dim, bs, 0, dtype);
        if let Some((key, value)) = self.quant_formats()? {
            key.check_dim(c.head_dim).map_err(|e| {
                anyhow::anyhow!(
                    "--kv-group-size {} does not fit this model's head_dim {} ({e}); \
                     allowed group sizes divide {}",
                    key.group_size(),
                    c.head_dim,
                    c.head_dim
                )
            })?;
            let rotated = self.scheme_for(c.head_dim) == QuantScheme::Rotated;
            if rotated {
                crate::kv::rotation::Rotation::check(c.head_dim)
                    .map_err(|e| anyhow::anyhow!("--kv-quant-scheme rotated: {e}; use affine"))?;
            }
            let dense = self.dense_layers(c.num_layers)?;
            for (l, f) in cfg.formats.iter_mut().enumerate() {
                if !dense.contains(&l) {
                    *f = KvFormat::Affine {
                        key,
                        value,
                        scale_dtype: dtype,
                        rotated,
                    };
                }
            }
            if self.quantized_kv_start > 0 {
                // No sequence holds more than the context window: staging past it is never used.
                let staged = self.quantized_kv_start.min(c.max_position_embeddings);
                cfg.staging = Some(Staging {
                    tokens: self.quantized_kv_start,
                    dtype,
                    num_blocks: max_batch.saturating_mul(cfg.blocks_for(staged) + 1),
                });
            }
        }
        cfg.window = self.max_kv_size;
        cfg.num_blocks = num_blocks;
        Ok(cfg)
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
        .num_blocks
        .checked_mul(cfg.bytes_per_block())
        .context("the KV cache size overflows")?;
    let staging = staging_bytes(cfg)?;
    let total = main.saturating_add(staging);
    let available = crate::model::weights::available_memory();
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
