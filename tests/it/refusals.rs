//! Nothing lost, nothing silently wrong (issue 21): files kvq must not overwrite or shrink, and
//! inputs it must refuse rather than run into a wrong answer. Each test drives the CLI.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn default_model() -> PathBuf {
    kvq::model::fetch::default_model().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

const QUICK: [&str; 6] = ["--raw", "--temp", "0", "--max-tokens", "2", "--no-progress"];

/// Two short prompts as JSONL with ids "a" and "b".
fn two_prompts(dir: &Path) -> PathBuf {
    let p = dir.join("in.jsonl");
    std::fs::write(
        &p,
        "{\"id\": \"a\", \"prompt\": \"The sky is\"}\n{\"id\": \"b\", \"prompt\": \"One, two,\"}\n",
    )
    .unwrap();
    p
}

#[test]
fn save_prompt_cache_never_replaces_the_model_a_device_or_an_existing_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    std::fs::copy(default_model(), &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    let gen = |save: &Path, force: bool| {
        let mut a = vec![
            "generate",
            "--model",
            s(&model),
            "--raw",
            "--temp",
            "0",
            "--max-tokens",
            "1",
            "--save-prompt-cache",
            s(save),
        ];
        if force {
            a.push("--force");
        }
        a.push("The capital of France is");
        kvq(&a)
    };
    // The model itself, even with --force, and through a symlink.
    let o = gen(&model, true);
    assert_fails_with(&o, "model as cache", "is the model file");
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    assert_fails_with(&gen(&link, true), "link to model", "is the model file");
    assert!(
        std::fs::read(&model).unwrap() == before,
        "the model changed"
    );
    // A device.
    assert_fails_with(
        &gen(Path::new("/dev/null"), true),
        "device",
        "not a regular file",
    );
    // An existing file: refused without --force, replaced with it.
    let other = dir.path().join("notes.txt");
    std::fs::write(&other, "my notes\n").unwrap();
    assert_fails_with(&gen(&other, false), "existing", "--force overwrites it");
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "my notes\n");
    let o = gen(&other, true);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(
        std::fs::read_to_string(&other).ok().as_deref(),
        Some("my notes\n")
    );
    // A symlink to a cache: the target is rewritten, the link stays a link.
    let target = dir.path().join("target.safetensors");
    std::fs::copy(&other, &target).unwrap();
    let cache_link = dir.path().join("cache-link");
    std::os::unix::fs::symlink(&target, &cache_link).unwrap();
    let o = gen(&cache_link, true);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::symlink_metadata(&cache_link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read(&target).unwrap(),
        std::fs::read(&other).unwrap(),
        "the link's target holds the new cache"
    );
    // No stray temporary files.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains(".tmp")), "{names:?}");
}

#[test]
fn resume_refuses_a_foreign_file_and_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = two_prompts(dir.path());
    let out = dir.path().join("essay.txt");
    let essay = "Chapter one\nIt was a dark night.\n";
    std::fs::write(&out, essay).unwrap();
    let args = |o: &Path| {
        let mut a = vec!["batch-generate", s(&input), "-o", s(o), "--resume"];
        a.extend(QUICK);
        a.iter().map(|x| x.to_string()).collect::<Vec<_>>()
    };
    let run = |o: &Path| {
        let a = args(o);
        kvq(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    assert_fails_with(&run(&out), "essay", "essay.txt:1: line 1 is not a kvq");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), essay);
    // A kvq output with one garbage line in the middle: refused, nothing dropped.
    let mixed = dir.path().join("mixed.jsonl");
    let text = "{\"id\":\"a\",\"text\":\"x\",\"finish_reason\":\"stop\"}\nnot a record\n\
                {\"id\":\"z\",\"text\":\"y\",\"finish_reason\":\"cancelled\"}\n";
    std::fs::write(&mixed, text).unwrap();
    assert_fails_with(&run(&mixed), "garbage", "mixed.jsonl:2");
    assert_eq!(std::fs::read_to_string(&mixed).unwrap(), text);
}

