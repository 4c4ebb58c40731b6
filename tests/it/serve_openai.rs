//! The official `openai` Python package against `kvq serve`: chat and completions, streamed and
//! not, through the client's own request and response types. The set-up installs the package
//! from PyPI (`pip install --target` under the target directory, else a virtual environment);
//! when it cannot, the test fails, unless KVQ_SKIP_OPENAI_CLIENT=1 says to skip it (README).

use crate::common::server::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set to 1 to skip this test where PyPI cannot be reached.
const OPT_OUT: &str = "KVQ_SKIP_OPENAI_CLIENT";

/// How to run a Python that can import `openai`.
struct Python {
    exe: PathBuf,
    /// A `pip install --target` folder to put on PYTHONPATH.
    path: Option<PathBuf>,
}

impl Python {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.exe);
        if let Some(p) = &self.path {
            c.env("PYTHONPATH", p);
        }
        c
    }

    fn imports_openai(&self) -> bool {
        self.command()
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

/// Runs a set-up command; the error carries its stderr.
fn run(what: &str, cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(5).collect();
    Err(format!(
        "{what} failed ({}): {}",
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    ))
}

const PIP: &[&str] = &[
    "-m",
    "pip",
    "install",
    "--quiet",
    "--disable-pip-version-check",
    "--no-input",
    "--timeout",
    "30",
];

/// `python3 -m pip install --target` into a fresh folder, renamed into place once complete
/// (an interrupted install is never taken for a good one).
fn pip_target(dir: &Path) -> Result<Python, String> {
    let want = Python {
        exe: "python3".into(),
        path: Some(dir.to_path_buf()),
    };
    if dir.exists() && want.imports_openai() {
        return Ok(want);
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    run(
        "python3 -m pip install --target",
        Command::new("python3")
            .args(PIP)
            .arg("--target")
            .arg(&tmp)
            .arg("openai"),
    )?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| format!("cannot move {}: {e}", tmp.display()))?;
    if want.imports_openai() {
        Ok(want)
    } else {
        Err(format!(
            "openai installed into {} does not import",
            dir.display()
        ))
    }
}

/// A virtual environment with `openai` (where python3 has no pip module of its own).
fn venv(dir: &Path) -> Result<Python, String> {
    let py = Python {
        exe: dir.join("bin/python"),
        path: None,
    };
    if py.imports_openai() {
        return Ok(py);
    }
    run(
        "python3 -m venv",
        Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(dir),
    )?;
    run(
        "pip install openai (venv)",
        py.command().args(PIP).arg("openai"),
    )?;
    if py.imports_openai() {
        Ok(py)
    } else {
        Err("openai installed into the venv does not import".into())
    }
}

/// A Python with `openai` importable, or every reason there is none.
fn python_with_openai() -> Result<Python, String> {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let first = match pip_target(&root.join("openai-pip")) {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    venv(&root.join("openai-venv")).map_err(|second| format!("{first}; then {second}"))
}

#[test]
fn official_openai_python_client() {
    if std::env::var(OPT_OUT).is_ok_and(|v| v == "1") {
        println!("skipped: {OPT_OUT}=1");
        return;
    }
    let py = python_with_openai().unwrap_or_else(|why| {
        panic!(
            "cannot install the openai Python package: {why}\n(set {OPT_OUT}=1 to skip this \
             test where PyPI cannot be reached)"
        )
    });
    let s = Server::start(&["--api-key", "test-key"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/openai_client_check.py");
    let out = py
        .command()
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
    assert_eq!(v["ignore_eos_tokens"], 24, "{v}");
    assert_eq!(v["ignore_eos_finish"], "length", "{v}");
    assert_eq!(v["bad_key_status"], 401);
    assert_eq!(v["bad_model_status"], 400);
    s.assert_no_leak();
}
