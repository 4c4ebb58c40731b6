//! Which model to run and how to load it, as plain data (the CLI's model flags convert into
//! this; nothing below the CLI reads clap types).

// The options come from the command line: no unwrap, expect or indexing that could panic on them
// (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use super::config::ModelConfig;
use candle_core::{DType, Device};
use std::path::PathBuf;

/// Where the weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// Real weights from `model`.
    #[default]
    Auto,
    /// Random weights of the shape in `config` (speed runs only).
    Dummy,
}

/// The model options of every subcommand.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelOptions {
    /// A .gguf file, a directory, or a Hugging Face repo id; `None`: the default model.
    pub model: Option<String>,
    pub load_format: LoadFormat,
    /// config.json giving the shape for [`LoadFormat::Dummy`].
    pub config: Option<PathBuf>,
    /// A tokenizer.json to use instead of the model's own.
    pub tokenizer: Option<PathBuf>,
    /// Compute dtype; `None`: f32 on the CPU, f16 elsewhere.
    pub dtype: Option<DType>,
    /// Load GGUF weights as dense `dtype` tensors.
    pub dequantize: bool,
    /// Keep GGUF weights quantized even where the CPU default would dequantize them.
    pub keep_quantized: bool,
    /// Context window to run with instead of the model's own (`--ctx-size`), like
    /// llama.cpp's `-c`: positions past the trained window are allowed, quality there is not
    /// promised.
    pub ctx_size: Option<usize>,
}

impl ModelOptions {
    /// `cfg` with the context window of `--ctx-size`, if given (at least 1, at most 2^24).
    pub fn with_context_window(&self, mut cfg: ModelConfig) -> anyhow::Result<ModelConfig> {
        if let Some(n) = self.ctx_size {
            if n == 0 || n > 1 << 24 {
                anyhow::bail!("--ctx-size {n} is out of range (1 to {})", 1 << 24);
            }
            cfg.max_position_embeddings = n;
        }
        Ok(cfg)
    }

    /// The dtype to compute in: `dtype` if given, else f32 on CPU and f16 elsewhere.
    pub fn dtype_for(&self, device: &Device) -> DType {
        match (self.dtype, device) {
            (Some(d), _) => d,
            (None, Device::Cpu) => DType::F32,
            (None, _) => DType::F16,
        }
    }
}