#[test]
fn resume_through_a_symlink_rewrites_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let input = two_prompts(dir.path());
    let real = dir.path().join("real.jsonl");
    // "a" is done; "b" was cancelled, so the file must be rewritten without it.
    std::fs::write(
        &real,
        "{\"id\":\"a\",\"text\":\"done\",\"finish_reason\":\"stop\"}\n\
         {\"id\":\"b\",\"text\":\"\",\"finish_reason\":\"cancelled\"}\n",
    )
    .unwrap();
    let link = dir.path().join("out.jsonl");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let mut a = vec!["batch-generate", s(&input), "-o", s(&link), "--resume"];
    a.extend(QUICK);
    let o = kvq(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let recs = records(&real);
    let ids: Vec<&str> = recs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "b"], "{recs:?}");
    assert_eq!(recs[0]["text"], "done");
    assert_eq!(recs[1]["finish_reason"], "length");
}

#[test]
fn error_records_never_shadow_a_valid_id() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    // Line 2 repeats id "a"; line 3 has no id and is broken: its line number is id 3 of line 4.
    std::fs::write(
        &input,
        "{\"id\": \"a\", \"prompt\": \"The sky is\"}\n\
         {\"id\": \"a\", \"prompt\": \"again\"}\n\
         {\"prompt\": 5}\n\
         {\"id\": 3, \"prompt\": \"One, two,\"}\n",
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let run = |extra: &str| {
        let mut a = vec![
            "batch-generate",
            s(&input),
            "-o",
            s(&out),
            "--skip-invalid",
            extra,
        ];
        a.extend(QUICK);
        kvq(&a)
    };
    let o = run("--force");
    assert!(o.status.success(), "{}", stderr(&o));
    let recs = records(&out);
    assert_eq!(recs.len(), 4, "{recs:?}");
    let errors: Vec<&Value> = recs
        .iter()
        .filter(|r| r["finish_reason"] == "error")
        .collect();
    assert_eq!(errors.len(), 2);
    for e in &errors {
        assert!(e["id"].is_null(), "an error record claims a valid id: {e}");
        assert!(e["line"].is_u64(), "{e}");
    }
    // A run cut before the valid requests finished: only the error records are written.
    let kept: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    std::fs::write(&out, kept.join("\n") + "\n").unwrap();
    let o = run("--resume");
    assert!(o.status.success(), "{}", stderr(&o));
    let recs = records(&out);
    let mut done: Vec<String> = recs
        .iter()
        .filter(|r| r["finish_reason"] != "error")
        .map(|r| r["id"].to_string())
        .collect();
    done.sort();
    assert_eq!(done, ["\"a\"", "3"], "{recs:?}");
    assert_eq!(
        recs.len(),
        4,
        "the error records are not written twice: {recs:?}"
    );
}

#[test]
fn a_second_run_on_a_locked_output_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.txt");
    std::fs::write(&input, "Count from one to a hundred:\n".repeat(4)).unwrap();
    let out = dir.path().join("out.jsonl");
    std::fs::write(
        &out,
        "{\"id\":1,\"text\":\"old\",\"finish_reason\":\"stop\"}\n",
    )
    .unwrap();
    let mut first = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(["batch-generate", s(&input), "-o", s(&out), "--force"])
        .args(["--raw", "--max-tokens", "400", "--no-progress"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The --force run empties the file once it holds the lock.
    let t0 = Instant::now();
    while std::fs::metadata(&out).unwrap().len() > 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "never truncated");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut a = vec!["batch-generate", s(&input), "-o", s(&out), "--resume"];
    a.extend(QUICK);
    let second = kvq(&a);
    let still_running = first.try_wait().unwrap().is_none();
    first.kill().ok();
    first.wait().unwrap();
    assert!(
        still_running,
        "the first run ended too soon to test the lock"
    );
    assert_fails_with(&second, "locked", "being written by another kvq run");
}

/// Generates with `extra` flags (greedy, --json) and returns the generated tokens.
fn greedy_tokens(prompt: &str, extra: &[&str]) -> Vec<u64> {
    let mut a = vec![
        "generate",
        "--raw",
        "--temp",
        "0",
        "--max-tokens",
        "12",
        "--json",
    ];
    a.extend(extra);
    a.push(prompt);
    let o = kvq(&a);
    assert!(o.status.success(), "{a:?}: {}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

const LONG_PROMPT: &str = "The history of the printing press begins in the fifteenth century, \
    when Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press into \
    a system that could produce books far faster than";

#[test]
fn damaged_prompt_cache_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.safetensors");
    greedy_tokens(LONG_PROMPT, &["--save-prompt-cache", s(&cache)]);
    let mut bytes = std::fs::read(&cache).unwrap();
    let at = bytes.len() - 100; // inside the last tensor's data
    bytes[at] ^= 0x40;
    std::fs::write(&cache, &bytes).unwrap();
    fails_with(
        &[
            "generate",
            "--raw",
            "--max-tokens",
            "2",
            "--prompt-cache",
            s(&cache),
            LONG_PROMPT,
        ],
        "is damaged",
    );
}

#[test]
fn prompt_cache_under_a_window_gives_the_windowed_output() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.safetensors");
    greedy_tokens(LONG_PROMPT, &["--save-prompt-cache", s(&cache)]);
    let longer = format!("{LONG_PROMPT} any scribe could copy them by hand.");
    let window = ["--max-kv-size", "16"];
    let plain = greedy_tokens(&longer, &window);
    let cached = greedy_tokens(
        &longer,
        &[&window[..], &["--prompt-cache", s(&cache)]].concat(),
    );
    assert_eq!(plain, cached);
}

