//! A fingerprint of the weights, so a prompt cache is only ever used with the model that made it.
//!
//! It is a sha256 over the weight files (and config.json for safetensors models), with each
//! file's length. Files up to 256 MiB are hashed whole (the default model: ~0.1 s); larger ones
//! in 64 evenly spaced 1 MiB samples, header and tail included, so the cost stays under a second
//! for any model — a fine-tune or another quantization changes every sample, an edit confined
//! to the bytes between samples of a large file would not be seen. It is computed only when a
//! prompt cache is saved or used.
//!
//! Dummy weights (`--load-format dummy`) are fingerprinted by their recipe (config, dtype,
//! device kind, seed) where the device's generator can be seeded; the CPU's cannot, so dummy
//! weights on the CPU differ on every run and have no fingerprint.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const FULL_HASH_LIMIT: u64 = 256 << 20;
const SAMPLES: u64 = 64;
const SAMPLE_BYTES: u64 = 1 << 20;

/// Where the loaded weights came from.
#[derive(Debug, Clone)]
pub enum WeightSource {
    /// A GGUF file.
    Gguf(PathBuf),
    /// config.json and the safetensors files, in a fixed order.
    Safetensors(Vec<PathBuf>),
    /// Random weights from `config` by a generator seeded with `seed` on `device`.
    Dummy {
        config: PathBuf,
        seed: u64,
        dtype: DType,
        device: Device,
    },
}

impl WeightSource {
    /// The files the weights are read from (a writer must never replace one of them).
    pub fn files(&self) -> Vec<PathBuf> {
        match self {
            WeightSource::Gguf(p) => vec![p.clone()],
            WeightSource::Safetensors(files) => files.clone(),
            WeightSource::Dummy { config, .. } => vec![config.clone()],
        }
    }
}

impl WeightSource {
    /// The fingerprint (lowercase hex sha256).
    pub fn fingerprint(&self) -> Result<String> {
        let mut h = Sha256::new();
        match self {
            WeightSource::Gguf(file) => {
                h.update(b"kvq-weights-v1\0");
                hash_file(&mut h, file)?;
            }
            WeightSource::Safetensors(files) => {
                h.update(b"kvq-weights-v1\0");
                for f in files {
                    hash_file(&mut h, f)?;
                }
            }
            WeightSource::Dummy {
                config,
                seed,
                dtype,
                device,
            } => {
                if device.is_cpu() {
                    bail!(
                        "--load-format dummy on the CPU draws new random weights on every run, \
                         so no prompt cache can be saved for or used with them"
                    );
                }
                h.update(b"kvq-dummy-v1\0");
                let cfg = std::fs::read(config)
                    .with_context(|| format!("cannot read {}", config.display()))?;
                h.update((cfg.len() as u64).to_le_bytes());
                h.update(&cfg);
                let kind = if device.is_cuda() { "cuda" } else { "metal" };
                h.update(format!("{kind}\0{}\0{seed}", dtype.as_str()).as_bytes());
            }
        }
        Ok(hex(&h.finalize()))
    }
}

fn hash_file(h: &mut Sha256, path: &Path) -> Result<()> {
    let ctx = || format!("cannot read {} to fingerprint the model", path.display());
    let mut f = std::fs::File::open(path).with_context(ctx)?;
    let len = f.metadata().with_context(ctx)?.len();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; SAMPLE_BYTES as usize];
    if len <= FULL_HASH_LIMIT {
        loop {
            let n = f.read(&mut buf).with_context(ctx)?;
            if n == 0 {
                break;
            }
            h.update(buf.get(..n).unwrap_or_default());
        }
        return Ok(());
    }
    for i in 0..SAMPLES {
        let at = (len - SAMPLE_BYTES) * i / (SAMPLES - 1);
        f.seek(SeekFrom::Start(at)).with_context(ctx)?;
        f.read_exact(&mut buf).with_context(ctx)?;
        h.update(&buf);
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_with_the_bytes_and_length_of_any_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, vec![7u8; 5000]).unwrap();
        std::fs::write(&b, b"config").unwrap();
        let fp = |files: Vec<PathBuf>| WeightSource::Safetensors(files).fingerprint().unwrap();
        let base = fp(vec![a.clone(), b.clone()]);
        assert_eq!(base.len(), 64);
        assert_eq!(base, fp(vec![a.clone(), b.clone()]));
        let mut changed = vec![7u8; 5000];
        changed[4321] = 8;
        std::fs::write(&a, &changed).unwrap();
        assert_ne!(base, fp(vec![a.clone(), b.clone()]));
        std::fs::write(&a, vec![7u8; 5001]).unwrap();
        assert_ne!(base, fp(vec![a.clone(), b.clone()]));
        assert!(WeightSource::Gguf(dir.path().join("missing"))
            .fingerprint()
            .is_err());
    }

    #[test]
    fn unseeded_dummy_weights_have_none() {
        let e = WeightSource::Dummy {
            config: PathBuf::from("config.json"),
            seed: 0,
            dtype: DType::F32,
            device: Device::Cpu,
        }
        .fingerprint()
        .unwrap_err()
        .to_string();
        assert!(e.contains("dummy") && e.contains("CPU"), "{e}");
    }
}
