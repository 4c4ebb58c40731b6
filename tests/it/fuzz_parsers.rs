//! Bounded fuzzing of every parser that reads user data (issue 21): GGUF header, metadata and
//! tokenizer, safetensors header (through the prompt-cache reader), prompt-cache files, batch
//! JSONL input and output lines, and `serve`'s request bodies. Each target mutates a seed
//! corpus with a seeded generator (bit flips, byte sets, truncation, splices, length fields set
//! to extremes; JSON fields set to hostile values) for a fixed number of cases, so it runs in
//! seconds in `cargo test`. A panic fails the test, an abort kills it, and a hang fails it: the
//! cases run on a thread the test waits for only until the target's limit. Each target prints
//! its case count and time (`--nocapture` shows them); `KVQ_FUZZ_CASES` scales the case
//! counts for a longer run by hand (1000 = the default).

use kvq::engine::batch_io::{decode_input, parse_input, read_resume, InputFormat};
use kvq::engine::sampler::SamplingParams;
use kvq::kv::cache::prompt_file::{save, PromptCacheFile, PromptCacheMeta};
use kvq::kv::format::LayerRows;
use kvq::server::api::{parse_request, Defaults, Endpoint};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Cases per target: the default times `KVQ_FUZZ_CASES` / 1000 when set.
fn cases(default: usize) -> usize {
    std::env::var("KVQ_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(default, |n| default * n / 1000)
        .max(1)
}

/// Values that break length fields: zero, small, around 2^31 / 2^32, and the maximum.
const EXTREMES: [u64; 7] = [0, 1, 255, 1 << 31, (1 << 32) - 1, 1 << 32, u64::MAX];

/// One random mutation of `seed`.
fn mutate(rng: &mut StdRng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    let rounds = rng.random_range(1..=4);
    for _ in 0..rounds {
        if b.is_empty() {
            b.push(rng.random());
            continue;
        }
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..6) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b[at] = rng.random(),
            2 => b.truncate(at),
            3 => {
                // An 8-byte little-endian length field set to an extreme.
                let v = EXTREMES[rng.random_range(0..EXTREMES.len())].to_le_bytes();
                let end = (at + 8).min(b.len());
                b[at..end].copy_from_slice(&v[..end - at]);
            }
            4 => {
                let from = rng.random_range(0..b.len());
                let n = rng.random_range(0..=16.min(b.len() - from));
                let chunk = b[from..from + n].to_vec();
                b.splice(at..at, chunk);
            }
            _ => {
                let end = (at + rng.random_range(1..=16)).min(b.len());
                b.drain(at..end);
            }
        }
    }
    b
}

struct Tally {
    cases: usize,
    accepted: usize,
}

/// Runs one target's case loop on its own thread and waits for it at most `limit`: a case that
/// hangs fails the test instead of stalling the suite. Prints what ran and how long.
fn run_bounded(
    name: &'static str,
    limit: Duration,
    target: impl FnOnce(&mut Tally) + Send + 'static,
) {
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    let worker = std::thread::Builder::new()
        .name(format!("fuzz-{name}"))
        .spawn(move || {
            let mut t = Tally {
                cases: 0,
                accepted: 0,
            };
            target(&mut t);
            let _ = tx.send(t);
        })
        .unwrap();
    match rx.recv_timeout(limit) {
        Ok(t) => {
            let took = started.elapsed();
            eprintln!(
                "fuzz {name}: {} cases ({} accepted, {} refused) in {:.2} s (limit {} s)",
                t.cases,
                t.accepted,
                t.cases - t.accepted,
                took.as_secs_f64(),
                limit.as_secs()
            );
        }
        // The thread ended without a tally: a case panicked; re-raise its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => panic!("fuzz {name}: the case loop ended without a result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("fuzz {name}: not done within {limit:?}: a case hangs")
        }
    }
}

/// The limit of every target: ten times what the default cases take on a busy CI machine,
/// far below "forever".
const LIMIT: Duration = Duration::from_secs(120);