#[test]
fn kv_memory_counts_the_staging_pool_and_must_hold_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let input = two_prompts(dir.path());
    let base = [
        "batch-generate",
        s(&input),
        "--raw",
        "--max-tokens",
        "2",
        "--no-progress",
    ];
    // 8 sequences x 33 staging blocks x 16 tokens of dense f32 rows alone exceed 64 MiB.
    fails_with(
        &[
            &base[..],
            &[
                "--kv-bits",
                "4",
                "--quantized-kv-start",
                "512",
                "--kv-memory",
                "64M",
            ],
        ]
        .concat(),
        "dense staging for --quantized-kv-start",
    );
    // The --kv-bits 4 budget's dense window copies: 1.41 MiB per sequence, 64 sequences.
    fails_with(
        &[
            &base[..],
            &["--kv-bits", "4", "--max-batch", "64", "--kv-memory", "64M"],
        ]
        .concat(),
        "plus 90.00 MiB of dense window copies for --max-batch 64 sequences",
    );
    fails_with(
        &[&base[..], &["--kv-memory", "1"]].concat(),
        "cannot hold the longest request",
    );
    fails_with(
        &[&base[..], &["--kv-memory", "1000T"]].concat(),
        "more than the",
    );
}

#[test]
fn a_bom_and_a_bad_byte_are_handled_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        b"\xEF\xBB\xBF{\"id\": \"x\", \"prompt\": \"The sky is\"}\n",
    )
    .unwrap();
    let mut a = vec!["batch-generate", s(&input)];
    a.extend(QUICK);
    let o = kvq(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["id"], "x", "read as JSONL despite the BOM: {r}");

    let text = dir.path().join("in.txt");
    std::fs::write(&text, b"The sky is\nbad \xFF byte\nOne, two,\n").unwrap();
    let mut a = vec!["batch-generate", s(&text)];
    a.extend(QUICK);
    fails_with(&a, "in.txt:2: not UTF-8");
    a.push("--skip-invalid");
    let o = kvq(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let recs: Vec<Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 3);
    let bad: Vec<&Value> = recs
        .iter()
        .filter(|r| r["finish_reason"] == "error")
        .collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0]["line"], 2);
}

#[test]
fn out_of_range_values_are_refused_with_the_allowed_range() {
    for (flag, value, needle) in [
        ("--top-p", "2", "--top-p must be in (0, 1]"),
        ("--top-p", "NaN", "--top-p must be in (0, 1]"),
        ("--top-p", "0", "--top-p must be in (0, 1]"),
        ("--min-p", "-1", "--min-p must be in [0, 1)"),
        ("--min-p", "NaN", "--min-p must be in [0, 1)"),
        ("--temp", "NaN", "--temp must be a number"),
    ] {
        fails_with(&["generate", flag, value, "hi"], needle);
    }
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one two three four five six seven eight nine ten").unwrap();
    fails_with(
        &["perplexity", s(&text), "--ctx", "2"],
        "--ctx must be at least 3",
    );
}

