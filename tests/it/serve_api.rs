//! `kvq serve` over HTTP: chat and completions, streamed and not, the 12 reference prompts
//! against `kvq generate` (dense and 4-bit KV), errors with OpenAI bodies, the queue limit, the
//! API key, client hang-ups; every test ends with the pool's blocks all free again.

use crate::common::server::*;
use crate::common::*;
use serde_json::{json, Value};

fn chat(s: &Server, body: Value) -> (String, String, Value) {
    let (code, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let c = &v["choices"][0];
    (
        c["message"]["content"].as_str().unwrap().to_string(),
        c["finish_reason"].as_str().unwrap().to_string(),
        v["usage"].clone(),
    )
}

/// The 12 reference prompts: the server's greedy answers (streamed and not, all 24 sent at
/// once so they share batches) equal `kvq generate`'s, run here with the same flags.
fn reference_prompts_match_generate(kv: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let cases = greedy_cases();
    let wants: Vec<Value> = cases
        .iter()
        .map(|case| {
            let args = reference_generate_args(case, kv, dir.path());
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = kvq(&argv);
            assert!(out.status.success(), "{}: {}", case["id"], stderr(&out));
            serde_json::from_slice(&out.stdout).unwrap()
        })
        .collect();
    let s = Server::start(&[&["--max-batch", "8"], kv].concat());
    std::thread::scope(|scope| {
        for (case, want) in cases.iter().zip(&wants) {
            let id = case["id"].as_str().unwrap();
            let (path, body) = if case["chat_template"].as_bool().unwrap() {
                (
                    "/v1/chat/completions",
                    chat_body(&case["messages"], json!({"max_tokens": 48})),
                )
            } else {
                (
                    "/v1/completions",
                    json!({"prompt": case["prompt"], "max_tokens": 48}),
                )
            };
            let (s, b2) = (&s, body.clone());
            scope.spawn(move || {
                let (code, v) = s.post(path, &b2);
                assert_eq!(code, 200, "{id}: {v}");
                let choice = &v["choices"][0];
                let text = choice["message"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
                    .unwrap();
                assert_eq!(text, want["text"], "{id}: text");
                assert_eq!(choice["finish_reason"], want["finish_reason"], "{id}");
                let n_prompt = want["prompt_tokens"].as_array().unwrap().len();
                assert_eq!(v["usage"]["prompt_tokens"], n_prompt, "{id}");
                let n_gen = want["tokens"].as_array().unwrap().len();
                assert_eq!(v["usage"]["completion_tokens"], n_gen, "{id}");
            });
            scope.spawn(move || {
                let mut sb = body;
                merge(&mut sb, json!({"stream": true}));
                let (stext, sfinish) = stream_text(&s.stream(path, &sb));
                assert_eq!(stext, want["text"], "{id}: streamed text");
                assert_eq!(sfinish, want["finish_reason"], "{id}: streamed finish");
            });
        }
    });
    s.assert_no_leak();
}

#[test]
fn reference_prompts_match_generate_dense() {
    reference_prompts_match_generate(&[]);
}

#[test]
fn reference_prompts_match_generate_kv4() {
    reference_prompts_match_generate(&["--kv-bits", "4"]);
}

#[test]
fn streaming_usage_models_health_and_stop_strings() {
    let s = Server::start(&[]);
    let (code, models) = s.get("/v1/models");
    assert_eq!(code, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(s.get("/health").0, 200);

    let msgs = json!([{"role": "user", "content": "Name three colors."}]);
    let (text, finish, usage) = chat(
        &s,
        chat_body(&msgs, json!({"model": name, "max_tokens": 12})),
    );
    assert!(!text.is_empty());
    assert!(finish == "length" || finish == "stop");
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion), "{usage}");
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Streamed with usage: the same text, role first, a usage chunk without choices.
    let chunks = s.stream(
        "/v1/chat/completions",
        &chat_body(
            &msgs,
            json!({"max_tokens": 12, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], completion);
    assert_eq!(stream_text(&chunks), (text.clone(), finish.clone()));

    // A stop string cuts the text before it, with finish_reason "stop".
    if let Some(cut) = text.char_indices().nth(3).map(|(i, _)| i) {
        let stop = &text[cut..];
        let stop: String = stop.chars().take(2).collect();
        let want = &text[..text.find(&stop).unwrap()];
        let (t2, f2, _) = chat(
            &s,
            chat_body(&msgs, json!({"max_tokens": 12, "stop": [stop]})),
        );
        assert_eq!(t2, want);
        assert_eq!(f2, "stop");
    }

    // Completions from token ids, streamed and not.
    let body = json!({"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 5});
    let (code, v) = s.post("/v1/completions", &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    let mut sb = body.clone();
    merge(&mut sb, json!({"stream": true}));
    let (st, sf) = stream_text(&s.stream("/v1/completions", &sb));
    assert_eq!(st, v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(sf, v["choices"][0]["finish_reason"].as_str().unwrap());
    s.assert_no_leak();
    assert!(s.metric("kvq_generated_tokens_total") > 0.0);
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let s = Server::start(&["--max-body", "4K"]);
    let long: Vec<u32> = vec![504; 9000];
    let cases: Vec<(&str, String, u16, Value)> = vec![
        (
            "/v1/chat/completions",
            "{\"messages\": [".into(),
            400,
            Value::Null,
        ),
        (
            "/v1/chat/completions",
            "{\"messages\": 3}".into(),
            400,
            json!("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
            json!("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": "ten"}).to_string(),
            400,
            json!("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temperature": -1}).to_string(),
            400,
            json!("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "n": 3}).to_string(),
            400,
            json!("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [99999999]}).to_string(),
            400,
            json!("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(5000)}).to_string(),
            413,
            Value::Null,
        ),
    ];
    for (path, body, status, param) in cases {
        let (code, text) = s.post_raw(path, &body, &[]);
        assert_eq!(code, status, "{body:.80}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert_eq!(v["error"]["param"], param, "{body:.80}: {v}");
    }
    // Over the context window: token ids keep the body small.
    let s2 = Server::start(&[]);
    let (code, v) = s2.post("/v1/completions", &json!({"prompt": long}));
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("context window"));
    assert_eq!(s.get("/nowhere").0, 404);
    // A known route with the wrong method: 405 with Allow and an error body.
    match ureq::get(&s.url("/v1/completions")).call() {
        Err(ureq::Error::Status(405, r)) => {
            assert_eq!(r.header("Allow"), Some("POST"));
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
        }
        other => panic!("expected 405, got {:?}", other.map(|r| r.status())),
    }
    s.assert_no_leak();
    s2.assert_no_leak();
    assert!(s.metric("kvq_requests_total{outcome=\"rejected\"}") >= 1.0);
}

#[test]
fn api_key_queue_limit_and_hang_ups() {
    let s = Server::start(&[
        "--api-key",
        "sesame",
        "--max-batch",
        "1",
        "--max-queue",
        "0",
    ]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 4}).to_string();
    assert_eq!(s.post_raw("/v1/completions", &body, &[]).0, 401);
    let wrong = [("Authorization", "Bearer nope")];
    assert_eq!(s.post_raw("/v1/completions", &body, &wrong).0, 401);
    let auth = [("Authorization", "Bearer sesame")];
    let (code, text) = s.post_raw("/v1/completions", &body, &auth);
    assert_eq!(code, 200, "{text}");
    // The scheme's case does not matter.
    let lower = [("Authorization", "bearer sesame")];
    assert_eq!(s.post_raw("/v1/completions", &body, &lower).0, 200);
    // Health and metrics stay open.
    assert_eq!(s.get("/health").0, 200);

    // One slot: a long stream holds it, a second request gets 429 + Retry-After.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "stream": true});
    let r = ureq::post(&s.url("/v1/completions"))
        .set("Authorization", "Bearer sesame")
        .send_string(&long.to_string())
        .unwrap();
    let mut reader = std::io::BufReader::new(r.into_reader());
    let mut line = String::new();
    use std::io::BufRead;
    while reader.read_line(&mut line).unwrap() > 0 && !line.starts_with("data: ") {
        line.clear();
    }
    match ureq::post(&s.url("/v1/completions"))
        .set("Authorization", "Bearer sesame")
        .send_string(&body)
    {
        Err(ureq::Error::Status(429, r)) => {
            assert_eq!(r.header("Retry-After"), Some("1"));
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(v["error"]["type"], "rate_limit_error");
        }
        other => panic!("expected 429, got {:?}", other.map(|r| r.status())),
    }
    assert!(s.main_pool("kvq_kv_blocks_used") > 0.0);
    // The client hangs up mid-stream: its request ends and its blocks come back.
    drop(reader);
    s.assert_no_leak();
    assert_eq!(s.metric("kvq_requests_total{outcome=\"cancelled\"}"), 1.0);
    // And the slot is free again.
    assert_eq!(s.post_raw("/v1/completions", &body, &auth).0, 200);
    // A non-streamed request whose client goes away is cancelled too.
    let hang = json!({"prompt": "Once upon a time", "max_tokens": 400}).to_string();
    let agent = ureq::AgentBuilder::new()
        .timeout(std::time::Duration::from_secs(3))
        .build();
    assert!(agent
        .post(&s.url("/v1/completions"))
        .set("Authorization", "Bearer sesame")
        .send_string(&hang)
        .is_err());
    s.assert_no_leak();
    assert_eq!(s.metric("kvq_requests_total{outcome=\"cancelled\"}"), 2.0);
}

/// The next `data:` line of a stream (panics at its end).
fn next_data(reader: &mut impl std::io::BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended");
        if line.starts_with("data: ") {
            return line;
        }
    }
}

/// Ctrl-C (SIGINT) and SIGTERM stop the server: at once when idle; with a stream in flight the
/// server takes no new connection, the stream goes on, and a second signal ends the process.
#[cfg(unix)]
#[test]
fn signals_stop_the_server_and_a_second_one_at_once() {
    use std::time::Duration;
    let mut s = Server::start(&[]);
    s.signal("TERM");
    let st = s
        .wait_exit(Duration::from_secs(10))
        .expect("idle server stops");
    assert!(st.success(), "{st}");

    let mut s = Server::start(&[]);
    // Long enough to outlast the test (the KV budget of BASE_FLAGS holds ~2,000 tokens).
    let long = json!({"prompt": "Once upon a time", "max_tokens": 1500, "stream": true,
                      "ignore_eos": true});
    let r = ureq::post(&s.url("/v1/completions"))
        .send_string(&long.to_string())
        .unwrap();
    let mut reader = std::io::BufReader::new(r.into_reader());
    next_data(&mut reader);
    s.signal("INT");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        ureq::get(&s.url("/health")).call().is_err(),
        "a stopping server takes no new connection"
    );
    // The request in flight goes on...
    for _ in 0..3 {
        assert!(next_data(&mut reader).contains("\"text\""));
    }
    assert!(s.wait_exit(Duration::from_millis(200)).is_none());
    // ...until a second signal.
    s.signal("INT");
    let st = s
        .wait_exit(Duration::from_secs(10))
        .expect("a second Ctrl-C stops it");
    assert!(!st.success(), "{st}");
}
