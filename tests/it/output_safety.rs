//! No panic, abort or hang on hostile shapes and outputs, one failing request ends alone, and
//! messages that name the real problem (issue 21). Each test drives the CLI.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn gguf_string(out: &mut Vec<u8>, x: &str) {
    out.extend((x.len() as u64).to_le_bytes());
    out.extend(x.as_bytes());
}

/// A GGUF v3 header with `tensors` claimed tensors (none stored) and llama shape metadata,
/// `overrides` replacing the default u32 values.
fn gguf_with(tensors: u64, overrides: &[(&str, u32)]) -> Vec<u8> {
    let mut kv: Vec<(String, u32)> = [
        ("embedding_length", 64),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
        ("feed_forward_length", 64),
        ("block_count", 1),
        ("context_length", 64),
        ("vocab_size", 8),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), *v))
    .collect();
    for (k, v) in overrides {
        kv.iter_mut().find(|(n, _)| n == k).unwrap().1 = *v;
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend((kv.len() as u64 + 1).to_le_bytes());
    gguf_string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    gguf_string(&mut b, "llama");
    for (k, v) in kv {
        gguf_string(&mut b, &format!("llama.{k}"));
        b.extend(4u32.to_le_bytes());
        b.extend(v.to_le_bytes());
    }
    b.extend(vec![0u8; 64]);
    b
}

/// The default model's token strings, by id.
fn model_tokens() -> Vec<String> {
    let model = kvq::model::fetch::default_model().unwrap();
    let mut r = std::fs::File::open(&model).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut r).unwrap();
    match content.metadata.get("tokenizer.ggml.tokens") {
        Some(candle_core::quantized::gguf_file::Value::Array(a)) => {
            a.iter().map(|t| t.to_string().unwrap().clone()).collect()
        }
        _ => panic!("no vocabulary"),
    }
}

/// A word-level tokenizer.json whose token `tokens[i]` has id i.
fn write_word_level(path: &Path, tokens: &[String]) {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), Value::from(i)))
        .collect();
    assert_eq!(vocab.len(), tokens.len(), "duplicate token strings");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": tokens[0]}
    });
    std::fs::write(path, json.to_string()).unwrap();
}

#[test]
fn a_tokenizer_is_checked_token_by_token() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = model_tokens();
    // The model's size, other tokens.
    let other: Vec<String> = (0..tokens.len()).map(|i| format!("t{i}")).collect();
    let tok = dir.path().join("other.json");
    write_word_level(&tok, &other);
    fails_with(
        &["generate", "--tokenizer", s(&tok), "--raw", "hi"],
        "is another vocabulary",
    );
    // Only the EOS token swapped with another: refused, naming that token.
    let mut swapped = tokens.clone();
    let eos = tokens.iter().position(|t| t == "<|im_end|>").unwrap();
    swapped.swap(eos, 100);
    write_word_level(&tok, &swapped);
    let e = fails_with(
        &["generate", "--tokenizer", s(&tok), "--raw", "hi"],
        "is another vocabulary",
    );
    assert!(e.contains(&format!("token {eos} ")), "{e}");
    // The model's own vocabulary: the same tokens, stopping at the model's EOS.
    write_word_level(&tok, &tokens);
    let run = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--raw",
            "--temp",
            "0",
            "--max-tokens",
            "6",
            "--json",
        ];
        a.extend(extra);
        a.push("hi");
        let o = kvq(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["tokens"].clone()
    };
    assert_eq!(run(&["--tokenizer", s(&tok)]), run(&[]));
}

/// A GGUF metadata value.
#[derive(Clone, Copy)]
enum Meta<'a> {
    U32(u32),
    Str(&'a str),
    Strs(&'a [&'a str]),
}

