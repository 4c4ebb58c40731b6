//! `kvq bench-batch` through the real binary on the default model, at shapes small enough for
//! the CPU: the llama-batched-bench columns, `--json` rows whose figures agree with their
//! definitions, KV flags that change the cache, prompts fully prefilled before decoding, and
//! bad values refused with the flag named.

use crate::common::*;
use serde_json::Value;

const SMALL: &[&str] = &[
    "bench-batch",
    "--npp",
    "8",
    "--ntg",
    "4",
    "--npl",
    "1,3",
    "--no-warmup",
    "--threads",
    "2",
];

fn run_json(extra: &[&str]) -> Value {
    let mut args = SMALL.to_vec();
    args.push("--json");
    args.extend_from_slice(extra);
    let out = kvq(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn table_has_llama_batched_bench_columns() {
    let out = kvq(SMALL);
    assert!(out.status.success(), "{}", stderr(&out));
    let s = String::from_utf8(out.stdout).unwrap();
    for col in [
        "PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s", "KV",
        "peak mem",
    ] {
        assert!(s.contains(col), "missing column {col}: {s}");
    }
    assert!(s.contains("dense"), "{s}");
    // N_KV = B * (PP + TG): 12 and 36.
    let n_kv: Vec<&str> = s
        .lines()
        .filter(|l| l.contains(" 8 ") && l.contains(" 4 "))
        .collect();
    assert_eq!(n_kv.len(), 2, "{s}");
    assert!(n_kv[0].contains(" 12 ") && n_kv[1].contains(" 36 "), "{s}");
}

/// Rows agree with llama-batched-bench's definitions; a one-sequence step chunk of 8 tokens
/// still gives exactly TG pure decode steps (no sequence decodes while another prefills); a
/// 4-bit cache holds the same tokens in fewer bytes.
#[test]
fn json_rows_follow_the_definitions_and_kv_flags() {
    let dense = run_json(&["--prefill-chunk", "8"]);
    let q4 = run_json(&["--kv-bits", "4", "--kv-quant-scheme", "affine"]);
    assert_eq!(dense["config"]["kv_bits"], Value::Null);
    assert_eq!(q4["config"]["kv_bits"], 4);
    assert!(q4["config"]["kv_cache"]
        .as_str()
        .unwrap()
        .contains("4-bit K"));
    for v in [&dense, &q4] {
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for (r, pl) in rows.iter().zip([1u64, 3]) {
            assert_eq!(r["pp"], 8);
            assert_eq!(r["tg"], 4);
            assert_eq!(r["pl"], pl);
            assert_eq!(r["n_kv"], pl * 12);
            assert_eq!(r["decode_steps"], 4);
            let f = |k: &str| r[k].as_f64().unwrap();
            assert!(f("t_pp") > 0.0 && f("t_tg") > 0.0);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
            assert!(close(f("speed_pp"), (pl * 8) as f64 / f("t_pp")), "{r}");
            assert!(close(f("speed_tg"), (pl * 4) as f64 / f("t_tg")), "{r}");
            assert!(close(f("t"), f("t_pp") + f("t_tg")), "{r}");
            assert!(close(f("speed"), (pl * 12) as f64 / f("t")), "{r}");
            assert!(r["peak_device_bytes"].is_null(), "CPU run: {r}");
        }
    }
    let bytes = |v: &Value, i: usize| v["rows"][i]["kv_bytes"].as_u64().unwrap();
    // The default model: 30 layers x 3 KV heads x 64 dims, K and V, f16 (the default dense
    // cache, also on the CPU), in blocks of 16 tokens: one block per sequence holds its 12
    // tokens.
    assert_eq!(bytes(&dense, 0), 30 * 2 * 3 * 64 * 2 * 16);
    assert_eq!(bytes(&dense, 1), 3 * bytes(&dense, 0));
    // 4.5 bits per value against 16.
    assert!(bytes(&q4, 0) * 3 < bytes(&dense, 0), "{q4}");
}

/// `--ctx-size` replaces the model's context window (like llama.cpp's `-c`, which runs shapes
/// past the trained window): a shape that fills it runs, one token more is refused by it.
#[test]
fn ctx_size_replaces_the_context_window() {
    let base = [
        "bench-batch",
        "--no-warmup",
        "--threads",
        "2",
        "--npl",
        "1",
        "--ntg",
        "4",
    ];
    let mut ok = base.to_vec();
    ok.extend(["--npp", "12", "--ctx-size", "16", "--json"]);
    let out = kvq(&ok);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["rows"][0]["n_kv"], 16);
    let mut over = base.to_vec();
    over.extend(["--npp", "13", "--ctx-size", "16"]);
    let out = kvq(&over);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("context window of 16"),
        "{}",
        stderr(&out)
    );
}

