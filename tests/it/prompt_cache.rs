//! Prompt caches end to end on the default model (greedy, f32, dequantized weights): a prompt
//! saved with `generate --save-prompt-cache` and reused by a longer prompt, by the same prompt,
//! and by requests of a running `batch-generate`, gives exactly the tokens of a run without the
//! cache — dense and 4-bit (the 4-bit cache holds the saving run's codes, imported as they are).
//! Files of another KV format, other weights, or damaged ones are refused with one line.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

// Saved prompts of at least 12 tokens: candle's CPU matmul rounds differently for attention over
// fewer keys (another kernel path), so a shorter saved prefill would store K/V that differ in
// the last bits from the same tokens inside a longer prefill (and 4-bit codes can flip on that).
const SHORT: &str =
    "The history of the Roman Empire is long and complicated. It began when Augustus";
const LONG: &str =
    "The history of the Roman Empire is long and complicated. It began when Augustus \
                    became the first emperor, and it";
const SHORT_B: &str = "A good recipe for bread needs flour, water, salt and yeast. First, mix the";
const LONG_B: &str = "A good recipe for bread needs flour, water, salt and yeast. First, mix the \
                      flour with warm water and let it rest for an hour. Then";

/// `generate` greedy f32 with `--json` on a raw prompt; panics unless it succeeds.
fn generate(prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let max = max_tokens.to_string();
    let mut args = vec![
        "generate",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--dequantize",
        "--max-tokens",
        &max,
        "--json",
        "--raw",
    ];
    args.extend(extra);
    args.push(prompt);
    let o = kvq(&args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `generate` that must fail; returns its one-line error.
fn generate_err(prompt: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "generate",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--dequantize",
        "--max-tokens",
        "4",
        "--raw",
    ];
    args.extend(extra);
    args.push(prompt);
    let o = kvq(&args);
    assert_eq!(o.status.code(), Some(1), "{args:?} should fail");
    let e = stderr(&o);
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    e
}

fn save(dir: &Path, name: &str, prompt: &str, kv: &[&str]) -> (PathBuf, Vec<u32>) {
    let path = dir.join(name);
    let mut extra = kv.to_vec();
    // The same name is saved once per KV setting: each run replaces the last one's file.
    extra.extend(["--save-prompt-cache", path.to_str().unwrap(), "--force"]);
    let out = generate(prompt, 2, &extra);
    assert!(path.is_file());
    (path, ids(&out["prompt_tokens"]))
}

#[test]
fn generate_from_a_prompt_cache_equals_a_fresh_run() {
    let dir = tempfile::tempdir().unwrap();
    // Plain 4-bit: the --kv-bits 4 budget centres keys by means fixed from a prompt shorter
    // than a block, so its stored rows depend on the prompt (its files are tested below).
    for kv in [&[][..], PLAIN4] {
        let (file, saved) = save(dir.path(), "short.safetensors", SHORT, kv);
        let mut with = kv.to_vec();
        with.extend(["--prompt-cache", file.to_str().unwrap()]);

        // A longer prompt that extends the saved one: only the rest is prefilled.
        let fresh = generate(LONG, 24, kv);
        let cached = generate(LONG, 24, &with);
        let prompt = ids(&cached["prompt_tokens"]);
        assert_eq!(
            prompt[..saved.len()],
            saved[..],
            "{kv:?}: the saved prompt is a prefix"
        );
        assert_eq!(cached["stats"]["cached_tokens"], saved.len());
        assert_eq!(
            cached["stats"]["prompt_tokens"].as_u64().unwrap() as usize,
            prompt.len() - saved.len()
        );
        assert_eq!(fresh["stats"]["cached_tokens"], 0);
        assert_eq!(
            ids(&cached["tokens"]),
            ids(&fresh["tokens"]),
            "{kv:?}: with vs without the prompt cache"
        );

        // Why: the saved rows are the very rows (codes) a prefill of the longer prompt stores.
        let (long_file, _) = save(dir.path(), "long.safetensors", LONG, kv);
        assert_eq!(
            leading_rows(&file, saved.len()),
            leading_rows(&long_file, saved.len()),
            "{kv:?}: stored rows of the shared tokens"
        );

        // The very same prompt: all but its last two tokens come from the cache.
        let fresh = generate(SHORT, 12, kv);
        let cached = generate(SHORT, 12, &with);
        assert_eq!(cached["stats"]["cached_tokens"], saved.len() - 2);
        assert_eq!(
            ids(&cached["tokens"]),
            ids(&fresh["tokens"]),
            "{kv:?}: same prompt"
        );

        // Saving again from a cached run writes the whole new prompt.
        let again = dir.path().join("again.safetensors");
        with.extend(["--save-prompt-cache", again.to_str().unwrap(), "--force"]);
        generate(LONG, 1, &with);
        let mut from_again = kv.to_vec();
        from_again.extend(["--prompt-cache", again.to_str().unwrap()]);
        let out = generate(LONG, 1, &from_again);
        assert_eq!(
            out["stats"]["cached_tokens"].as_u64().unwrap() as usize,
            prompt.len() - 2
        );
    }
}

#[test]
fn batch_requests_start_from_their_prompt_caches() {
    let dir = tempfile::tempdir().unwrap();
    let kv = ["--kv-bits", "4"];
    let (a, _) = save(dir.path(), "a.safetensors", SHORT, &kv);
    let (b, _) = save(dir.path(), "b.safetensors", SHORT_B, &kv);
    let line = |id: &str, prompt: &str, cache: Option<&Path>| {
        let mut v = serde_json::json!({"id": id, "prompt": prompt, "max_tokens": 16});
        if let Some(c) = cache {
            v["prompt_cache"] = Value::from(c.to_str().unwrap());
        }
        v.to_string()
    };
    let input = dir.path().join("in.jsonl");
    let lines = [
        line("long-a", LONG, Some(&a)),
        line("long-b", LONG_B, Some(&b)),
        line("plain", LONG, None),
        line("short-a", SHORT, Some(&a)),
        line("long-a-again", LONG, Some(&a)),
    ];
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("out.jsonl");
    let mut args = vec![
        "batch-generate",
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--raw",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--dequantize",
        "--no-progress",
        // Requests join a running batch: imports, prompt rests and decode steps share passes.
        "--max-batch",
        "3",
    ];
    args.extend(kv);
    let o = kvq(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    let recs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 5);
    let get = |id: &str| recs.iter().find(|r| r["id"] == id).unwrap().clone();
    for (id, prompt) in [
        ("long-a", LONG),
        ("long-b", LONG_B),
        ("plain", LONG),
        ("short-a", SHORT),
        ("long-a-again", LONG),
    ] {
        let r = get(id);
        let alone = generate(prompt, 16, &kv);
        assert_eq!(
            ids(&r["tokens"]),
            ids(&alone["tokens"]),
            "{id}: batch vs alone"
        );
        assert_eq!(r.get("cached_tokens").is_some(), id != "plain", "{id}");
    }
    assert!(get("long-a")["cached_tokens"].as_u64().unwrap() > 5);
}

#[test]
fn other_formats_weights_and_damaged_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (dense, _) = save(dir.path(), "dense.safetensors", SHORT, &[]);
    let (q4, _) = save(dir.path(), "q4.safetensors", SHORT, PLAIN4);
    let use_ = |f: &Path, kv: &[&str]| {
        let mut v = kv.to_vec();
        v.extend(["--prompt-cache", f.to_str().unwrap()]);
        generate_err(LONG, &v)
    };

    // Another KV format.
    let e = use_(&q4, &["--kv-bits", "8"]);
    assert!(
        e.contains("layer 0 is rotated 4-bit/g64 with f16 scales") && e.contains("8-bit/g64"),
        "{e}"
    );
    // A plain 4-bit file under the --kv-bits 4 budget (centred keys): the way back is named.
    let e = use_(&q4, &["--kv-bits", "4"]);
    assert!(
        e.contains("holds keys stored as they are") && e.contains("--kv-bits 4 --kv-residual 0"),
        "{e}"
    );
    // Same width, other scheme: rotated rows are not affine rows.
    let e = use_(&q4, &[PLAIN4, &["--kv-quant-scheme", "affine"]].concat());
    assert!(
        e.contains("rotated 4-bit/g64") && e.contains("affine 4-bit/g64"),
        "{e}"
    );
    let e = use_(&dense, PLAIN4);
    assert!(e.contains("layer 0 is dense f32"), "{e}");
    // Below --quantized-kv-start the first tokens are dense: quantized rows do not fit there,
    // dense rows do.
    let e = use_(&q4, &[PLAIN4, &["--quantized-kv-start", "64"]].concat());
    assert!(e.contains("--quantized-kv-start 64"), "{e}");
    let ok = {
        let mut v = [PLAIN4, &["--quantized-kv-start", "64"]].concat();
        v.extend(["--prompt-cache", dense.to_str().unwrap()]);
        generate(LONG, 8, &v)
    };
    assert_eq!(
        ids(&ok["tokens"]),
        ids(&generate(LONG, 8, &[PLAIN4, &["--quantized-kv-start", "64"]].concat())["tokens"])
    );

    // Another way of computing K/V (quantized GGUF matmuls instead of dense weights).
    let o = kvq(&[
        "generate",
        "--temp",
        "0",
        "--dtype",
        "f32",
        "--keep-quantized",
        "--max-tokens",
        "2",
        "--raw",
        "--prompt-cache",
        dense.to_str().unwrap(),
        LONG,
    ]);
    assert!(
        stderr(&o).contains("--keep-quantized must match"),
        "{}",
        stderr(&o)
    );

    // Other weights: a tampered fingerprint, and random weights of another shape.
    let tampered = dir.path().join("tampered.safetensors");
    std::fs::write(
        &tampered,
        set_metadata(&dense, "kvq.fingerprint", "0123456789abcdef"),
    )
    .unwrap();
    let e = use_(&tampered, &[]);
    assert!(
        e.contains("other weights") && e.contains("0123456789abcdef"),
        "{e}"
    );
    let o = kvq(&[
        "generate",
        "--load-format",
        "dummy",
        "--config",
        fixture("tiny-llama/config.json").to_str().unwrap(),
        "--raw",
        "--prompt-cache",
        dense.to_str().unwrap(),
        LONG,
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("dummy"), "{}", stderr(&o));

    // Damaged or unrelated files.
    let bytes = std::fs::read(&dense).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = use_(&cut, &[]);
    assert!(
        e.contains("cut.safetensors") && e.contains("not a kvq prompt cache"),
        "{e}"
    );
    let e = use_(&dir.path().join("missing.safetensors"), &[]);
    assert!(e.contains("missing.safetensors"), "{e}");

    // A prompt that shares nothing with the saved one.
    let e = generate_err(
        "Completely different words",
        &["--prompt-cache", dense.to_str().unwrap()],
    );
    assert!(e.contains("shares no leading tokens"), "{e}");

    // In a batch file the error names FILE:LINE.
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        format!(
            "{{\"id\": 1, \"prompt\": \"hi\"}}\n{{\"id\": 2, \"prompt\": {:?}, \"prompt_cache\": {:?}}}\n",
            LONG,
            q4.to_str().unwrap()
        ),
    )
    .unwrap();
    let o = kvq(&[
        "batch-generate",
        input.to_str().unwrap(),
        "--raw",
        "--dtype",
        "f32",
        "--dequantize",
        "--no-progress",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("in.jsonl:2:") && e.contains("4-bit/g64"), "{e}");
}

/// The bytes of the first `n` rows of every tensor of a prompt-cache file, by name.
fn leading_rows(path: &Path, n: usize) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let data = &bytes[8 + len..];
    let mut out: Vec<(String, Vec<u8>)> = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let rows = v["shape"][0].as_u64().unwrap() as usize;
            let (a, b) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let row = (b - a) / rows;
            (k.clone(), data[a..a + n * row].to_vec())
        })
        .collect();
    out.sort();
    assert!(!out.is_empty());
    out
}