/// A GGUF v3 file: `meta`, then F32 tensors of the given GGML dimensions (fastest first),
/// aligned to 32 bytes and filled with 0.01.
fn gguf_file(meta: &[(&str, Meta)], tensors: &[(&str, &[u64])]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        gguf_string(&mut b, k);
        match v {
            Meta::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::Str(x) => {
                b.extend(8u32.to_le_bytes());
                gguf_string(&mut b, x);
            }
            Meta::Strs(xs) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((xs.len() as u64).to_le_bytes());
                for x in *xs {
                    gguf_string(&mut b, x);
                }
            }
        }
    }
    let sizes: Vec<u64> = tensors
        .iter()
        .map(|(_, d)| d.iter().product::<u64>() * 4)
        .collect();
    let mut offset = 0u64;
    for ((name, dims), size) in tensors.iter().zip(&sizes) {
        gguf_string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += size.div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    for size in sizes {
        for _ in 0..size / 4 {
            b.extend(0.01f32.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
    }
    b
}

/// A one-layer llama GGUF of 64 wide with an 8-token vocabulary, `extra` metadata added, and
/// the token embeddings and a Q projection of `q_rows` rows stored.
fn tiny_llama_gguf(extra: &[(&str, Meta)], q_rows: u64) -> Vec<u8> {
    let mut meta = vec![
        ("general.architecture", Meta::Str("llama")),
        ("llama.embedding_length", Meta::U32(64)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(64)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(64)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        (
            "tokenizer.ggml.tokens",
            Meta::Strs(&["a", "b", "c", "d", "e", "f", "g", "h"]),
        ),
    ];
    meta.extend(extra.iter().copied());
    gguf_file(
        &meta,
        &[
            ("token_embd.weight", &[64, 8]),
            ("blk.0.attn_q.weight", &[64, q_rows]),
        ],
    )
}

#[test]
fn a_bad_alignment_or_an_empty_attention_tensor_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (v, name) in [(0, "a0.gguf"), (24, "a24.gguf")] {
        let g = temp_file(
            dir.path(),
            name,
            &tiny_llama_gguf(&[("general.alignment", Meta::U32(v))], 64),
        );
        fails_with(
            &["generate", "--model", s(&g), "--raw", "a"],
            &format!("general.alignment is {v}: it must be a power of two"),
        );
    }
    // A Q projection of no rows (candle cannot even read it), and of too few rows (checked
    // before its rows are un-permuted).
    let g = temp_file(dir.path(), "q0.gguf", &tiny_llama_gguf(&[], 0));
    fails_with(
        &["generate", "--model", s(&g), "--raw", "a"],
        "tensor blk.0.attn_q.weight has a dimension of 0",
    );
    let g = temp_file(dir.path(), "q2.gguf", &tiny_llama_gguf(&[], 2));
    fails_with(
        &["generate", "--model", s(&g), "--raw", "a"],
        "tensor blk.0.attn_q.weight has shape [2, 64], the config expects [64, 64]",
    );
}

fn temp_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn zero_head_counts_are_refused_not_divided_by() {
    let dir = tempfile::tempdir().unwrap();
    let g = temp_file(
        dir.path(),
        "h0.gguf",
        &gguf_with(0, &[("attention.head_count", 0)]),
    );
    fails_with(&["generate", "--model", s(&g), "hi"], "invalid head counts");
    let cfg = temp_file(
        dir.path(),
        "config.json",
        br#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 0, "vocab_size": 49152}"#,
    );
    fails_with(
        &[
            "generate",
            "--load-format",
            "dummy",
            "--config",
            s(&cfg),
            "--raw",
            "hi",
        ],
        "invalid head counts",
    );
}

#[test]
fn counts_near_two_to_the_32_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let g = temp_file(dir.path(), "t.gguf", &gguf_with(1 << 32, &[]));
    fails_with(
        &["generate", "--model", s(&g), "hi"],
        "4294967296 tensors claimed",
    );
    let g = temp_file(
        dir.path(),
        "c.gguf",
        &gguf_with(0, &[("context_length", u32::MAX)]),
    );
    fails_with(
        &["generate", "--model", s(&g), "hi"],
        "context length 4294967295",
    );
    let g = temp_file(
        dir.path(),
        "l.gguf",
        &gguf_with(0, &[("block_count", u32::MAX)]),
    );
    fails_with(
        &["generate", "--model", s(&g), "hi"],
        "layer count 4294967295",
    );
    // A metadata string claiming 4 GiB.
    let mut b = gguf_with(0, &[]);
    b.truncate(16);
    b.extend(1u64.to_le_bytes()); // one metadata entry
    b.extend((u32::MAX as u64).to_le_bytes());
    b.extend(vec![0u8; 64]);
    let g = temp_file(dir.path(), "s.gguf", &b);
    fails_with(
        &["generate", "--model", s(&g), "hi"],
        "claims 4294967295 bytes",
    );
}

#[test]
fn huge_sizes_are_refused_not_aborted() {
    fails_with(
        &[
            "bench-kv-cache",
            "--layers",
            "1000",
            "--seq-len",
            "1000000",
            "--heads",
            "64",
        ],
        "more than the",
    );
    fails_with(
        &[
            "bench-kv-cache",
            "--layers",
            "4294967296",
            "--seq-len",
            "4294967296",
            "--heads",
            "4294967296",
        ],
        "more than 16 EiB",
    );
    // Staging beyond the context window is never used, so a huge threshold costs nothing.
    let o = kvq(&[
        "generate",
        "--kv-bits",
        "4",
        "--quantized-kv-start",
        "1000000",
        "--raw",
        "--temp",
        "0",
        "--max-tokens",
        "2",
        "hi",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Runs kvq with stdout into a pipe whose reader is gone; returns its output.
fn into_closed_pipe(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

#[test]
fn json_into_a_closed_pipe_or_a_full_disk_is_an_error_not_a_panic() {
    let gen = ["generate", "--raw", "--max-tokens", "2", "--json", "hi"];
    let dir = tempfile::tempdir().unwrap();
    let text = temp_file(
        dir.path(),
        "t.txt",
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
            .as_bytes(),
    );
    let ppl = ["perplexity", s(&text), "--ctx", "8", "--json"];
    let bench = [
        "bench-kv-cache",
        "--layers",
        "1",
        "--seq-len",
        "64",
        "--heads",
        "2",
        "--repeats",
        "1",
        "--no-attention",
        "--json",
    ];
    let batch_bench = [
        "bench-batch",
        "--npp",
        "4",
        "--ntg",
        "2",
        "--npl",
        "1",
        "--no-warmup",
        "--json",
    ];
    for args in [&gen[..], &ppl[..], &bench[..], &batch_bench[..]] {
        let o = into_closed_pipe(args);
        assert_fails_with(
            &o,
            &format!("{args:?} closed pipe"),
            "cannot write to standard output",
        );
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_kvq"))
            .args(args)
            .stdout(full)
            .output()
            .unwrap();
        assert_fails_with(&o, &format!("{args:?} /dev/full"), "No space left");
    }
}

#[test]
fn stream_outputs_are_written_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let input = temp_file(dir.path(), "in.txt", b"The sky is\nOne, two,\n");
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(["batch-generate", s(&input), "-o", "/dev/stdout"])
        .args(["--raw", "--max-tokens", "2", "--no-progress"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("-o /dev/stdout into a pipe hangs");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8(o.stdout).unwrap().lines().count(), 2);
    fails_with(
        &[
            "batch-generate",
            s(&input),
            "-o",
            "/dev/full",
            "--raw",
            "--max-tokens",
            "2",
            "--no-progress",
        ],
        "No space left",
    );
    fails_with(
        &["batch-generate", s(&input), "-o", "/dev/null", "--resume"],
        "--resume needs a regular file",
    );
}

/// A one-layer llama of random weights whose embedding of the word "bad" is NaN, with an
/// output projection of its own (so the NaN reaches only sequences that contain "bad").
fn nan_model(dir: &Path) -> PathBuf {
    use candle_core::{DType, Device, Tensor};
    use std::collections::HashMap;
    let m = dir.join("nan-model");
    std::fs::create_dir(&m).unwrap();
    std::fs::write(
        m.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 8, "max_position_embeddings": 64, "tie_word_embeddings": false,
            "bos_token_id": 1, "eos_token_id": 2}"#,
    )
    .unwrap();
    std::fs::write(
        m.join("tokenizer.json"),
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1,
            "</s>": 2, "hi": 3, "bad": 4, "w": 5, "x": 6, "y": 7}, "unk_token": "<unk>"}}"#,
    )
    .unwrap();
    let dev = Device::Cpu;
    let mut seed = 0u32;
    let mut rand = |shape: (usize, usize)| {
        seed += 1;
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let h = (i as u32 + 1).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503);
                (h % 1000) as f32 / 5000.0 - 0.1
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let mut embed = rand((8, 64)).to_vec2::<f32>().unwrap();
    embed[4] = vec![f32::NAN; 64];
    t.insert(
        "model.embed_tokens.weight".into(),
        Tensor::new(embed, &dev).unwrap(),
    );
    t.insert("lm_head.weight".into(), rand((8, 64)));
    let ones = Tensor::ones(64, DType::F32, &dev).unwrap();
    t.insert("model.norm.weight".into(), ones.clone());
    let l = "model.layers.0";
    t.insert(format!("{l}.input_layernorm.weight"), ones.clone());
    t.insert(format!("{l}.post_attention_layernorm.weight"), ones);
    for (name, shape) in [
        ("self_attn.q_proj", (64, 64)),
        ("self_attn.k_proj", (32, 64)),
        ("self_attn.v_proj", (32, 64)),
        ("self_attn.o_proj", (64, 64)),
        ("mlp.gate_proj", (64, 64)),
        ("mlp.up_proj", (64, 64)),
        ("mlp.down_proj", (64, 64)),
    ] {
        t.insert(format!("{l}.{name}.weight"), rand(shape));
    }
    candle_core::safetensors::save(&t, m.join("model.safetensors")).unwrap();
    m
}

#[test]
fn a_request_with_nan_logits_ends_alone_and_resume_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let model = nan_model(dir.path());
    let input = temp_file(
        dir.path(),
        "in.jsonl",
        b"{\"id\": \"good1\", \"prompt\": \"hi w x\"}\n{\"id\": \"poison\", \"prompt\": \"w bad x\"}\n{\"id\": \"good2\", \"prompt\": \"x y w\"}\n",
    );
    let out = dir.path().join("out.jsonl");
    let run = |extra: &str| {
        kvq(&[
            "batch-generate",
            s(&input),
            "--model",
            s(&model),
            "-o",
            s(&out),
            "--raw",
            "--temp",
            "0",
            // One token: a good request's own sample is never fed back (it may be "bad").
            "--max-tokens",
            "1",
            "--no-progress",
            extra,
        ])
    };
    let o = run("--force");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    let recs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 3, "{text}");
    for r in &recs {
        if r["id"] == "poison" {
            assert_eq!(r["finish_reason"], "error", "{r}");
            assert!(r["error"].as_str().unwrap().contains("NaN"), "{r}");
        } else {
            assert_ne!(r["finish_reason"], "error", "{r}");
        }
    }
    // --resume reads the error record as done and goes on.
    let kept: Vec<&str> = text.lines().filter(|l| l.contains("poison")).collect();
    std::fs::write(&out, kept.join("\n") + "\n").unwrap();
    let o = run("--resume");
    assert!(o.status.success(), "{}", stderr(&o));
    let n = std::fs::read_to_string(&out).unwrap().lines().count();
    assert_eq!(n, 3);
}

