//! `kvq serve`: the engine behind an OpenAI-compatible HTTP API (generate, batch-generate and
//! serve are three front ends of one engine: docs/ARCHITECTURE.md).
//!
//! Two sides joined by channels: the engine thread ([`worker`]) owns the model and the KV
//! cache and runs steps; a tokio runtime serves HTTP ([`routes`]) and turns requests into jobs.
//! Requests join the running batch between steps and leave it the moment they finish or their
//! client goes away.

pub mod api;
pub mod metrics;
pub mod response;
pub mod routes;
pub mod worker;

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use crate::engine::scheduler::{Engine, EngineConfig};
use crate::kv::cache::PagedKvCache;
use crate::model::load::LoadedModel;
use api::Defaults;
use metrics::Metrics;
use routes::AppState;
use worker::Outstanding;

/// How to serve (everything but the model, which the loader passed to [`serve`] makes).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// Requests that may wait for a place in the batch before new ones get 429.
    pub max_queue: usize,
    /// Largest request body in bytes (413 above).
    pub max_body: usize,
    pub api_key: Option<String>,
    pub engine: EngineConfig,
    /// The name `/v1/models` lists and requests must use (or leave out).
    pub model_name: String,
    pub defaults: Defaults,
    /// Keep prompts' full KV blocks for reuse by later requests (automatic prefix caching).
    pub prefix_cache: bool,
}

/// Loads the model and its cache on the engine thread (they stay there).
pub type Loader = Box<dyn FnOnce() -> Result<(LoadedModel, PagedKvCache)> + Send>;

/// Starts the engine thread, then serves HTTP until Ctrl-C. The line
/// `kvq serve: listening on http://ADDR` on stderr says when requests can come.
pub fn serve(opts: ServeOptions, load: Loader) -> Result<()> {
    if opts.engine.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if opts.max_body == 0 {
        bail!("--max-body must be at least 1 byte");
    }
    let metrics = Arc::new(Metrics::default());
    let outstanding = Arc::new(Outstanding::default());
    let (jobs_tx, jobs_rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
    let engine_cfg = opts.engine.clone();
    let prefix_cache = opts.prefix_cache;
    let (m2, o2) = (metrics.clone(), outstanding.clone());
    let engine_alive = Arc::new(AtomicBool::new(true));
    let alive = Alive(engine_alive.clone());
    let engine_thread = std::thread::Builder::new()
        .name("kvq-engine".into())
        .spawn(move || {
            let _alive = alive;
            let loaded = match load() {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let (m, mut cache) = loaded;
            if prefix_cache {
                match cache.enable_prefix_cache() {
                    Ok(()) => eprintln!("kvq serve: automatic prefix reuse on"),
                    Err(e) => eprintln!("kvq serve: automatic prefix reuse off: {e}"),
                }
            }
            let engine = match Engine::new(&m.model, cache, engine_cfg) {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            worker::run(&m, engine, jobs_rx, &m2, &o2, move || {
                let _ = ready_tx.send(Ok(()));
            });
        })
        .context("cannot start the engine thread")?;
    ready_rx
        .recv()
        .context("the engine thread stopped while loading the model")??;

    let state = Arc::new(AppState {
        model: opts.model_name.clone(),
        defaults: opts.defaults.clone(),
        api_key: opts.api_key.clone(),
        max_outstanding: opts.engine.max_batch + opts.max_queue,
        jobs: Mutex::new(jobs_tx),
        metrics,
        outstanding,
        next_id: Default::default(),
        engine_alive,
    });
    let app = routes::router(state, opts.max_body);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the HTTP runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (--host/--port)"))?;
        let local: SocketAddr = listener.local_addr()?;
        let signals = StopSignals::new().context("cannot catch Ctrl-C / SIGTERM")?;
        eprintln!("kvq serve: listening on http://{local}");
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal(signals))
            .await
            .context("the HTTP server failed")
    })?;
    // The state (and with it the job sender) is gone: the engine thread ends.
    drop(rt);
    let _ = engine_thread.join();
    Ok(())
}

/// Clears its flag when the engine thread ends, by returning or by a panic (`/health` then
/// answers 503, so a supervisor can restart the server).
struct Alive(Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Ctrl-C (SIGINT) and SIGTERM, caught from the moment this is made: it is made before the
/// server says it listens, so a signal sent right after that line stops the server gracefully
/// instead of taking the default action (an immediate kill).
struct StopSignals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Registers the handlers (inside the runtime).
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                int: signal(SignalKind::interrupt())?,
                term: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next Ctrl-C or SIGTERM.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Resolves on the first Ctrl-C (or SIGTERM, what service managers send): the server then
/// takes no new connections and lets the requests in flight finish. A second signal ends the
/// process at once — a long stream must not keep a server that was asked to stop alive.
async fn shutdown_signal(mut signals: StopSignals) {
    signals.next().await;
    eprintln!(
        "kvq serve: stopping: no new requests, those in flight finish (Ctrl-C again to stop now)"
    );
    tokio::spawn(async move {
        signals.next().await;
        eprintln!("kvq serve: stopped with requests in flight");
        std::process::exit(130);
    });
}