/// The real GGUF's header (magic to the end of its tensor infos) and two small synthetic ones,
/// each with the bytes of tensor data that follow it in its file (the real header's tensors
/// point into the 97 MB it leaves out: `check_header` is told the file's real length).
fn gguf_seeds() -> Vec<(Vec<u8>, u64)> {
    let model = kvq::model::fetch::default_model().unwrap();
    let bytes = std::fs::read(&model).unwrap();
    let content = {
        let mut r = std::io::Cursor::new(&bytes);
        candle_core::quantized::gguf_file::Content::read(&mut r).unwrap()
    };
    let header = bytes[..content.tensor_data_offset as usize].to_vec();
    let mut small = b"GGUF".to_vec();
    small.extend(3u32.to_le_bytes());
    small.extend(1u64.to_le_bytes());
    small.extend(2u64.to_le_bytes());
    for (k, t, v) in [
        ("general.architecture", 8u32, b"llama".to_vec()),
        ("llama.block_count", 4u32, 1u32.to_le_bytes().to_vec()),
    ] {
        small.extend((k.len() as u64).to_le_bytes());
        small.extend(k.as_bytes());
        small.extend(t.to_le_bytes());
        if t == 8 {
            small.extend((v.len() as u64).to_le_bytes());
        }
        small.extend(v);
    }
    small.extend(5u64.to_le_bytes());
    small.extend(b"tok.w");
    small.extend(2u32.to_le_bytes());
    small.extend(32u64.to_le_bytes());
    small.extend(4u64.to_le_bytes());
    small.extend(0u32.to_le_bytes());
    small.extend(0u64.to_le_bytes());
    small.extend(vec![0u8; 512]);
    let data = (bytes.len() - header.len()) as u64;
    vec![(header, data), (small, 0), (aligned_tokenizer_seed(), 0)]
}

/// A small GGUF with `general.alignment` and a byte-level BPE tokenizer (tokens, merges, types,
/// special ids), so mutations reach candle's alignment arithmetic and kvq's tokenizer builder.
fn aligned_tokenizer_seed() -> Vec<u8> {
    fn string(b: &mut Vec<u8>, x: &str) {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    }
    let tokens = ["a", "b", "ab", "<s>", "</s>", "\u{120}c"];
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(9u64.to_le_bytes());
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "llama");
    string(&mut b, "general.alignment");
    b.extend(4u32.to_le_bytes());
    b.extend(64u32.to_le_bytes());
    string(&mut b, "tokenizer.ggml.model");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "gpt2");
    string(&mut b, "tokenizer.ggml.pre");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "smollm");
    string(&mut b, "tokenizer.ggml.tokens");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        string(&mut b, t);
    }
    string(&mut b, "tokenizer.ggml.merges");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    string(&mut b, "a b");
    string(&mut b, "tokenizer.ggml.token_type");
    b.extend(9u32.to_le_bytes());
    b.extend(5u32.to_le_bytes());
    b.extend((tokens.len() as u64).to_le_bytes());
    for t in [1i32, 1, 1, 3, 3, 1] {
        b.extend(t.to_le_bytes());
    }
    for (k, v) in [
        ("tokenizer.ggml.bos_token_id", 3u32),
        ("tokenizer.ggml.eos_token_id", 4),
    ] {
        string(&mut b, k);
        b.extend(4u32.to_le_bytes());
        b.extend(v.to_le_bytes());
    }
    string(&mut b, "tok.w");
    b.extend(2u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(64) * 64 + 512, 0);
    b
}

#[test]
fn fuzz_gguf_header_metadata_and_tokenizer() {
    run_bounded("gguf", LIMIT, |t| {
        let seeds = gguf_seeds();
        let mut rng = StdRng::seed_from_u64(21);
        // The real header is ~1 MB (and its 49k-token vocabulary takes a while to build): few
        // cases on it, many on the small ones.
        for ((seed, data), n) in seeds.iter().zip([cases(100), cases(15000), cases(15000)]) {
            for _ in 0..n {
                let b = mutate(&mut rng, seed);
                t.cases += 1;
                // kvq's bounds walk first; only what it accepts reaches candle's reader, as in
                // `load`. Neither may panic or allocate from a bad length.
                let len = b.len() as u64 + data;
                if kvq::model::gguf_check::check_header(&b[..], len).is_err() {
                    continue;
                }
                let mut r = std::io::Cursor::new(&b);
                if let Ok(c) = candle_core::quantized::gguf_file::Content::read(&mut r) {
                    t.accepted += 1;
                    let _ = kvq::model::config::ModelConfig::from_gguf(&c);
                    if let Ok(tok) = kvq::model::tokenizer::TextTokenizer::from_gguf(&c) {
                        let _ = tok.encode("ab c <s> 12", true);
                    }
                }
            }
        }
    });
}

