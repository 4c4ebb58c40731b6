//! Quantized KV caches inside `kvq generate`: greedy tokens under 8-bit, the bytes the cache
//! reports against the format's formula, sliding windows that keep the cache flat, and prefill
//! peak memory below the dense cache's.

use crate::common::*;

fn json(args: &[&str]) -> serde_json::Value {
    let out = kvq(args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Generated ids of a reference case under extra KV flags.
fn greedy_tokens(case: &serde_json::Value, kv: &[&str], dir: &std::path::Path) -> Vec<u32> {
    let args = reference_generate_args(case, kv, dir);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ids(&json(&argv)["tokens"])
}

#[test]
fn eight_bit_cache_keeps_the_dense_greedy_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut ok = 0;
    let mut report = Vec::new();
    for case in greedy_cases() {
        let got = greedy_tokens(&case, &["--kv-bits", "8"], dir.path());
        let need = required_prefix(&case);
        let same = got.len() >= need.len() && got[..need.len()] == need[..];
        ok += same as usize;
        report.push(format!(
            "{}: {}",
            case["id"],
            if same { "ok" } else { "differs" }
        ));
    }
    assert!(
        ok >= 11,
        "8-bit KV kept the dense tokens on only {ok}/12:\n{}",
        report.join("\n")
    );
}

/// 4-bit g64 computing in f32 (f16 scales) on this model: 64 dims × 4 bits = 32 B of codes + 2 B
/// scale + 2 B bias per head → 36 B (4.5 bits per value); 3 KV heads, K and V, 30 layers → 6480 B
/// per token.
const Q4_BYTES_PER_TOKEN: u64 = 30 * 2 * 3 * 36;

#[test]
fn reported_bytes_follow_the_format_formula() {
    let v = json(&[
        "generate",
        "--temp",
        "0",
        "--max-tokens",
        "40",
        "--kv-bits",
        "4",
        "--kv-residual",
        "0",
        "--json",
        "--raw",
        "The history of the printing press begins",
    ]);
    let stats = &v["stats"];
    assert_eq!(stats["kv_window_bytes"], 0);
    assert_eq!(
        stats["kv_bytes_per_token"].as_u64().unwrap(),
        Q4_BYTES_PER_TOKEN
    );
    let tokens = (v["prompt_tokens"].as_array().unwrap().len()
        + v["tokens"].as_array().unwrap().len()
        - 1) as u64; // the last token is never fed back
    let bytes = stats["kv_bytes"].as_u64().unwrap();
    let formula = tokens * Q4_BYTES_PER_TOKEN;
    let block = 16 * Q4_BYTES_PER_TOKEN; // one partial block per sequence (all layers)
    assert!(
        bytes >= formula && bytes < formula + block,
        "{bytes} vs formula {formula}"
    );

    // The `--kv-bits 4` budget: 4-bit keys (36 B a head), 3-bit values (24 + 4 B), and per
    // sequence f16 copies of its newest 60 and first 4 rows (64 × 30 layers × K, V × 3 heads ×
    // 64 × 2 B), 4.5 bits per value over 2,048 tokens.
    let b = json(&[
        "generate",
        "--max-tokens",
        "4",
        "--kv-bits",
        "4",
        "--json",
        "--raw",
        "Hello",
    ]);
    assert_eq!(b["stats"]["kv_bytes_per_token"], 30 * 3 * (36 + 28));
    assert_eq!(b["stats"]["kv_window_bytes"], 64 * 30 * 2 * 3 * 64 * 2);

    // The dense cache for comparison: f16 by default also on the CPU (64 × 2 B per head), f32
    // under --dtype f32 or --kv-dtype f32 (64 × 4 B).
    for (flags, bytes) in [
        (&[][..], 128),
        (&["--dtype", "f32"][..], 256),
        (&["--kv-dtype", "f32"][..], 256),
    ] {
        let mut argv = vec!["generate", "--temp", "0", "--max-tokens", "4", "--json"];
        argv.extend(flags);
        argv.extend(["--raw", "Hello"]);
        let d = json(&argv);
        assert_eq!(
            d["stats"]["kv_bytes_per_token"].as_u64().unwrap(),
            30 * 2 * 3 * bytes,
            "{flags:?}"
        );
    }
}

#[test]
fn sliding_window_keeps_kv_bytes_flat_dense_and_quantized() {
    for kv in [&[][..], &["--kv-bits", "4"][..]] {
        let mut args = vec![
            "generate",
            "--temp",
            "0",
            "--max-tokens",
            "120",
            "--max-kv-size",
            "32",
            "--json",
            "--raw",
            "Once upon a time",
        ];
        args.extend_from_slice(kv);
        let v = json(&args);
        assert_eq!(v["tokens"].as_array().unwrap().len(), 120, "{kv:?}");
        let per_token = v["stats"]["kv_bytes_per_token"].as_u64().unwrap();
        // Window 32 in 16-token blocks: at most 3 blocks held, whatever the length.
        let peak = v["stats"]["kv_bytes"].as_u64().unwrap();
        assert!(peak <= 3 * 16 * per_token, "{kv:?}: peak {peak} > 3 blocks");
    }
}

#[test]
fn quantized_prefill_peaks_below_the_dense_cache() {
    let text = std::fs::read_to_string(reference_dir().join("corpus.txt")).unwrap();
    let prompt: String = text.chars().take(9000).collect(); // ~2K tokens
    let peak = |kv: &[&str]| -> u64 {
        let mut args = vec!["generate", "--max-tokens", "1", "--json", "--raw", &prompt];
        args.extend_from_slice(kv);
        json(&args)["stats"]["peak_memory_bytes"].as_u64().unwrap()
    };
    let dense = peak(&[]);
    let q4 = peak(&["--kv-bits", "4"]);
    assert!(
        q4 < dense,
        "4-bit peak {q4} B is not below the dense cache's {dense} B"
    );
}

#[test]
fn bad_kv_flags_are_refused_with_the_reason() {
    for (args, needle) in [
        (vec!["--kv-bits", "7"], "allowed"),
        (vec!["--kv-bits", "4", "--kv-group-size", "48"], "allowed"),
        (
            vec!["--kv-bits", "4", "--kv-group-size", "128"],
            "head_dim 64",
        ),
        (vec!["--kv-group-size", "32"], "add --kv-bits"),
        (vec!["--quantized-kv-start", "64"], "add --kv-bits"),
        (
            vec!["--kv-bits", "4", "--kv-dense-layers", "40"],
            "out of range",
        ),
        (vec!["--max-kv-size", "0"], "--max-kv-size"),
    ] {
        let mut a = vec!["generate", "--max-tokens", "2"];
        a.extend(args.iter());
        a.push("hi");
        let out = kvq(&a);
        assert_eq!(out.status.code(), Some(1), "{a:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(needle),
            "{a:?}: want '{needle}' in {}",
            stderr(&out)
        );
    }
}

/// `--kv-bits 4` alone is the budget's best setting: the cache its parts make when spelled out
/// (same bytes, same window, same tokens). Where that setting cannot run (here
/// `--quantized-kv-start`), one note says so and the cache is plain 4-bit.
#[test]
fn kv_bits_4_alone_is_the_budgets_best_setting() {
    let text = std::fs::read_to_string(reference_dir().join("corpus.txt")).unwrap();
    let prompt: String = text.chars().take(600).collect(); // ~130 tokens: past the window
    let run = |kv: &[&str]| -> (serde_json::Value, String) {
        let mut args = vec!["generate", "--temp", "0", "--max-tokens", "16", "--json"];
        args.extend_from_slice(kv);
        args.extend(["--raw", &prompt]);
        let out = kvq(&args);
        assert!(out.status.success(), "{kv:?}: {}", stderr(&out));
        let v = serde_json::from_slice(&out.stdout).expect("one JSON object");
        (v, stderr(&out))
    };
    let same = |a: &serde_json::Value, b: &serde_json::Value, what: &str| {
        assert_eq!(ids(&a["tokens"]), ids(&b["tokens"]), "{what}");
        for k in ["kv_bytes", "kv_bytes_per_token", "kv_window_bytes"] {
            assert_eq!(a["stats"][k], b["stats"][k], "{what}: {k}");
        }
    };
    let (budget, e) = run(&["--kv-bits", "4"]);
    assert!(!e.contains("note:"), "{e}");
    let (parts, _) = run(BUDGET4_PARTS);
    same(&budget, &parts, "budget vs parts");
    assert!(budget["stats"]["kv_window_bytes"].as_u64().unwrap() > 0);

    let (staged, e) = run(&["--kv-bits", "4", "--quantized-kv-start", "16"]);
    assert!(
        e.contains("note: --kv-bits 4: plain 4-bit keys and values, since --quantized-kv-start"),
        "{e}"
    );
    let (plain, e) = run(&[PLAIN4, &["--quantized-kv-start", "16"]].concat());
    assert!(!e.contains("note:"), "{e}");
    same(&staged, &plain, "fallback vs plain");
    assert_eq!(staged["stats"]["kv_window_bytes"], 0);
}