/// `--kv-bits 3.5` is 4-bit keys with 3-bit values: the cache the two per-side flags make, in
/// fewer bytes than 4-bit and more than 3-bit.
#[test]
fn a_half_average_makes_keys_one_bit_wider_than_values() {
    let avg = run_json(&["--kv-bits", "3.5"]);
    let sides = run_json(&["--kv-key-bits", "4", "--kv-value-bits", "3"]);
    assert_eq!(avg["config"]["kv_bits"], 3.5);
    assert_eq!(avg["config"]["kv_cache"], sides["config"]["kv_cache"]);
    let label = avg["config"]["kv_cache"].as_str().unwrap();
    assert!(
        label.contains("4-bit K") && label.contains("3-bit V"),
        "{label}"
    );
    let bytes = |v: &Value| v["rows"][1]["kv_bytes"].as_u64().unwrap();
    // Plain widths (a part given): --kv-bits 4 / 3 alone are budgets, below.
    let q4 = run_json(&["--kv-bits", "4", "--kv-residual", "0"]);
    let q3 = run_json(&["--kv-bits", "3", "--kv-residual", "0"]);
    assert_eq!(bytes(&avg), bytes(&sides));
    assert!(bytes(&q3) < bytes(&avg) && bytes(&avg) < bytes(&q4));
    // The --kv-bits 4 budget is this split with the dense window and centred keys.
    let budget = run_json(&["--kv-bits", "4"]);
    let c = &budget["config"];
    assert_eq!(
        (&c["kv_key_bits"], &c["kv_value_bits"]),
        (&4.into(), &3.into())
    );
    assert_eq!((&c["kv_residual"], &c["kv_sinks"]), (&60.into(), &4.into()));
    assert_eq!(c["kv_center"], true);
    assert_eq!(bytes(&budget), bytes(&avg));
    let label = c["kv_cache"].as_str().unwrap();
    assert!(
        label.contains("3-bit V") && label.contains("60 dense + 4 sinks, centred keys"),
        "{label}"
    );
}

#[test]
fn bad_values_are_refused_with_the_flag_named() {
    for (args, want) in [
        (&["--npl", "0"][..], "--npl"),
        (&["--npp", "8,x"][..], "--npp"),
        (&["--ntg=-1"][..], "--ntg"),
        (&["--kv-bits", "7"][..], "--kv-bits"),
        (&["--kv-group-size", "32"][..], "--kv-bits"),
        (&["--prefill-chunk", "0"][..], "--prefill-chunk"),
        (&["--npp", "9000"][..], "context window"),
        (&["--ctx-size", "0"][..], "--ctx-size"),
    ] {
        let mut a = vec!["bench-batch", "--no-warmup", "--threads", "2"];
        a.extend_from_slice(args);
        let out = kvq(&a);
        assert!(!out.status.success(), "{args:?} was accepted");
        let e = stderr(&out);
        assert!(e.contains(want), "{args:?}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{args:?}: not one line: {e}");
    }
    // Refused by the flag's parser (clap's message, with its hint line).
    let out = kvq(&["bench-batch", "--no-warmup", "--kv-bits", "6.5"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("--kv-bits") && e.contains("3.5"), "{e}");
}
