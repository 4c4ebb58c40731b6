//! A bounded load test of `kvq serve`: 200 requests from 32 concurrent clients, random prompt
//! and answer lengths, some streamed, some hung up mid-stream, some malformed. Every valid
//! request is answered with `kvq batch-generate`'s greedy text for it (with the same KV cache),
//! every malformed one gets a 4xx, and the pool's blocks are all free at the end. Run with a
//! dense cache and a queue that takes every client, and (80 requests) with a 4-bit cache and a
//! queue of 2, where clients are refused with 429 and come back after its Retry-After.

use crate::common::server::*;
use crate::common::*;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const CLIENTS: usize = 32;

enum Kind {
    Plain,
    Streamed,
    HangUp,
    Malformed(String),
}

/// How long one request may keep meeting 429s before the test gives up on it.
const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(600);

#[test]
fn load_200_requests_32_clients_dense() {
    load(&[], 64, 200);
}

/// Fewer requests: the point is the 4-bit cache and the refusals, at a bounded cost.
#[test]
fn load_80_requests_32_clients_kv4_small_queue() {
    load(&["--kv-bits", "4"], 2, 80);
}

fn load(kv: &[&str], max_queue: usize, requests: usize) {
    let corpus = std::fs::read_to_string(reference_dir().join("corpus.txt")).unwrap();
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let malformed = [
        "{\"prompt\": ".to_string(),
        json!({"prompt": 17}).to_string(),
        json!({"prompt": "hi", "max_tokens": "many"}).to_string(),
        json!({"prompt": "hi", "model": "nope"}).to_string(),
        json!({"prompt": "hi", "top_p": 7}).to_string(),
    ];
    let mut reqs: Vec<(Kind, String, usize)> = Vec::new();
    for i in 0..requests {
        let n = rng.random_range(3..120);
        let at = rng.random_range(0..words.len() - n);
        let prompt = words[at..at + n].join(" ");
        let max_tokens = rng.random_range(1..=12);
        let kind = match i % 10 {
            7 => Kind::Malformed(malformed[(i / 10) % malformed.len()].clone()),
            3 => Kind::HangUp,
            1 | 5 => Kind::Streamed,
            _ => Kind::Plain,
        };
        reqs.push((kind, prompt, max_tokens));
    }

    // batch-generate's greedy answers for the valid requests.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let lines: Vec<String> = reqs
        .iter()
        .enumerate()
        .filter(|(_, r)| !matches!(r.0, Kind::Malformed(_)))
        .map(|(i, (_, p, m))| {
            json!({"id": i, "prompt": p, "raw": true, "max_tokens": m}).to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let mut args = vec![
        "batch-generate",
        input.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
        "--no-progress",
        "--max-batch",
        "8",
    ];
    args.extend(BASE_FLAGS);
    args.extend(kv);
    let out = kvq(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let want: HashMap<usize, String> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["id"].as_u64().unwrap() as usize,
                v["text"].as_str().unwrap().to_string(),
            )
        })
        .collect();

    let queue = max_queue.to_string();
    let s = Server::start(&[&["--max-batch", "8", "--max-queue", &queue], kv].concat());
    let next = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<String>::new());
    std::thread::scope(|scope| {
        for _ in 0..CLIENTS {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((kind, prompt, max_tokens)) = reqs.get(i) else {
                    break;
                };
                let mut body = json!({"prompt": prompt, "max_tokens": max_tokens});
                match kind {
                    Kind::HangUp => merge(&mut body, json!({"stream": true, "max_tokens": 64})),
                    Kind::Streamed => merge(&mut body, json!({"stream": true})),
                    _ => {}
                }
                let body = match kind {
                    Kind::Malformed(b) => b.clone(),
                    _ => body.to_string(),
                };
                let (sent, n) = s.post_retrying("/v1/completions", &body, GIVE_UP);
                refused.fetch_add(n, Ordering::SeqCst);
                let problem = match (kind, sent) {
                    (Kind::Malformed(_), Err((code, _))) if (400..500).contains(&code) => None,
                    (_, Err((code, text))) => Some(format!("{i}: {code} for {body}: {text}")),
                    (Kind::Malformed(_), Ok(r)) => Some(format!("{i}: {} for {body}", r.status())),
                    (Kind::HangUp, Ok(r)) => {
                        hang_up(r);
                        None
                    }
                    (Kind::Streamed, Ok(r)) => {
                        let (text, _) = stream_text(&read_stream(r));
                        (text != want[&i])
                            .then(|| format!("{i}: streamed {text:?} != {:?}", want[&i]))
                    }
                    (Kind::Plain, Ok(r)) => {
                        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                        let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                        (text != want[&i]).then(|| format!("{i}: {text:?} != {:?}", want[&i]))
                    }
                };
                if let Some(p) = problem {
                    failures.lock().unwrap().push(p);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    s.assert_no_leak();
    let finished = s.metric("kvq_requests_total{outcome=\"finished\"}");
    let cancelled = s.metric("kvq_requests_total{outcome=\"cancelled\"}");
    // A hung-up request may have finished before the server noticed; a refused one never
    // reached the engine.
    assert_eq!(finished + cancelled, (requests - requests / 10) as f64);
    let refused = refused.into_inner();
    if CLIENTS > 8 + max_queue {
        assert!(refused > 0, "a queue of {max_queue} refused no client");
    } else {
        assert_eq!(refused, 0, "the queue takes every client");
    }
    eprintln!("load: {refused} refusals (429) retried");
}
