//! Compiles kvq's CUDA kernels to fat binaries (machine code + PTX), only for `--features cuda`
//! builds (NVCC and CUDA_COMPUTE_CAP come from ../shared/cuda/env.sh; defaults: `nvcc`, 90).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    // One fat binary per kernel file: quant.cu (quantization), decode.cu (decode attention),
    // sample.cu (token picks), fused.cu (fused decoder ops), gemv.cu (projections of a few rows),
    // ring.cu (the residual window's rows of a captured decode step),
    // holding machine code for compute capability `cap` and its PTX for newer GPUs (loaded by
    // src/device/kernels.rs).
    for name in ["quant", "decode", "sample", "fused", "gemv", "ring"] {
        let status = Command::new(&nvcc)
            .args([
                "--fatbin",
                "-O3",
                "-std=c++17",
                &format!("-gencode=arch=compute_{cap},code=sm_{cap}"),
                &format!("-gencode=arch=compute_{cap},code=compute_{cap}"),
                "-o",
            ])
            .arg(out.join(format!("{name}.fatbin")))
            .arg(format!("kernels/{name}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {nvcc}: {e} (source ../shared/cuda/env.sh first)")
            });
        assert!(status.success(), "nvcc failed on kernels/{name}.cu");
    }
}