#[test]
fn kv_residual_is_refused_where_it_cannot_apply() {
    for (extra, needle) in [
        (
            &["--kv-residual", "8"][..],
            "--kv-residual only applies to a quantized cache: add --kv-bits",
        ),
        (
            &["--kv-bits", "4", "--kv-residual", "5000"][..],
            "--kv-residual must be between 0 and 4096 (got 5000)",
        ),
        (
            &[
                "--kv-bits",
                "4",
                "--kv-residual",
                "8",
                "--quantized-kv-start",
                "4",
            ][..],
            "--kv-residual cannot be combined with --quantized-kv-start",
        ),
        (
            &["--kv-bits", "4", "--kv-sinks", "4"][..],
            "--kv-sinks needs --kv-residual (at least 1)",
        ),
        (
            &["--kv-bits", "4", "--kv-residual", "8", "--kv-sinks", "300"][..],
            "--kv-sinks must be between 0 and 256 (got 300)",
        ),
        (
            &["--kv-sinks", "4"][..],
            "--kv-sinks only applies to a quantized cache",
        ),
        (
            &["--kv-center"][..],
            "--kv-center only applies to a quantized cache: add --kv-bits",
        ),
        (
            &["--kv-bits", "4", "--kv-center", "--quantized-kv-start", "4"][..],
            "--kv-center cannot be combined with --quantized-kv-start",
        ),
    ] {
        let mut args = vec!["generate", "--max-tokens", "2"];
        args.extend_from_slice(extra);
        args.push("hi");
        fails_with(&args, needle);
    }
}

#[test]
fn a_tokenizer_of_another_vocabulary_is_refused() {
    let tok = fixture("hub/tiny-llama/tokenizer.json");
    fails_with(
        &["generate", "--tokenizer", s(&tok), "--raw", "hi"],
        "they do not belong together",
    );
}

