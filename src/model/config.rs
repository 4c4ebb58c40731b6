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

/// Which layers slide by default when the config lists none: Gemma 2 every other layer from
/// the first, Gemma 3 five of every six, Mistral and Phi-3 all of them (when a window is set),
/// Qwen2 the layers from `max_window_layers` on.
/// Most layers a config may claim: checked as soon as the count is read, before per-layer
/// tables are built from it (the same bound `validate` applies).
const MAX_LAYERS: usize = 1 << 16;

fn check_layer_count(n: usize) -> Result<usize> {
    if n > MAX_LAYERS {
        bail!("model config: layer count {n} is out of range (at most {MAX_LAYERS})");
    }
    Ok(n)
}

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
        let num_layers = check_layer_count(get_u("block_count")?)?;
        let rope_theta = get_f("rope.freq_base").unwrap_or(10_000.0);
        let window = get_u("attention.sliding_window").ok().filter(|&w| w > 0);
        let sliding = match md.get(&key("attention.sliding_window_pattern")) {
            Some(gguf_file::Value::Array(a)) => {
                let v: Vec<bool> = a
                    .iter()
                    .map(|x| x.to_bool())
                    .collect::<std::result::Result<_, _>>()
                    .with_context(|| {
                        format!(
                            "{} is not an array of bools",
                            key("attention.sliding_window_pattern")
                        )
                    })?;
                if v.len() != num_layers {
                    bail!(
                        "{} has {} entries for {num_layers} layers",
                        key("attention.sliding_window_pattern"),
                        v.len()
                    );
                }
                v
            }
            // Qwen2 GGUFs carry no window (llama.cpp runs them global).
            _ if arch == Arch::Qwen2 => vec![false; num_layers],
            _ => default_sliding(arch, num_layers, 0),
        };
        let local_theta = match arch {
            // llama.cpp's default for Gemma 3's local layers.
            Arch::Gemma3 => get_f("rope.freq_base_swa").unwrap_or(10_000.0),
            _ => get_f("rope.freq_base_swa").unwrap_or(rope_theta),
        };
        let softcap = |k: &str| get_f(k).filter(|&c| c > 0.0);
        let rope_scaling = match md.get(&key("rope.scaling.type")).map(|v| v.to_string()) {
            None => None,
            Some(Ok(t)) if t == "none" => None,
            Some(Ok(t)) if t == "linear" => match get_f("rope.scaling.factor") {
                Some(f) if f > 0.0 && f.is_finite() && f != 1.0 => {
                    Some(RopeScaling::Linear { factor: f })
                }
                Some(1.0) => None,
                f => bail!(
                    "GGUF {} is {f:?}: a linear RoPE scaling needs a positive factor",
                    key("rope.scaling.factor")
                ),
            },
            Some(Ok(t)) => bail!(
                "GGUF {} '{t}' is not supported (kvq knows none and linear)",
                key("rope.scaling.type")
            ),
            Some(Err(_)) => bail!("GGUF {} is not a string", key("rope.scaling.type")),
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta,
            rope_scaling,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64,
            max_position_embeddings: get_u("context_length").unwrap_or(4096),
            tie_word_embeddings: !has_output,
            attention_bias: has_q_bias,
            qk_norm: has_q_norm,
            layers: layer_kinds(&sliding, window, rope_theta, local_theta),
            attn_scale: gguf_attn_scale(
                arch,
                get_f("attention.scale"),
                num_layers,
                hidden_size,
                num_heads,
                head_dim,
            ),
            attn_softcap: if arch == Arch::Gemma2 {
                softcap("attn_logit_softcapping")
            } else {
                None
            },
            final_softcap: if arch == Arch::Gemma2 {
                softcap("final_logit_softcapping")
            } else {
                None
            },
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
        // transformers 5 writes `rope_parameters` (per layer type for Gemma 3) instead of
        // `rope_theta` / `rope_scaling`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let typed = |t: &str| rope_params.and_then(|p| p.get(t)).filter(|p| p.is_object());
        let global_params = typed("full_attention").or(rope_params);
        let theta_of =
            |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
        let rope_theta = theta_of(global_params)
            .or_else(|| v.get("rope_theta").and_then(Value::as_f64))
            .unwrap_or(10_000.0) as f32;
        let local_theta = theta_of(typed("sliding_attention"))
            .or_else(|| v.get("rope_local_base_freq").and_then(Value::as_f64))
            .map_or(rope_theta, |t| t as f32);
        if let Some(f) = global_params
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or_else(|| v.get("partial_rotary_factor").and_then(Value::as_f64))
        {
            if f != 1.0 {
                bail!("partial_rotary_factor {f} is not supported (kvq rotates whole heads)");
            }
        }
        let scaling = match v.get("rope_scaling") {
            Some(Value::Null) | None => global_params.filter(|p| {
                p.get("rope_type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t != "default")
            }),
            Some(rs) => Some(rs),
        };
        let rope_type = |rs: &Value| {
            rs.get("rope_type")
                .or_else(|| rs.get("type"))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let rope_scaling = match scaling {
            Some(rs) if rope_type(rs).as_deref() == Some("linear") => {
                match rs.get("factor").and_then(Value::as_f64) {
                    Some(f) if f > 0.0 && f.is_finite() => {
                        Some(RopeScaling::Linear { factor: f as f32 })
                    }
                    _ => bail!("rope_scaling {rs}: a linear scaling needs a positive factor"),
                }
            }
            Some(rs) if rope_type(rs).as_deref() == Some("llama3") => {
                let f = |k: &str| rs.get(k).and_then(Value::as_f64).map(|x| x as f32);
                Some(RopeScaling::Llama3(Llama3RopeScaling {
                    factor: f("factor").context("rope_scaling.factor")?,
                    low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: rs
                        .get("original_max_position_embeddings")
                        .and_then(Value::as_u64)
                        .unwrap_or(8192)
                        as usize,
                }))
            }
            None => None,
            Some(rs) => bail!("unsupported rope_scaling {rs}"),
        };
        let num_layers = check_layer_count(u("num_hidden_layers")?)?;
        let window = v
            .get("sliding_window")
            .and_then(Value::as_u64)
            .map(|w| w as usize)
            .filter(|&w| w > 0)
            .filter(|_| {
                arch != Arch::Qwen2
                    || v.get("use_sliding_window").and_then(Value::as_bool) == Some(true)
            });
        let sliding = match v.get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != num_layers {
                    bail!(
                        "layer_types has {} entries for {num_layers} layers",
                        types.len()
                    );
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => bail!(
                            "layer_types entry {t} is not supported (kvq knows sliding_attention, \
                             full_attention)"
                        ),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let first = v
                    .get("max_window_layers")
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize;
                match v.get("sliding_window_pattern").and_then(Value::as_u64) {
                    Some(p) if p > 0 && arch == Arch::Gemma3 => {
                        (0..num_layers).map(|l| (l + 1) % p as usize != 0).collect()
                    }
                    _ => default_sliding(arch, num_layers, first),
                }
            }
        };
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        let attn_scale = match f("query_pre_attn_scalar") {
            Some(s) if arch.is_gemma() => 1.0 / s.sqrt(),
            _ => 1.0 / (head_dim as f64).sqrt(),
        };
        if arch.is_gemma() {
            let act = v
                .get("hidden_activation")
                .or_else(|| v.get("hidden_act"))
                .and_then(Value::as_str)
                .unwrap_or("gelu_pytorch_tanh");
            if act != "gelu_pytorch_tanh" {
                bail!("hidden_activation {act} is not supported for Gemma (kvq runs gelu_pytorch_tanh)");
            }
        }
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: u("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads: u("num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            vocab_size: u("vocab_size")?,
            rope_theta,
            rope_scaling,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            max_position_embeddings: u("max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(arch.is_gemma()),
            attention_bias: v
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(arch == Arch::Qwen2),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            layers: layer_kinds(&sliding, window, rope_theta, local_theta),
            attn_scale,
            attn_softcap: f("attn_logit_softcapping")
                .filter(|&c| c > 0.0 && arch == Arch::Gemma2)
                .map(|c| c as f32),
            final_softcap: f("final_logit_softcapping")
                .filter(|&c| c > 0.0 && arch.is_gemma())
                .map(|c| c as f32),
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
#[path = "config_tests.rs"]
mod tests;
