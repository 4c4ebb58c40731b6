//! Text ⇄ token ids, from GGUF metadata or from Hugging Face `tokenizer.json` files.
//!
//! Decisions:
//! - One type, [`TextTokenizer`], wraps a `tokenizers::Tokenizer` plus what the engine needs beside
//!   it: BOS/EOS ids, whether the model wants a BOS, and the chat template source.
//! - GGUF SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) are rebuilt by
//!   [`super::tokenizer_spm`] (merges from scores, byte fallback).
//! - GGUF byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is rebuilt as a `tokenizers` BPE. The
//!   pre-tokenizer follows `tokenizer.ggml.pre` the way llama.cpp does: the SmolLM/StarCoder family
//!   isolates every digit before the GPT-2 split (a plain ByteLevel gives different ids when 2+
//!   spaces precede a digit), Llama 3 and Qwen2 use their own split regexes. An unknown `pre` is
//!   refused rather than silently tokenized differently from the model's training.
//! - Control tokens (token_type 3) become special added tokens, so `<|im_start|>` written in a
//!   rendered chat template encodes to its single id; user-defined tokens (type 4) are matched too.
//! - `encode` never runs the post-processor; BOS is prepended by us, only when asked and when the
//!   model wants one, and never twice (chat templates often render the BOS themselves).

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// GGUF token_type values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Llama 3's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`): digits in runs of up to 3.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: like Llama 3 but every digit alone.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer plus the special-token facts the engine and chat templates need.
pub struct TextTokenizer {
    inner: Tokenizer,
    bos: Option<(u32, String)>,
    eos_ids: Vec<u32>,
    eos_text: Option<String>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl TextTokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`): byte-level BPE ("gpt2")
    /// or SentencePiece ("llama").
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let get = |key: &str| md.get(key);
        let model = get("tokenizer.ggml.model")
            .ok_or_else(|| anyhow!("GGUF has no tokenizer (tokenizer.ggml.model is missing)"))?
            .to_string()
            .context("tokenizer.ggml.model is not a string")?;
        if model != "gpt2" && model != "llama" {
            bail!("unsupported GGUF tokenizer model {model:?} (kvq reads byte-level BPE, \"gpt2\", and SentencePiece, \"llama\"; use the model's tokenizer.json instead)");
        }
        let tokens: Vec<String> = get("tokenizer.ggml.tokens")
            .ok_or_else(|| anyhow!("GGUF tokenizer.ggml.tokens is missing"))?
            .to_vec()
            .context("tokenizer.ggml.tokens is not an array")?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<std::result::Result<_, _>>()
            .context("tokenizer.ggml.tokens holds a non-string")?;
        let merges: Vec<(String, String)> = match get("tokenizer.ggml.merges") {
            None => Vec::new(),
            Some(v) => v
                .to_vec()
                .context("tokenizer.ggml.merges is not an array")?
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let m = m
                        .to_string()
                        .context("tokenizer.ggml.merges holds a non-string")?;
                    let (a, b) = m.split_once(' ').ok_or_else(|| {
                        anyhow!("tokenizer.ggml.merges[{i}] = {m:?} is not \"a b\"")
                    })?;
                    Ok((a.to_string(), b.to_string()))
                })
                .collect::<Result<_>>()?,
        };
        let token_types: Vec<i32> = match get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(v) => v
                .to_vec()
                .context("tokenizer.ggml.token_type is not an array")?
                .iter()
                .map(|t| t.to_i32())
                .collect::<std::result::Result<_, _>>()
                .context("tokenizer.ggml.token_type holds a non-i32")?,
        };
        if token_types.len() != tokens.len() {
            bail!(
                "GGUF tokenizer has {} tokens but {} token types",
                tokens.len(),
                token_types.len()
            );
        }
        let id_of = |key: &str| -> Result<Option<u32>> {
            match get(key) {
                None => Ok(None),
                Some(v) => {
                    let id = v.to_u32().with_context(|| format!("{key} is not a u32"))?;
                    if id as usize >= tokens.len() {
                        bail!("{key} = {id} is outside the vocabulary ({})", tokens.len());
                    }
                    Ok(Some(id))
                }
            }
        };
        let bos_id = id_of("tokenizer.ggml.bos_token_id")?;
        let eos_id = id_of("tokenizer.ggml.eos_token_id")?;
        let eot_id = id_of("tokenizer.ggml.eot_token_id")?;
        let unk_id = id_of("tokenizer.ggml.unknown_token_id")?;
        let add_bos = match get("tokenizer.ggml.add_bos_token") {
            Some(v) => v
                .to_bool()
                .context("tokenizer.ggml.add_bos_token is not a bool")?,
            None => false,
        };
        let mut inner = if model == "llama" {
            gguf_sentencepiece(md, &tokens, unk_id)?
        } else {
            gguf_bpe(md, &tokens, merges, unk_id)?
        };
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL)
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| anyhow!("adding the GGUF control tokens: {e}"))?;
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, t)| **t == TOKEN_TYPE_USER_DEFINED)
            .map(|(tok, _)| AddedToken::from(tok.clone(), false).normalized(false))
            .collect();
        inner
            .add_tokens(user)
            .map_err(|e| anyhow!("adding the GGUF user-defined tokens: {e}"))?;

        let mut eos_ids = Vec::new();
        for id in [eos_id, eot_id].into_iter().flatten() {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let chat_template = match get("tokenizer.chat_template") {
            Some(v) => Some(
                v.to_string()
                    .context("tokenizer.chat_template is not a string")?
                    .clone(),
            ),
            None => None,
        };
        Ok(Self {
            // Both ids were checked against the vocabulary above.
            bos: bos_id.and_then(|id| Some((id, tokens.get(id as usize)?.clone()))),
            eos_text: eos_id.and_then(|id| tokens.get(id as usize).cloned()),
            eos_ids,
            add_bos,
            chat_template,
            inner,
        })
    }

    /// Loads `tokenizer.json`, with BOS/EOS, `add_bos_token` and the chat template from
    /// `tokenizer_config.json`, and extra EOS ids from `config.json` / `generation_config.json`
    /// (`eos_token_id` may be an integer or a list).
    pub fn from_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Path>,
        extra_configs: &[&Path],
    ) -> Result<Self> {
        let inner = Tokenizer::from_file(tokenizer_json)
            .map_err(|e| anyhow!("reading {}: {e}", tokenizer_json.display()))?;
        let cfg = match tokenizer_config {
            Some(p) => Some(read_json(p)?),
            None => None,
        };
        let token_field = |name: &str| -> Option<String> {
            let v = cfg.as_ref()?.get(name)?;
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_text = token_field("bos_token");
        let mut eos_text = token_field("eos_token");
        let bos = bos_text.and_then(|t| inner.token_to_id(&t).map(|id| (id, t)));

        let mut eos_ids = Vec::new();
        if let Some(id) = eos_text.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        for path in extra_configs {
            let v = read_json(path)?;
            let ids: Vec<u64> = match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
                _ => Vec::new(),
            };
            for id in ids {
                let id = u32::try_from(id)
                    .with_context(|| format!("{}: eos_token_id {id} too large", path.display()))?;
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        if eos_text.is_none() {
            eos_text = eos_ids.first().and_then(|&id| inner.id_to_token(id));
        }

        // add_bos_token when the config says so; otherwise whatever the post-processor would do.
        let add_bos = match cfg.as_ref().and_then(|c| c.get("add_bos_token")) {
            Some(serde_json::Value::Bool(b)) => *b,
            _ => match &bos {
                Some((id, _)) => inner
                    .encode("", true)
                    .map(|e| e.get_ids().first() == Some(id))
                    .unwrap_or(false),
                None => false,
            },
        };
        let chat_template =
            match cfg.as_ref().and_then(|c| c.get("chat_template")) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take the one called "default", else the first.
                Some(serde_json::Value::Array(list)) => {
                    let named = |want: Option<&str>| {
                        list.iter().find_map(|t| {
                            let name = t.get("name")?.as_str()?;
                            if want.is_none_or(|w| w == name) {
                                t.get("template")?.as_str().map(str::to_string)
                            } else {
                                None
                            }
                        })
                    };
                    named(Some("default")).or_else(|| named(None))
                }
                // transformers 5 writes the template beside the tokenizer instead.
                _ => {
                    let file = tokenizer_json.with_file_name("chat_template.jinja");
                    if file.is_file() {
                        Some(std::fs::read_to_string(&file).with_context(|| {
                            format!("reading the chat template {}", file.display())
                        })?)
                    } else {
                        None
                    }
                }
            };
        Ok(Self {
            inner,
            bos,
            eos_ids,
            eos_text,
            add_bos,
            chat_template,
        })
    }

    /// This tokenizer, with the BOS, EOS and `add_bos_token` of `own` (the model's tokenizer,
    /// whose vocabulary this one was checked to share) where it has none of its own: a bare
    /// tokenizer.json names no EOS, and generation would never stop at one.
    pub fn with_special_tokens_of(mut self, own: &TextTokenizer) -> Self {
        if self.bos.is_none() {
            self.bos = own.bos.clone();
            self.add_bos = own.add_bos;
        }
        if self.eos_ids.is_empty() {
            self.eos_ids = own.eos_ids.clone();
            self.eos_text = own.eos_text.clone();
        }
        self
    }

    /// Encodes `text`; special-token strings in it map to their ids. A BOS is prepended only when
    /// `add_bos` is true, the model asks for one (`add_bos_token`) and the text does not already
    /// start with it.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if add_bos && self.add_bos {
            if let Some((bos, _)) = &self.bos {
                if ids.first() != Some(bos) {
                    ids.insert(0, *bos);
                }
            }
        }
        Ok(ids)
    }

    /// Decodes ids to text, leaving special tokens out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }

    /// The BOS token id and text, when the model has one.
    pub fn bos_token(&self) -> Option<(u32, String)> {
        self.bos.clone()
    }

    /// Every id that ends generation (EOS, end-of-turn, config-listed ids).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The main EOS token's text, as chat templates call it (`eos_token`).
    pub fn eos_token(&self) -> Option<String> {
        self.eos_text.clone()
    }

    /// Whether the model wants a BOS at the start of a prompt.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The chat template source, when the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token string of `id` (byte-level form, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

/// The SentencePiece model ("llama") of a GGUF vocabulary: scores from `tokenizer.ggml.scores`,
/// rebuilt by [`super::tokenizer_spm`].
fn gguf_sentencepiece(
    md: &HashMap<String, gguf_file::Value>,
    tokens: &[String],
    unk_id: Option<u32>,
) -> Result<Tokenizer> {
    let get = |key: &str| md.get(key);
    let scores: Vec<f32> = match get("tokenizer.ggml.scores") {
        None => bail!("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores"),
        Some(v) => v
            .to_vec()
            .context("tokenizer.ggml.scores is not an array")?
            .iter()
            .map(|s| s.to_f32())
            .collect::<std::result::Result<_, _>>()
            .context("tokenizer.ggml.scores holds a non-f32")?,
    };
    if scores.len() != tokens.len() {
        bail!(
            "GGUF tokenizer has {} tokens but {} scores",
            tokens.len(),
            scores.len()
        );
    }
    let add_space_prefix = match get("tokenizer.ggml.add_space_prefix") {
        Some(v) => v
            .to_bool()
            .context("tokenizer.ggml.add_space_prefix is not a bool")?,
        None => true, // llama.cpp's default for SentencePiece
    };
    super::tokenizer_spm::tokenizer(tokens, &scores, unk_id, add_space_prefix)
}

/// The byte-level BPE model ("gpt2") of a GGUF vocabulary, its pre-tokenizer chosen by
/// `tokenizer.ggml.pre`.
fn gguf_bpe(
    md: &HashMap<String, gguf_file::Value>,
    tokens: &[String],
    merges: Vec<(String, String)>,
    unk_id: Option<u32>,
) -> Result<Tokenizer> {
    let get = |key: &str| md.get(key);
    let pre = match get("tokenizer.ggml.pre") {
        Some(v) => v
            .to_string()
            .context("tokenizer.ggml.pre is not a string")?
            .clone(),
        None => "default".to_string(),
    };
    let pre_tokenizer = pre_tokenizer_for(&pre)?;

    let mut vocab = ahash::AHashMap::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        // Duplicate strings exist in some vocabularies; the first id wins, as in llama.cpp.
        vocab.entry(tok.clone()).or_insert(id as u32);
    }
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges);
    if let Some(unk) = unk_id.and_then(|id| tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| anyhow!("building the BPE model from GGUF: {e}"))?;

    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// The pre-tokenizer llama.cpp applies for a GGUF `tokenizer.ggml.pre` value.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let pattern = SplitPattern::Regex(re.to_string());
        Ok(Split::new(pattern, SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| anyhow!("compiling the {pre} split regex: {e}"))?
            .into())
    };
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true).into(),
        "smollm" | "starcoder" | "refact" => Sequence::new(vec![
            Digits::new(true).into(),
            byte_level(true).into(),
        ])
        .into(),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => {
            Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false).into()]).into()
        }
        "qwen2" => {
            Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false).into()]).into()
        }
        other => bail!(
            "unsupported GGUF pre-tokenizer {other:?} (kvq knows default/gpt2, smollm/starcoder, llama3/llama-bpe, qwen2; use the model's tokenizer.json instead)"
        ),
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}