/// A small valid prompt cache (2 layers, 5 tokens, dense f32).
fn prompt_cache_seed(dir: &std::path::Path) -> Vec<u8> {
    use candle_core::{DType, Device, Tensor};
    let rows = |s: f64| LayerRows::Dense {
        k: Tensor::arange(0f32, 5.0 * 64.0, &Device::Cpu)
            .unwrap()
            .affine(s, 0.0)
            .unwrap()
            .reshape((5, 64))
            .unwrap(),
        v: Tensor::ones((5, 64), DType::F32, &Device::Cpu).unwrap(),
    };
    let meta = PromptCacheMeta {
        fingerprint: "f".into(),
        model: "m".into(),
        weights: "dense".into(),
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 32,
        formats: vec![kvq::kv::format::KvFormat::Dense(DType::F32); 2],
        tokens: vec![1, 2, 3, 4, 5],
        centers: Vec::new(),
    };
    let p = dir.join("seed.safetensors");
    save(&p, &meta, &[rows(0.1), rows(0.2)]).unwrap();
    std::fs::read(&p).unwrap()
}

#[test]
fn fuzz_prompt_cache_and_safetensors_header() {
    run_bounded("prompt-cache", LIMIT, |t| {
        let dir = tempfile::tempdir().unwrap();
        let seed = prompt_cache_seed(dir.path());
        let header_len = u64::from_le_bytes(seed[..8].try_into().unwrap()) as usize + 8;
        let mut rng = StdRng::seed_from_u64(2121);
        let path = dir.path().join("case.safetensors");
        for i in 0..cases(5000) {
            // Most mutations aim at the header, the rest anywhere (data: checksums must catch
            // them).
            let b = if i % 4 == 3 {
                mutate(&mut rng, &seed)
            } else {
                let mut h = mutate(&mut rng, &seed[..header_len]);
                h.extend_from_slice(&seed[header_len..]);
                h
            };
            std::fs::write(&path, &b).unwrap();
            t.cases += 1;
            if let Ok(f) = PromptCacheFile::open(&path) {
                if b != seed {
                    // Accepted only if the data is intact: the header may differ (key order,
                    // metadata text), never the rows.
                    assert_eq!(
                        &b[b.len() - (seed.len() - header_len)..],
                        &seed[header_len..],
                        "a damaged prompt cache was accepted"
                    );
                }
                t.accepted += 1;
                let n = f.tokens().len();
                let _ = f.load_rows(n, &candle_core::Device::Cpu);
            }
        }
    });
}

#[test]
fn fuzz_batch_input_and_output_lines() {
    run_bounded("batch-jsonl", LIMIT, |t| {
        let input_seed = concat!(
            "{\"id\": \"a\", \"prompt\": \"hi\", \"max_tokens\": 3, \"stop\": [\"x\"], \"raw\": true}\n",
            "{\"id\": 7, \"messages\": [{\"role\": \"user\", \"content\": \"yo\"}], \"top_p\": 0.5}\n",
            "plain text prompt\n",
            "\u{feff}{\"prompt\": \"bom\", \"prompt_cache\": \"c.st\", \"seed\": 18446744073709551615}\n",
        )
        .as_bytes()
        .to_vec();
        let output_seed = concat!(
            "{\"id\":\"a\",\"text\":\"t\",\"finish_reason\":\"stop\"}\n",
            "{\"id\":null,\"line\":3,\"line_hash\":\"0123456789abcdef\",\"finish_reason\":\"error\",\"error\":\"e\"}\n",
            "{\"id\":2,\"finish_reason\":\"cancelled\"}\n",
            "{\"id\":4,\"finish_reason\":\"error\",\"error\":\"NaN\"}\n",
        )
        .as_bytes()
        .to_vec();
        let mut rng = StdRng::seed_from_u64(2122);
        for _ in 0..cases(100000) {
            let b = mutate(&mut rng, &input_seed);
            t.cases += 1;
            let (text, bad) = decode_input(&b);
            // Line numbers hold: one text line per input line.
            let body = b.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&b);
            assert_eq!(
                text.split('\n').count(),
                body.split(|&c| c == b'\n').count()
            );
            assert_eq!(
                kvq::engine::batch_io::line_hashes(&b).len(),
                body.split(|&c| c == b'\n').count()
            );
            let parsed = parse_input(&text, InputFormat::Auto);
            t.accepted += parsed.iter().filter(|r| r.is_ok()).count().min(1);
            for e in bad {
                assert!(e.line >= 1);
            }
            let o = mutate(&mut rng, &output_seed);
            if let Ok(s) = std::str::from_utf8(&o) {
                if let Ok(st) = read_resume(s) {
                    assert!(st.keep.len() <= s.lines().count());
                }
            }
        }
    });
}

