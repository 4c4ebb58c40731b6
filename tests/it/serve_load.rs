//! A bounded load test of `kvq serve`: 200 requests from 32 concurrent clients, random prompt
//! and answer lengths, some streamed, some hung up mid-stream, some malformed. Every valid
//! request is answered with `kvq batch-generate`'s greedy text for it, every malformed one gets
//! a 4xx, and the pool's blocks are all free at the end.

use crate::common::server::*;
use crate::common::*;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const REQUESTS: usize = 200;
const CLIENTS: usize = 32;

enum Kind {
    Plain,
    Streamed,
    HangUp,
    Malformed(String),
}

#[test]
fn load_200_requests_32_clients() {
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
    for i in 0..REQUESTS {
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

    let s = Server::start(&["--max-batch", "8", "--max-queue", "64"]);
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<String>::new());
    std::thread::scope(|scope| {
        for _ in 0..CLIENTS {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((kind, prompt, max_tokens)) = reqs.get(i) else {
                    break;
                };
                let body = json!({"prompt": prompt, "max_tokens": max_tokens});
                let problem = match kind {
                    Kind::Malformed(b) => {
                        let (code, text) = s.post_raw("/v1/completions", b, &[]);
                        (!(400..500).contains(&code))
                            .then(|| format!("{i}: {code} for {b}: {text}"))
                    }
                    Kind::HangUp => {
                        let mut b = body.clone();
                        merge(&mut b, json!({"stream": true, "max_tokens": 64}));
                        s.stream_and_hang_up("/v1/completions", &b);
                        None
                    }
                    Kind::Streamed => {
                        let mut b = body.clone();
                        merge(&mut b, json!({"stream": true}));
                        let (text, _) = stream_text(&s.stream("/v1/completions", &b));
                        (text != want[&i])
                            .then(|| format!("{i}: streamed {text:?} != {:?}", want[&i]))
                    }
                    Kind::Plain => {
                        let (code, v) = s.post("/v1/completions", &body);
                        let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                        (code != 200 || text != want[&i])
                            .then(|| format!("{i}: {code} {text:?} != {:?}", want[&i]))
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
    // A hung-up request may have finished before the server noticed.
    assert_eq!(finished + cancelled, (REQUESTS - REQUESTS / 10) as f64);
}
