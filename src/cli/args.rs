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
            let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
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
            Device::new_cuda(ordinal).with_context(|| format!("cannot open --device {spec}"))
        }
        "metal" => {
            if !candle_core::utils::metal_is_available() {
                bail!("--device {spec}: this kvq was built without Metal (rebuild with --features metal)");
            }
            Device::new_metal(ordinal).with_context(|| format!("cannot open --device {spec}"))
        }
        "auto" => {
            if candle_core::utils::cuda_is_available() {
                Device::new_cuda(0).context("cannot open cuda:0")
            } else if candle_core::utils::metal_is_available() {
                Device::new_metal(0).context("cannot open metal:0")
            } else {
                Ok(Device::Cpu)
            }
        }
        other => bail!("unknown device '{other}' for --device (allowed: cpu, cuda[:N], metal[:N], auto)"),
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

    /// Load GGUF weights as dense --dtype tensors instead of keeping them quantized
    /// (slower; used for exact checks against float references).
    #[arg(long)]
    pub dequantize: bool,
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
