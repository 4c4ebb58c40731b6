//! `--stop` strings over streamed text.
//!
//! A stop string may arrive split over several chunks, so text that could still turn into a
//! stop string is held back until it is decided. On a match everything before the stop string is
//! released and the stop string itself (and anything after it) is dropped. The earliest match in
//! the text wins when several stop strings occur.

// Stop strings come from the command line, JSONL files and HTTP bodies: no unwrap, expect or
// indexing that could panic on them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

/// Finds stop strings across chunk boundaries.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds a chunk; returns the text that is now safe to emit and whether a stop string matched.
    /// After a match, further chunks are swallowed.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let emit = self.held[..at].to_string();
            self.held.clear();
            return (emit, true);
        }
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        (emit, false)
    }

    /// Releases held-back text at the end of generation (nothing after a match).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let start = held.len().saturating_sub(longest);
        held.char_indices()
            .map(|(i, _)| i)
            .skip_while(|&i| i < start)
            .find(|&i| {
                let tail = &held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .map_or(0, |i| held.len() - i)
    }
}
