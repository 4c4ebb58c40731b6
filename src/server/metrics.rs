//! What `/metrics` reports: a snapshot the engine thread refreshes after every step (it alone
//! sees the engine), read by the HTTP side and written out in Prometheus' text format.

use std::fmt::Write;
use std::sync::Mutex;

/// Blocks of one KV pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolBlocks {
    /// `main` or `staging` (the dense pool of --quantized-kv-start); the pools of layers that
    /// attend through a window of W tokens add `-window-W` (e.g. `main-window-512`).
    pub pool: String,
    /// How the pool stores K/V (e.g. `dense-f32`, `affine-k4-v4`).
    pub format: String,
    pub free: usize,
    pub total: usize,
    /// Blocks held only by the prefix cache (free for the taking, evicted least recently used).
    pub cached: usize,
}

/// The server's counters and gauges.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub requests_finished: u64,
    pub requests_cancelled: u64,
    pub requests_rejected: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Generated tokens per second over the last few seconds.
    pub tokens_per_second: f64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_tokens: u64,
    pub pools: Vec<PoolBlocks>,
}

/// Shared between the engine thread (writer) and the handlers (readers).
#[derive(Debug, Default)]
pub struct Metrics {
    snap: Mutex<Snapshot>,
}

impl Metrics {
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        let mut s = self.snap.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
    }

    pub fn snapshot(&self) -> Snapshot {
        self.snap.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Snapshot {
    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {kind}");
            for (labels, value) in rows {
                let _ = writeln!(o, "{name}{labels} {value}");
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        metric(
            "kvq_requests_running",
            "gauge",
            "Requests prefilling or decoding.",
            one(self.running.to_string()),
        );
        metric(
            "kvq_requests_waiting",
            "gauge",
            "Requests queued for room in the batch or the KV cache.",
            one(self.waiting.to_string()),
        );
        metric(
            "kvq_requests_total",
            "counter",
            "Requests ended, by outcome.",
            vec![
                (
                    "{outcome=\"finished\"}".into(),
                    self.requests_finished.to_string(),
                ),
                (
                    "{outcome=\"cancelled\"}".into(),
                    self.requests_cancelled.to_string(),
                ),
                (
                    "{outcome=\"rejected\"}".into(),
                    self.requests_rejected.to_string(),
                ),
            ],
        );
        metric(
            "kvq_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            one(self.prompt_tokens.to_string()),
        );
        metric(
            "kvq_generated_tokens_total",
            "counter",
            "Tokens generated.",
            one(self.generated_tokens.to_string()),
        );
        metric(
            "kvq_generated_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 seconds.",
            one(format!("{:.3}", self.tokens_per_second)),
        );
        metric(
            "kvq_prefix_cache_hits_total",
            "counter",
            "Requests whose prompt started with blocks found in the prefix cache.",
            one(self.prefix_cache_hits.to_string()),
        );
        metric(
            "kvq_prefix_cache_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache instead of prefilled.",
            one(self.prefix_cache_tokens.to_string()),
        );
        let labels = |p: &PoolBlocks| format!("{{pool=\"{}\",format=\"{}\"}}", p.pool, p.format);
        for (name, help, get) in [
            (
                "kvq_kv_blocks_free",
                "KV blocks free for the taking (prefix-cached blocks included).",
                (|p: &PoolBlocks| p.free) as fn(&PoolBlocks) -> usize,
            ),
            (
                "kvq_kv_blocks_used",
                "KV blocks held by requests.",
                |p: &PoolBlocks| p.total - p.free,
            ),
            (
                "kvq_kv_blocks_total",
                "KV blocks of the pool.",
                |p: &PoolBlocks| p.total,
            ),
            (
                "kvq_kv_blocks_prefix_cached",
                "Free KV blocks still holding a cached prompt prefix.",
                |p: &PoolBlocks| p.cached,
            ),
        ] {
            metric(
                name,
                "gauge",
                help,
                self.pools
                    .iter()
                    .map(|p| (labels(p), get(p).to_string()))
                    .collect(),
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_has_every_series() {
        let s = Snapshot {
            running: 2,
            waiting: 1,
            generated_tokens: 10,
            pools: vec![PoolBlocks {
                pool: "main".into(),
                format: "dense-f32".into(),
                free: 3,
                total: 8,
                cached: 1,
            }],
            ..Default::default()
        };
        let t = s.prometheus();
        assert!(t.contains("kvq_requests_running 2\n"), "{t}");
        assert!(t.contains("kvq_requests_waiting 1\n"));
        assert!(t.contains("kvq_generated_tokens_total 10\n"));
        assert!(t.contains("kvq_kv_blocks_free{pool=\"main\",format=\"dense-f32\"} 3\n"));
        assert!(t.contains("kvq_kv_blocks_used{pool=\"main\",format=\"dense-f32\"} 5\n"));
        assert!(t.contains("# TYPE kvq_requests_total counter\n"));
    }
}
