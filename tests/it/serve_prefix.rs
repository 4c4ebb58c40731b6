//! Automatic prefix reuse in `kvq serve`: a request sharing a 1,000-token prefix with an
//! earlier one prefills only the rest (usage reports the cached tokens) and gets the same
//! tokens as a server without reuse, with a dense, a 4-bit and a centred 3.5-bit cache, and
//! under the dense window (`--kv-residual`) where copies were kept.

use crate::common::server::*;
use crate::common::*;
use serde_json::{json, Value};

/// `len` token ids of the reference corpus from `at`.
fn corpus_ids(at: usize, len: usize) -> Vec<u32> {
    let text =
        std::fs::read_to_string(reference_dir().join("corpus-first65536-token-ids.txt")).unwrap();
    text.split_whitespace()
        .skip(at)
        .take(len)
        .map(|t| t.parse().unwrap())
        .collect()
}

fn complete(s: &Server, prompt: &[u32]) -> (String, Value) {
    let (code, v) = s.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8}),
    );
    assert_eq!(code, 200, "{v}");
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["usage"].clone(),
    )
}

fn shared_prefix_reuse(kv: &[&str]) {
    let prefix = corpus_ids(0, 1000);
    let a: Vec<u32> = [&prefix[..], &corpus_ids(5000, 40)].concat();
    let b: Vec<u32> = [&prefix[..], &corpus_ids(9000, 25)].concat();
    let flags = [&["--kv-memory", "256M"], kv].concat();

    let cold = Server::start(&[&flags[..], &["--no-prefix-cache"]].concat());
    let (want_a, usage) = complete(&cold, &a);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    let (want_b, usage) = complete(&cold, &b);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "reuse is off"
    );
    cold.assert_no_leak();
    drop(cold);

    let s = Server::start(&flags);
    let (got_a, usage) = complete(&s, &a);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(got_a, want_a);
    // b shares a's first 1000 tokens: 62 whole blocks of 16 come from the cache.
    let (got_b, usage) = complete(&s, &b);
    assert_eq!(usage["prompt_tokens"], b.len());
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 992,
        "{usage}"
    );
    assert_eq!(got_b, want_b, "same tokens with and without reuse");
    // a again: all its whole blocks but what must be left to prefill.
    let (again, usage) = complete(&s, &a);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 1024,
        "{usage}"
    );
    assert_eq!(again, want_a);
    assert_eq!(s.metric("kvq_prefix_cache_hits_total"), 2.0);
    assert_eq!(s.metric("kvq_prefix_cache_tokens_total"), 2016.0);
    // Parked blocks count as free, and are listed as cached.
    s.assert_no_leak();
    assert!(s.main_pool("kvq_kv_blocks_prefix_cached") >= 64.0);
}

#[test]
fn shared_prefix_reuse_dense() {
    shared_prefix_reuse(&[]);
}

#[test]
fn shared_prefix_reuse_kv4() {
    // Plain 4-bit (a part given): the budget's preset has a dense window, tested below.
    shared_prefix_reuse(PLAIN4);
}

/// Centred keys (`--kv-center`): a prefix is reused with the key means its blocks were stored
/// with (those of its first block), so b gets what it gets alone.
#[test]
fn shared_prefix_reuse_kv_center() {
    shared_prefix_reuse(&["--kv-bits", "3.5", "--kv-center"]);
}

/// Under `--kv-residual` the first token after a shared prefix attends the dense copies of the
/// positions before it, which shared blocks do not keep: a prompt stops its prefill once at its
/// last whole block short of its final two tokens and keeps its copies there, and a later prompt
/// is reused up to such a point only. Every answer is that of a server without reuse.
#[test]
fn shared_prefix_reuse_under_kv_residual() {
    let flags = SMALL_WINDOW;
    // 72 tokens: copies kept at 64.
    let a: Vec<u32> = [corpus_ids(0, 64), corpus_ids(5000, 8)].concat();
    let b: Vec<u32> = [corpus_ids(0, 64), corpus_ids(9000, 8)].concat();
    // Shares two whole blocks with a, where a kept no copies.
    let c: Vec<u32> = [corpus_ids(0, 40), corpus_ids(7000, 30)].concat();
    // A second turn after a: a's prompt and more.
    let d: Vec<u32> = [&a[..], &corpus_ids(12000, 20)].concat();
    let cold = Server::start(&[flags, &["--no-prefix-cache"]].concat());
    let want: Vec<String> = [&a, &b, &c, &d]
        .iter()
        .map(|p| complete(&cold, p).0)
        .collect();
    drop(cold);
    let s = Server::start(flags);
    for (prompt, want, cached) in [
        (&a, &want[0], 0),
        (&b, &want[1], 64),
        (&c, &want[2], 0),
        (&a, &want[0], 64),
        (&d, &want[3], 64),
    ] {
        let (got, usage) = complete(&s, prompt);
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], cached,
            "{usage}"
        );
        assert_eq!(&got, want, "same tokens with and without reuse");
    }
    assert_eq!(s.metric("kvq_prefix_cache_hits_total"), 3.0);
    s.assert_no_leak();
}

/// A pool too small to keep every prompt: cached prefixes are evicted least recently used, the
/// deepest blocks of a chain first, and every request is still answered with the text it got
/// before (evicted blocks are never handed out as cached rows).
#[test]
fn cached_prefixes_are_evicted_lru_under_pressure() {
    let s = Server::start(&["--kv-memory", "30M"]);
    let total = s.main_pool("kvq_kv_blocks_total") as usize;
    assert!(total >= 12, "{total} blocks");
    // Prompts of whole blocks plus 8 tokens: with 8 answer tokens each takes one more block.
    let k = total / 4;
    let k_c = total - k - 1;
    let prompt = |at: usize, blocks: usize| corpus_ids(at, blocks * 16 + 8);
    let (a, b, c) = (prompt(0, k), prompt(20_000, k), prompt(40_000, k_c));
    let cached = |u: &Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize
    };
    let parked = || s.main_pool("kvq_kv_blocks_prefix_cached") as usize;

    let (text_a, u) = complete(&s, &a);
    assert_eq!(cached(&u), 0);
    let (text_b, u) = complete(&s, &b);
    assert_eq!(cached(&u), 0);
    assert_eq!(parked(), 2 * k, "both prompts' whole blocks stay");
    // a again: reused whole, and now more recent than b.
    let (t, u) = complete(&s, &a);
    assert_eq!((t.as_str(), cached(&u)), (text_a.as_str(), 16 * k));
    // c needs every block but a's: all of b's are evicted, none of a's.
    let (text_c, u) = complete(&s, &c);
    assert_eq!(cached(&u), 0);
    assert_eq!(parked(), k + k_c);
    let (t, u) = complete(&s, &a);
    assert_eq!(
        (t.as_str(), cached(&u)),
        (text_a.as_str(), 16 * k),
        "a survived"
    );
    let (t, u) = complete(&s, &b);
    assert_eq!(
        (t.as_str(), cached(&u)),
        (text_b.as_str(), 0),
        "b was evicted"
    );
    // b took k blocks from the least recently used chain, c, from its end: c keeps its head.
    let (t, u) = complete(&s, &c);
    assert_eq!((t.as_str(), cached(&u)), (text_c.as_str(), 16 * (k_c - k)));
    assert_eq!(s.metric("kvq_prefix_cache_hits_total"), 3.0);
    s.assert_no_leak();
}