/// The file with one metadata field replaced (the header rewritten, the data kept).
fn set_metadata(path: &Path, key: &str, value: &str) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["__metadata__"][key] = Value::from(value);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(&bytes[8 + n..]);
    out
}

/// A prompt cache depends on the prompt and the settings alone: two runs, one of them on a
/// single thread, save the same bytes (the header's keys in a fixed order, rows whose sums do not
/// depend on how the work was split), dense and 4-bit.
#[test]
fn the_same_prompt_is_saved_as_the_same_bytes_by_every_run() {
    let dir = tempfile::tempdir().unwrap();
    for kv in [&[][..], &["--kv-bits", "4"][..]] {
        let save_with = |name: &str, threads: &str| -> Vec<u8> {
            let path = dir.path().join(name);
            let mut args = vec!["generate", "--raw", "--temp", "0", "--max-tokens", "1"];
            args.extend(kv);
            args.extend([
                "--save-prompt-cache",
                path.to_str().unwrap(),
                "--force",
                SHORT,
            ]);
            let mut cmd = std::process::Command::new(kvq_bin());
            cmd.args(&args);
            if !threads.is_empty() {
                cmd.env("RAYON_NUM_THREADS", threads);
            }
            let o = cmd.output().unwrap();
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
            std::fs::read(&path).unwrap()
        };
        let a = save_with("a.safetensors", "");
        let b = save_with("b.safetensors", "1");
        assert!(a == b, "{kv:?}: two saves of one prompt differ");
    }
}

