//! `kvq bench-kv-cache` through the real binary: table, JSON, CSV, refusals, and the exact
//! memory figures of the default shape (computed from the format, without allocating 512 MiB).

use kvq::bench::kv_cache::BenchConfig;
use kvq::kv::format::KvWidths;
use kvq::kv::format::QuantFormat;
use std::process::{Command, Output};

fn kvq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvq"))
        .arg("bench-kv-cache")
        .args(args)
        .output()
        .expect("run kvq")
}

const SMALL: &[&str] = &[
    "--layers",
    "2",
    "--seq-len",
    "64",
    "--heads",
    "4",
    "--head-dim",
    "128",
    "--repeats",
    "2",
];

/// The JSON report of a run at the SMALL shape with `extra` flags (`--json` added), which must
/// succeed.
fn small_json(extra: &[&str]) -> serde_json::Value {
    let mut args = SMALL.to_vec();
    args.push("--json");
    args.extend(extra);
    let out = kvq(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn table_names_dtype_and_rows() {
    let out = kvq(SMALL);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(s.contains("values of f16"), "{s}");
    assert!(!s.contains("FP16"));
    for col in [
        "Mode",
        "Memory",
        "Compression",
        "Bits/value",
        "Mean Err",
        "Max Err",
        "Quantize",
        "Dequantize",
        "GB/s",
    ] {
        assert!(s.contains(col), "missing column {col}: {s}");
    }
    // 2 layers x 64 x 4 x 128 x K,V = 131072 f16 values = 0.25 MiB.
    assert!(s.contains("f16 (dense)") && s.contains("0.25 MiB"), "{s}");
    assert!(
        s.contains("8-bit") && s.contains("1.88x") && s.contains("4-bit") && s.contains("3.56x"),
        "{s}"
    );
}

#[test]
fn json_has_config_and_rows() {
    let v = small_json(&["--dtype", "f32", "--bits", "8,4,3"]);
    assert_eq!(v["config"]["dtype"], "f32");
    assert_eq!(v["config"]["layers"], 2);
    assert!(v["config"]["memcpy_gbps"].as_f64().unwrap() > 0.0);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows[0]["bits"].is_null());
    assert_eq!(rows[0]["bytes"], 131072 * 4);
    for (row, bits) in rows[1..].iter().zip([8, 4, 3]) {
        assert_eq!(row["bits"], bits);
        for k in [
            "mode",
            "bytes",
            "compression",
            "bits_per_value",
            "mean_error",
            "max_error",
            "quantize_ms",
            "dequantize_ms",
            "gbps",
        ] {
            assert!(!row[k].is_null(), "row lacks {k}");
        }
        assert!(row["quantize_ms"].as_f64().unwrap() > 0.0);
    }
    // f32 data, f16 scales (what a cache computing in f32 stores), g64: 8-bit = 8.5 bits/value,
    // 4-bit = 4.5.
    assert_eq!(rows[1]["bits_per_value"], 8.5);
    assert_eq!(rows[2]["bits_per_value"], 4.5);
    assert_eq!(rows[2]["bytes"], 131072 * 9 / 16);
    // Mean |error| of N(0,1) data (MLX: 0.0046 at 8 bits, 0.077 at 4 bits; within 5%).
    let e8 = rows[1]["mean_error"].as_f64().unwrap();
    let e4 = rows[2]["mean_error"].as_f64().unwrap();
    assert!((e8 / 0.00456 - 1.0).abs() < 0.05, "8-bit mean error {e8}");
    assert!((e4 / 0.07711 - 1.0).abs() < 0.05, "4-bit mean error {e4}");
}

/// Settings whose keys are wider than their values (`--bits 4.5`, `6/4`): rows named by both
/// widths, bytes and bits per value of K and V each in its own format, an error between the two
/// sides' alone, and an attention row through the same formats.
#[test]
fn split_widths_rows() {
    let v = small_json(&["--dtype", "f32", "--bits", "5,4.5,4,6/4"]);
    assert_eq!(v["config"]["bits"], serde_json::json!([5, 4.5, 4, 5.0]));
    let rows = v["rows"].as_array().unwrap();
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(
        modes,
        ["f32 (dense)", "5-bit", "K5/V4-bit", "4-bit", "K6/V4-bit"]
    );
    assert_eq!(rows[2]["bits"], 4.5);
    // Half the values (K) at 5.5 bits, half (V) at 4.5 (f16 scales, g64).
    assert_eq!(rows[2]["bits_per_value"], 5.0);
    assert_eq!(rows[4]["bits_per_value"], 5.5);
    let bytes = |i: usize| rows[i]["bytes"].as_u64().unwrap();
    assert_eq!(2 * bytes(2), bytes(1) + bytes(3));
    let err = |i: usize| rows[i]["mean_error"].as_f64().unwrap();
    assert!(err(1) < err(2) && err(2) < err(3), "{rows:?}");
    assert!(
        (err(2) - (err(1) + err(3)) / 2.0).abs() < 0.02 * err(3),
        "{rows:?}"
    );
    let att = v["attention"].as_array().unwrap();
    let aerr = |i: usize| att[i]["max_abs_error"].as_f64().unwrap();
    assert_eq!(att[2]["mode"], "K5/V4-bit");
    assert!(aerr(2) > 0.0 && aerr(2) < aerr(3), "{att:?}");
}

#[test]
fn csv_has_header_and_one_line_per_row() {
    let mut args = SMALL.to_vec();
    args.extend(["--csv", "--bits", "2"]);
    let out = kvq(&args);
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    // First the memory/quantize table, then (after a blank line) the attention table.
    let (table, attention) = s.split_once("\n\n").expect("two CSV sections");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{s}");
    assert!(lines[0].starts_with("mode,bits,bytes,"));
    assert!(lines[2].starts_with("2-bit,2,"));
    let att: Vec<&str> = attention.lines().collect();
    assert!(att[0].starts_with("seq_len,mode,bits,ms,"), "{s}");
    assert_eq!(att.len(), 3, "{s}");
    assert!(att[2].contains(",2-bit,2,"), "{s}");

    args.push("--no-attention");
    let out = kvq(&args);
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 3);
}

