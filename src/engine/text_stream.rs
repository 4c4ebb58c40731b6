//! The text of one request as its tokens arrive: incremental detokenization followed by stop
//! strings, so what a caller sees never contains a stop string or a broken UTF-8 character.

// Stop strings come from the command line, JSONL files and HTTP bodies: no unwrap, expect or
// indexing that could panic on them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::Result;

use super::detok::Detokenizer;
use super::stop::StopMatcher;
use crate::model::tokenizer::TextTokenizer;

/// Detokenizer + stop matcher for one sequence; special tokens (EOS) are left out of the text.
pub struct TextStream<'a> {
    detok: Detokenizer<'a>,
    stops: StopMatcher,
    text: String,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a TextTokenizer, stop: Vec<String>) -> Self {
        Self {
            detok: Detokenizer::new(tok, true),
            stops: StopMatcher::new(stop),
            text: String::new(),
        }
    }

    /// Adds one token; returns the newly released text and whether a stop string matched (after
    /// which the request should end: further tokens add nothing).
    pub fn push(&mut self, token: u32) -> Result<(String, bool)> {
        let piece = self.detok.push(token)?;
        let (out, stopped) = self.stops.push(&piece);
        self.text.push_str(&out);
        Ok((out, stopped))
    }

    /// Ends the stream and returns the whole text. Without a stop-string match, the text held
    /// back (a partial character, a possible stop-string prefix) is released.
    pub fn finish(mut self) -> Result<String> {
        if !self.stops.stopped() {
            let tail = self.detok.finish()?;
            let (out, _) = self.stops.push(&tail);
            self.text.push_str(&out);
            let rest = self.stops.finish();
            self.text.push_str(&rest);
        }
        Ok(self.text)
    }

    pub fn stopped(&self) -> bool {
        self.stops.stopped()
    }
}
