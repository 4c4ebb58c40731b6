//! [`ModelConfig::from_hf_json`]: the shape from a Hugging Face config.json (transformers 4 and
//! 5 spellings).

// Data here comes from model files: no unwrap, expect or indexing that could panic on them (issue
// 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use super::{
    check_layer_count, default_sliding, layer_kinds, Arch, Llama3RopeScaling, ModelConfig,
    RopeScaling,
};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

impl ModelConfig {
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
        let (rope_theta, local_theta, rope_scaling) = rope(v)?;
        let num_layers = check_layer_count(u("num_hidden_layers")?)?;
        let (window, sliding) = sliding(v, arch, num_layers)?;
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
}

/// RoPE bases of the global and the local (sliding-window) layers, and the global layers'
/// scaling. transformers 5 writes `rope_parameters` (per layer type for Gemma 3) instead of
/// `rope_theta` / `rope_scaling`.
fn rope(v: &Value) -> Result<(f32, f32, Option<RopeScaling>)> {
    let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
    let typed = |t: &str| rope_params.and_then(|p| p.get(t)).filter(|p| p.is_object());
    let global_params = typed("full_attention").or(rope_params);
    let theta_of = |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
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
                    .unwrap_or(8192) as usize,
            }))
        }
        None => None,
        Some(rs) => bail!("unsupported rope_scaling {rs}"),
    };
    Ok((rope_theta, local_theta, rope_scaling))
}

/// The sliding window and which layers attend through it (`layer_types`, Gemma 3's
/// `sliding_window_pattern`, Qwen2's `max_window_layers`, else the architecture's default).
fn sliding(v: &Value, arch: Arch, num_layers: usize) -> Result<(Option<usize>, Vec<bool>)> {
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
    Ok((window, sliding))
}