/// Valid request bodies of both endpoints: every field `parse_request` reads, in its forms.
fn http_seeds() -> Vec<(Endpoint, Value)> {
    vec![
        (
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            Endpoint::Chat,
            json!({"messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "yo"}]},
                                {"role": "assistant", "content": null}],
                   "max_completion_tokens": 3, "seed": 7, "top_k": 5, "min_p": 0.1, "n": 1}),
        ),
        (
            Endpoint::Completions,
            json!({"model": "m", "prompt": "Once upon", "max_tokens": 4, "stop": "x",
                   "temperature": 0}),
        ),
        (
            Endpoint::Completions,
            json!({"prompt": [1, 2, 3], "seed": 18446744073709551615u64, "top_p": 1}),
        ),
        (
            Endpoint::Completions,
            json!({"prompt": ["one"], "stream": false, "user": "x"}),
        ),
    ]
}

/// A value a hostile or careless client might put in any field.
fn hostile_value(rng: &mut StdRng) -> Value {
    let nested = |depth: usize| {
        let mut v = json!(1);
        for _ in 0..depth {
            v = json!([v]);
        }
        v
    };
    match rng.random_range(0..22) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e308),
        5 => json!(-1e308),
        6 => json!(0.5),
        7 => json!(2),
        8 => json!(u64::MAX),
        9 => json!(i64::MIN),
        10 => json!(""),
        11 => json!("x"),
        12 => json!([]),
        13 => json!([null]),
        14 => json!({}),
        15 => json!([1, 2]),
        16 => json!("a".repeat(1000)),
        17 => Value::Array(vec![json!(0); 1000]),
        18 => nested(rng.random_range(1..100)),
        19 => json!([{"role": 5}]),
        20 => json!([{"role": "user", "content": [{"type": "image_url"}]}]),
        _ => json!(4294967296u64),
    }
}

const HTTP_FIELDS: [&str; 17] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "content",
    "role",
    "include_usage",
];

/// One structural mutation: a field set to a hostile value or removed, inside the body or
/// inside its first message / stream options.
fn mutate_json(rng: &mut StdRng, v: &Value) -> Value {
    let mut v = v.clone();
    for _ in 0..rng.random_range(1..=3) {
        let key = HTTP_FIELDS[rng.random_range(0..HTTP_FIELDS.len())];
        let value = hostile_value(rng);
        let target = match rng.random_range(0..4) {
            0 => v.pointer_mut("/messages/0"),
            1 => v.pointer_mut("/stream_options"),
            _ => Some(&mut v),
        };
        match target {
            Some(Value::Object(o)) if rng.random_bool(0.2) => {
                o.remove(key);
            }
            Some(Value::Object(o)) => {
                o.insert(key.to_string(), value);
            }
            Some(other) => *other = value,
            None => {}
        }
    }
    if rng.random_bool(0.05) {
        v = hostile_value(rng);
    }
    v
}

#[test]
fn fuzz_http_request_bodies() {
    run_bounded("http-body", LIMIT, |t| {
        let defaults = Defaults {
            params: SamplingParams::default(),
            max_tokens: 16,
            stop: vec![],
        };
        let seeds = http_seeds();
        let mut rng = StdRng::seed_from_u64(2123);
        for i in 0..cases(100000) {
            let (endpoint, seed) = &seeds[i % seeds.len()];
            let body = if rng.random_bool(0.5) {
                serde_json::to_vec(&mutate_json(&mut rng, seed)).unwrap()
            } else {
                mutate(&mut rng, &serde_json::to_vec(seed).unwrap())
            };
            t.cases += 1;
            for ep in [*endpoint, Endpoint::Chat, Endpoint::Completions] {
                match parse_request(&body, ep, "m", &defaults) {
                    Ok(r) => {
                        t.accepted += usize::from(ep == *endpoint);
                        assert!(r.max_tokens >= 1);
                        assert!(r.params.validate().is_ok());
                        assert!(r.stop.iter().all(|s| !s.is_empty()));
                        if let Some(p) = r.params.top_p {
                            assert!(p > 0.0 && p < 1.0, "top_p {p}");
                        }
                    }
                    Err(e) => {
                        assert_eq!(e.status, 400, "{e:?}");
                        assert!(!e.message.is_empty());
                        assert!(e.param.as_deref() != Some(""));
                    }
                }
            }
        }
    });
}
