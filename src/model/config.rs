//! The decoder's shape, read from GGUF metadata or a Hugging Face config.json.
//!
//! One struct serves the whole Llama family (Llama 2/3, SmolLM, Mistral, Qwen2/2.5, Qwen3): they
//! differ only in flags (attention bias, q/k norms, tied embeddings, RoPE scaling).

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde_json::Value;
use std::path::Path;

/// Architectures the one decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    /// Maps a GGUF `general.architecture` or an HF `model_type` to an architecture.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "llama" | "smollm" | "smollm2" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => bail!(
                "unsupported model architecture '{other}' (kvq runs: llama, mistral, qwen2, qwen3)"
            ),
        })
    }
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
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f64,
    /// Context window: prompts plus generated tokens never exceed it.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Qwen2: biases on the q/k/v projections.
    pub attention_bias: bool,
    /// Qwen3: RMS norms on q and k per head, before RoPE.
    pub qk_norm: bool,
}

impl ModelConfig {
    /// Reads the shape from GGUF metadata (`<arch>.block_count`, ...).
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let arch_name = md
            .get("general.architecture")
            .context("GGUF has no general.architecture")?
            .to_string()
            .context("general.architecture is not a string")?
            .clone();
        let arch = Arch::from_name(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_u = |k: &str| -> Result<usize> {
            let v = md
                .get(&key(k))
                .with_context(|| format!("GGUF metadata lacks {}", key(k)))?;
            let n = v
                .to_u64()
                .or_else(|_| v.to_u32().map(u64::from))
                .ok()
                .or_else(|| v.to_i32().ok().and_then(|x| u64::try_from(x).ok()))
                .with_context(|| format!("GGUF {} is not a non-negative integer", key(k)))?;
            usize::try_from(n).with_context(|| format!("GGUF {} = {n} is too large", key(k)))
        };
        let get_f = |k: &str| -> Option<f32> {
            md.get(&key(k)).and_then(|v| {
                v.to_f32()
                    .ok()
                    .or_else(|| v.to_f64().ok().map(|x| x as f32))
            })
        };
        let hidden_size = get_u("embedding_length")?;
        let num_heads = get_u("attention.head_count")?;
        let num_kv_heads = get_u("attention.head_count_kv").unwrap_or(num_heads);
        // A zero head count is refused by `validate`, not divided by.
        let head_dim = get_u("attention.key_length")
            .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
        let vocab_size = match get_u("vocab_size") {
            Ok(v) => v,
            Err(_) => match md.get("tokenizer.ggml.tokens") {
                Some(gguf_file::Value::Array(a)) => a.len(),
                _ => bail!("GGUF metadata gives no vocabulary size"),
            },
        };
        let has_output = content.tensor_infos.contains_key("output.weight");
        let has_q_bias = content.tensor_infos.contains_key("blk.0.attn_q.bias");
        let has_q_norm = content
            .tensor_infos
            .contains_key("blk.0.attn_q_norm.weight");
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_layers: get_u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling: None,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64,
            max_position_embeddings: get_u("context_length").unwrap_or(4096),
            tie_word_embeddings: !has_output,
            attention_bias: has_q_bias,
            qk_norm: has_q_norm,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a Hugging Face config.json.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_hf_json(&v).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_hf_json(v: &Value) -> Result<Self> {
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| {
                v.get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(Value::as_str)
                    .map(|s| s.trim_end_matches("ForCausalLM"))
            })
            .context("config has neither model_type nor architectures")?;
        let arch = Arch::from_name(model_type)?;
        let u = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| usize::try_from(x).unwrap_or(usize::MAX))
                .with_context(|| format!("config lacks integer field '{k}'"))
        };
        let hidden_size = u("hidden_size")?;
        let num_heads = u("num_attention_heads")?;
        let head_dim = match v.get("head_dim").and_then(Value::as_u64) {
            Some(h) => usize::try_from(h).unwrap_or(usize::MAX),
            None => hidden_size.checked_div(num_heads).unwrap_or(0),
        };
        let rope_scaling = match v.get("rope_scaling") {
            Some(rs) if rs.get("rope_type").and_then(Value::as_str) == Some("llama3") => {
                let f = |k: &str| rs.get(k).and_then(Value::as_f64).map(|x| x as f32);
                Some(Llama3RopeScaling {
                    factor: f("factor").context("rope_scaling.factor")?,
                    low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: rs
                        .get("original_max_position_embeddings")
                        .and_then(Value::as_u64)
                        .unwrap_or(8192)
                        as usize,
                })
            }
            Some(Value::Null) | None => None,
            Some(rs) => bail!("unsupported rope_scaling {rs}"),
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: u("intermediate_size")?,
            num_layers: u("num_hidden_layers")?,
            num_heads,
            num_kv_heads: u("num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            vocab_size: u("vocab_size")?,
            rope_theta: v
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0) as f32,
            rope_scaling,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            max_position_embeddings: u("max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            attention_bias: v
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(arch == Arch::Qwen2),
            qk_norm: arch == Arch::Qwen3,
        };
        cfg.validate()?;
        Ok(cfg)
    }

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
        // Sizes no real model comes near: refused before anything is allocated from them.
        for (name, v, max) in [
            ("layer count", self.num_layers, 1 << 16),
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
        let available = super::weights::available_memory();
        if p == 0 || p > u32::MAX as usize || rope > available {
            bail!(
                "model config: context length {p} is out of range (its position tables need \
                 {rope} bytes, {available} are available)"
            );
        }
        Ok(())
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn gqa_groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}
