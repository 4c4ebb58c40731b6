//! `kvq generate` against transformers' greedy generations of the default model
//! (../shared/reference/smollm2-greedy.jsonl): exact prompt ids, and exact generated ids up to
//! the first fragile step (a near-tie that may go either way).

use crate::common::*;

#[test]
fn greedy_generate_matches_transformers_reference() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for case in greedy_cases() {
        let id = case["id"].as_str().unwrap().to_string();
        let args = reference_generate_args(&case, &[], dir.path());
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
        let need = required_prefix(&case);
        if tokens.len() < need.len() || tokens[..need.len()] != need[..] {
            failures.push(format!("{id}: got {tokens:?}, want prefix {need:?}"));
        }
        // Whole generations (no fragile step) also agree on the finish reason.
        if case["fragile_steps"].as_array().unwrap().is_empty() {
            let want = ids(&case["generated_ids"]);
            assert_eq!(tokens, want, "{id}: full generation");
            let reason = if case["stopped_by_eos"].as_bool().unwrap() {
                "stop"
            } else {
                "length"
            };
            assert_eq!(got["finish_reason"], reason, "{id}");
            assert_eq!(got["text"], case["generated_text"], "{id}: text");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
