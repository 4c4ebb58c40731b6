//! Criterion benches of the fused CPU quantize / dequantize kernels next to a parallel copy of
//! the same dense bytes (the baseline the bench-kv-cache ratios use).

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvq::kv::format::{self, QuantFormat};

fn bench(c: &mut Criterion) {
    // 8 heads x 4096 tokens x head_dim 128: 4 Mi values, one K tensor of a mid-sized layer.
    let shape = (8, 4096, 128);
    for dtype in [DType::F16, DType::F32] {
        let x = Tensor::randn(0f32, 1f32, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let dense = (x.elem_count() * dtype.size_in_bytes()) as u64;
        let mut g = c.benchmark_group(format!("quant_{}", dtype.as_str()));
        g.throughput(Throughput::Bytes(2 * dense));
        g.bench_function("copy", |b| b.iter(|| x.copy().unwrap()));
        for bits in [8u32, 4, 3] {
            let fmt = QuantFormat::new(bits, 64).unwrap();
            let q = format::quantize(&x, fmt).unwrap();
            g.throughput(Throughput::Bytes(dense + q.bytes() as u64));
            g.bench_function(format!("quantize_b{bits}"), |b| {
                b.iter(|| format::quantize(&x, fmt).unwrap())
            });
            g.bench_function(format!("dequantize_b{bits}"), |b| {
                b.iter(|| format::dequantize(&q, fmt).unwrap())
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