/// Runs kvq, killed after `secs` (a run that should have been refused would otherwise serve
/// forever).
fn kvq_within(args: &[&str], secs: u64) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(secs) {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn serve_kv_memory_is_checked_as_batch_generate_checks_it() {
    let serve = ["serve", "--host", "127.0.0.1", "--port", "0"];
    let o = kvq_within(&[&serve[..], &["--kv-memory", "1"]].concat(), 120);
    assert_fails_with(
        &o,
        "--kv-memory 1",
        "cannot hold one request of --max-tokens 256",
    );
    // 8 sequences x 33 staging blocks x 16 tokens of dense rows exceed 64 MiB.
    let staged = [
        "--kv-bits",
        "4",
        "--quantized-kv-start",
        "512",
        "--kv-memory",
        "64M",
    ];
    let o = kvq_within(&[&serve[..], &staged[..]].concat(), 120);
    assert_fails_with(&o, "staging", "dense staging for --quantized-kv-start");
    let o = kvq_within(&[&serve[..], &["--kv-memory", "1000T"]].concat(), 120);
    assert_fails_with(&o, "1000T", "more than the");
}

#[test]
fn a_fixed_line_runs_on_resume_and_an_unchanged_one_is_not_redone() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let a = "{\"id\": \"a\", \"prompt\": \"The sky is\"}";
    let still_broken = "{\"prompt\": 5}";
    std::fs::write(
        &input,
        format!(
            "{a}\n{{\"id\": \"b\", \"prompt\": \"One, two,\", \"top_p\": 2}}\n\
             {{\"id\": \"c\", \"prompt\": \n{still_broken}\n"
        ),
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let run = |extra: &[&str]| {
        let mut args = vec!["batch-generate", s(&input), "-o", s(&out)];
        args.extend(extra);
        args.extend(QUICK);
        kvq(&args)
    };
    // Without --skip-invalid an out-of-range value stops the run, naming its line and field.
    let tp = dir.path().join("tp.jsonl");
    std::fs::write(&tp, format!("{a}\n{{\"prompt\": \"x\", \"top_p\": 2}}\n")).unwrap();
    let mut args = vec!["batch-generate", s(&tp)];
    args.extend(QUICK);
    fails_with(&args, "tp.jsonl:2: \"top_p\" must be in (0, 1]");
    let o = run(&["--skip-invalid"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let recs = records(&out);
    assert_eq!(recs.len(), 4, "{recs:?}");
    let line2 = recs.iter().find(|r| r["line"] == 2).unwrap();
    assert_eq!(line2["finish_reason"], "error");
    assert!(
        line2["error"].as_str().unwrap().contains("\"top_p\""),
        "{line2}"
    );
    // Lines 2 and 3 fixed, line 4 left broken.
    std::fs::write(
        &input,
        format!(
            "{a}\n{{\"id\": \"b\", \"prompt\": \"One, two,\", \"top_p\": 0.5}}\n\
             {{\"id\": \"c\", \"prompt\": \"Red, green,\"}}\n{still_broken}\n"
        ),
    )
    .unwrap();
    let o = run(&["--resume", "--skip-invalid"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let recs = records(&out);
    let answered = |id: &str| {
        recs.iter()
            .filter(|r| r["id"] == id && r["finish_reason"] != "error")
            .count()
    };
    assert_eq!(
        (answered("a"), answered("b"), answered("c")),
        (1, 1, 1),
        "{recs:?}"
    );
    let line4 = recs.iter().filter(|r| r["line"] == 4).count();
    assert_eq!(
        line4, 1,
        "an unchanged broken line is reported once: {recs:?}"
    );
    assert_eq!(recs.len(), 6, "{recs:?}");
}

#[test]
fn batch_output_is_never_an_input_and_force_waits_for_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let input = two_prompts(dir.path());
    let before_input = std::fs::read(&input).unwrap();
    // A copy of the default model in a KVQ_HOME of its own.
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let model = home.join(kvq::model::fetch::DEFAULT_MODEL_FILE);
    std::fs::copy(default_model(), &model).unwrap();
    let model_len = std::fs::metadata(&model).unwrap().len();
    let hard = dir.path().join("hard.gguf");
    std::fs::hard_link(&model, &hard).unwrap();
    let batch = |out: &Path, extra: &[&str]| {
        let mut a = vec!["batch-generate", s(&input), "-o", s(out)];
        a.extend(extra);
        a.extend(QUICK);
        kvq(&a)
    };
    for out in [&model, &hard] {
        for mode in ["--force", "--resume"] {
            let o = batch(out, &["--model", s(&model), mode]);
            assert_fails_with(&o, &format!("{out:?} {mode}"), "is the model file");
        }
    }
    assert_eq!(std::fs::metadata(&model).unwrap().len(), model_len);
    let o = batch(&input, &["--force"]);
    assert_fails_with(&o, "input as output", "is the input file");
    assert_eq!(std::fs::read(&input).unwrap(), before_input);
    // The files of a model directory.
    let tiny = dir.path().join("tiny");
    std::fs::create_dir(&tiny).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("hub/tiny-llama").join(f), tiny.join(f)).unwrap();
    }
    for f in ["model.safetensors", "tokenizer.json"] {
        let before = std::fs::read(tiny.join(f)).unwrap();
        let o = batch(&tiny.join(f), &["--model", s(&tiny), "--force"]);
        assert_fails_with(&o, f, "is the model file");
        assert_eq!(std::fs::read(tiny.join(f)).unwrap(), before);
    }
    // The default model, known only once loaded: checked after loading, before the run starts.
    let mut a = vec!["batch-generate", s(&input), "-o", s(&hard), "--force"];
    a.extend(QUICK);
    let o = Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(&a)
        .env("KVQ_HOME", &home)
        .output()
        .unwrap();
    assert_fails_with(&o, "default model as output", "is the model file");
    assert_eq!(std::fs::metadata(&model).unwrap().len(), model_len);

    // --force keeps the old output until the run is under way: a line refused after the model
    // has loaded leaves it as it was.
    let out = dir.path().join("results.jsonl");
    let old = "{\"id\":\"x\",\"text\":\"hours of work\",\"finish_reason\":\"stop\"}\n";
    std::fs::write(&out, old).unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"id\": \"a\", \"prompt\": \"hi\", \"max_tokens\": 0}\n",
    )
    .unwrap();
    let mut a = vec!["batch-generate", s(&bad), "-o", s(&out), "--force"];
    a.extend(QUICK);
    assert_fails_with(&kvq(&a), "max_tokens 0", "bad.jsonl:1");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), old);
    let o = batch(&out, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(records(&out).len(), 2);
}

#[test]
fn save_prompt_cache_refuses_a_hard_link_to_the_model_and_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    std::fs::copy(default_model(), &model).unwrap();
    let hard = dir.path().join("cache.safetensors");
    std::fs::hard_link(&model, &hard).unwrap();
    let fifo = dir.path().join("fifo.safetensors");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for (path, needle) in [(&hard, "is the model file"), (&fifo, "is a FIFO")] {
        let o = kvq_within(
            &[
                "generate",
                "--model",
                s(&model),
                "--raw",
                "--max-tokens",
                "1",
                "--force",
                "--save-prompt-cache",
                s(path),
                "The capital of France is",
            ],
            120,
        );
        assert_fails_with(&o, needle, needle);
    }
    assert_eq!(
        std::fs::read(&model).unwrap(),
        std::fs::read(default_model()).unwrap()
    );
}
