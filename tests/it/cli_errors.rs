//! Bad input gets a one-line cause and exit code 1 — never a panic (exit 101).

use crate::common::*;
use std::io::Write;

/// A minimal GGUF v3 file: metadata key/strings and one 2-D tensor of raw type `ggml_type`.
fn tiny_gguf(arch: &str, ggml_type: u32) -> Vec<u8> {
    fn s(out: &mut Vec<u8>, x: &str) {
        out.extend((x.len() as u64).to_le_bytes());
        out.extend(x.as_bytes());
    }
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes()); // string
    s(&mut b, arch);
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(ggml_type.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(vec![0u8; 32 * 4 * 4]);
    b
}

#[test]
fn missing_model_file() {
    fails_with(
        &["generate", "--model", "/nonexistent/dir/model.gguf", "hi"],
        "no such file",
    );
}

#[test]
fn corrupt_model_file() {
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(b"this is not a gguf file at all, just text\n")
        .unwrap();
    fails_with(
        &["generate", "--model", f.path().to_str().unwrap(), "hi"],
        "not a readable GGUF model file",
    );
}

#[test]
fn truncated_model_file() {
    let full = kvq::model::fetch::default_model().unwrap();
    let bytes = std::fs::read(&full).unwrap();
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(&bytes[..bytes.len() / 2]).unwrap();
    fails_with(
        &["generate", "--model", f.path().to_str().unwrap(), "hi"],
        "is truncated",
    );
}

#[test]
fn unsupported_architecture() {
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(&tiny_gguf("falcon", 0)).unwrap();
    fails_with(
        &["generate", "--model", f.path().to_str().unwrap(), "hi"],
        "unsupported model architecture 'falcon'",
    );
}

#[test]
fn unsupported_tensor_type() {
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(&tiny_gguf("llama", 16)).unwrap(); // IQ2_XXS
    fails_with(
        &["generate", "--model", f.path().to_str().unwrap(), "hi"],
        "unsupported tensor type",
    );
}

#[test]
fn empty_prompt() {
    fails_with(&["generate", ""], "the prompt is empty");
    fails_with(&["generate", "   "], "the prompt is empty");
    fails_with(&["generate"], "no prompt");
}

#[test]
fn prompt_longer_than_context_window() {
    let cfg = fixture("tiny-llama/config.json");
    let long = "the quick brown fox jumps over the lazy dog ".repeat(20);
    fails_with(
        &[
            "generate",
            "--load-format",
            "dummy",
            "--config",
            cfg.to_str().unwrap(),
            "--raw",
            &long,
        ],
        "but the model's context window is 64 tokens",
    );
}

#[test]
fn unknown_device() {
    fails_with(
        &["generate", "--device", "tpu", "hi"],
        "unknown device 'tpu'",
    );
    fails_with(
        &["generate", "--device", "cuda:x", "hi"],
        "invalid device ordinal",
    );
    if !candle_core::utils::cuda_is_available() {
        fails_with(
            &["generate", "--device", "cuda", "hi"],
            "built without CUDA",
        );
    }
}

#[test]
fn conflicting_flags() {
    fails_with(
        &["generate", "--raw", "--system", "be brief", "hi"],
        "--raw",
    );
    fails_with(&["generate", "--messages", "m.json", "hi"], "not both");
    fails_with(&["generate", "--temp=-1", "hi"], "--temp");
    fails_with(&["generate", "--max-tokens", "0", "hi"], "--max-tokens");
    fails_with(
        &[
            "generate",
            "--dequantize",
            "--load-format",
            "dummy",
            "--config",
            fixture("tiny-llama/config.json").to_str().unwrap(),
            "hi",
        ],
        "--dequantize",
    );
}

#[test]
fn bad_kv_scheme_and_widths() {
    fails_with(&["generate", "--kv-key-bits", "8", "hi"], "--kv-value-bits");
    fails_with(
        &["generate", "--kv-bits", "4", "--kv-value-bits", "7", "hi"],
        "--kv-value-bits 7",
    );
    fails_with(
        &["generate", "--kv-quant-scheme", "rotated", "hi"],
        "--kv-bits",
    );
    // head_dim 96 = 192 / 2: the Hadamard transform needs a power of two.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 192, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 49152, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let dummy = [
        "generate",
        "--load-format",
        "dummy",
        "--config",
        cfg.to_str().unwrap(),
        "--raw",
        "--max-tokens",
        "2",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
    ];
    let mut rotated = dummy.to_vec();
    rotated.extend(["--kv-quant-scheme", "rotated", "hi"]);
    fails_with(&rotated, "power-of-two head_dim");
    // Without the flag such a model falls back to plain affine groups.
    let mut plain = dummy.to_vec();
    plain.push("hi");
    let out = kvq(&plain);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn bad_messages_file() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(b"{\"role\": \"user\"}").unwrap();
    let out = kvq(&["generate", "--messages", f.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(f.path().to_str().unwrap()),
        "{}",
        stderr(&out)
    );
}

#[test]
fn generation_stops_at_the_end_of_the_window() {
    let cfg = fixture("tiny-llama/config.json");
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(4);
    let out = kvq(&[
        "generate",
        "--load-format",
        "dummy",
        "--config",
        cfg.to_str().unwrap(),
        "--raw",
        "--temp",
        "0",
        "--max-tokens",
        "500",
        "--json",
        &prompt,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["finish_reason"], "length");
    let p = v["prompt_tokens"].as_array().unwrap().len();
    let g = v["tokens"].as_array().unwrap().len();
    assert!(p < 64);
    assert_eq!(
        p + g,
        64,
        "prompt {p} + generated {g} should fill the 64-token window"
    );
}

#[test]
fn prompt_file_gives_the_same_prompt_and_bad_files_are_refused() {
    let cfg = fixture("tiny-llama/config.json");
    let cfg = cfg.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = "the quick brown fox jumps over the lazy dog";
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, format!("{text}\n")).unwrap();
    let file = file.to_str().unwrap();
    let base = [
        "generate",
        "--load-format",
        "dummy",
        "--config",
        cfg,
        "--raw",
    ];
    let ids = |extra: &[&str]| -> serde_json::Value {
        let mut args = base.to_vec();
        args.extend_from_slice(&["--max-tokens", "1", "--json"]);
        args.extend_from_slice(extra);
        let out = kvq(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["prompt_tokens"].clone()
    };
    // The file's trailing newline is dropped: the same ids as the argument.
    assert_eq!(ids(&["--prompt-file", file]), ids(&[text]));

    let mut both = base.to_vec();
    both.extend_from_slice(&["--prompt-file", file, text]);
    fails_with(&both, "either a PROMPT or --prompt-file");
    let missing = dir.path().join("nope.txt");
    let mut gone = base.to_vec();
    gone.extend_from_slice(&["--prompt-file", missing.to_str().unwrap()]);
    fails_with(&gone, "nope.txt");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n").unwrap();
    let mut blank = base.to_vec();
    blank.extend_from_slice(&["--prompt-file", empty.to_str().unwrap()]);
    fails_with(&blank, "the prompt is empty");
}
