//! The architectures beside the Llama family — Gemma 2, Gemma 3, Phi-3, Mistral with a sliding
//! window, Qwen2 with sliding layers — against transformers, on the tiny seeded models of
//! fixtures/tiny (made by scripts/make_tiny_models.py; windows of 16 tokens, prompts over 100).
//!
//! Each model is loaded from its safetensors directory and from its GGUF file: greedy tokens
//! through `kvq generate` must be transformers' exactly, last-position logits within 1e-4; with
//! an 8-bit cache on every layer the tokens must stay the dense ones up to the first near-tie.
//! The SentencePiece GGUF tokenizers must give transformers' ids on multilingual text with
//! byte-fallback characters, and Gemma's chat template its rendering.

use crate::common::*;
use candle_core::{DType, Device};
use kvq::kv::cache::{CacheConfig, PagedKvCache};
use kvq::model::chat::Message;
use kvq::model::llama::{LogitsFor, SeqInput};
use kvq::model::load::{load, LoadedModel};
use kvq::model::options::ModelOptions;
use serde_json::Value;
use std::path::PathBuf;

const ARCHS: [&str; 5] = ["gemma2", "gemma3", "phi3", "mistral", "qwen2"];

fn dir(arch: &str) -> PathBuf {
    fixture("tiny").join(arch)
}