/// Under the dense window with sinks and centred 3.5-bit keys (`--kv-residual`, `--kv-sinks`,
/// `--kv-center`) a prompt file keeps the dense copies its run held (sinks and the newest
/// positions), and a run started from it goes on exactly as a fresh run: the same tokens, and,
/// bit for bit, the same file when it saves the longer prompt in turn (every layer's rows, key
/// means and copies).
#[test]
fn kv_window_prompt_files_start_runs_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let kv = SMALL_WINDOW;
    let (file, saved) = save(dir.path(), "w.safetensors", SHORT_B, kv);
    assert!(saved.len() >= 16, "{} tokens", saved.len());
    let mut with = kv.to_vec();
    with.extend(["--prompt-cache", file.to_str().unwrap()]);
    let fresh = generate(LONG_B, 24, kv);
    let cached = generate(LONG_B, 24, &with);
    assert_eq!(cached["stats"]["cached_tokens"], saved.len());
    assert_eq!(ids(&cached["tokens"]), ids(&fresh["tokens"]));
    let (fresh_file, _) = save(dir.path(), "fresh.safetensors", LONG_B, kv);
    let (from_file, _) = save(dir.path(), "from.safetensors", LONG_B, &with);
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert!(
        bytes(&fresh_file) == bytes(&from_file),
        "a run started from the file saves other rows or copies than a fresh run"
    );
    let header = |p: &Path| {
        leading_rows(p, 1)
            .into_iter()
            .map(|(n, _)| n)
            .collect::<Vec<_>>()
    };
    let names = header(&fresh_file);
    for t in [
        "1.k.sinks",
        "1.v.sinks",
        "1.k.window",
        "1.v.window",
        "1.k.center",
    ] {
        assert!(names.iter().any(|n| n == t), "{t} in {names:?}");
    }
}

