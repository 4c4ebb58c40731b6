//! OpenAI request bodies, checked field by field (so a bad request gets a 400 naming the field,
//! not a serde message), and the error body; the answers are in [`super::response`].
//!
//! Only what kvq can honour is accepted: `n` must be 1; unknown fields are ignored, as OpenAI's
//! own clients send several (`user`, `logprobs: false`, ...). One kvq extension: `ignore_eos`
//! (as vLLM names it) keeps generating past the end-of-sequence token, so a benchmark gets
//! exactly `max_tokens` tokens per request.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use serde_json::{json, Map, Value};

use crate::engine::sampler::SamplingParams;
use crate::model::chat::Message;

/// A refused request: HTTP status, the offending field (OpenAI's `param`) and a message.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub param: Option<String>,
    pub message: String,
    /// OpenAI's `error.type`.
    pub kind: &'static str,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            param: Some(param.to_string()),
            message: message.into(),
            kind: "invalid_request_error",
        }
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            param: None,
            message: message.into(),
            kind,
        }
    }

    /// The body OpenAI sends with an error.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": Value::Null,
            }
        })
    }
}

/// What the prompt is: a conversation (rendered with the chat template) or plain text / ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

impl Prompt {
    /// The request field the prompt came from (for errors about it).
    pub fn field(&self) -> &'static str {
        match self {
            Prompt::Chat(_) => "messages",
            Prompt::Text(_) | Prompt::Tokens(_) => "prompt",
        }
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Server-wide defaults a request may override (from the sampling flags).
#[derive(Debug, Clone)]
pub struct Defaults {
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
}

/// A checked request.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carrying `usage`.
    pub stream_usage: bool,
    /// kvq extension: the end-of-sequence token does not end the request (stop strings and
    /// `max_tokens` still do).
    pub ignore_eos: bool,
}

/// Parses and checks a request body for `endpoint`, served under the name `model`.
pub fn parse_request(
    body: &[u8],
    endpoint: Endpoint,
    model: &str,
    defaults: &Defaults,
) -> Result<CompletionRequest, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError {
        status: 400,
        param: None,
        message: format!("the body is not valid JSON: {e}"),
        kind: "invalid_request_error",
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(
            400,
            "invalid_request_error",
            "the body must be a JSON object",
        ));
    };
    if let Some(m) = o.get("model") {
        let name = m
            .as_str()
            .ok_or_else(|| ApiError::invalid("model", "\"model\" must be a string"))?;
        if name != model {
            return Err(ApiError::invalid(
                "model",
                format!("the model '{name}' does not exist: this server serves '{model}'"),
            ));
        }
    }
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat(parse_messages(o.get("messages"))?),
        Endpoint::Completions => parse_prompt(o.get("prompt"))?,
    };
    let mut params = defaults.params.clone();
    if let Some(t) = number(&o, "temperature", 0.0, 2.0)? {
        params.temperature = t;
    }
    if let Some(p) = number(&o, "top_p", 0.0, 1.0)? {
        if p == 0.0 {
            return Err(ApiError::invalid("top_p", "\"top_p\" must be above 0"));
        }
        params.top_p = (p < 1.0).then_some(p);
    }
    if let Some(p) = number(&o, "min_p", 0.0, 1.0)? {
        params.min_p = (p > 0.0).then_some(p);
    }
    if let Some(k) = integer(&o, "top_k")? {
        params.top_k = (k > 0).then_some(k as usize);
    }
    if let Some(s) = integer(&o, "seed")? {
        params.seed = s;
    }
    let max_tokens = match (
        integer(&o, "max_completion_tokens")?,
        integer(&o, "max_tokens")?,
    ) {
        (Some(n), _) => (n, "max_completion_tokens"),
        (None, Some(n)) => (n, "max_tokens"),
        (None, None) => (defaults.max_tokens as u64, "max_tokens"),
    };
    if max_tokens.0 == 0 {
        return Err(ApiError::invalid(
            max_tokens.1,
            format!("\"{}\" must be at least 1", max_tokens.1),
        ));
    }
    if let Some(n) = integer(&o, "n")? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("\"n\" must be 1 (one choice per request), not {n}"),
            ));
        }
    }
    let stop = match o.get("stop") {
        None | Some(Value::Null) => defaults.stop.clone(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::invalid("stop", "\"stop\" must be a string or an array of strings")
            })?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "\"stop\" must be a string or an array of strings",
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let stream = boolean(&o, "stream")?.unwrap_or(false);
    let ignore_eos = boolean(&o, "ignore_eos")?.unwrap_or(false);
    let stream_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options.include_usage",
                    "\"stream_options.include_usage\" must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "\"stream_options\" must be an object",
            ))
        }
    };
    params
        .validate()
        .map_err(|e| ApiError::new(400, "invalid_request_error", e.to_string()))?;
    Ok(CompletionRequest {
        prompt,
        params,
        max_tokens: max_tokens.0 as usize,
        stop,
        stream,
        stream_usage,
        ignore_eos,
    })
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| ApiError::invalid("messages", m);
    let Some(Value::Array(items)) = v else {
        return Err(bad(
            "\"messages\" must be a non-empty array of {\"role\", \"content\"} objects".into(),
        ));
    };
    if items.is_empty() {
        return Err(bad("\"messages\" must not be empty".into()));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("messages[{i}].role must be a string")))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            // Content parts: only text parts can be served by a text model.
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content: only {{\"type\": \"text\", \"text\": ...}} \
                                 parts are supported"
                            )))
                        }
                    }
                }
                text
            }
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or an array of text parts"
                )))
            }
        };
        out.push(Message::new(role, content));
    }
    Ok(out)
}

