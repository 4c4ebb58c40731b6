//! `kvq perplexity` on the default model and the reference corpus (a small slice of the
//! protocol, so CI stays quick; the full 32 × 2048 figures are in the README).

use crate::common::*;

fn corpus() -> String {
    reference_dir().join("corpus.txt").display().to_string()
}

fn run_json(extra: &[&str]) -> serde_json::Value {
    let c = corpus();
    let mut args = vec![
        "perplexity",
        c.as_str(),
        "--json",
        "--no-progress",
        "--dequantize",
        "--dtype",
        "f32",
    ];
    args.extend_from_slice(extra);
    let out = kvq(&args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// One run, four settings: the reference twice (divergence exactly zero), 8-bit, plain 4-bit and
/// rotated 4-bit — quality must order as the formats do, on real text.
#[test]
fn divergence_orders_settings_and_is_zero_against_itself() {
    let v = run_json(&[
        "--ctx",
        "256",
        "--max-tokens",
        "1024",
        "--compare",
        "f32,f32,8,4:affine,4:rotated",
    ]);
    assert_eq!(v["windows"], 4);
    let s = v["settings"].as_array().unwrap();
    assert_eq!(s.len(), 5);
    assert!(s[0]["vs_reference"].is_null());
    for r in s {
        // 4 windows × 255 targets.
        assert_eq!(r["tokens"], 1020, "{r}");
        let ppl = f(&r["ppl"]);
        assert!(ppl.is_finite() && ppl > 1.0 && ppl < 200.0, "{r}");
    }
    assert_eq!(f(&s[0]["ppl"]), f(&s[1]["ppl"]));
    let d = |i: usize| s[i]["vs_reference"].clone();
    assert_eq!(f(&d(1)["kl_mean"]), 0.0);
    assert_eq!(f(&d(1)["same_top1_pct"]), 100.0);
    let (kl8, kl4, kl4r) = (
        f(&d(2)["kl_mean"]),
        f(&d(3)["kl_mean"]),
        f(&d(4)["kl_mean"]),
    );
    assert!(kl8 > 0.0 && kl8 < kl4, "8-bit {kl8} vs 4-bit {kl4}");
    assert!(
        kl4r < kl4,
        "rotated 4-bit {kl4r} should beat plain 4-bit {kl4}"
    );
    assert!(f(&d(2)["same_top1_pct"]) >= f(&d(3)["same_top1_pct"]));
    for i in 2..5 {
        let dd = d(i);
        assert!(
            f(&dd["kl_max"]) >= f(&dd["kl_p99"]) && f(&dd["kl_p99"]) >= 0.0,
            "{dd}"
        );
    }
    assert!(f(&s[2]["kv_bytes_per_token"]) < f(&s[0]["kv_bytes_per_token"]));
    // Bits actually stored per value, scales included: f16 scales and biases per 64 values even
    // though the run computes in f32.
    let bits: Vec<f64> = s.iter().map(|r| f(&r["bits_per_value"])).collect();
    assert_eq!(bits, [32.0, 32.0, 8.5, 4.5, 4.5]);
}

/// Chunk boundaries must not matter: the cache holds the same rows whether a window arrives in
/// one pass or in many small ones that straddle blocks. The dense cache agrees to rounding; a
/// quantized cache only statistically — a last-bit difference in K from a matmul of another
/// shape can flip a code, and the flip propagates through later layers (both runs are equally
/// valid draws of the quantization noise) — so a chunk-boundary bug, not noise, must show.
#[test]
fn chunking_does_not_change_the_result() {
    let a = run_json(&["--ctx", "96", "--max-tokens", "192", "--compare", "f32,4"]);
    let b = run_json(&[
        "--ctx",
        "96",
        "--max-tokens",
        "192",
        "--compare",
        "f32,4",
        "--chunk",
        "17",
    ]);
    let ppl = |v: &serde_json::Value, i: usize| f(&v["settings"][i]["ppl"]);
    let (pa, pb) = (ppl(&a, 0), ppl(&b, 0));
    assert!((pa - pb).abs() / pa < 1e-4, "dense: {pa} vs {pb}");
    let (qa, qb) = (ppl(&a, 1), ppl(&b, 1));
    assert!((qa - qb).abs() / qa < 0.03, "4-bit: {qa} vs {qb}");
}

#[test]
fn bad_input_is_refused_with_the_reason() {
    let c = corpus();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "perplexity",
                &c,
                "--load-format",
                "dummy",
                "--config",
                "fixtures/tiny-llama/config.json",
            ],
            "random weights",
        ),
        (vec!["perplexity", &c, "--compare", "f32,q4"], "--compare"),
        (vec!["perplexity", &c, "--compare", "7"], "7"),
        (vec!["perplexity", &c, "--ctx", "1"], "--ctx"),
        (
            vec!["perplexity", &c, "--ctx", "512", "--max-tokens", "100"],
            "less than one window",
        ),
        (vec!["perplexity", "/no/such/file.txt"], "cannot read"),
        (
            vec!["perplexity", &c, "--kv-quant-scheme", "rotated"],
            "--kv-bits",
        ),
    ];
    for (args, want) in cases {
        let out = kvq(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

/// A tiny text whose token count is below one window.
#[test]
fn short_text_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("short.txt");
    std::fs::write(&p, "Just a few words.").unwrap();
    let out = kvq(&["perplexity", p.to_str().unwrap(), "--ctx", "64"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("fewer than one window"), "{err}");
}

/// `--quantized-reference` measures against the first entry as given (no dense row in front),
/// and `:exact` keeps the exact kernel: with only the last layer quantized (so no layer's cache
/// is requantized from a slightly different input), the CPU's 8-bit passes are within the
/// bound issue 17 sets against the exact kernel (mean KL ≤ 0.0005, same top-1 ≥ 99.5%).
#[test]
fn eight_bit_queries_against_the_exact_kernel() {
    let dense: Vec<String> = (0..29).map(|i| i.to_string()).collect();
    let dense = dense.join(",");
    let v = run_json(&[
        "--ctx",
        "512",
        "--max-tokens",
        "1024",
        "--kv-bits",
        "4",
        "--kv-dense-layers",
        &dense,
        "--compare",
        "4:exact,4",
        "--quantized-reference",
    ]);
    let s = v["settings"].as_array().unwrap();
    assert_eq!(s.len(), 2, "{v}");
    assert!(s[0]["vs_reference"].is_null());
    let label = |i: usize| s[i]["label"].as_str().unwrap().to_string();
    assert!(label(0).starts_with("4-bit g64"), "{}", label(0));
    let d = s[1]["vs_reference"].clone();
    if label(1).ends_with("8-bit attention") {
        // This CPU has the 8-bit passes (AVX2 or AVX-512 VNNI).
        assert!(label(0).ends_with("exact attention"), "{}", label(0));
        assert!(f(&d["kl_mean"]) <= 5e-4, "{d}");
        assert!(f(&d["same_top1_pct"]) >= 99.5, "{d}");
    } else {
        assert_eq!(f(&d["kl_mean"]), 0.0, "{d}");
    }
    let out = kvq(&["perplexity", &corpus(), "--quantized-reference"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--compare"), "{}", stderr(&out));
}

/// `--kv-residual` (here `:r32` on one row): the newest 32 positions of every query attend dense,
/// which must cut 4-bit's divergence at least in half on real text, and the row's bits per value
/// count the dense copies: 32 f16 rows spread over a 256-token window add 32 · 16 / 256 = 2 bits.
#[test]
fn a_residual_window_cuts_divergence_and_is_counted_in_bits() {
    let v = run_json(&[
        "--ctx",
        "256",
        "--max-tokens",
        "512",
        "--compare",
        "f32,4,4:r32",
    ]);
    let s = v["settings"].as_array().unwrap();
    let kl = |i: usize| f(&s[i]["vs_reference"]["kl_mean"]);
    assert!(
        kl(2) > 0.0 && kl(2) < 0.5 * kl(1),
        "r32 {} vs {}",
        kl(2),
        kl(1)
    );
    let top1 = |i: usize| f(&s[i]["vs_reference"]["same_top1_pct"]);
    assert!(top1(2) > top1(1), "{} vs {}", top1(2), top1(1));
    assert_eq!(f(&s[1]["bits_per_value"]), 4.5);
    assert_eq!(f(&s[2]["bits_per_value"]), 6.5);
    assert!(
        s[2]["label"].as_str().unwrap().contains("+ 32 dense"),
        "{}",
        s[2]["label"]
    );
}

#[test]
fn centred_keys_cut_divergence_at_the_same_bits() {
    let v = run_json(&[
        "--ctx",
        "256",
        "--max-tokens",
        "512",
        "--compare",
        "f32,3,3:c",
    ]);
    let s = v["settings"].as_array().unwrap();
    let kl = |i: usize| f(&s[i]["vs_reference"]["kl_mean"]);
    assert!(
        kl(2) > 0.0 && kl(2) < kl(1),
        "centred {} vs {}",
        kl(2),
        kl(1)
    );
    assert_eq!(f(&s[1]["bits_per_value"]), f(&s[2]["bits_per_value"]));
    assert!(
        s[2]["label"].as_str().unwrap().contains("centred keys"),
        "{}",
        s[2]["label"]
    );
}
