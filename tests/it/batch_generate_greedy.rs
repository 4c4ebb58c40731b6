//! Greedy batched generation (max batch 8, chunked prefill, requests joining and leaving mid-run)
//! gives the tokens each request gets alone (a fresh max-batch-1 engine per request, what
//! `kvq generate` runs), bit for bit on the batch-invariant CPU path: every one of the 62
//! requests in full (a difference prints its first step and top-1/top-2 margin), the 12
//! reference prompts equal to the reference up to their first fragile step, identical prompts
//! identical.
use crate::common::*;
use candle_core::{DType, Device};
use kvq::engine::batch::{Batch, BatchRequest};
use kvq::engine::request::Request;
use kvq::engine::sampler::SamplingParams;
use kvq::engine::scheduler::{Engine, EngineConfig};
use kvq::kv::cache::{CacheConfig, PagedKvCache};
use kvq::model::llama::{LogitsFor, SeqInput};
use kvq::model::load::{load, LoadedModel};
use kvq::model::options::ModelOptions;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;

fn dense_cache(m: &LoadedModel, blocks: usize) -> PagedKvCache {
    let c = m.model.config();
    let cfg = CacheConfig::dense(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        16,
        blocks,
        DType::F32,
    );
    PagedKvCache::new(cfg, &Device::Cpu).unwrap()
}

/// Runs `reqs` through one engine; returns generated tokens by id.
fn run(
    m: &LoadedModel,
    reqs: &[BatchRequest],
    cfg: EngineConfig,
    blocks: usize,
) -> HashMap<String, Vec<u32>> {
    let max_batch = cfg.max_batch;
    let mut engine = Engine::new(&m.model, dense_cache(m, blocks), cfg).unwrap();
    let mut batch = Batch::new(&mut engine, &m.tokenizer);
    for r in reqs {
        batch.add(r.clone()).unwrap();
    }
    let mut out = HashMap::new();
    let mut peak_running = 0;
    let outcome = batch
        .run(
            &AtomicBool::new(false),
            |r| {
                out.insert(r.id.to_string(), r.tokens);
                Ok(())
            },
            |e, _| peak_running = peak_running.max(e.num_running()),
        )
        .unwrap();
    assert_eq!(outcome.finished, reqs.len());
    assert!(peak_running <= max_batch);
    out
}

/// Top-1 minus top-2 logit after `prefix`, computed alone.
fn margin_after(m: &LoadedModel, prefix: &[u32]) -> f32 {
    let mut cache = dense_cache(m, prefix.len().div_ceil(16) + 1);
    cache.add_sequence(0).unwrap();
    cache.reserve(0, prefix.len()).unwrap();
    let inp = [SeqInput {
        seq: 0,
        tokens: prefix.to_vec(),
    }];
    let logits = m.model.forward(&inp, &mut cache, LogitsFor::Last).unwrap();
    let mut row: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    row.sort_by(|a, b| b.total_cmp(a));
    row[0] - row[1]
}

fn request(id: Value, prompt: Vec<u32>, max_tokens: usize, eos: &[u32]) -> BatchRequest {
    BatchRequest {
        id,
        request: Request {
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            eos: eos.to_vec(),
        },
        stop: Vec::new(),
    }
}

#[test]
fn batched_greedy_equals_alone() {
    let args = ModelOptions {
        dtype: Some(DType::F32),
        // The CPU default: GGUF blocks through kvq's kernels (batch_logits.rs covers dense).
        dequantize: false,
        ..ModelOptions::default()
    };
    let mut m = load(&args, &Device::Cpu).unwrap();
    m.model.set_batch_invariant(true);
    let eos = m.tokenizer.eos_token_ids().to_vec();
    let cases = greedy_cases();
    let mut reqs = Vec::new();
    for c in &cases {
        // Only the steps before the first fragile one are compared: generate no further.
        let n = required_prefix(c).len().max(1);
        reqs.push(request(c["id"].clone(), ids(&c["input_ids"]), n, &eos));
    }
    // 50 prompts of random lengths cut from real text; every fifth one repeats an earlier one.
    let random = random_corpus_prompts(5, 50);
    for (i, p) in random.iter().enumerate() {
        reqs.push(request(Value::from(i), p.clone(), 16, &eos));
    }
    // Interleave so reference and random requests share batches.
    let (refs, rands) = reqs.split_at(cases.len());
    let mut mixed = Vec::new();
    for (i, r) in rands.iter().enumerate() {
        mixed.push(r.clone());
        if i % 4 == 0 && i / 4 < refs.len() {
            mixed.push(refs[i / 4].clone());
        }
    }
    mixed.extend(refs[mixed.len() - rands.len()..].iter().cloned());
    assert_eq!(mixed.len(), 62);

    let batched = run(
        &m,
        &mixed,
        EngineConfig {
            max_batch: 8,
            prefill_chunk: 64,
            ..Default::default()
        },
        8 * 20,
    );
    let mut alone = HashMap::new();
    for r in &mixed {
        let blocks = (r.request.prompt.len() + r.request.max_tokens).div_ceil(16) + 1;
        alone.extend(run(
            &m,
            std::slice::from_ref(r),
            EngineConfig::default(),
            blocks,
        ));
    }

    // Reference prompts: up to the first fragile step, batched = alone = the reference.
    for c in &cases {
        let key = c["id"].to_string();
        let want = required_prefix(c);
        let n = want.len();
        assert_eq!(alone[&key][..n], want[..], "{key}: alone vs reference");
        assert_eq!(batched[&key][..n], want[..], "{key}: batched vs reference");
    }

    // Every request, reference and random: batched = alone in full.
    let mut same = 0;
    for (i, p) in random.iter().enumerate() {
        let key = i.to_string();
        let (a, b) = (&alone[&key], &batched[&key]);
        if a == b {
            same += 1;
            continue;
        }
        let d = a
            .iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len()));
        let mut prefix = p.clone();
        prefix.extend(&a[..d]);
        let margin = margin_after(&m, &prefix);
        eprintln!("random prompt {i}: first difference at step {d}, top-1/top-2 margin {margin:e}");
    }
    eprintln!("batched = alone in full for {same}/50 random prompts");
    assert_eq!(same, 50, "only {same}/50 random prompts match alone");
    for c in &cases {
        let key = c["id"].to_string();
        assert_eq!(batched[&key], alone[&key], "{key}: batched vs alone");
    }

    // Identical prompts in one batch: identical outputs.
    for (i, p) in random.iter().enumerate() {
        for (j, q) in random.iter().enumerate().skip(i + 1) {
            if p == q {
                assert_eq!(
                    batched[&i.to_string()],
                    batched[&j.to_string()],
                    "copies {i} and {j}"
                );
            }
        }
    }
    let s01 = batched[&Value::from("s01-factual-capital").to_string()].clone();
    let s09 = batched[&Value::from("s09-factual-capital-repeat").to_string()].clone();
    assert_eq!(s01, s09, "the repeated reference prompt");
}
