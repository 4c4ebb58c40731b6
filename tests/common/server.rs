//! A real `kvq serve` on a free local port, and a small HTTP client for the serve tests.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Flags every serve test starts with: greedy, f32 activations and dense weights (as the
/// reference and generate tests run), a small KV budget, short answers by default.
pub const BASE_FLAGS: &[&str] = &[
    "--temp",
    "0",
    "--dtype",
    "f32",
    "--dequantize",
    "--kv-memory",
    "96M",
    "--max-tokens",
    "16",
];

pub struct Server {
    child: Child,
    pub base: String,
}

impl Server {
    /// Starts `kvq serve --port 0` with BASE_FLAGS and `extra` (a flag of both is taken from
    /// `extra`), and waits for its address.
    pub fn start(extra: &[&str]) -> Server {
        let mut base = Vec::new();
        let mut skip = false;
        for f in BASE_FLAGS {
            if f.starts_with("--") {
                skip = extra.contains(f);
            }
            if !skip {
                base.push(*f);
            }
        }
        let mut child = Command::new(super::kvq_bin())
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(&base)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvq serve starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Keeps draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[serve] {line}");
                if let Some(addr) = line.strip_prefix("kvq serve: listening on ") {
                    if let Some(t) = tx.take() {
                        let _ = t.send(addr.to_string());
                    }
                }
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(b) => b,
            Err(_) => {
                let _ = child.kill();
                panic!("kvq serve did not start listening");
            }
        };
        Server { child, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs a body as is; returns the status and the body.
    pub fn post_raw(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let mut req = ureq::post(&self.url(path)).set("Content-Type", "application/json");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        match req.send_string(body) {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("POST {path}: {e}"),
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (code, text) = self.post_raw(path, &body.to_string(), &[]);
        let v = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("POST {path}: {code} body is not JSON ({e}): {text}"));
        (code, v)
    }

    /// A streamed request read to its end: the chunks (every `data:` line but `[DONE]`, which
    /// must come last).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = ureq::post(&self.url(path))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .unwrap_or_else(|e| panic!("POST {path} (stream): {e}"));
        read_stream(r)
    }

    /// Starts a stream, reads its first `data:` line, and hangs up (a client going away).
    pub fn stream_and_hang_up(&self, path: &str, body: &Value) {
        let r = ureq::post(&self.url(path))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .unwrap_or_else(|e| panic!("POST {path} (stream): {e}"));
        hang_up(r);
    }

    /// POSTs `body`; a 429 is retried after its Retry-After (which must be a whole number of
    /// seconds, with a `rate_limit_error` body) until `give_up` has passed. Returns the response
    /// or the last error status and body, and how many 429s came.
    pub fn post_retrying(
        &self,
        path: &str,
        body: &str,
        give_up: Duration,
    ) -> (Result<ureq::Response, (u16, String)>, usize) {
        let t0 = Instant::now();
        let mut refused = 0;
        loop {
            let r = ureq::post(&self.url(path))
                .set("Content-Type", "application/json")
                .send_string(body);
            match r {
                Err(ureq::Error::Status(429, r)) if t0.elapsed() < give_up => {
                    let wait: u64 = r
                        .header("Retry-After")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or_else(|| panic!("429 without Retry-After seconds"));
                    let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
                    refused += 1;
                    std::thread::sleep(Duration::from_secs(wait));
                }
                Ok(r) => return (Ok(r), refused),
                Err(ureq::Error::Status(code, r)) => {
                    return (Err((code, r.into_string().unwrap())), refused)
                }
                Err(e) => panic!("POST {path}: {e}"),
            }
        }
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        match ureq::get(&self.url(path)).call() {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }

    /// The value of one `/metrics` series (name with its labels, as printed).
    pub fn metric(&self, series: &str) -> f64 {
        let (code, text) = self.get("/metrics");
        assert_eq!(code, 200);
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no series {series} in /metrics:\n{text}"))
            .parse()
            .unwrap()
    }

    /// The main pool's series `name` (whatever its format label).
    pub fn main_pool(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{pool=\"main\"")))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("no main-pool {name} in /metrics:\n{text}"))
            .parse()
            .unwrap()
    }

    /// Waits until nothing runs or waits, then checks that every main-pool block is free again
    /// (prefix-cached blocks count as free: any request may take them).
    pub fn assert_no_leak(&self) {
        let t0 = Instant::now();
        loop {
            let idle = self.metric("kvq_requests_running") == 0.0
                && self.metric("kvq_requests_waiting") == 0.0;
            let free = self.main_pool("kvq_kv_blocks_free");
            let total = self.main_pool("kvq_kv_blocks_total");
            if idle && free == total {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "blocks leaked: {free} of {total} free (idle: {idle})"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Server {
    /// Sends the server process a signal (`INT`, `TERM`) with kill(1).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill -{name} failed");
    }

    /// The server's exit status once it has ended, or None if it still runs after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if t0.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat body for the messages of a reference case (or a user message).
pub fn chat_body(messages: &Value, extra: Value) -> Value {
    let mut b = serde_json::json!({ "messages": messages });
    merge(&mut b, extra);
    b
}

pub fn merge(into: &mut Value, extra: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, extra) {
        a.extend(b);
    }
}

/// The text of a streamed answer (chat deltas or completion texts) and its finish reason.
pub fn stream_text(chunks: &[Value]) -> (String, String) {
    let mut text = String::new();
    let mut finish = String::new();
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            if let Some(t) = ch["delta"]["content"].as_str().or(ch["text"].as_str()) {
                text.push_str(t);
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, finish)
}

/// The chunks of a streamed response read to its end (every `data:` line but `[DONE]`, which
/// must come last).
pub fn read_stream(r: ureq::Response) -> Vec<Value> {
    assert_eq!(r.status(), 200);
    assert!(
        r.content_type().starts_with("text/event-stream"),
        "{}",
        r.content_type()
    );
    let mut chunks = Vec::new();
    let mut done = false;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        assert!(!done, "data after [DONE]: {data}");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("chunk is JSON"));
        }
    }
    assert!(done, "the stream did not end with [DONE]");
    chunks
}

/// Reads a streamed response up to its first `data:` line and closes the connection.
pub fn hang_up(r: ureq::Response) {
    let mut reader = BufReader::new(r.into_reader());
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 0 && !line.starts_with("data: ") {
        line.clear();
    }
    drop(reader); // closes the connection mid-stream
}

/// Reads all of `r` (for bodies of error responses).
pub fn read_all(mut r: impl Read) -> String {
    let mut s = String::new();
    r.read_to_string(&mut s).unwrap();
    s
}