/// `generate_err` started from `file`.
fn start_err(file: &Path, flags: &[&str], prompt: &str) -> String {
    let mut args = flags.to_vec();
    args.extend(["--prompt-cache", file.to_str().unwrap()]);
    generate_err(prompt, &args)
}

/// A file that cannot start a run as a fresh run goes under the window is refused, naming what
/// to change: saved without sinks (or without copies at all) for a run with them, saved with
/// them for a run without, or a prompt that stops short of the file's last position (whose
/// first computed token would need copies the file does not hold).
#[test]
fn kv_window_prompt_files_refuse_what_they_cannot_start_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let run = ["--kv-bits", "4", "--kv-residual", "8", "--kv-sinks", "4"];
    let (no_sinks, _) = save(
        dir.path(),
        "n.safetensors",
        SHORT,
        &["--kv-bits", "4", "--kv-residual", "8"],
    );
    let e = start_err(&no_sinks, &run, LONG);
    assert!(
        e.contains("--kv-sinks 4") && e.contains("--save-prompt-cache"),
        "{e}"
    );
    let (plain, _) = save(dir.path(), "p.safetensors", SHORT, PLAIN4);
    let e = start_err(&plain, &run, LONG);
    assert!(
        e.contains("saved without --kv-residual") && e.contains("--save-prompt-cache"),
        "{e}"
    );
    let (window, _) = save(dir.path(), "w.safetensors", SHORT, &run);
    let e = start_err(&window, PLAIN4, LONG);
    assert!(
        e.contains("start from it with --kv-residual 8 --kv-sinks 4"),
        "{e}"
    );
    let e = start_err(&window, &run, SHORT);
    assert!(e.contains("starts only prompts that extend all its"), "{e}");
}

/// Centred keys (`--kv-center`) are saved with their sequence's key means, and a run started
/// from the file takes them along: it generates what a fresh run does (the saved prompt holds a
/// whole first block, 16 tokens, so both fix their means from the same rows) and stores the same
/// rows. A file of centred keys is refused without `--kv-center`, and a plain one with it.
#[test]
fn kv_center_prompt_files_carry_their_key_means() {
    let dir = tempfile::tempdir().unwrap();
    let kv = ["--kv-bits", "3.5", "--kv-center"];
    let (file, saved) = save(dir.path(), "c.safetensors", SHORT_B, &kv);
    assert!(saved.len() >= 16, "{} tokens", saved.len());
    let mut with = kv.to_vec();
    with.extend(["--prompt-cache", file.to_str().unwrap()]);
    let fresh = generate(LONG_B, 16, &kv);
    let cached = generate(LONG_B, 16, &with);
    assert_eq!(cached["stats"]["cached_tokens"], saved.len());
    assert_eq!(ids(&cached["tokens"]), ids(&fresh["tokens"]));
    let (long_file, _) = save(dir.path(), "long.safetensors", LONG_B, &kv);
    assert_eq!(
        leading_rows(&file, saved.len()),
        leading_rows(&long_file, saved.len())
    );
    let plain = ["--kv-bits", "3.5", "--prompt-cache", file.to_str().unwrap()];
    let e = generate_err(LONG_B, &plain);
    assert!(e.contains("start from it with --kv-center"), "{e}");
    let (plain_file, _) = save(dir.path(), "p.safetensors", SHORT_B, &["--kv-bits", "3.5"]);
    let mut centred = kv.to_vec();
    centred.extend(["--prompt-cache", plain_file.to_str().unwrap()]);
    let e = generate_err(LONG_B, &centred);
    assert!(e.contains("start from it without --kv-center"), "{e}");
}