#[test]
fn messages_name_the_real_problem() {
    let dir = tempfile::tempdir().unwrap();
    // A FIFO as --model (opening it would block).
    let fifo = dir.path().join("model.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    fails_with(
        &["generate", "--model", s(&fifo), "hi"],
        "not a regular file or directory",
    );
    fails_with(
        &["generate", "--model", "/dev/zero", "hi"],
        "not a regular file or directory",
    );
    // A lone .safetensors file as --model.
    let st = fixture("hub/tiny-llama/model.safetensors");
    fails_with(
        &["generate", "--model", s(&st), "hi"],
        "is a safetensors file",
    );
    // A directory as --prompt-cache.
    fails_with(
        &[
            "generate",
            "--raw",
            "--prompt-cache",
            s(dir.path()),
            "hello there my friend",
        ],
        "it is a directory",
    );
    // A --tokenizer of the model's own vocabulary but without a chat template: the message
    // names the tokenizer, not the GGUF.
    let tok = dir.path().join("tokenizer.json");
    write_word_level(&tok, &model_tokens());
    fails_with(
        &["generate", "--tokenizer", s(&tok), "hi"],
        &format!("--tokenizer {} has no chat template", s(&tok)),
    );
    // A bad width in --compare is blamed on --compare.
    let text = temp_file(dir.path(), "t.txt", b"one two three");
    fails_with(
        &["perplexity", s(&text), "--compare", "f32,9"],
        "--compare: '9'",
    );
}
