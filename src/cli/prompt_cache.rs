//! Prompt caches at the command line: opening a file for a prompt (with every check a user
//! needs a clear one-line answer to), and writing one after a prefill.
//!
//! A cache is reused up to the longest common prefix of its tokens and the new prompt (at most
//! all but the prompt's last two tokens); the rest of the prompt is prefilled. Under
//! `--kv-residual` the file must also hold the dense copies that prefill attends
//! ([`check_held`]). A cache that shares no
//! leading token with the prompt is refused, as is one made by another model or stored in
//! another format than this run would store those tokens in.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::engine::request::CachedPrefix;
use crate::kv::cache::held::HeldRows;
use crate::kv::cache::prompt_file::{
    reusable_prefix, save_with, ModelIdentity, PromptCacheFile, PromptCacheMeta,
};
use crate::kv::cache::{CacheConfig, PromptKv};
use crate::kv::format::{KvFormat, LayerRows};
use crate::model::load::LoadedModel;

/// Opened prompt-cache files by path, so requests naming the same file share one mapping.
#[derive(Default)]
pub struct CacheFiles {
    open: HashMap<PathBuf, Arc<PromptCacheFile>>,
}

impl CacheFiles {
    /// The prefix of `prompt` that `path` provides, checked against the model and the cache
    /// layout `cfg` this run uses.
    pub fn prefix_for(
        &mut self,
        path: &Path,
        prompt: &[u32],
        model: &ModelIdentity,
        cfg: &CacheConfig,
    ) -> Result<CachedPrefix> {
        let file = match self.open.get(path) {
            Some(f) => f.clone(),
            None => {
                let f = Arc::new(PromptCacheFile::open(path)?);
                self.open.insert(path.to_path_buf(), f.clone());
                f
            }
        };
        file.check_model(model)?;
        match (file.meta().centred(), cfg.center) {
            (true, false) => bail!(
                "prompt cache {} holds keys stored centred (saved with --kv-center): start from \
                 it with --kv-center",
                path.display()
            ),
            (false, true) => bail!(
                "prompt cache {} holds keys stored as they are: start from it without \
                 --kv-center (--kv-bits 4 or 3 alone centres keys: --kv-bits 4 --kv-residual 0 \
                 is plain 4-bit), or save it again with this run's KV flags",
                path.display()
            ),
            _ => {}
        }
        let mut tokens = reusable_prefix(file.tokens(), prompt);
        if let Some(w) = cfg.window {
            // With --max-kv-size W a position at or past W attends only the last W positions,
            // so its K/V differ from the (whole-history) saved ones: only the first W rows are
            // what this run would have computed.
            tokens = tokens.min(w);
        }
        check_held(&file, cfg, tokens)?;
        if tokens == 0 && prompt.len() <= 2 {
            bail!(
                "the prompt has {} tokens: too short to start from prompt cache {} (its last two \
                 tokens are always computed)",
                prompt.len(),
                path.display()
            );
        }
        if tokens == 0 {
            let first = |t: &[u32]| t.first().map_or("nothing".into(), |x| format!("token {x}"));
            bail!(
                "prompt cache {} shares no leading tokens with this prompt (it starts with {}, \
                 the prompt with {})",
                path.display(),
                first(file.tokens()),
                first(prompt)
            );
        }
        let hint = match &cfg.staging {
            Some(st) if cfg.prefix_in_staging(tokens) => format!(
                " (--quantized-kv-start {} keeps the first {tokens} tokens dense)",
                st.tokens
            ),
            _ => " (save and use it with the same --kv-bits, --kv-group-size, \
                  --kv-dense-layers, --kv-dtype and --dtype)"
                .into(),
        };
        file.check_formats(&cfg.formats_for_prefix(tokens), &hint)?;
        Ok(CachedPrefix { file, tokens })
    }
}

/// Refuses a start from `tokens` positions of `file` that could not go on as a fresh run
/// does under `--kv-residual` / `--kv-sinks`: the file's rows were computed through its run's
/// window (so it must be this run's), and the first position computed must attend the dense
/// copies of the `N − 1` before it, which the file holds for its last positions only
/// (`kv::cache::held` says why).
fn check_held(file: &PromptCacheFile, cfg: &CacheConfig, tokens: usize) -> Result<()> {
    let quantized = cfg
        .formats
        .iter()
        .any(|f| matches!(f, KvFormat::Affine { .. }));
    let (path, h) = (file.path().display(), file.held_meta());
    let (n, s) = if quantized {
        (cfg.residual, cfg.sinks)
    } else {
        (0, 0)
    };
    let flags = |n: usize, s: usize| match (n, s) {
        (0, _) => "without --kv-residual".to_string(),
        (n, 0) => format!("with --kv-residual {n} and without --kv-sinks"),
        (n, s) => format!("with --kv-residual {n} --kv-sinks {s}"),
    };
    if h.residual == 0 && n > 0 {
        bail!(
            "prompt cache {path} holds no dense copies of its rows (saved without \
             --kv-residual), which this run attends dense: save it again (--save-prompt-cache) \
             {}",
            flags(n, s)
        );
    }
    if (h.residual, h.sinks) != (n, s) {
        bail!(
            "prompt cache {path} was saved {}, and its rows were computed through that dense \
             window; this run keeps {n} positions and {s} sinks dense: start from it {}, or \
             save it again (--save-prompt-cache) {}",
            flags(h.residual, h.sinks),
            flags(h.residual, h.sinks),
            flags(n, s)
        );
    }
    let len = file.tokens().len();
    let kept = HeldRows::window_rows(n, len);
    if n == 0 || tokens == 0 || (tokens + 1).saturating_sub(n) >= len - kept {
        return Ok(());
    }
    bail!(
        "prompt cache {path} holds the dense copies (--kv-residual {n}) of its last {kept} \
         positions only, and the first position this run computes, {tokens}, must attend the {} \
         before it dense: under --kv-residual a file starts only prompts that extend all its \
         {len} tokens (by at least two)",
        n - 1
    )
}

/// Refuses to save where the cache could not hold the whole prompt (a sliding window shorter
/// than the prompt drops its first tokens before the prefill ends).
pub fn check_can_save(cfg: &CacheConfig, prompt_tokens: usize) -> Result<()> {
    if let Some(w) = cfg.kept_window() {
        if prompt_tokens >= w {
            bail!(
                "--save-prompt-cache needs the whole prompt in the KV cache, but the prompt has \
                 {prompt_tokens} tokens and the cache keeps {w} (--max-kv-size or the model's \
                 sliding window)"
            );
        }
    }
    Ok(())
}

/// Writes a prompt's K/V as stored (its rows, and the key means of centred keys) with what
/// identifies them.
pub fn write(
    path: &Path,
    m: &LoadedModel,
    identity: &ModelIdentity,
    prompt: &[u32],
    kv: &PromptKv,
) -> Result<()> {
    let rows = &kv.rows;
    let meta = PromptCacheMeta {
        fingerprint: identity.fingerprint.clone(),
        model: m.description.clone(),
        weights: identity.weights.clone(),
        num_layers: identity.num_layers,
        num_kv_heads: identity.num_kv_heads,
        head_dim: identity.head_dim,
        formats: rows.iter().map(LayerRows::format).collect(),
        tokens: prompt.to_vec(),
        centers: kv.centers.clone(),
    };
    save_with(
        &super::output_file::replace_target(path),
        &meta,
        rows,
        kv.held.as_ref(),
    )?;
    Ok(())
}
