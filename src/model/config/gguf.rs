//! [`ModelConfig::from_gguf`]: the shape from GGUF metadata, as llama.cpp's converter writes it.

// Data here comes from model files: no unwrap, expect or indexing that could panic on them (issue
// 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use super::{
    check_layer_count, default_sliding, gguf_attn_scale, layer_kinds, Arch, ModelConfig,
    RopeScaling,
};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;

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
}
