//! The official `openai` Python package against `kvq serve`: chat and completions, streamed and
//! not, through the client's own request and response types. The package is installed into a
//! virtual environment under the target directory; without a way to PyPI the test says so and
//! passes without running.

use crate::common::server::*;
use std::path::PathBuf;
use std::process::Command;

/// A Python with `openai` importable, or why there is none.
fn python_with_openai() -> Result<PathBuf, String> {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let py = venv.join("bin/python");
    let has = |py: &PathBuf| {
        Command::new(py)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has(&py) {
        return Ok(py);
    }
    let out = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .map_err(|e| format!("python3 cannot be run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "python3 -m venv failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let out = Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--timeout",
            "30",
            "openai",
        ])
        .output()
        .map_err(|e| format!("pip cannot be run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pip install openai failed (no way to PyPI?): {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(py)
}

#[test]
fn official_openai_python_client() {
    let py = match python_with_openai() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let s = Server::start(&["--api-key", "test-key"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/openai_client_check.py");
    let out = Command::new(&py)
        .arg(&script)
        .args([
            "--base-url",
            &format!("{}/v1", s.base),
            "--api-key",
            "test-key",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    // The client's answers equal what the server sends to a plain HTTP request.
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
    });
    let auth = [("Authorization", "Bearer test-key")];
    let (code, direct) = s.post_raw("/v1/chat/completions", &body.to_string(), &auth);
    let direct: serde_json::Value = serde_json::from_str(&direct).unwrap();
    assert_eq!(code, 200);
    assert_eq!(v["chat"], direct["choices"][0]["message"]["content"]);
    assert_eq!(v["chat_stream"], v["chat"]);
    assert_eq!(v["completion_stream"], v["completion"]);
    assert!(
        v["completion"].as_str().is_some_and(|t| !t.is_empty()),
        "{v}"
    );
    assert_eq!(v["bad_key_status"], 401);
    assert_eq!(v["bad_model_status"], 400);
    s.assert_no_leak();
}
