//! Bounded fuzzing of every parser that reads user files (issue 21): GGUF header and metadata,
//! safetensors header (through the prompt-cache reader), prompt-cache files, and batch JSONL
//! input and output lines. Each target mutates a seed corpus with a seeded generator (bit
//! flips, byte sets, truncation, splices, length fields set to extremes) for a fixed number of
//! cases, so it runs in seconds in `cargo test`; a panic fails the test, an abort kills it,
//! and each target checks its own time. `KVQ_FUZZ_CASES` scales the case counts for a longer
//! run by hand.

use kvq::engine::batch_io::{decode_input, parse_input, read_resume, InputFormat};
use kvq::kv::cache::prompt_file::{save, PromptCacheFile, PromptCacheMeta};
use kvq::kv::format::LayerRows;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
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
    name: &'static str,
    cases: usize,
    accepted: usize,
    started: Instant,
}

impl Tally {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            cases: 0,
            accepted: 0,
            started: Instant::now(),
        }
    }

    fn report(&self, limit: Duration) {
        let took = self.started.elapsed();
        eprintln!(
            "fuzz {}: {} cases, {} accepted, {} refused, {:.2} s",
            self.name,
            self.cases,
            self.accepted,
            self.cases - self.accepted,
            took.as_secs_f64()
        );
        assert!(took < limit, "{} took {took:?} (a hang?)", self.name);
    }
}

/// The real GGUF's header (magic to the end of its tensor infos) and a small synthetic one.
fn gguf_seeds() -> Vec<Vec<u8>> {
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
    vec![header, small]
}

#[test]
fn fuzz_gguf_header_and_metadata() {
    let seeds = gguf_seeds();
    let mut rng = StdRng::seed_from_u64(21);
    let mut t = Tally::new("gguf");
    // The real header is ~1 MB: fewer cases on it, more on the small one.
    for (seed, n) in seeds.iter().zip([cases(60), cases(3000)]) {
        for _ in 0..n {
            let b = mutate(&mut rng, seed);
            t.cases += 1;
            // kvq's bounds walk first; only what it accepts reaches candle's reader, as in
            // `load`. Neither may panic or allocate from a bad length.
            if kvq::model::gguf_check::check_header(&b[..], b.len() as u64).is_err() {
                continue;
            }
            let mut r = std::io::Cursor::new(&b);
            if let Ok(c) = candle_core::quantized::gguf_file::Content::read(&mut r) {
                t.accepted += 1;
                let _ = kvq::model::config::ModelConfig::from_gguf(&c);
            }
        }
    }
    t.report(Duration::from_secs(120));
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
    };
    let p = dir.join("seed.safetensors");
    save(&p, &meta, &[rows(0.1), rows(0.2)]).unwrap();
    std::fs::read(&p).unwrap()
}

#[test]
fn fuzz_prompt_cache_and_safetensors_header() {
    let dir = tempfile::tempdir().unwrap();
    let seed = prompt_cache_seed(dir.path());
    let header_len = u64::from_le_bytes(seed[..8].try_into().unwrap()) as usize + 8;
    let mut rng = StdRng::seed_from_u64(2121);
    let mut t = Tally::new("prompt-cache");
    let path = dir.path().join("case.safetensors");
    for i in 0..cases(1500) {
        // Most mutations aim at the header, the rest anywhere (data: checksums must catch them).
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
    t.report(Duration::from_secs(120));
}

#[test]
fn fuzz_batch_input_and_output_lines() {
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
        "{\"id\":null,\"line\":3,\"finish_reason\":\"error\",\"error\":\"e\"}\n",
        "{\"id\":2,\"finish_reason\":\"cancelled\"}\n",
        "{\"id\":4,\"finish_reason\":\"error\",\"error\":\"NaN\"}\n",
    )
    .as_bytes()
    .to_vec();
    let mut rng = StdRng::seed_from_u64(2122);
    let mut t = Tally::new("batch-jsonl");
    for _ in 0..cases(20000) {
        let b = mutate(&mut rng, &input_seed);
        t.cases += 1;
        let (text, bad) = decode_input(&b);
        // Line numbers hold: one text line per input line.
        let body = b.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&b);
        assert_eq!(
            text.split('\n').count(),
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
    t.report(Duration::from_secs(120));
}
