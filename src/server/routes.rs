//! The HTTP side: OpenAI routes, health and metrics, the bearer-token check, the queue limit.
//!
//! Handlers never touch the model: they check the body, hand a [`Job`] to the engine thread and
//! relay its [`Update`]s, as one JSON response or as server-sent events. Dropping a handler (the
//! client went away) drops the job's receiver, which the engine thread takes as a cancel.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::convert::Infallible;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{parse_request, ApiError, Defaults, Endpoint};
use super::metrics::Metrics;
use super::response::{ResponseMeta, Usage};
use super::worker::{Job, Outstanding, Update};

/// What every handler shares.
pub struct AppState {
    pub model: String,
    pub defaults: Defaults,
    pub api_key: Option<String>,
    /// Jobs accepted at once (running + waiting) before new ones get 429.
    pub max_outstanding: usize,
    pub jobs: Mutex<Sender<Job>>,
    pub metrics: Arc<Metrics>,
    pub outstanding: Arc<Outstanding>,
    pub next_id: std::sync::atomic::AtomicU64,
    /// False once the engine thread has ended (a panic): nothing can be served.
    pub engine_alive: Arc<std::sync::atomic::AtomicBool>,
}

pub fn router(state: Arc<AppState>, max_body: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = (status, Json(self.body())).into_response();
        if self.status == 429 {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == 401 {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        // The scheme is case-insensitive (RFC 9110): "bearer KEY" is as good as "Bearer KEY".
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        if given != Some(key.as_str()) {
            return ApiError::new(
                401,
                "authentication_error",
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
            )
            .into_response();
        }
    }
    next.run(req).await
}

async fn not_found() -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        "no such route: kvq serves POST /v1/chat/completions, POST /v1/completions, \
         GET /v1/models, GET /health, GET /metrics",
    )
}

/// A known route with the wrong method: an OpenAI error body too (axum adds `Allow`).
async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        format!(
            "{} {} is not served: see the Allow header",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.engine_alive.load(std::sync::atomic::Ordering::SeqCst) {
        Json(json!({ "status": "ok" })).into_response()
    } else {
        engine_stopped().into_response()
    }
}

/// What every request gets once the engine thread is gone.
fn engine_stopped() -> ApiError {
    ApiError::new(
        503,
        "server_error",
        "the engine thread has stopped (see the server's log); restart the server",
    )
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.snapshot().prometheus(),
    )
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": st.model, "object": "model", "created": 0, "owned_by": "kvq" }],
    }))
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(st, body, Endpoint::Chat).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(st, body, Endpoint::Completions).await
}

async fn complete(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    match try_complete(st, body, endpoint).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn try_complete(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| {
        let status = e.status().as_u16();
        let msg = if status == 413 {
            "the request body is larger than this server's --max-body".to_string()
        } else {
            e.body_text()
        };
        ApiError::new(status, "invalid_request_error", msg)
    })?;
    let req = parse_request(&body, endpoint, &st.model, &st.defaults)?;
    if !st.outstanding.try_acquire(st.max_outstanding) {
        return Err(ApiError::new(
            429,
            "rate_limit_error",
            "the server's queue is full (--max-queue); retry later",
        ));
    }
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        prompt: req.prompt,
        params: req.params,
        max_tokens: req.max_tokens,
        stop: req.stop,
        ignore_eos: req.ignore_eos,
        updates: tx,
    };
    let sent = st
        .jobs
        .lock()
        .map_err(|_| internal("the job queue is poisoned"))?
        .send(job);
    if sent.is_err() {
        st.outstanding.release();
        return Err(engine_stopped());
    }
    // The first update says whether the engine took it.
    match rx.recv().await {
        Some(Update::Started { .. }) => {}
        Some(Update::Rejected(e)) => return Err(e),
        Some(Update::Failed(m)) => return Err(internal(&m)),
        _ => return Err(internal("the engine dropped the request")),
    }
    let n = st
        .next_id
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{n}"),
            Endpoint::Completions => format!("cmpl-{n}"),
        },
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: st.model.clone(),
        endpoint,
    };
    if req.stream {
        return Ok(Sse::new(sse_stream(meta, rx, req.stream_usage)).into_response());
    }
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Update::Text(t)) => text.push_str(&t),
            Some(Update::Done { finish, usage }) => {
                return Ok(Json(meta.complete(&text, finish, usage)).into_response())
            }
            Some(Update::Failed(m)) => return Err(internal(&m)),
            _ => return Err(internal("the engine dropped the request")),
        }
    }
}

