//! `kvq generate` with the CPU defaults — GGUF weights kept in their blocks (kvq's kernels), f32
//! arithmetic, K and V stored in f16 — against transformers' greedy generations of the default
//! model (../shared/reference/smollm2-greedy.jsonl): exact prompt ids, and the generated ids up
//! to the first fragile step on at least 11 of the 12 prompts. The weight kernels compute the
//! dense f32 product of the dequantized weights; the f16 cache is the one rounding the
//! reference arithmetic (`--dequantize --dtype f32`) does not have.

use crate::common::*;

#[test]
fn default_block_weights_keep_transformers_greedy_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let cases = greedy_cases();
    let mut failures = Vec::new();
    for case in &cases {
        let id = case["id"].as_str().unwrap().to_string();
        let mut args = reference_generate_args(case, &[], dir.path());
        // The defaults: no --dequantize, no --dtype (f32 compute, f16 cache on the CPU).
        let at = args.iter().position(|a| a == "--dtype").unwrap();
        args.drain(at..at + 2);
        args.retain(|a| a != "--dequantize");
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = kvq(&argv);
        assert!(out.status.success(), "{id}: {}", stderr(&out));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(
            ids(&got["prompt_tokens"]),
            ids(&case["input_ids"]),
            "{id}: prompt ids"
        );
        let tokens = ids(&got["tokens"]);
        let need = required_prefix(case);
        if tokens.len() < need.len() || tokens[..need.len()] != need[..] {
            failures.push(format!("{id}: got {tokens:?}, want prefix {need:?}"));
        }
    }
    assert!(
        failures.len() <= 1 && cases.len() == 12,
        "{} of {} prompts left transformers' greedy tokens:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
