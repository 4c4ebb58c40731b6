//! SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
//! Gemma, Phi-3 files) as a `tokenizers` BPE with byte fallback.
//!
//! A GGUF keeps SentencePiece's pieces, scores and token types, not merges. SentencePiece BPE
//! merges the adjacent pair whose joined piece scores highest; a `tokenizers` BPE merges by
//! rank, so the merges are derived from the vocabulary the way transformers converts a
//! SentencePiece model: every split of every piece into two pieces of the vocabulary, ordered by
//! the joined piece's score (then longer left part, longer right part, then vocabulary order).
//! Characters outside the vocabulary fall back to `<0xXX>` byte tokens.
//!
//! Spaces become `▁`. With `tokenizer.ggml.add_space_prefix` (Llama, Mistral; not Gemma) the
//! first piece of text gets one `▁` in front, as transformers' Metaspace pre-tokenizer does, and
//! decoding strips it again.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{anyhow, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::Tokenizer;

/// SentencePiece's space marker.
const SPACE: char = '▁';

/// Merges that reproduce SentencePiece BPE on `tokens` with `scores` (see the module doc).
pub fn merges_from_scores(tokens: &[String], scores: &[f32]) -> Vec<(String, String)> {
    let mut ids = ahash::AHashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        ids.entry(t.as_str()).or_insert(id);
    }
    // (score, left chars, right chars, order) per merge; order keeps the scan's order on ties.
    let mut found: Vec<(f32, usize, usize, usize, String, String)> = Vec::new();
    for (piece, &score) in tokens.iter().zip(scores) {
        let mut local: Vec<(usize, usize, &str, &str)> = Vec::new();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                local.push((li, ri, l, r));
            }
        }
        local.sort_by_key(|&(li, ri, ..)| (li, ri));
        for (_, _, l, r) in local {
            let order = found.len();
            found.push((
                score,
                l.chars().count(),
                r.chars().count(),
                order,
                l.to_string(),
                r.to_string(),
            ));
        }
    }
    found.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
            .then(a.3.cmp(&b.3))
    });
    found.into_iter().map(|m| (m.4, m.5)).collect()
}

/// The tokenizer of a SentencePiece vocabulary (added tokens are the caller's).
pub fn tokenizer(
    tokens: &[String],
    scores: &[f32],
    unk: Option<u32>,
    add_space_prefix: bool,
) -> Result<Tokenizer> {
    let mut vocab = ahash::AHashMap::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        vocab.entry(tok.clone()).or_insert(id as u32);
    }
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges_from_scores(tokens, scores))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk.and_then(|id| tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| anyhow!("building the SentencePiece BPE model from GGUF: {e}"))?;
    let mut inner = Tokenizer::new(bpe);
    let to_space = Replace::new(SPACE.to_string(), " ")
        .map_err(|e| anyhow!("building the SentencePiece decoder: {e}"))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(to_space),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        inner.with_pre_tokenizer(Some(Metaspace::new(SPACE, PrependScheme::First, false)));
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    } else {
        let to_marker = Replace::new(" ", SPACE.to_string())
            .map_err(|e| anyhow!("building the SentencePiece normalizer: {e}"))?;
        inner
            .with_normalizer(Some(to_marker))
            .map_err(|e| anyhow!("setting the SentencePiece normalizer: {e}"))?;
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn merges_follow_the_joined_piece_score() {
        let tokens = toks(&["<unk>", "a", "b", "c", "ab", "bc", "abc"]);
        // "bc" outranks "ab"; "abc" splits as a+bc and ab+c, both at its score.
        let scores = [0.0, 0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let m = merges_from_scores(&tokens, &scores);
        let pairs: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(pairs, [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
    }

    #[test]
    fn encodes_by_score_with_byte_fallback_and_round_trips() {
        let mut tokens = toks(&["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a"]);
        let mut scores = vec![0.0, 0.0, 0.0, -9.0, -9.0, -9.0, -9.0, -2.0, -1.0, -0.5];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
        }
        let t = tokenizer(&tokens, &scores, Some(0), true).unwrap();
        let enc = t.encode("abc é", false).unwrap();
        let got: Vec<&str> = enc.get_tokens().iter().map(String::as_str).collect();
        // "▁a" first (best score), then "bc"; the space stays "▁"; é is two UTF-8 bytes.
        assert_eq!(got, ["▁a", "bc", "▁", "<0xC3>", "<0xA9>"]);
        assert_eq!(t.decode(enc.get_ids(), false).unwrap(), "abc é");
    }
}