fn reference(arch: &str) -> Value {
    let path = dir(arch).join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Values in one K (or V) row of the model: KV heads × head_dim, from its config.json.
fn kv_width(arch: &str) -> u64 {
    let text = std::fs::read_to_string(dir(arch).join("hf/config.json")).unwrap();
    let c: Value = serde_json::from_str(&text).unwrap();
    let heads = c["num_attention_heads"].as_u64().unwrap();
    let head_dim = c["head_dim"]
        .as_u64()
        .unwrap_or(c["hidden_size"].as_u64().unwrap() / heads);
    c["num_key_value_heads"].as_u64().unwrap() * head_dim
}

/// The model's two files: the safetensors directory and the GGUF.
fn sources(arch: &str) -> [String; 2] {
    [
        dir(arch).join("hf").display().to_string(),
        dir(arch).join("model.gguf").display().to_string(),
    ]
}

fn load_f32(model: &str) -> LoadedModel {
    let args = ModelOptions {
        model: Some(model.to_string()),
        dtype: Some(DType::F32),
        ..ModelOptions::default()
    };
    load(&args, &Device::Cpu).unwrap_or_else(|e| panic!("{model}: {e:#}"))
}

/// A dense f32 cache with the model's per-layer windows.
fn cache_for(m: &LoadedModel, blocks: usize) -> PagedKvCache {
    let c = m.model.config();
    let mut cfg = CacheConfig::dense(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        16,
        blocks,
        DType::F32,
    );
    cfg.layer_windows = c.layers.iter().map(|l| l.window).collect();
    PagedKvCache::new(cfg, &Device::Cpu).unwrap()
}

/// `kvq generate --raw --temp 0 --dtype f32 --json --max-tokens 12` of `prompt` with `extra`
/// flags.
fn generate(model: &str, prompt: &str, extra: &[&str]) -> Value {
    generate_n(model, prompt, "12", extra)
}

/// [`generate`] of at most `max` tokens.
fn generate_n(model: &str, prompt: &str, max: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--raw",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--max-tokens",
        max,
        "--json",
    ];
    args.extend_from_slice(extra);
    args.push(prompt);
    let out = kvq(&args);
    assert!(out.status.success(), "{model}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn greedy_tokens_are_transformers_from_safetensors_and_gguf() {
    for arch in ARCHS {
        let r = reference(arch);
        let window = r["window"].as_u64().unwrap() as usize;
        for model in sources(arch) {
            for case in r["cases"].as_array().unwrap() {
                let want_prompt = ids(&case["input_ids"]);
                assert!(want_prompt.len() >= 3 * window, "{arch}: prompt too short");
                let out = generate(&model, case["prompt"].as_str().unwrap(), &[]);
                assert_eq!(
                    ids(&out["prompt_tokens"]),
                    want_prompt,
                    "{model}: prompt ids"
                );
                assert_eq!(
                    ids(&out["tokens"]),
                    ids(&case["generated_ids"]),
                    "{model}: greedy tokens"
                );
            }
        }
    }
}

#[test]
fn last_position_logits_are_transformers_within_1e_4() {
    for arch in ARCHS {
        let r = reference(arch);
        for model in sources(arch) {
            let m = load_f32(&model);
            for case in r["cases"].as_array().unwrap() {
                let prompt = ids(&case["input_ids"]);
                let mut cache = cache_for(&m, 64);
                cache.add_sequence(0).unwrap();
                // In chunks of 40, so windows are crossed inside and between forward passes.
                let mut logits = None;
                for chunk in prompt.chunks(40) {
                    cache.reserve(0, chunk.len()).unwrap();
                    let inp = [SeqInput {
                        seq: 0,
                        tokens: chunk.to_vec(),
                    }];
                    logits = Some(m.model.forward(&inp, &mut cache, LogitsFor::Last).unwrap());
                }
                let got: Vec<f32> = logits.unwrap().squeeze(0).unwrap().to_vec1().unwrap();
                let want: Vec<f32> = case["last_logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect();
                assert_eq!(got.len(), want.len(), "{model}: vocabulary");
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(
                    err < 1e-4,
                    "{model}: max |Δlogit| {err} (logits up to {scale})"
                );
                assert!(scale > 0.1, "{model}: logits too small to test ({scale})");
            }
        }
    }
}

#[test]
fn eight_bit_cache_on_every_layer_keeps_dense_tokens_until_a_near_tie() {
    for arch in ARCHS {
        let r = reference(arch);
        for model in sources(arch) {
            let mut compared = 0;
            for case in r["cases"].as_array().unwrap() {
                let want = ids(&case["generated_ids"]);
                let margins: Vec<f64> = case["margins"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m.as_f64().unwrap())
                    .collect();
                // Tokens before the first step whose top two logits are within 0.05 must match.
                let sure = margins.iter().position(|&m| m < 0.05).unwrap_or(want.len());
                let out = generate(
                    &model,
                    case["prompt"].as_str().unwrap(),
                    &["--kv-bits", "8", "--kv-group-size", "32"],
                );
                let got = ids(&out["tokens"]);
                assert_eq!(got[..sure], want[..sure], "{model}: 8-bit cache tokens");
                // Every layer is quantized, windowed ones included.
                let groups = out["stats"]["kv_groups"].as_array().unwrap();
                let dense = 2 * 4 * kv_width(arch);
                for g in groups {
                    let per_layer =
                        g["kv_bytes_per_token"].as_u64().unwrap() / g["layers"].as_u64().unwrap();
                    assert!(per_layer < dense / 3, "{model}: {g} is not 8-bit");
                }
                compared += sure;
            }
            // The Gemma fixtures are made with clear margins (scripts/make_tiny_models.py):
            // the test compares real tokens there.
            let least = if arch.starts_with("gemma") { 12 } else { 2 };
            assert!(
                compared >= least,
                "{model}: only {compared} tokens before a near-tie"
            );
        }
    }
}

/// `kvq generate --json` of the first Gemma 3 prompt for `max` tokens: the per-group stats.
fn gemma3_groups(extra: &[&str], max: &str) -> (usize, Vec<Value>) {
    let r = reference("gemma3");
    let prompt = r["cases"][0]["prompt"].as_str().unwrap();
    let model = sources("gemma3")[1].clone();
    let out = generate_n(&model, prompt, max, extra);
    let len = ids(&out["prompt_tokens"]).len() + ids(&out["tokens"]).len();
    let groups = out["stats"]["kv_groups"].as_array().unwrap().clone();
    let total: u64 = groups.iter().map(|g| g["kv_bytes"].as_u64().unwrap()).sum();
    assert_eq!(total, out["stats"]["kv_bytes"].as_u64().unwrap());
    (len, groups)
}

#[test]
fn windowed_layers_hold_a_flat_cache_while_the_global_layer_grows() {
    // Gemma 3: two layers slide over 16 tokens, one is global; blocks of 16. Between steps the
    // windowed group holds at most ceil(16/16) + 1 = 2 blocks, the global one every position.
    for extra in [&[][..], &["--kv-bits", "8", "--kv-group-size", "32"][..]] {
        let mut windowed = Vec::new();
        for max in ["8", "120"] {
            let (len, g) = gemma3_groups(extra, max);
            assert_eq!(g.len(), 2, "{g:?}");
            let (global, win) = (&g[0], &g[1]);
            assert!(global["window"].is_null() && win["window"] == 16, "{g:?}");
            assert_eq!(
                (global["layers"].as_u64(), win["layers"].as_u64()),
                (Some(1), Some(2))
            );
            let block = |g: &Value| 16 * g["kv_bytes_per_token"].as_u64().unwrap();
            // Two layers to one: the windowed group's token is twice the global one's.
            assert_eq!(block(win), 2 * block(global));
            // Measured after each step: the last step that kept the sequence wrote len - 2.
            let blocks = (len as u64 - 2).div_ceil(16);
            assert_eq!(
                global["kv_bytes"].as_u64().unwrap(),
                blocks * block(global),
                "{g:?}"
            );
            assert_eq!(win["kv_bytes"].as_u64().unwrap(), 2 * block(win), "{g:?}");
            windowed.push((len, win["kv_bytes"].clone()));
        }
        assert!(
            windowed[1].0 > windowed[0].0 + 64,
            "{windowed:?}: the long run stopped early"
        );
        assert_eq!(windowed[0].1, windowed[1].1);
    }
}

#[test]
fn sentencepiece_gguf_tokenizes_as_transformers() {
    for arch in ["gemma3", "mistral"] {
        let r = reference(arch);
        let t = &r["tokenizer"];
        let text = t["text"].as_str().unwrap();
        for model in sources(arch) {
            let m = load_f32(&model);
            let got = m.tokenizer.encode(text, false).unwrap();
            assert_eq!(got, ids(&t["ids"]), "{model}: ids of the multilingual text");
            assert_eq!(
                m.tokenizer.decode(&got, false).unwrap(),
                t["decoded"].as_str().unwrap(),
                "{model}: decoded text"
            );
            let chat: Vec<Message> = serde_json::from_value(t["chat"].clone()).unwrap();
            assert_eq!(
                m.encode_chat(&chat).unwrap(),
                ids(&t["chat_ids"]),
                "{model}: chat template rendering"
            );
        }
    }
    // The text does reach byte fallback (so the test covers it).
    let r = reference("gemma3");
    let m = load_f32(&sources("gemma3")[1]);
    let bytes = ids(&r["tokenizer"]["ids"])
        .iter()
        .filter(|&&id| {
            m.tokenizer
                .id_to_token(id)
                .is_some_and(|t| t.starts_with("<0x"))
        })
        .count();
    assert!(bytes > 10, "only {bytes} byte-fallback tokens");
}

#[test]
fn fully_windowed_model_holds_a_flat_cache() {
    // Mistral slides on every layer: once the window is full, decoding holds a fixed number of
    // blocks whatever the length.
    let m = load_f32(&sources("mistral")[1]);
    let mut cache = cache_for(&m, 64);
    cache.add_sequence(0).unwrap();
    let mut held = Vec::new();
    let mut token = 5u32;
    for _ in 0..80 {
        cache.reserve(0, 1).unwrap();
        let inp = [SeqInput {
            seq: 0,
            tokens: vec![token],
        }];
        let logits = m.model.forward(&inp, &mut cache, LogitsFor::Last).unwrap();
        token = kvq::engine::sampler::argmax_rows(&logits).unwrap()[0];
        held.push(cache.bytes_in_use());
    }
    // A new block is taken before the oldest leaves: one or two blocks of 16, never more.
    let block = cache.config().bytes_per_block();
    let early = *held[20..50].iter().max().unwrap();
    let late = *held[50..].iter().max().unwrap();
    assert_eq!(early, late, "{held:?}");
    assert!(late <= 2 * block, "{late} bytes held, blocks of {block}");
}

#[test]
fn batched_generation_equals_alone_on_a_sentencepiece_model() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    let r = reference("gemma3");
    let mut lines: Vec<String> = r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prompt"].as_str().unwrap().to_string())
        .collect();
    lines.push("Grüße aus München, 日本語のテキスト".into());
    lines.push("The workshop".into());
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let model = sources("gemma3")[1].clone();
    let run = |batch: &str| -> Vec<(String, Vec<u32>)> {
        let out = tmp.path().join(format!("out{batch}.jsonl"));
        let o = kvq(&[
            "batch-generate",
            prompts.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--model",
            &model,
            "--raw",
            "--temp",
            "0",
            "--dtype",
            "f32",
            "--max-tokens",
            "20",
            "--no-progress",
            "--max-batch",
            batch,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let mut recs: Vec<(String, Vec<u32>)> = std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                (v["id"].to_string(), ids(&v["tokens"]))
            })
            .collect();
        recs.sort();
        recs
    };
    let alone = run("1");
    assert_eq!(alone.len(), lines.len());
    assert_eq!(run("4"), alone);
}

#[test]
fn unsupported_architectures_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(dir("gemma3").join("hf").join(f), tmp.path().join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(dir("gemma3").join("hf/config.json")).unwrap();
    let cfg = cfg.replace("\"gemma3_text\"", "\"falcon\"");
    std::fs::write(tmp.path().join("config.json"), cfg).unwrap();
    let o = kvq(&[
        "generate",
        "--model",
        tmp.path().to_str().unwrap(),
        "--raw",
        "hi",
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("'falcon'")
            && e.contains("gemma2")
            && e.contains("gemma3")
            && e.contains("phi3"),
        "{e}"
    );
}
