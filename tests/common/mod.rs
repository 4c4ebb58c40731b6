//! Helpers shared by the integration tests: where the reference data is, and running the CLI.
#![allow(dead_code)]

pub mod server;

use std::path::PathBuf;
use std::process::{Command, Output};

/// The reference oracles (`KVQ_REFERENCE_DIR`, else `../shared/reference` beside the crate).
pub fn reference_dir() -> PathBuf {
    match std::env::var_os("KVQ_REFERENCE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/reference"),
    }
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The 12 greedy reference cases.
pub fn greedy_cases() -> Vec<serde_json::Value> {
    let path = reference_dir().join("smollm2-greedy.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).expect("reference line is JSON"))
        .collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Generated ids that must match: all of them, or those before the first fragile step.
pub fn required_prefix(case: &serde_json::Value) -> Vec<u32> {
    let want = ids(&case["generated_ids"]);
    let first_fragile = case["fragile_steps"]
        .as_array()
        .and_then(|a| a.iter().filter_map(|f| f["step"].as_u64()).min())
        .map(|s| s as usize)
        .unwrap_or(want.len());
    want[..first_fragile.min(want.len())].to_vec()
}

/// The kvq binary under test: `KVQ_BIN` (or `KVQ_TEST_BIN`) when set (a copy kept apart from
/// a target directory other builds may overwrite, or carried to another machine with its
/// tests), else the one cargo built beside the tests.
pub fn kvq_bin() -> PathBuf {
    std::env::var_os("KVQ_BIN")
        .or_else(|| std::env::var_os("KVQ_TEST_BIN"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvq")))
}

pub fn kvq(args: &[&str]) -> Output {
    kvq_env(args, &[])
}

/// [`kvq`] with extra environment variables.
pub fn kvq_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(kvq_bin())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("kvq runs")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that `o` failed with exit 1 and a last stderr line `error: ...` containing `needle`
/// (and no panic); returns that line.
pub fn assert_fails_with(o: &Output, what: &str, needle: &str) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{what}: stderr {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    let last = err
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .to_string();
    assert!(last.starts_with("error: "), "{what}: {err}");
    assert!(last.contains(needle), "{what}: want '{needle}' in: {last}");
    last
}

/// Runs kvq, expects failure with exit 1 and a single `error:` line containing `needle`.
pub fn fails_with(args: &[&str], needle: &str) -> String {
    assert_fails_with(&kvq(args), &format!("args {args:?}"), needle)
}

/// `kvq generate` arguments for a reference case: greedy, f32, dequantized weights, 48 tokens,
/// `--json`, then `extra`; chat cases go through `--messages` (a file written into `dir`), raw
/// ones through `--raw`.
pub fn reference_generate_args(
    case: &serde_json::Value,
    extra: &[&str],
    dir: &std::path::Path,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "generate",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--dequantize",
        "--max-tokens",
        "48",
        "--json",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    if case["chat_template"].as_bool().unwrap() {
        let file = dir.join(format!("{}.json", case["id"].as_str().unwrap()));
        std::fs::write(&file, case["messages"].to_string()).unwrap();
        args.extend(["--messages".into(), file.display().to_string()]);
    } else {
        args.extend(["--raw".into(), case["prompt"].as_str().unwrap().to_string()]);
    }
    args
}

/// `count` prompts of 1..=120 token ids cut from the reference corpus's ids at random places
/// (seeded); every fifth one repeats an earlier prompt, so batches hold identical prompts.
pub fn random_corpus_prompts(seed: u64, count: usize) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let corpus_path = reference_dir().join("corpus-first65536-token-ids.txt");
    let corpus: Vec<u32> = std::fs::read_to_string(&corpus_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", corpus_path.display()))
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for i in 0..count {
        let p = if i % 5 == 4 {
            prompts[rng.random_range(0..prompts.len())].clone()
        } else {
            let len = rng.random_range(1..=120);
            let at = rng.random_range(0..corpus.len() - len);
            corpus[at..at + len].to_vec()
        };
        prompts.push(p);
    }
    prompts
}

/// Plain 4-bit keys and values (a part given by hand: not the `--kv-bits 4` budget).
pub const PLAIN4: &[&str] = &["--kv-bits", "4", "--kv-residual", "0"];

/// The `--kv-bits 4` budget spelled out: K4/V3, the newest 60 positions and the first 4 dense,
/// centred keys (what `--kv-bits 4` alone means where it can run).
pub const BUDGET4_PARTS: &[&str] = &[
    "--kv-bits",
    "3.5",
    "--kv-residual",
    "60",
    "--kv-sinks",
    "4",
    "--kv-center",
];

/// The recommended window setting (K4/V3, dense newest positions and sinks, centred keys) with
/// an 8-position window, which short test prompts cross.
pub const SMALL_WINDOW: &[&str] = &[
    "--kv-bits",
    "3.5",
    "--kv-residual",
    "8",
    "--kv-sinks",
    "4",
    "--kv-center",
];
