//! Greedy batched generation with a quantized KV cache (`--kv-bits 8` and `4`, and `4` with a
//! dense residual window and sinks: `--kv-residual 8 --kv-sinks 2`) against each
//! request alone with the same cache setting (a max-batch-1 engine, what `kvq generate` runs):
//! max batch 8 with prefill chunks of 32, so prompt chunks and other requests' decode steps share
//! forward passes and requests join and leave mid-run.
//!
//! With the batch-invariant CPU path (row-invariant matmuls, prompt tokens attended as decode
//! queries of their own position) every forward-pass row depends only on its own sequence, so:
//! - every prompt's stored K/V (codes, scales, biases) are bit-identical batched and alone, in
//!   every layer — quantization itself never depends on batch composition (same K/V in, same
//!   codes out), and the K/V going in no longer do either;
//! - 8-bit and 4-bit alike: every prompt generates the same tokens batched and alone (a
//!   difference would print its first step and the top-1/top-2 margin there), identical
//!   prompts identical.
//!
//! Smaller than `batch_generate_greedy` to keep CI time modest: the 12 reference prompts and 30
//! random ones (every fifth a repeat), 12 new tokens each, per setting.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use kvq::engine::request::{Event, Request};
use kvq::engine::sampler::SamplingParams;
use kvq::engine::scheduler::{Engine, EngineConfig};
use kvq::kv::cache::{CacheConfig, PagedKvCache};
use kvq::kv::format::QuantFormat;
use kvq::kv::format::{KvFormat, LayerRows};
use kvq::model::llama::{LogitsFor, SeqInput};
use kvq::model::load::{load, LoadedModel};
use kvq::model::options::ModelOptions;
use std::collections::HashMap;

const NEW_TOKENS: usize = 12;

/// A cache setting: bits, `--kv-residual`, `--kv-sinks`.
type Kv = (u32, usize, usize);

fn quant_cache(m: &LoadedModel, (bits, residual, sinks): Kv, blocks: usize) -> PagedKvCache {
    let c = m.model.config();
    let mut cfg = CacheConfig::dense(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        16,
        blocks,
        DType::F32,
    );
    cfg.formats = vec![
        KvFormat::affine(QuantFormat::new(bits, 64).unwrap(), DType::F32, false);
        c.num_layers
    ];
    cfg.residual = residual;
    cfg.sinks = sinks;
    PagedKvCache::new(cfg, &Device::Cpu).unwrap()
}

/// Every stored value of a prompt's rows (codes as integers), flattened, per layer.
fn stored(rows: &[LayerRows]) -> Vec<Vec<f64>> {
    let flat = |t: &Tensor| -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    rows.iter()
        .map(|r| match r {
            LayerRows::Affine { k, v, .. } => [k, v]
                .iter()
                .flat_map(|q| [flat(&q.codes), flat(&q.scales), flat(&q.biases)])
                .flatten()
                .collect::<Vec<_>>(),
            LayerRows::Dense { .. } => panic!("expected a quantized cache"),
        })
        .collect()
}

struct RunOut {
    tokens: Vec<u32>,
    prompt_rows: Vec<Vec<f64>>,
}

/// Runs `prompts` through one engine; returns each one's tokens and stored prompt rows.
fn run(
    m: &LoadedModel,
    kv: Kv,
    prompts: &[Vec<u32>],
    cfg: EngineConfig,
    blocks: usize,
) -> Vec<RunOut> {
    let max_batch = cfg.max_batch;
    let mut engine = Engine::new(&m.model, quant_cache(m, kv, blocks), cfg).unwrap();
    let eos = m.tokenizer.eos_token_ids().to_vec();
    let mut ids = Vec::new();
    for p in prompts {
        let id = engine
            .add(Request {
                prompt: p.clone(),
                params: SamplingParams::greedy(),
                max_tokens: NEW_TOKENS,
                eos: eos.clone(),
            })
            .unwrap();
        engine.keep_prompt_kv(id);
        ids.push(id);
    }
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut rows: HashMap<u64, Vec<Vec<f64>>> = HashMap::new();
    let mut peak_running = 0;
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let Event::Token { id, token } = ev {
                tokens.entry(id).or_default().push(token);
            }
        }
        peak_running = peak_running.max(engine.num_running());
        for &id in &ids {
            if let Some(r) = engine.take_prompt_kv(id) {
                rows.insert(id, stored(&r.rows));
            }
        }
    }
    assert!(peak_running <= max_batch);
    ids.iter()
        .map(|id| RunOut {
            tokens: tokens.remove(id).unwrap(),
            prompt_rows: rows.remove(id).unwrap(),
        })
        .collect()
}