#[test]
fn bad_flags_give_one_line_errors() {
    for (flag, value, needle) in [
        ("--bits", "7", "2, 3, 4, 5, 6, 8"),
        ("--bits", "", "empty"),
        ("--bits", "8,,4", "empty"),
        ("--bits", "7.5", "4.5"),
        ("--bits", "9/4", "2, 3, 4, 5, 6, 8"),
        ("--bits", "4/x", "KEY/VALUE"),
        ("--group-size", "48", "32, 64, 128"),
        ("--head-dim", "96", "group"),
        ("--layers", "0", "--layers"),
        ("--attn-layers", "0", "--attn-layers"),
        ("--seq-len", "0", "--seq-len"),
        ("--repeats", "0", "--repeats"),
        ("--device", "tpu", "device"),
    ] {
        let mut args = SMALL.to_vec();
        match args.iter().position(|a| *a == flag) {
            Some(i) => args[i + 1] = value,
            None => args.extend([flag, value]),
        }
        let out = kvq(&args);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{flag} {value}: {err}");
        assert!(err.contains(needle), "{flag} {value}: {err}");
    }
}

#[test]
fn default_shape_memory_matches_the_issue() {
    let mib = |b: u64| format!("{:.2}", b as f64 / 1048576.0);
    for (dtype, dense, q8, q4, c8, c4) in [
        // f32 computes with f16 scales, as the cache stores them.
        (
            candle_core::DType::F32,
            "512.00",
            "136.00",
            "72.00",
            "3.76",
            "7.11",
        ),
        (
            candle_core::DType::F16,
            "256.00",
            "136.00",
            "72.00",
            "1.88",
            "3.56",
        ),
    ] {
        let cfg = BenchConfig {
            layers: 32,
            attn_layers: 1,
            seq_len: 512,
            seq_lens: vec![512],
            gqa: 4,
            block_size: 16,
            heads: 32,
            head_dim: 128,
            batch: 1,
            bits: vec![KvWidths::same(8), KvWidths::same(4)],
            group_size: 64,
            dtype,
            seed: 0,
            warmup: 1,
            repeats: 5,
            rotated: false,
            residual: 0,
            sinks: 0,
            center: false,
        };
        cfg.validate().unwrap();
        let bytes = |b: u32| {
            let f = QuantFormat::new(b, 64).unwrap();
            cfg.quantized_bytes(f, f)
        };
        let (b8, b4) = (bytes(8), bytes(4));
        assert_eq!(
            (mib(cfg.dense_bytes()), mib(b8), mib(b4)),
            (dense.into(), q8.into(), q4.into())
        );
        let ratio = |b: u64| format!("{:.2}", cfg.dense_bytes() as f64 / b as f64);
        assert_eq!((ratio(b8), ratio(b4)), (c8.into(), c4.into()));
    }
}

/// `--rotated` adds a rotated row per width whose output is as close to the dense output as
/// the plain row's (random N(0,1) data has no outliers, so rotation neither helps nor hurts
/// much; a broken rotation would be far off).
#[test]
fn rotated_attention_rows() {
    let v = small_json(&["--dtype", "f32", "--bits", "8,4", "--rotated"]);
    let rows = v["attention"].as_array().unwrap();
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(
        modes,
        [
            "f32 (dense)",
            "8-bit",
            "8-bit rotated",
            "4-bit",
            "4-bit rotated"
        ]
    );
    let err = |i: usize| rows[i]["max_abs_error"].as_f64().unwrap();
    assert!(
        err(2) < 3.0 * err(1) + 1e-4,
        "8-bit rotated {} vs {}",
        err(2),
        err(1)
    );
    assert!(
        err(4) < 3.0 * err(3) + 1e-3,
        "4-bit rotated {} vs {}",
        err(4),
        err(3)
    );
    assert!(err(4) > 0.0 && err(2) > 0.0);

    let out = kvq(&[
        "--layers",
        "1",
        "--seq-len",
        "32",
        "--heads",
        "2",
        "--head-dim",
        "96",
        "--group-size",
        "32",
        "--rotated",
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("power-of-two"), "{e}");
}

/// A step of several layers (each its own pool) attends to the same data as one layer: the same
/// outputs (so the same errors), a time per layer, and the setting in the config.
#[test]
fn attention_step_of_several_layers() {
    let run =
        |layers: &str| small_json(&["--dtype", "f32", "--bits", "4", "--attn-layers", layers]);
    let (one, three) = (run("1"), run("3"));
    assert_eq!(three["config"]["attn_layers"], 3);
    let errs = |v: &serde_json::Value| -> Vec<f64> {
        v["attention"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["max_abs_error"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(errs(&one), errs(&three));
    assert!(three["attention"][1]["ms"].as_f64().unwrap() > 0.0);
}
