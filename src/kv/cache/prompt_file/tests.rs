//! Prompt-cache files: round trips, refusals, damaged files.

use super::*;
use crate::kv::cache::{CacheConfig, PagedKvCache};
use crate::kv::format::QuantFormat;

fn identity() -> ModelIdentity {
    ModelIdentity {
        fingerprint: "abc123".into(),
        weights: "dense".into(),
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 32,
    }
}

/// A 2-layer cache in `fmt` holding `n` tokens of sequence 0.
fn cache_with(fmt: KvFormat, n: usize) -> PagedKvCache {
    let mut cfg = CacheConfig::dense(2, 2, 32, 4, 16, DType::F32);
    cfg.formats = vec![fmt; 2];
    let mut c = PagedKvCache::new(cfg, &Device::Cpu).unwrap();
    c.add_sequence(0).unwrap();
    c.reserve(0, n).unwrap();
    let x = Tensor::arange(0f32, (n * 64) as f32, &Device::Cpu)
        .unwrap()
        .affine(0.013, -1.0)
        .unwrap()
        .sin()
        .unwrap()
        .reshape((n, 64))
        .unwrap();
    for l in 0..2 {
        c.write(l, 0, 0, &x, &x.cos().unwrap()).unwrap();
    }
    c.advance(0, n).unwrap();
    c
}

fn meta(fmt: KvFormat, n: usize) -> PromptCacheMeta {
    let id = identity();
    PromptCacheMeta {
        fingerprint: id.fingerprint,
        model: "test".into(),
        weights: id.weights,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 32,
        formats: vec![fmt; 2],
        tokens: (100..100 + n as u32).collect(),
        centers: Vec::new(),
    }
}

fn q4() -> KvFormat {
    KvFormat::affine(QuantFormat::new(4, 32).unwrap(), DType::F32, false)
}

#[test]
fn save_open_load_round_trips_stored_rows() {
    let dir = tempfile::tempdir().unwrap();
    for fmt in [KvFormat::Dense(DType::F32), q4()] {
        let c = cache_with(fmt, 9);
        let rows = c.export_rows(0).unwrap();
        let path = dir.path().join("p.safetensors");
        save(&path, &meta(fmt, 9), &rows).unwrap();
        let f = PromptCacheFile::open(&path).unwrap();
        assert_eq!(f.meta(), &meta(fmt, 9));
        f.check_model(&identity()).unwrap();
        f.check_formats(&[fmt, fmt], "").unwrap();
        // Importing 5 of the 9 rows gives exactly the first 5 stored rows.
        let part = f.load_rows(5, &Device::Cpu).unwrap();
        let mut d = PagedKvCache::new(c.config().clone(), &Device::Cpu).unwrap();
        d.add_sequence(3).unwrap();
        d.import_rows(3, &part, 2).unwrap();
        let back = d.export_rows(3).unwrap();
        for (a, b) in back.iter().zip(&rows) {
            let b = b.narrow(0, 5).unwrap();
            let (ta, tb) = match (a, &b) {
                (LayerRows::Dense { k, v }, LayerRows::Dense { k: k2, v: v2 }) => {
                    (vec![k, v], vec![k2, v2])
                }
                (LayerRows::Affine { k, v, .. }, LayerRows::Affine { k: k2, v: v2, .. }) => (
                    vec![&k.codes, &k.scales, &v.codes, &v.biases],
                    vec![&k2.codes, &k2.scales, &v2.codes, &v2.biases],
                ),
                _ => panic!("format changed"),
            };
            for (x, y) in ta.iter().zip(tb) {
                let x: Vec<f64> = x
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let y: Vec<f64> = y
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(x, y);
            }
        }
    }
}

