//! The decoder's shape, read from GGUF metadata or a Hugging Face config.json.
//!
//! One struct serves every architecture kvq runs: the Llama family (Llama 2/3, SmolLM, Mistral,
//! Qwen2/2.5, Qwen3), Gemma 2, Gemma 3 (text) and Phi-3. They differ only in switches (attention
//! bias, q/k norms, tied embeddings, RoPE scaling, soft-capping, extra norms, activation) and in
//! [`ModelConfig::layers`]: each layer's attention kind — global, or a sliding window of W
//! tokens — with its own RoPE base.

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};

mod gguf;
mod hf;

/// Architectures the one decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
}

/// The names [`Arch::from_name`] accepts, for messages.
pub const SUPPORTED_ARCHS: &str = "llama, mistral, qwen2, qwen3, gemma2, gemma3 (text), phi3";

impl Arch {
    /// Maps a GGUF `general.architecture` or an HF `model_type` to an architecture.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "llama" | "smollm" | "smollm2" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma2" => Arch::Gemma2,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            "phi3" => Arch::Phi3,
            other => {
                bail!("unsupported model architecture '{other}' (kvq runs: {SUPPORTED_ARCHS})")
            }
        })
    }

    /// Gemma 2 and 3: RMS norms scale by `1 + w` in Hugging Face weights (llama.cpp's GGUF
    /// stores `1 + w`), embeddings are scaled by √hidden, every sub-block has a post-norm,
    /// the MLP is GeGLU (tanh GELU).
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }
}

/// How one layer attends.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LayerAttn {
    /// `Some(W)`: a sliding window — a query sees the W most recent positions, itself
    /// included; `None`: every earlier position (global).
    pub window: Option<usize>,
    /// RoPE base of this layer (Gemma 3's local layers have their own).
    pub rope_theta: f32,
}

/// The per-layer attention kinds of a model whose window is `window` (if any): `sliding[l]`
/// says whether layer `l` uses it; sliding layers take `local_theta`, the others `theta`.
fn layer_kinds(
    sliding: &[bool],
    window: Option<usize>,
    theta: f32,
    local_theta: f32,
) -> Vec<LayerAttn> {
    sliding
        .iter()
        .map(|&s| match window {
            Some(w) if s => LayerAttn {
                window: Some(w),
                rope_theta: local_theta,
            },
            _ => LayerAttn {
                window: None,
                rope_theta: theta,
            },
        })
        .collect()
}

/// Most layers a config may claim: checked as soon as the count is read, before per-layer
/// tables are built from it (the same bound `validate` applies).
const MAX_LAYERS: usize = 1 << 16;

fn check_layer_count(n: usize) -> Result<usize> {
    if n > MAX_LAYERS {
        bail!("model config: layer count {n} is out of range (at most {MAX_LAYERS})");
    }
    Ok(n)
}

/// Which layers slide by default when the config lists none: Gemma 2 every other layer from
/// the first, Gemma 3 five of every six, Mistral and Phi-3 all of them (when a window is set),
/// Qwen2 the layers from `max_window_layers` on.
fn default_sliding(arch: Arch, layers: usize, qwen2_first: usize) -> Vec<bool> {
    (0..layers)
        .map(|l| match arch {
            Arch::Gemma2 => l % 2 == 0,
            Arch::Gemma3 => (l + 1) % 6 != 0,
            Arch::Qwen2 => l >= qwen2_first,
            _ => true,
        })
        .collect()
}

/// The attention score scale of a GGUF model: its `attention.scale` if it has one, else what
/// llama.cpp uses — `1/√head_dim`, but `1/√(hidden / heads)` for the 27B Gemma 2 (46 layers)
/// and Gemma 3 (62 layers), whose `query_pre_attn_scalar` the file does not keep.
fn gguf_attn_scale(
    arch: Arch,
    scale: Option<f32>,
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> f64 {
    if let Some(s) = scale.filter(|s| *s > 0.0 && s.is_finite()) {
        return s as f64;
    }
    let big = matches!((arch, layers), (Arch::Gemma2, 46) | (Arch::Gemma3, 62));
    let d = if big {
        hidden.checked_div(heads).unwrap_or(head_dim)
    } else {
        head_dim
    };
    1.0 / (d.max(1) as f64).sqrt()
}

/// How RoPE frequencies of the model's global base are scaled (local bases never are).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum RopeScaling {
    Llama3(Llama3RopeScaling),
    /// Positions divided by `factor` (`rope_type: linear`; Gemma 3 4B and larger, ×8).
    Linear {
        factor: f32,
    },
}

/// Llama-3-style frequency scaling of RoPE (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rms_norm_eps: f64,
    /// Context window: prompts plus generated tokens never exceed it.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Qwen2: biases on the q/k/v projections.
    pub attention_bias: bool,
    /// Qwen3, Gemma 3: RMS norms on q and k per head, before RoPE.
    pub qk_norm: bool,
    /// Each layer's attention kind and RoPE base (`num_layers` entries).
    pub layers: Vec<LayerAttn>,
    /// Scale of the attention scores (`1/√head_dim`, Gemma: `1/√query_pre_attn_scalar`).
    pub attn_scale: f64,
    /// Gemma 2: attention scores become `c·tanh(s/c)` before the mask.
    pub attn_softcap: Option<f32>,
    /// Gemma 2: final logits become `c·tanh(x/c)`.
    pub final_softcap: Option<f32>,
}

impl ModelConfig {
    fn validate(&self) -> Result<()> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            bail!(
                "invalid head counts: {} query heads, {} KV heads",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!("invalid head_dim {}", self.head_dim);
        }
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            bail!("model config has a zero size");
        }
        if self.layers.len() != self.num_layers {
            bail!(
                "{} layer attention kinds for {} layers",
                self.layers.len(),
                self.num_layers
            );
        }
        // Sizes no real model comes near: refused before anything is allocated from them.
        for (name, v, max) in [
            ("layer count", self.num_layers, MAX_LAYERS),
            ("head count", self.num_heads, 1 << 16),
            ("head_dim", self.head_dim, 1 << 16),
            ("hidden size", self.hidden_size, 1 << 20),
            ("feed-forward size", self.intermediate_size, 1 << 22),
            ("vocabulary size", self.vocab_size, 1 << 26),
        ] {
            if v > max {
                bail!("model config: {name} {v} is out of range (at most {max})");
            }
        }
        let p = self.max_position_embeddings;
        // RoPE tables: positions x head_dim/2, f32, three of them while they are built.
        let rope = p.saturating_mul(self.head_dim / 2).saturating_mul(12);
        let available = crate::device::available_memory_bytes();
        if p == 0 || p > u32::MAX as usize || rope > available {
            bail!(
                "model config: context length {p} is out of range (its position tables need \
                 {rope} bytes, {available} are available)"
            );
        }
        Ok(())
    }

    /// The window of every windowed layer when all such layers share one (they do in every
    /// architecture kvq runs); `None` when no layer slides.
    pub fn sliding_window(&self) -> Option<usize> {
        self.layers.iter().filter_map(|l| l.window).max()
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn gqa_groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

#[cfg(test)]
mod tests;
