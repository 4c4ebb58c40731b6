//! Hub downloads against a local HTTP server that speaks the parts of the Hub protocol hf-hub
//! uses (repo info, ranged `resolve` requests with etag / x-repo-commit), plus offline mode and
//! local directories. One test touches the environment; the others do not.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvq::model::hub::{model_files_in_dir, resolve_repo, HubModel};
use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/hub/tiny-llama");

/// repo id → file name → bytes.
type Repos = HashMap<String, HashMap<String, Vec<u8>>>;

fn fixture_repo() -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(FIXTURE)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Serves `repos` on 127.0.0.1; returns the endpoint and a request counter.
fn serve(repos: Repos) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            let mut range = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = line.split_once(':') {
                    if k.eq_ignore_ascii_case("range") {
                        range = Some(v.trim().to_string());
                    }
                }
            }
            let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
            let response = respond(&repos, &path, range.as_deref());
            let _ = stream.write_all(&response);
        }
    });
    (endpoint, hits)
}

fn respond(repos: &Repos, path: &str, range: Option<&str>) -> Vec<u8> {
    let reply = |status: &str, headers: Vec<String>, body: &[u8]| {
        let mut out = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for h in headers {
            out.push_str(&h);
            out.push_str("\r\n");
        }
        out.push_str("\r\n");
        let mut out = out.into_bytes();
        out.extend_from_slice(body);
        out
    };
    if let Some(rest) = path.strip_prefix("/api/models/") {
        if let Some((repo, _rev)) = rest.split_once("/revision/") {
            if let Some(files) = repos.get(repo) {
                let siblings: Vec<_> = files
                    .keys()
                    .map(|f| serde_json::json!({"rfilename": f}))
                    .collect();
                let body = serde_json::json!({"sha": COMMIT, "siblings": siblings}).to_string();
                return reply(
                    "200 OK",
                    vec!["Content-Type: application/json".into()],
                    body.as_bytes(),
                );
            }
        }
        return reply(
            "404 Not Found",
            vec![],
            b"{\"error\":\"Repository not found\"}",
        );
    }
    if let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") {
        let file = rest.split_once('/').map(|(_, f)| f).unwrap_or("");
        if let Some(data) = repos.get(repo).and_then(|r| r.get(file)) {
            let etag = format!("\"{:x}\"", Sha256::digest(data));
            let start: usize = range
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.split('-').next())
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let end = match range
                .and_then(|r| r.split('-').nth(1))
                .and_then(|s| s.parse::<usize>().ok())
            {
                Some(e) => e.min(data.len().saturating_sub(1)),
                None => data.len().saturating_sub(1),
            };
            let body = if data.is_empty() {
                &[][..]
            } else {
                &data[start.min(data.len())..=end]
            };
            let headers = vec![
                format!("ETag: {etag}"),
                format!("X-Repo-Commit: {COMMIT}"),
                format!("Content-Range: bytes {start}-{end}/{}", data.len()),
            ];
            return reply("206 Partial Content", headers, body);
        }
        return reply("404 Not Found", vec![], b"Entry not found");
    }
    reply("404 Not Found", vec![], b"")
}

fn gguf_bytes(tag: &str) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(tag.as_bytes());
    b
}

