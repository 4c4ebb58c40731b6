//! Bit-exactness against MLX's own output (../shared/reference/mlx-quant-golden.safetensors):
//! codes, scales, biases and dequantized values, for every case in the file, on the fused CPU
//! path, the generic candle-op path and (with `--features cuda`, on a GPU) the CUDA kernels.
//! Set KVQ_REFERENCE_DIR to read the file from elsewhere.

use candle_core::{DType, Device, Tensor};
use kvq::kv::format::{self, QuantFormat, Quantized};
use std::collections::HashMap;
use std::path::PathBuf;

fn golden() -> HashMap<String, Tensor> {
    let dir = std::env::var_os("KVQ_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/reference"))
        });
    let path = dir.join("mlx-quant-golden.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Raw bits of any tensor, so f16 comparisons are exact (and -0.0 != 0.0).
fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
    match t.dtype() {
        DType::U32 => t.to_vec1::<u32>().unwrap(),
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn assert_same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (bits(got), bits(want));
    let bad: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} differ, first at {}",
        bad.len(),
        g.len(),
        bad[0]
    );
}

type Quantize = fn(&Tensor, QuantFormat) -> candle_core::Result<Quantized>;
type Dequantize = fn(&Quantized, QuantFormat) -> candle_core::Result<Tensor>;

/// Runs one implementation over every case of the golden file; returns the number of cases.
fn check_all(name: &str, device: &Device, quantize: Quantize, dequantize: Dequantize) -> usize {
    let g = golden();
    let mut cases = 0;
    for dt in ["f32", "f16"] {
        for bits_ in QuantFormat::BITS {
            for group in QuantFormat::GROUP_SIZES {
                let key = format!("{dt}.b{bits_}.g{group}");
                let get = |k: &str| {
                    g.get(&format!("{key}.{k}"))
                        .unwrap_or_else(|| panic!("golden file lacks {key}.{k}"))
                        .to_device(device)
                        .unwrap()
                };
                let fmt = QuantFormat::new(bits_, group).unwrap();
                let q = quantize(&get("x"), fmt).unwrap();
                let case = format!("{name} {key}");
                assert_same(&format!("{case} codes"), &q.codes, &get("codes"));
                assert_same(&format!("{case} scales"), &q.scales, &get("scales"));
                assert_same(&format!("{case} biases"), &q.biases, &get("biases"));
                assert_same(
                    &format!("{case} deq"),
                    &dequantize(&q, fmt).unwrap(),
                    &get("deq"),
                );
                // Dequantizing MLX's own codes must also give MLX's values.
                let theirs = Quantized {
                    codes: get("codes"),
                    scales: get("scales"),
                    biases: get("biases"),
                };
                assert_same(
                    &format!("{case} deq(mlx)"),
                    &dequantize(&theirs, fmt).unwrap(),
                    &get("deq"),
                );
                cases += 1;
            }
        }
    }
    cases
}

#[test]
fn fused_cpu_matches_mlx() {
    assert_eq!(
        check_all("cpu", &Device::Cpu, format::quantize, format::dequantize),
        36
    );
}

#[test]
fn generic_matches_mlx() {
    assert_eq!(
        check_all(
            "generic",
            &Device::Cpu,
            format::generic::quantize,
            format::generic::dequantize
        ),
        36
    );
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_mlx() {
    let dev = Device::new_cuda(0).expect("a CUDA device (this test runs on the GPU machine)");
    assert_eq!(
        check_all("cuda", &dev, format::quantize, format::dequantize),
        36
    );
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_generic_matches_mlx() {
    let dev = Device::new_cuda(0).expect("a CUDA device (this test runs on the GPU machine)");
    assert_eq!(
        check_all(
            "cuda-generic",
            &dev,
            format::generic::quantize,
            format::generic::dequantize
        ),
        36
    );
}