fn internal(msg: &str) -> ApiError {
    ApiError::new(500, "server_error", msg)
}

/// The stream of one request: a chunk per piece of text, a last chunk with the finish reason,
/// the usage chunk if asked for, then `[DONE]`. A failure mid-stream ends it with an error
/// object (the status line is already sent).
fn sse_stream(
    meta: ResponseMeta,
    rx: UnboundedReceiver<Update>,
    with_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct St {
        meta: ResponseMeta,
        rx: UnboundedReceiver<Update>,
        first: bool,
        /// Events left to send after the end (usage chunk, `[DONE]`).
        tail: Vec<SseEvent>,
        with_usage: bool,
        done: bool,
    }
    let st = St {
        meta,
        rx,
        first: true,
        tail: Vec::new(),
        with_usage,
        done: false,
    };
    stream::unfold(st, |mut st| async move {
        if let Some(ev) = st.tail.pop() {
            return Some((Ok(ev), st));
        }
        if st.done {
            return None;
        }
        let json_event = |v: Value| SseEvent::default().data(v.to_string());
        let (ev, end): (SseEvent, Option<Option<Usage>>) = match st.rx.recv().await {
            Some(Update::Text(t)) => (json_event(st.meta.chunk(Some(&t), st.first, None)), None),
            Some(Update::Done { finish, usage }) => (
                json_event(st.meta.chunk(None, st.first, Some(finish))),
                Some(Some(usage)),
            ),
            Some(Update::Failed(m)) => (json_event(internal(&m).body()), Some(None)),
            Some(Update::Started { .. }) | Some(Update::Rejected(_)) | None => (
                json_event(internal("the engine dropped the request").body()),
                Some(None),
            ),
        };
        st.first = false;
        if let Some(usage) = end {
            st.done = true;
            // Popped from the end: [DONE] goes last.
            st.tail.push(SseEvent::default().data("[DONE]"));
            if let (Some(u), true) = (usage, st.with_usage) {
                st.tail.push(json_event(st.meta.usage_chunk(u)));
            }
        }
        Some((Ok(ev), st))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn state() -> Arc<AppState> {
        Arc::new(AppState {
            model: "m".into(),
            defaults: Defaults {
                params: Default::default(),
                max_tokens: 4,
                stop: Vec::new(),
            },
            api_key: None,
            max_outstanding: 1,
            jobs: Mutex::new(std::sync::mpsc::channel().0),
            metrics: Default::default(),
            outstanding: Default::default(),
            next_id: Default::default(),
            engine_alive: Arc::new(AtomicBool::new(true)),
        })
    }

    #[test]
    fn health_and_requests_say_503_once_the_engine_thread_is_gone() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let st = state();
        let r = rt.block_on(health(State(st.clone())));
        assert_eq!(r.status(), StatusCode::OK);
        // The channel's receiver is gone, as when the engine thread ends.
        st.engine_alive.store(false, Ordering::SeqCst);
        let r = rt.block_on(health(State(st.clone())));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = Bytes::from_static(br#"{"prompt": "hi"}"#);
        let r = rt.block_on(completions(State(st.clone()), Ok(body)));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        // Its place in the queue was given back.
        assert!(st.outstanding.try_acquire(1));
    }
}