fn parse_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "\"prompt\" must be a non-empty string, an array of one string, or an array of \
             token ids",
        )
    };
    let p = match v {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a.first().is_some_and(Value::is_string) => {
            Prompt::Text(
                a.first()
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            )
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Tokens(
            a.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(bad)?,
        ),
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(Value::is_string) => {
            return Err(ApiError::invalid(
                "prompt",
                "one prompt per request: send each prompt of the array as its own request",
            ))
        }
        _ => return Err(bad()),
    };
    if matches!(&p, Prompt::Text(s) if s.is_empty()) {
        return Err(ApiError::invalid("prompt", "\"prompt\" is empty"));
    }
    Ok(p)
}

/// An optional number field in `[lo, hi]`.
fn number(o: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !(lo..=hi).contains(&x) {
                return Err(ApiError::invalid(
                    key,
                    format!("\"{key}\" must be between {lo} and {hi}, not {x}"),
                ));
            }
            Ok(Some(x))
        }
        Some(_) => Err(ApiError::invalid(
            key,
            format!("\"{key}\" must be a number"),
        )),
    }
}

/// An optional non-negative integer field.
fn integer(o: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid(key, format!("\"{key}\" must be a non-negative integer"))
        }),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("\"{key}\" must be a non-negative integer"),
        )),
    }
}

fn boolean(o: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("\"{key}\" must be a boolean"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Defaults {
        Defaults {
            params: SamplingParams::default(),
            max_tokens: 16,
            stop: vec![],
        }
    }

    fn parse(body: &str, ep: Endpoint) -> Result<CompletionRequest, ApiError> {
        parse_request(body.as_bytes(), ep, "m", &defaults())
    }

    #[test]
    fn chat_request_fields_override_the_defaults() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,
               "top_k":5,"top_p":1,"min_p":0,"seed":7,"max_tokens":3,"stop":"x","stream":true,
               "stream_options":{"include_usage":true},"user":"ignored"}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![Message::new("user", "hi")]));
        assert_eq!(r.params.temperature, 0.0);
        assert_eq!(r.params.top_k, Some(5));
        assert_eq!(r.params.top_p, None);
        assert_eq!(r.params.min_p, None);
        assert_eq!(r.params.seed, 7);
        assert_eq!(r.max_tokens, 3);
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.stream_usage);
        assert!(!r.ignore_eos);
        let d = parse(r#"{"prompt":"abc"}"#, Endpoint::Completions).unwrap();
        assert_eq!(d.prompt, Prompt::Text("abc".into()));
        assert_eq!(d.max_tokens, 16);
        assert!(!d.stream);
        let t = parse(r#"{"prompt":[1,2,3]}"#, Endpoint::Completions).unwrap();
        assert_eq!(t.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let e = parse(r#"{"prompt":"a","ignore_eos":true}"#, Endpoint::Completions).unwrap();
        assert!(e.ignore_eos);
    }

    #[test]
    fn bad_requests_name_their_field() {
        let cases = [
            ("{", Endpoint::Chat, None),
            ("[1]", Endpoint::Chat, None),
            (r#"{"messages":"hi"}"#, Endpoint::Chat, Some("messages")),
            (r#"{"messages":[]}"#, Endpoint::Chat, Some("messages")),
            (
                r#"{"messages":[{"role":1}]}"#,
                Endpoint::Chat,
                Some("messages"),
            ),
            (r#"{"prompt":5}"#, Endpoint::Completions, Some("prompt")),
            (r#"{"prompt":""}"#, Endpoint::Completions, Some("prompt")),
            (
                r#"{"prompt":"a","model":"other"}"#,
                Endpoint::Completions,
                Some("model"),
            ),
            (
                r#"{"prompt":"a","temperature":"hot"}"#,
                Endpoint::Completions,
                Some("temperature"),
            ),
            (
                r#"{"prompt":"a","temperature":3}"#,
                Endpoint::Completions,
                Some("temperature"),
            ),
            (
                r#"{"prompt":"a","max_tokens":-1}"#,
                Endpoint::Completions,
                Some("max_tokens"),
            ),
            (
                r#"{"prompt":"a","max_tokens":0}"#,
                Endpoint::Completions,
                Some("max_tokens"),
            ),
            (r#"{"prompt":"a","n":2}"#, Endpoint::Completions, Some("n")),
            (
                r#"{"prompt":"a","stop":[1]}"#,
                Endpoint::Completions,
                Some("stop"),
            ),
            (
                r#"{"prompt":"a","stream":"yes"}"#,
                Endpoint::Completions,
                Some("stream"),
            ),
            (
                r#"{"prompt":"a","top_p":0}"#,
                Endpoint::Completions,
                Some("top_p"),
            ),
            (
                r#"{"prompt":"a","ignore_eos":1}"#,
                Endpoint::Completions,
                Some("ignore_eos"),
            ),
        ];
        for (body, ep, param) in cases {
            let e = parse(body, ep).expect_err(body);
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
            assert_eq!(e.body()["error"]["param"], json!(param), "{body}");
        }
    }
}
