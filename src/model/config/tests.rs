//! GGUF metadata as llama.cpp's converter writes it for Gemma models, and Hugging Face
//! configs with RoPE scaling and sliding windows.

use super::*;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value as G, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;

/// A Gemma 3 GGUF header as llama.cpp writes it: no `sliding_window_pattern` array (the
/// pattern of 6 is implied), `rope.freq_base` of the global layers only.
fn gemma3(layers: u32, hidden: u32, heads: u32, extra: &[(&str, G)]) -> Content {
    let mut md: HashMap<String, G> = HashMap::new();
    md.insert("general.architecture".into(), G::String("gemma3".into()));
    for (k, v) in [
        ("block_count", G::U32(layers)),
        ("embedding_length", G::U32(hidden)),
        ("feed_forward_length", G::U32(4 * hidden)),
        ("attention.head_count", G::U32(heads)),
        ("attention.head_count_kv", G::U32(heads / 2)),
        ("attention.key_length", G::U32(128)),
        ("attention.value_length", G::U32(128)),
        ("attention.sliding_window", G::U32(1024)),
        ("rope.freq_base", G::F32(1_000_000.0)),
        ("context_length", G::U32(8192)),
        ("attention.layer_norm_rms_epsilon", G::F32(1e-6)),
        ("vocab_size", G::U32(1000)),
    ] {
        md.insert(format!("gemma3.{k}"), v);
    }
    for (k, v) in extra {
        md.insert(format!("gemma3.{k}"), v.clone());
    }
    let info = || TensorInfo {
        ggml_dtype: GgmlDType::F32,
        shape: candle_core::Shape::from(1usize),
        offset: 0,
    };
    let tensor_infos = ["blk.0.attn_q_norm.weight", "token_embd.weight"]
        .iter()
        .map(|n| (n.to_string(), info()))
        .collect();
    Content {
        magic: VersionedMagic::GgufV3,
        metadata: md,
        tensor_infos,
        tensor_data_offset: 0,
    }
}

#[test]
fn llama_cpp_gemma3_layout_takes_the_default_pattern_and_local_base() {
    let c = ModelConfig::from_gguf(&gemma3(12, 512, 4, &[])).unwrap();
    let windows: Vec<Option<usize>> = c.layers.iter().map(|l| l.window).collect();
    let want: Vec<Option<usize>> = (0..12).map(|l| (l % 6 != 5).then_some(1024)).collect();
    assert_eq!(windows, want);
    // Local layers on llama.cpp's 10000, the global ones on the file's base; no scaling.
    assert_eq!(c.layers[0].rope_theta, 10_000.0);
    assert_eq!(c.layers[5].rope_theta, 1_000_000.0);
    assert_eq!(c.rope_scaling, None);
    assert!(c.qk_norm && c.tie_word_embeddings);
    assert!((c.attn_scale - 1.0 / 128f64.sqrt()).abs() < 1e-12);
}

#[test]
fn gguf_linear_rope_scaling_and_attention_scale_are_read() {
    let scaled = [
        ("rope.scaling.type", G::String("linear".into())),
        ("rope.scaling.factor", G::F32(8.0)),
    ];
    let c = ModelConfig::from_gguf(&gemma3(12, 512, 4, &scaled)).unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
    // A factor of 1 and type none scale nothing; other types are refused by name.
    let none = [("rope.scaling.type", G::String("none".into()))];
    assert_eq!(
        ModelConfig::from_gguf(&gemma3(12, 512, 4, &none))
            .unwrap()
            .rope_scaling,
        None
    );
    let yarn = [("rope.scaling.type", G::String("yarn".into()))];
    let e = ModelConfig::from_gguf(&gemma3(12, 512, 4, &yarn)).unwrap_err();
    assert!(format!("{e:#}").contains("'yarn'"), "{e:#}");
    // An explicit attention.scale wins.
    let s = [("attention.scale", G::F32(0.125))];
    let c = ModelConfig::from_gguf(&gemma3(12, 512, 4, &s)).unwrap();
    assert_eq!(c.attn_scale, 0.125);
    // Gemma 3 27B (62 layers): queries scaled by hidden / heads, as llama.cpp does.
    let c = ModelConfig::from_gguf(&gemma3(62, 5376, 32, &[])).unwrap();
    assert!((c.attn_scale - 1.0 / 168f64.sqrt()).abs() < 1e-12);
}

#[test]
fn hf_linear_rope_scaling_in_both_spellings() {
    let base = serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "vocab_size": 100, "sliding_window": 16, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64,
    });
    let with = |k: &str, v: serde_json::Value| {
        let mut c = base.clone();
        c[k] = v;
        ModelConfig::from_hf_json(&c)
    };
    let linear = Some(RopeScaling::Linear { factor: 8.0 });
    let c = with(
        "rope_scaling",
        serde_json::json!({"rope_type": "linear", "factor": 8.0}),
    )
    .unwrap();
    assert_eq!(c.rope_scaling, linear);
    let c = with(
        "rope_scaling",
        serde_json::json!({"type": "linear", "factor": 8.0}),
    )
    .unwrap();
    assert_eq!(c.rope_scaling, linear);
    // transformers 5: per layer type, the global layers scaled.
    let c = with(
        "rope_parameters",
        serde_json::json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }),
    )
    .unwrap();
    assert_eq!(c.rope_scaling, linear);
    assert!(with("rope_scaling", serde_json::json!({"rope_type": "linear"})).is_err());
}

#[test]
fn phi3_mini_window_covers_every_layer() {
    // Phi-3-mini-4k-instruct's config.json (the parts kvq reads): one window for all layers.
    let v = serde_json::json!({
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": null, "sliding_window": 2047,
        "tie_word_embeddings": false,
    });
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!(c.arch, Arch::Phi3);
    assert_eq!(c.layers.len(), 32);
    assert!(
        c.layers.iter().all(|l| l.window == Some(2047)),
        "{:?}",
        c.layers
    );
    assert_eq!(c.sliding_window(), Some(2047));
    // Without a window every layer is global.
    let mut g = v.clone();
    g["sliding_window"] = serde_json::Value::Null;
    let c = ModelConfig::from_hf_json(&g).unwrap();
    assert!(c.layers.iter().all(|l| l.window.is_none()));
}