/// Top-1 minus top-2 logit after `prefix`, computed alone with the same cache setting.
fn margin_after(m: &LoadedModel, kv: Kv, prefix: &[u32]) -> f32 {
    let mut cache = quant_cache(m, kv, prefix.len().div_ceil(16) + 1);
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

/// The reference prompts and random cuts of real text (every fifth one repeats an earlier one),
/// interleaved so they share batches.
fn prompts() -> Vec<Vec<u32>> {
    let refs: Vec<Vec<u32>> = greedy_cases()
        .iter()
        .map(|c| ids(&c["input_ids"]))
        .collect();
    let random = random_corpus_prompts(7, 30);
    let mut mixed = Vec::new();
    let mut refs = refs.into_iter();
    for (i, r) in random.into_iter().enumerate() {
        mixed.push(r);
        if i % 2 == 0 {
            mixed.extend(refs.next());
        }
    }
    mixed.extend(refs);
    mixed
}

#[test]
fn quantized_batched_greedy_equals_alone() {
    let args = ModelOptions {
        dtype: Some(DType::F32),
        dequantize: true,
        ..ModelOptions::default()
    };
    let mut m = load(&args, &Device::Cpu).unwrap();
    m.model.set_batch_invariant(true);
    let prompts = prompts();
    assert_eq!(prompts.len(), 42);
    for kv in [(8, 0, 0), (4, 0, 0), (4, 8, 2)] {
        let batched = run(
            &m,
            kv,
            &prompts,
            EngineConfig {
                max_batch: 8,
                prefill_chunk: 32,
                ..Default::default()
            },
            8 * 10,
        );
        let alone: Vec<RunOut> = prompts
            .iter()
            .map(|p| {
                let blocks = (p.len() + NEW_TOKENS).div_ceil(16) + 1;
                run(
                    &m,
                    kv,
                    std::slice::from_ref(p),
                    EngineConfig::default(),
                    blocks,
                )
                .remove(0)
            })
            .collect();

        let mut same = 0;
        let layers = m.model.config().num_layers;
        let mut layer_same = vec![0usize; layers];
        for (i, ((b, a), p)) in batched.iter().zip(&alone).zip(&prompts).enumerate() {
            for (l, n) in layer_same.iter_mut().enumerate() {
                *n += usize::from(a.prompt_rows[l] == b.prompt_rows[l]);
            }
            if a.tokens == b.tokens {
                same += 1;
                continue;
            }
            let d = a
                .tokens
                .iter()
                .zip(&b.tokens)
                .position(|(x, y)| x != y)
                .unwrap_or(a.tokens.len().min(b.tokens.len()));
            let mut prefix = p.clone();
            prefix.extend(&a.tokens[..d]);
            let margin = margin_after(&m, kv, &prefix);
            eprintln!("{kv:?}: prompt {i}: first difference at step {d}, margin {margin:e}");
        }
        let n = prompts.len();
        eprintln!(
            "{kv:?}: batched = alone in full for {same}/{n}; prompts whose stored K/V are \
             bit-identical batched and alone, per layer: {layer_same:?}"
        );
        assert_eq!(
            layer_same,
            vec![n; layers],
            "{kv:?}: stored K/V depend on the batch"
        );
        assert_eq!(same, n, "{kv:?}: only {same}/{n} identical");
        for (i, p) in prompts.iter().enumerate() {
            for (j, q) in prompts.iter().enumerate().skip(i + 1) {
                if p == q {
                    assert_eq!(batched[i].tokens, batched[j].tokens, "copies {i}, {j}");
                }
            }
        }
    }
}
