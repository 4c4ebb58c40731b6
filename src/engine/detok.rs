//! Incremental detokenization for streaming.
//!
//! Decoding one token at a time is wrong (byte-level tokens can hold part of a UTF-8 character;
//! SentencePiece decoders drop a leading space at the start of a decode) and decoding the whole
//! sequence each step is quadratic. Like text-generation-inference we keep two offsets: the text
//! of `ids[prefix..read]` was already emitted; each step decodes `ids[prefix..]` and emits what
//! it adds beyond that prefix. While the new text ends in U+FFFD (an incomplete character) it is
//! held back; `finish` flushes whatever is left, so nothing is ever lost.

// Token ids come from the model and from prompts: no unwrap, expect or indexing that could panic on
// them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::Result;

use crate::model::tokenizer::TextTokenizer;

const REPLACEMENT: char = '\u{FFFD}';

/// Streams the text of a growing token list.
pub struct Detokenizer<'a> {
    tok: &'a TextTokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl<'a> Detokenizer<'a> {
    pub fn new(tok: &'a TextTokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix_text = self.tok.decode(
            self.ids.get(self.prefix..self.read).unwrap_or(&[]),
            self.skip_special,
        )?;
        let new_text = self.tok.decode(
            self.ids.get(self.prefix..).unwrap_or(&[]),
            self.skip_special,
        )?;
        if new_text.len() > prefix_text.len() && !new_text.ends_with(REPLACEMENT) {
            if let Some(delta) = new_text.strip_prefix(prefix_text.as_str()) {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// Flushes text still held back (an incomplete character at the very end decodes as U+FFFD,
    /// as a full decode would show it).
    pub fn finish(&mut self) -> Result<String> {
        let prefix_text = self.tok.decode(
            self.ids.get(self.prefix..self.read).unwrap_or(&[]),
            self.skip_special,
        )?;
        let new_text = self.tok.decode(
            self.ids.get(self.prefix..).unwrap_or(&[]),
            self.skip_special,
        )?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(match new_text.strip_prefix(prefix_text.as_str()) {
            Some(delta) => delta.to_string(),
            None => String::new(),
        })
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
