//! CUDA graphs replay decode steps exactly (CUDA builds only; run on a GPU): the 12 reference
//! prompts through `kvq batch-generate` give the same tokens with `--cuda-graphs on` and `off`,
//! for the f16, 8-bit, 4-bit and 4.5 (5-bit keys, 4-bit values) caches. `--max-batch 5` with the cases' different lengths makes
//! rows finish and join between steps (the batch moves between graph buckets), and 48 new
//! tokens on 16-token blocks make every sequence grow into new blocks (replayed graphs must read
//! the updated block tables). The same with the fused small-step projections on
//! (`KVQ_GPU_GEMV=on`, model::gemv).

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
    let mut args = vec![
        "batch-generate",
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--force",
        "--device",
        "cuda",
        "--temp",
        "0",
        "--max-tokens",
        "48",
        "--max-batch",
        "5",
        "--kv-block-size",
        "16",
        "--no-progress",
        "--cuda-graphs",
        graphs,
    ];
    args.extend(kv);
    let o = kvq_env(&args, &[("KVQ_GPU_GEMV", if gemv { "on" } else { "off" })]);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    std::fs::read_to_string(&out)
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
        (&["--kv-bits", "4"], false),
        (&["--kv-bits", "4.5"], false),
        (&[][..], true),
        (&["--kv-bits", "4"], true),
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