#[test]
fn refuses_other_models_formats_and_damaged_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.safetensors");
    save(
        &path,
        &meta(q4(), 6),
        &cache_with(q4(), 6).export_rows(0).unwrap(),
    )
    .unwrap();
    let f = PromptCacheFile::open(&path).unwrap();

    let e = f
        .check_model(&ModelIdentity {
            fingerprint: "ffff".into(),
            ..identity()
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fingerprint abc123") && e.contains("ffff"),
        "{e}"
    );
    let e = f
        .check_model(&ModelIdentity {
            head_dim: 64,
            ..identity()
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("head_dim 32") && e.contains("2 x 2 x 64"), "{e}");
    let e = f
        .check_model(&ModelIdentity {
            weights: "quantized".into(),
            ..identity()
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--dequantize"), "{e}");
    let q8 = KvFormat::affine(QuantFormat::new(8, 32).unwrap(), DType::F32, false);
    let e = f.check_formats(&[q8, q8], "").unwrap_err().to_string();
    assert!(
        e.contains("layer 0 is affine 4-bit/g32 with f32 scales")
            && e.contains("keeps it as affine 8-bit/g32 with f32 scales"),
        "{e}"
    );

    // Saved by a kvq that kept f32 scales when computing in f32: refused with the reason.
    let q4h = q4().with_scale_dtype(DType::F16);
    let e = f
        .check_formats(&[q4h, q4h], " (hint)")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&path.display().to_string())
            && e.contains("earlier kvq")
            && e.contains("affine 4-bit/g32 with f32 scales")
            && e.contains("--save-prompt-cache")
            && !e.contains("hint"),
        "{e}"
    );

    // Cut short, or not a prompt cache at all: refused on open with the file's name.
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let e = PromptCacheFile::open(&cut).unwrap_err().to_string();
    assert!(
        e.contains("cut.safetensors") && e.contains("not a kvq prompt cache"),
        "{e}"
    );
    let other = dir.path().join("other.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([("w", Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())]),
        &other,
    )
    .unwrap();
    assert!(PromptCacheFile::open(&other).is_err());
    assert!(PromptCacheFile::open(&dir.path().join("missing")).is_err());
}

#[test]
fn reuse_is_the_common_prefix_short_of_the_last_two_tokens() {
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3, 4, 5]), 3);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3, 4]), 2);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3]), 1);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 9, 3, 4]), 1);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[7, 2, 5]), 0);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2]), 0);
}

#[test]
fn the_same_cache_is_saved_as_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let rows = cache_with(q4(), 4).export_rows(0).unwrap();
    let saved: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let p = dir.path().join(format!("p{i}.safetensors"));
            save(&p, &meta(q4(), 4), &rows).unwrap();
            std::fs::read(&p).unwrap()
        })
        .collect();
    for s in &saved[1..] {
        assert!(s == &saved[0], "the header's order changed between saves");
    }
    PromptCacheFile::open(&dir.path().join("p3.safetensors")).unwrap();
}

/// Dense copies (`--kv-residual 4 --kv-sinks 2`) of a 9-token prompt in both layers.
fn held_rows() -> crate::kv::cache::held::HeldRows {
    use crate::kv::cache::held::{HeldLayer, HeldRows};
    let t = |n: usize, at: f64| {
        Tensor::arange(0f32, (n * 64) as f32, &Device::Cpu)
            .unwrap()
            .affine(0.01, at)
            .unwrap()
            .reshape((n, 64))
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
    };
    let layer = |l: f64| HeldLayer {
        sink_k: t(2, l),
        sink_v: t(2, l + 0.5),
        window_k: t(3, -l),
        window_v: t(3, -l - 0.5),
    };
    HeldRows {
        residual: 4,
        sinks: 2,
        len: 9,
        layers: vec![Some(layer(1.0)), Some(layer(2.0))],
    }
}

/// A file saved with dense copies holds them as saved (its header says with what window), and
/// a damaged copy is refused when the file is opened.
#[test]
fn dense_copies_round_trip_and_are_checksummed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.safetensors");
    let rows = cache_with(q4(), 9).export_rows(0).unwrap();
    let held = held_rows();
    save_with(&path, &meta(q4(), 9), &rows, Some(&held)).unwrap();
    let f = PromptCacheFile::open(&path).unwrap();
    assert_eq!(
        f.held_meta(),
        HeldMeta {
            residual: 4,
            sinks: 2
        }
    );
    let back = f.load_held(&Device::Cpu).unwrap().unwrap();
    assert_eq!((back.residual, back.sinks, back.len), (4, 2, 9));
    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    for (a, b) in back.layers.iter().zip(&held.layers) {
        let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
        assert_eq!(bits(&a.sink_k), bits(&b.sink_k));
        assert_eq!(bits(&a.sink_v), bits(&b.sink_v));
        assert_eq!(bits(&a.window_k), bits(&b.window_k));
        assert_eq!(bits(&a.window_v), bits(&b.window_v));
    }
    // Without copies: none, and the file is the one `save` writes.
    let plain = dir.path().join("p.safetensors");
    save(&plain, &meta(q4(), 9), &rows).unwrap();
    let p = PromptCacheFile::open(&plain).unwrap();
    assert_eq!(p.held_meta(), HeldMeta::default());
    assert!(p.load_held(&Device::Cpu).unwrap().is_none());
    // A copy of the wrong length is not saved.
    let mut short = held.clone();
    short.len = 8;
    assert!(save_with(&path, &meta(q4(), 9), &rows, Some(&short)).is_err());
    // One flipped byte in a window tensor's data: refused, naming the tensor.
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = header["1.v.window"]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let e = PromptCacheFile::open(&path).unwrap_err().to_string();
    assert!(e.contains("1.v.window is damaged"), "{e}");
}
