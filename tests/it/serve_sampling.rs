//! Sampling over HTTP: a seeded sampled request gives the same text every time, alone or beside
//! a twin in one batch, and the text `kvq generate --seed` gives with the same values; the
//! `ignore_eos` extension generates exactly `max_tokens`; `/metrics` reports a tokens/s rate
//! after traffic.

use crate::common::server::*;
use crate::common::*;
use serde_json::{json, Value};

const PROMPT: &str = "Once upon a time, in a small village by the sea,";

fn completion(s: &Server, body: &Value) -> (String, String, u64) {
    let (code, v) = s.post("/v1/completions", body);
    assert_eq!(code, 200, "{v}");
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn seeded_sampling_ignore_eos_and_tokens_per_second() {
    let s = Server::start(&[]);
    let sampled = |seed: u64| {
        json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "top_p": 0.9,
               "top_k": 40, "min_p": 0.02, "seed": seed})
    };
    // Twins sent together share batches; a third copy runs alone afterwards.
    let (one, two) = std::thread::scope(|scope| {
        let h = scope.spawn(|| completion(&s, &sampled(1234)));
        let two = completion(&s, &sampled(1234));
        (h.join().unwrap(), two)
    });
    assert_eq!(one, two, "the same seed gives the same text");
    assert_eq!(completion(&s, &sampled(1234)), one);
    assert_ne!(
        completion(&s, &sampled(1235)).0,
        one.0,
        "another seed, another text"
    );
    let out = kvq(&[
        "generate",
        "--raw",
        PROMPT,
        "--json",
        "--dtype",
        "f32",
        "--dequantize",
        "--max-tokens",
        "24",
        "--temp",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--min-p",
        "0.02",
        "--seed",
        "1234",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let want: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(one.0, want["text"], "kvq generate --seed 1234");
    assert_eq!(one.1, want["finish_reason"]);

    // A short answer ends at the end-of-sequence token; with ignore_eos it runs to max_tokens
    // (the end token itself is special: not in the text).
    let msgs = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let chat = |extra: Value| {
        let mut body = chat_body(&msgs, json!({"max_tokens": 40}));
        merge(&mut body, extra);
        let (code, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(code, 200, "{v}");
        v
    };
    let short = chat(json!({}));
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    let n_short = short["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n_short < 40, "{short}");
    let long = chat(json!({"ignore_eos": true}));
    assert_eq!(long["choices"][0]["finish_reason"], "length", "{long}");
    assert_eq!(long["usage"]["completion_tokens"], 40);
    let short_text = short["choices"][0]["message"]["content"].as_str().unwrap();
    let long_text = long["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(long_text.starts_with(short_text), "{long_text:?}");
    let chunks = s.stream(
        "/v1/chat/completions",
        &chat_body(
            &msgs,
            json!({"max_tokens": 40, "ignore_eos": true, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 40);
    assert_eq!(
        stream_text(&chunks),
        (long_text.to_string(), "length".into())
    );

    // Tokens/s over the last 10 s: above 0 right after this traffic, and at most the tokens
    // generated (the rate is taken over a second at least).
    let rate = s.metric("kvq_generated_tokens_per_second");
    let total = s.metric("kvq_generated_tokens_total");
    assert!(total >= 80.0, "{total}"); // the two ignore_eos answers alone
    assert!(rate > 0.0 && rate <= total, "rate {rate}, total {total}");
    s.assert_no_leak();
}
