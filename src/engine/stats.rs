//! Run statistics: token counts and times by phase, KV bytes, peak memory.
//!
//! A step that carries any prompt tokens is counted as prefill time, a step of decode tokens
//! only as decode time; with one request (`generate`) the two never mix. Rates are tokens over
//! the time of the steps of that phase.

use std::time::Duration;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    /// Prompt tokens run through the model (those taken from prompt caches are not).
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from prompt caches.
    pub cached_tokens: usize,
    pub prefill_seconds: f64,
    /// Tokens sampled (the first one comes from the prompt's last position).
    pub generated_tokens: usize,
    /// Tokens fed back in steps without prompt tokens, and the time of those steps.
    pub decode_tokens: usize,
    pub decode_seconds: f64,
    pub steps: usize,
    pub peak_kv_bytes: usize,
    /// Requests that started on blocks of the automatic prefix cache, and the prompt tokens
    /// those blocks held (not prefilled).
    pub prefix_hits: usize,
    pub prefix_tokens: usize,
    /// Kernels one replayed decode step launches (inside one CUDA graph), for the largest batch
    /// captured so far; absent where no step was replayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_kernels: Option<usize>,
}

impl Stats {
    pub fn record_step(&mut self, prefill_tokens: usize, decode_tokens: usize, took: Duration) {
        self.steps += 1;
        self.prompt_tokens += prefill_tokens;
        if prefill_tokens > 0 {
            self.prefill_seconds += took.as_secs_f64();
        } else {
            self.decode_tokens += decode_tokens;
            self.decode_seconds += took.as_secs_f64();
        }
    }

    pub fn observe_kv(&mut self, bytes: usize) {
        self.peak_kv_bytes = self.peak_kv_bytes.max(bytes);
    }

    pub fn prompt_tps(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_seconds)
    }

    /// Decode tokens per second over pure decode steps.
    pub fn decode_tps(&self) -> f64 {
        rate(self.decode_tokens, self.decode_seconds)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Peak resident memory of this process (Linux VmHWM), if the platform tells.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Human-readable bytes (binary units).
pub fn fmt_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
