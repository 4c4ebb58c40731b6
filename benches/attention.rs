//! Criterion benchmark of one decode-attention step on the CPU: f16 dense vs 8-bit vs 4-bit
//! blocks, batch 4, 8 KV heads x GQA 4, head_dim 128, at 1K and 4K tokens per sequence.
//! (`kvq bench-kv-cache` measures the same on any device and longer contexts.)

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvq::kv::attend::decode::decode_attention;
use kvq::kv::format::QuantFormat;
use kvq::kv::format::{KvFormat, LayerKv};

const BATCH: usize = 4;
const KV_HEADS: usize = 8;
const GQA: usize = 4;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;

fn bench(c: &mut Criterion) {
    let dev = Device::Cpu;
    let width = KV_HEADS * HEAD_DIM;
    let mut group = c.benchmark_group("decode_attention");
    group.sample_size(20);
    for len in [1024usize, 4096] {
        let per_seq = len / BLOCK;
        let slots = BATCH * per_seq * BLOCK;
        // Reverse block order: a non-trivial table without a random generator.
        let ids: Vec<u32> = (0..(BATCH * per_seq) as u32).rev().collect();
        let tables = Tensor::from_vec(ids, (BATCH, per_seq), &dev).unwrap();
        let starts = Tensor::zeros(BATCH, DType::U32, &dev).unwrap();
        let lens = Tensor::from_vec(vec![len as u32; BATCH], BATCH, &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (slots, width), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (slots, width), &dev).unwrap();
        let q = Tensor::randn(0f32, 1.0, (BATCH, KV_HEADS * GQA, HEAD_DIM), &dev)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        let formats = [
            ("f16", KvFormat::Dense(DType::F16)),
            ("8-bit", affine(8)),
            ("4-bit", affine(4)),
        ];
        for (name, format) in formats {
            let pool = LayerKv::zeros(format, slots, width, &dev).unwrap();
            pool.write_run(0, &k, &v).unwrap();
            group.bench_with_input(BenchmarkId::new(name, len), &len, |b, _| {
                b.iter(|| {
                    decode_attention(&q, &pool, &tables, &starts, &lens, BLOCK, KV_HEADS, 0.088)
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

fn affine(bits: u32) -> KvFormat {
    KvFormat::affine(QuantFormat::new(bits, 64).unwrap(), DType::F16, false)
}

criterion_group!(benches, bench);
criterion_main!(benches);