#[test]
fn downloads_through_hf_endpoint_then_works_offline() {
    let mut repos = Repos::new();
    repos.insert("kvq-test/tiny-llama".into(), fixture_repo());
    repos.insert(
        "kvq-test/two-gguf".into(),
        [
            ("a.Q4_0.gguf".to_string(), gguf_bytes("a")),
            ("b.Q8_0.gguf".to_string(), gguf_bytes("bb")),
        ]
        .into(),
    );
    repos.insert(
        "kvq-test/one-gguf".into(),
        [("only.gguf".to_string(), gguf_bytes("only"))].into(),
    );
    let (endpoint, hits) = serve(repos);
    let home = tempfile::tempdir().unwrap();
    std::env::set_var("HF_HOME", home.path());
    std::env::set_var("HF_ENDPOINT", &endpoint);
    std::env::remove_var("HF_HUB_OFFLINE");

    // A safetensors repo: every file arrives byte for byte in HF_HOME's cache.
    let HubModel::Safetensors { dir_files } = resolve_repo("kvq-test/tiny-llama").unwrap() else {
        panic!("expected a safetensors model");
    };
    let same = |got: &Path, name: &str| {
        assert!(
            got.starts_with(home.path()),
            "{} outside HF_HOME",
            got.display()
        );
        assert_eq!(
            std::fs::read(got).unwrap(),
            std::fs::read(Path::new(FIXTURE).join(name)).unwrap(),
            "{name}"
        );
    };
    same(&dir_files.config, "config.json");
    same(&dir_files.tokenizer, "tokenizer.json");
    same(
        dir_files.tokenizer_config.as_ref().unwrap(),
        "tokenizer_config.json",
    );
    same(
        dir_files.generation_config.as_ref().unwrap(),
        "generation_config.json",
    );
    assert_eq!(dir_files.weights.len(), 1);
    same(&dir_files.weights[0], "model.safetensors");

    // GGUF repos: the only file, a named file, and an error listing the choices.
    let HubModel::Gguf(p) = resolve_repo("kvq-test/one-gguf").unwrap() else {
        panic!()
    };
    assert_eq!(std::fs::read(p).unwrap(), gguf_bytes("only"));
    let HubModel::Gguf(p) = resolve_repo("kvq-test/two-gguf:b.Q8_0.gguf").unwrap() else {
        panic!()
    };
    assert_eq!(std::fs::read(p).unwrap(), gguf_bytes("bb"));
    let err = resolve_repo("kvq-test/two-gguf").unwrap_err().to_string();
    assert!(
        err.contains("a.Q4_0.gguf") && err.contains("b.Q8_0.gguf"),
        "{err}"
    );
    let err = resolve_repo("kvq-test/two-gguf:c.gguf")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("c.gguf") && err.contains("a.Q4_0.gguf"),
        "{err}"
    );
    let err = format!("{:#}", resolve_repo("kvq-test/missing").unwrap_err());
    assert!(err.contains("kvq-test/missing"), "{err}");

    // Offline: served from the cache without a single request; uncached repos say so.
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let before = hits.load(Ordering::SeqCst);
    let HubModel::Safetensors { dir_files: offline } = resolve_repo("kvq-test/tiny-llama").unwrap()
    else {
        panic!("expected a safetensors model");
    };
    assert_eq!(offline.config, dir_files.config);
    assert_eq!(
        std::fs::read(&offline.weights[0]).unwrap(),
        std::fs::read(&dir_files.weights[0]).unwrap()
    );
    let HubModel::Gguf(p) = resolve_repo("kvq-test/two-gguf:b.Q8_0.gguf").unwrap() else {
        panic!()
    };
    assert_eq!(std::fs::read(p).unwrap(), gguf_bytes("bb"));
    let err = resolve_repo("kvq-test/never-downloaded")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HF_HUB_OFFLINE") && err.contains("kvq-test/never-downloaded"),
        "{err}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        before,
        "offline mode contacted the server"
    );
    std::env::remove_var("HF_HUB_OFFLINE");
}

fn copy_fixture(to: &Path) {
    for (name, data) in fixture_repo() {
        std::fs::write(to.join(name), data).unwrap();
    }
}

#[test]
fn local_directory_single_and_sharded() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture(dir.path());
    let files = model_files_in_dir(dir.path()).unwrap();
    assert_eq!(files.weights, vec![dir.path().join("model.safetensors")]);
    assert_eq!(
        files.tokenizer_config,
        Some(dir.path().join("tokenizer_config.json"))
    );

    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    let index = r#"{"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#;
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    let err = model_files_in_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::write(dir.path().join(shard), b"x").unwrap();
    }
    let files = model_files_in_dir(dir.path()).unwrap();
    let names: Vec<PathBuf> = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    .iter()
    .map(|n| dir.path().join(n))
    .collect();
    assert_eq!(files.weights, names);
    assert_eq!(files.generation_config, None);
}

#[test]
fn local_directory_errors_name_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let err = model_files_in_dir(&dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a directory"), "{err}");
    let err = model_files_in_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    copy_fixture(dir.path());
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = model_files_in_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    copy_fixture(dir.path());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = model_files_in_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("no weights"), "{err}");
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    let err = model_files_in_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("weight_map"), "{err}");
}
