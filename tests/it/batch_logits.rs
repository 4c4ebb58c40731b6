//! A batch of prompts of different lengths, run through the model together, gives each row the
//! logits it gets alone — for the prompt pass and for decode steps after it — bit for bit, on
//! the batch-invariant CPU path (the default there).

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use kvq::kv::cache::{CacheConfig, PagedKvCache};
use kvq::model::llama::{Llama, LogitsFor, SeqInput};
use kvq::model::load::load;
use kvq::model::options::ModelOptions;

fn cache_for(model: &Llama, blocks: usize) -> PagedKvCache {
    let c = model.config();
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

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn batched_rows_equal_single_rows_dense() {
    batched_rows_equal_single_rows(true);
}

/// The CPU default: GGUF blocks multiplied by kvq's kernels.
#[test]
fn batched_rows_equal_single_rows_blocks() {
    batched_rows_equal_single_rows(false);
}

fn batched_rows_equal_single_rows(dequantize: bool) {
    let args = ModelOptions {
        dtype: Some(DType::F32),
        dequantize,
        ..ModelOptions::default()
    };
    let mut m = load(&args, &Device::Cpu).unwrap();
    m.model.set_batch_invariant(true);
    let model = &m.model;
    let prompts: Vec<Vec<u32>> = greedy_cases()
        .iter()
        .map(|c| ids(&c["input_ids"]))
        .collect();
    // Three decode steps after the prompt, feeding the same (arbitrary, fixed) tokens everywhere.
    let steps: [u32; 3] = [504, 3575, 282];

    // Alone: one cache per prompt.
    let mut alone = Vec::new();
    for p in &prompts {
        let mut cache = cache_for(model, 64);
        cache.add_sequence(0).unwrap();
        cache.reserve(0, p.len()).unwrap();
        let inp = [SeqInput {
            seq: 0,
            tokens: p.clone(),
        }];
        let mut rows = vec![model.forward(&inp, &mut cache, LogitsFor::All).unwrap()];
        for &t in &steps {
            cache.reserve(0, 1).unwrap();
            let inp = [SeqInput {
                seq: 0,
                tokens: vec![t],
            }];
            rows.push(model.forward(&inp, &mut cache, LogitsFor::Last).unwrap());
        }
        alone.push(rows);
    }

    // Together: one cache, every prompt in one forward pass, then batched decode steps.
    let mut cache = cache_for(model, 12 * 64);
    let inputs: Vec<SeqInput> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| SeqInput {
            seq: i as u64,
            tokens: p.clone(),
        })
        .collect();
    for inp in &inputs {
        cache.add_sequence(inp.seq).unwrap();
        cache.reserve(inp.seq, inp.tokens.len()).unwrap();
    }
    let all = model.forward(&inputs, &mut cache, LogitsFor::All).unwrap();
    let mut offset = 0;
    let mut worst = 0f32;
    for (i, p) in prompts.iter().enumerate() {
        let rows = all.narrow(0, offset, p.len()).unwrap();
        worst = worst.max(max_abs_diff(&rows, &alone[i][0]));
        offset += p.len();
    }
    for (k, &t) in steps.iter().enumerate() {
        let inputs: Vec<SeqInput> = (0..prompts.len())
            .map(|i| SeqInput {
                seq: i as u64,
                tokens: vec![t],
            })
            .collect();
        for inp in &inputs {
            cache.reserve(inp.seq, 1).unwrap();
        }
        let out = model.forward(&inputs, &mut cache, LogitsFor::Last).unwrap();
        for (i, rows) in alone.iter().enumerate() {
            let row = out.narrow(0, i, 1).unwrap();
            worst = worst.max(max_abs_diff(&row, &rows[k + 1]));
        }
    }
    eprintln!("max abs logit difference batched vs alone: {worst:e}");
    // Row-invariant matmuls and per-query attention order: not merely close, identical.
    assert_eq!(
        worst, 0.0,
        "max abs logit difference batched vs alone: {worst}"
    );
}
