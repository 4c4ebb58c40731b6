//! CUDA graphs replay decode steps exactly (CUDA builds only; run on a GPU): the 12 reference
//! prompts through `kvq batch-generate` give the same tokens with `--cuda-graphs on` and `off`,
//! for the f16, 8-bit, 4-bit and 4.5 (5-bit keys, 4-bit values) caches. `--max-batch 5` with the cases' different lengths makes
//! rows finish and join between steps (the batch moves between graph buckets), and 48 new
//! tokens on 16-token blocks make every sequence grow into new blocks (replayed graphs must read
//! the updated block tables). The same with the fused small-step projections on
//! (`KVQ_GPU_GEMV=on`, model::gemv). The residual window and centred keys (`--kv-residual`,
//! `--kv-sinks`, `--kv-center`), whose steps write the rows' dense copies and subtract their
//! means inside the graph, are checked the same way on the reference prompts, and on dummy
//! weights of the default model's shape (no files needed) with prompts shorter and longer than
//! the sinks, so that replayed steps write sink rows, wrap the rings, and recapture when the
//! copies' pools grow.

use crate::common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The reference cases as batch-generate input lines (chat cases as messages, raw ones raw).
fn write_input(dir: &Path) -> std::path::PathBuf {
    let lines: Vec<String> = greedy_cases()
        .iter()
        .map(|c| {
            let id = c["id"].clone();
            if c["chat_template"].as_bool().unwrap() {
                json!({"id": id, "messages": c["messages"]})
            } else {
                json!({"id": id, "prompt": c["prompt"], "raw": true})
            }
            .to_string()
        })
        .collect();
    let path = dir.join("cases.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Generated tokens per request id (`gemv`: the fused small-step projections on).
fn run(
    dir: &Path,
    input: &Path,
    graphs: &str,
    kv: &[&str],
    gemv: bool,
) -> BTreeMap<String, Vec<u32>> {
    let out = dir.join(format!("out-{graphs}-{}-{gemv}.jsonl", kv.join("")));
    let mut args = vec![input.to_str().unwrap(), "--max-tokens", "48"];
    args.extend(kv);
    generated(&out, graphs, &args, gemv)
}

/// `kvq batch-generate` of `args` (input first) into `out` with `--cuda-graphs graphs`:
/// generated tokens per request id.
fn generated(out: &Path, graphs: &str, args: &[&str], gemv: bool) -> BTreeMap<String, Vec<u32>> {
    let mut all = vec![
        "batch-generate",
        args[0],
        "-o",
        out.to_str().unwrap(),
        "--force",
        "--device",
        "cuda",
        "--temp",
        "0",
        "--max-batch",
        "5",
        "--kv-block-size",
        "16",
        "--no-progress",
        "--cuda-graphs",
        graphs,
    ];
    all.extend(&args[1..]);
    let o = kvq_env(&all, &[("KVQ_GPU_GEMV", if gemv { "on" } else { "off" })]);
    assert!(o.status.success(), "{all:?}: {}", stderr(&o));
    std::fs::read_to_string(out)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["id"].to_string(), ids(&v["tokens"]))
        })
        .collect()
}

#[test]
fn graph_replay_equals_eager_launches_on_the_reference_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let input = write_input(dir.path());
    for (kv, gemv) in [
        (&[][..], false),
        (&["--kv-bits", "8"], false),
        (PLAIN4, false),
        (&["--kv-bits", "4.5"], false),
        (&[][..], true),
        (PLAIN4, true),
        (&["--kv-bits", "4", "--kv-center"], false),
        (WINDOW, false),
        (WINDOW, true),
    ] {
        let eager = run(dir.path(), &input, "off", kv, gemv);
        let graphs = run(dir.path(), &input, "on", kv, gemv);
        let kv = (kv, gemv);
        assert_eq!(eager.len(), 12, "{kv:?}: every request answered");
        assert!(
            eager.values().any(|t| t.len() > 40),
            "{kv:?}: some cross 3 blocks"
        );
        assert_eq!(graphs, eager, "{kv:?}: graphs on vs off");
    }
}

/// The best setting at 4.5 bits per value (README), spelled out.
const WINDOW: &[&str] = BUDGET4_PARTS;

#[test]
fn graph_replay_equals_eager_under_the_window_on_dummy_weights() {
    let dir = tempfile::tempdir().unwrap();
    // Raw prompts of 1 to 34 words: shorter and longer than the 12 sinks below.
    let lines: Vec<String> = (0..12)
        .map(|i| {
            let words = vec!["the sky"; 1 + 3 * i].join(" ");
            json!({"id": i, "prompt": words, "raw": true}).to_string()
        })
        .collect();
    let input = dir.path().join("prompts.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let config = format!("{root}/fixtures/smollm2-135m/config.json");
    let tokenizer = format!("{root}/fixtures/tiny/qwen2/hf/tokenizer.json");
    let model = [
        "--load-format",
        "dummy",
        "--config",
        config.as_str(),
        "--tokenizer",
        tokenizer.as_str(),
        "--max-tokens",
        "40",
    ];
    for kv in [
        &[
            "--kv-bits",
            "3.5",
            "--kv-residual",
            "8",
            "--kv-sinks",
            "12",
            "--kv-center",
        ][..],
        &["--kv-bits", "4", "--kv-residual", "20"],
        &["--kv-bits", "3", "--kv-center"],
    ] {
        let mut args = vec![input.to_str().unwrap()];
        args.extend(model);
        args.extend(kv);
        let tag = kv.join("");
        let eager = generated(&dir.path().join(format!("e{tag}")), "off", &args, false);
        let graphs = generated(&dir.path().join(format!("g{tag}")), "on", &args, false);
        assert_eq!(eager.len(), 12, "{kv:?}: every request answered");
        assert!(eager.values().any(|t| t.len() == 40), "{kv:?}: 40 tokens");
        assert_eq!(graphs, eager, "{kv:?}: graphs on vs off");
        // The steps were replayed, not launched eagerly beside the graphs.
        let mut bench = vec!["bench-batch", "--device", "cuda", "--no-warmup"];
        bench.extend(&model[..6]);
        bench.extend([
            "--npp",
            "40",
            "--ntg",
            "16",
            "--npl",
            "1,3",
            "--ctx-size",
            "64",
        ]);
        bench.extend(kv);
        let o = kvq(&bench);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{bench:?}: {}", stderr(&o));
        assert!(
            out.contains("replayed as one CUDA graph"),
            "{kv:?}: no replayed step in {out}"
        );
    }
}
