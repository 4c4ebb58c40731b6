//! `kvq batch-generate` as a process: a SIGKILL half-way leaves only whole lines and `--resume`
//! completes the rest without duplicates; a KV budget for two sequences still runs everything;
//! bad input lines are reported as FILE:LINE or written as error records.

use crate::common::*;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const N: usize = 12;

/// Raw prompts of 10 to 24 tokens: with 8 new tokens one request needs exactly 2 KV blocks of 16.
fn write_prompts(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("prompts.txt");
    let lines: Vec<String> = (0..N)
        .map(|i| format!("Here is a short list of numbers in increasing order, starting at {i}:"))
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

const COMMON: [&str; 8] = [
    "--raw",
    "--temp",
    "0",
    "--max-tokens",
    "8",
    "--no-progress",
    "--kv-block-size",
    "16",
];

/// Every line of an output file, parsed; panics on a torn or non-JSON line.
fn records(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "torn last line: {text:?}"
    );
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn ids_once(recs: &[Value]) -> HashMap<String, usize> {
    let mut count = HashMap::new();
    for r in recs {
        *count.entry(r["id"].to_string()).or_insert(0) += 1;
    }
    count
}

#[test]
fn killed_job_resumes_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path());
    let out = dir.path().join("out.jsonl");
    let (p, o) = (prompts.to_str().unwrap(), out.to_str().unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(["batch-generate", p, "-o", o, "--max-batch", "2"])
        .args(COMMON)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let lines = std::fs::read_to_string(&out)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= 3 {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("batch-generate ended before it could be killed: {status}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "no output after 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = records(&out);
    assert!(
        before.len() >= 3 && before.len() < N,
        "{} lines",
        before.len()
    );
    for r in &before {
        assert!(r["text"].is_string() && r["tokens"].is_array(), "{r}");
    }

    // Without --resume an existing output is refused.
    let refused = kvq(&["batch-generate", p, "-o", o, "--no-progress"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("--resume"),
        "{}",
        stderr(&refused)
    );

    let done = kvq(&[
        &["batch-generate", p, "-o", o, "--resume", "--max-batch", "4"][..],
        &COMMON,
    ]
    .concat());
    assert!(done.status.success(), "{}", stderr(&done));
    let after = records(&out);
    assert_eq!(
        after[..before.len()],
        before[..],
        "finished lines were kept as they were"
    );
    let count = ids_once(&after);
    assert_eq!(count.len(), N, "{count:?}");
    assert!(count.values().all(|&c| c == 1), "duplicates: {count:?}");
    assert!(after.iter().all(|r| r["finish_reason"] != "cancelled"));
    assert!(
        stderr(&done).contains(&format!("already done (--resume) of {N}")),
        "{}",
        stderr(&done)
    );
}

#[test]
fn budget_for_two_sequences_completes_all() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path());
    // Dense f32 KV of the default model: 30 layers x (K + V) x 3 heads x 64 x 4 bytes per token;
    // each request holds 17 to 31 tokens (2 blocks of 16), so 4 blocks fit two at once.
    let block_bytes = 30 * 2 * 3 * 64 * 4 * 16;
    let budget = (4 * block_bytes).to_string();
    let o = kvq(&[
        &[
            "batch-generate",
            prompts.to_str().unwrap(),
            "--max-batch",
            "8",
        ][..],
        &["--kv-memory", &budget, "--dtype", "f32"],
        &COMMON,
    ]
    .concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    let recs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), N);
    assert_eq!(ids_once(&recs).len(), N);
    for r in &recs {
        assert!(r["tokens"].as_array().unwrap().len() <= 8);
        let n = r["prompt_tokens"].as_u64().unwrap();
        assert!((10..=24).contains(&n), "{r}");
        assert!(r["ttft_ms"].as_f64().unwrap() <= r["total_ms"].as_f64().unwrap());
    }
    let err = stderr(&o);
    assert!(
        err.contains("KV budget") && err.contains("2.81 MiB"),
        "{err}"
    );
}

#[test]
fn invalid_lines_name_file_and_line_or_become_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("in.jsonl");
    std::fs::write(
        &path,
        "{\"id\": \"ok\", \"prompt\": \"Hi\", \"max_tokens\": 2}\n\n{\"id\": \"bad\", \"prompt\": 3}\n",
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let o = kvq(&["batch-generate", p, "--no-progress"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.starts_with(&format!("error: {p}:3: ")), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let o = kvq(&[&["batch-generate", p, "--skip-invalid"][..], &COMMON].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let recs: Vec<Value> = String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 2);
    let bad = recs.iter().find(|r| r["id"] == "bad").unwrap();
    assert_eq!(
        (bad["finish_reason"].as_str(), bad["line"].as_u64()),
        (Some("error"), Some(3))
    );
    let ok = recs.iter().find(|r| r["id"] == "ok").unwrap();
    assert_eq!(
        ok["tokens"].as_array().unwrap().len(),
        2,
        "per-request max_tokens wins"
    );
}

#[test]
fn ctrl_c_writes_what_finished_and_resume_redoes_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path());
    let out = dir.path().join("out.jsonl");
    let (p, o) = (prompts.to_str().unwrap(), out.to_str().unwrap());
    let child = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(["batch-generate", p, "-o", o, "--max-batch", "3"])
        .args(COMMON)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&out)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < 2
    {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "no output after 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = Command::new("kill")
        .args(["-s", "INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(130), "{err}");
    assert!(
        err.contains("interrupted:") && err.contains("--resume"),
        "{err}"
    );
    let before = records(&out);
    assert!(
        before.len() < N,
        "Ctrl-C did not stop admission: {} lines",
        before.len()
    );

    let done = kvq(&[&["batch-generate", p, "-o", o, "--resume"][..], &COMMON].concat());
    assert!(done.status.success(), "{}", stderr(&done));
    let after = records(&out);
    let count = ids_once(&after);
    assert_eq!(count.len(), N, "{count:?}");
    assert!(count.values().all(|&c| c == 1), "duplicates: {count:?}");
    assert!(after.iter().all(|r| r["finish_reason"] != "cancelled"));
}
