//! Compiles kvq's CUDA kernels to PTX, only for `--features cuda` builds (NVCC and
//! CUDA_COMPUTE_CAP come from ../shared/cuda/env.sh; defaults: `nvcc`, 90).

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
    // One PTX per kernel file: quant.cu (quantization), decode.cu (decode attention).
    for name in ["quant", "decode"] {
        let status = Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
                "-o",
            ])
            .arg(out.join(format!("{name}.ptx")))
            .arg(format!("kernels/{name}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {nvcc}: {e} (source ../shared/cuda/env.sh first)")
            });
        assert!(status.success(), "nvcc failed on kernels/{name}.cu");
    }
}
