//! The OpenAI response objects: whole answers, stream chunks and `usage`.

// Answers carry what HTTP bodies asked for: no unwrap, expect or indexing that could panic on them
// (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use serde_json::{json, Map, Value};

use super::api::Endpoint;
use crate::engine::request::FinishReason;

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache instead of a prefill.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }
}

/// OpenAI's finish_reason (a cancelled request has no reader left to see one).
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Error => "error",
    }
}

/// Identity of one response: its id, creation time and the model name.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    /// The whole (non-streamed) response.
    pub fn complete(&self, text: &str, finish: FinishReason, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": Value::Null,
                "finish_reason": finish_reason(finish),
            }),
            Endpoint::Completions => json!({
                "index": 0,
                "text": text,
                "logprobs": Value::Null,
                "finish_reason": finish_reason(finish),
            }),
        };
        json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat => "chat.completion",
                Endpoint::Completions => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.json(),
        })
    }

    /// One stream chunk: `text` (the first chat chunk also carries the role) and, in the last
    /// one, the finish reason.
    pub fn chunk(&self, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(finish_reason);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({ "index": 0, "delta": delta, "logprobs": Value::Null, "finish_reason": finish })
            }
            Endpoint::Completions => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": Value::Null,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The usage chunk of `stream_options.include_usage`: no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.json(),
        })
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_have_openai_shapes() {
        let meta = ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 5,
            model: "m".into(),
            endpoint: Endpoint::Chat,
        };
        let usage = Usage {
            prompt_tokens: 4,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        let v = meta.complete("hi", FinishReason::Stop, usage);
        assert_eq!(v["choices"][0]["message"]["content"], "hi");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 6);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        let c = meta.chunk(Some("a"), true, None);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        let last = meta.chunk(None, false, Some(FinishReason::Length));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
    }
}
