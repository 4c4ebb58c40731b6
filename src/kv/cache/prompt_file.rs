//! Prompt-cache files: a prompt's KV history exactly as the cache stored it, in safetensors.
//!
//! One file holds per-token rows for every layer — dense rows as `L.k` / `L.v`
//! (`[n, kv_heads*head_dim]`, the layer's dtype); quantized rows as `L.k.codes` (u32
//! `[n, words]`), `L.k.scales`, `L.k.biases` (`[n, groups]`), same for `v`. Rows rather than
//! blocks: the file does not depend on `--kv-block-size`, and any prefix of it can be imported.
//! Quantized rows stay quantized, so importing them writes the very codes the saving run made
//! (nothing is re-quantized, nothing drifts).
//!
//! The header's metadata (all strings) says what the rows belong to, and every field is checked
//! before a file is used:
//! - `kvq.prompt_cache`: format version ([`VERSION`]);
//! - `kvq.fingerprint`: the weights' fingerprint (`crate::model::fingerprint`); `kvq.model`
//!   names what was loaded (messages only);
//! - `kvq.weights`: `dense`, `blocks` (GGUF blocks, kvq's CPU kernels) or `quantized` (candle's
//!   quantized matmul): each computes K/V differently;
//! - `kvq.shape`: `layers,kv_heads,head_dim`;
//! - `kvq.layers`: each layer's stored format (`dense:f32`, `affine:4:64:f16`, comma-separated);
//! - `kvq.tokens`: the token ids (a JSON array), one per row;
//! - `kvq.checksums`: a JSON object, tensor name -> sha256 (hex) of its data bytes, checked
//!   when the file is opened, so a damaged file is refused instead of changing the output.
//!
//! Keys stored centred (`--kv-center`) come with their sequence's mean per quantized layer,
//! `L.k.center` (f32 `[kv_heads*head_dim]`): the rows mean nothing without it. A file saved
//! under `--kv-residual` keeps the dense copies its run held (sinks and window, see [`held`]).

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::held::HeldRows;
use crate::kv::format::tag::{file_tensors, format_name, format_tag, parse_format};
use crate::kv::format::{KvFormat, LayerRows};

mod held;
pub use held::HeldMeta;

/// The file format version this code writes and reads.
pub const VERSION: &str = "2";

#[derive(Debug, thiserror::Error)]
pub enum PromptCacheError {
    #[error("cannot read prompt cache {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a kvq prompt cache: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error("prompt cache {path} {msg}")]
    Mismatch { path: PathBuf, msg: String },
    #[error("cannot write prompt cache {path}: {msg}")]
    Write { path: PathBuf, msg: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, PromptCacheError>;

/// What the rows belong to: everything a reader checks before using them.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptCacheMeta {
    pub fingerprint: String,
    /// A human-readable name of the model (not checked).
    pub model: String,
    /// `dense`, `blocks` or `quantized` weights (see the module doc).
    pub weights: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Stored format of each layer's rows.
    pub formats: Vec<KvFormat>,
    /// One token id per row.
    pub tokens: Vec<u32>,
    /// The key means of centred keys per layer (`--kv-center`; `None`: a layer whose keys are
    /// stored as they are); empty when no layer's keys are centred.
    pub centers: Vec<Option<Vec<f32>>>,
}

impl PromptCacheMeta {
    /// Whether the rows' keys are stored centred (`--kv-center`).
    pub fn centred(&self) -> bool {
        self.centers.iter().any(Option::is_some)
    }
}

/// The file tensor of layer `l`'s key mean.
fn center_name(l: usize) -> String {
    format!("{l}.k.center")
}

/// The model a cache is about to be used with.
#[derive(Debug, Clone)]
pub struct ModelIdentity {
    pub fingerprint: String,
    pub weights: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// sha256 of a tensor's bytes, in hex.
fn checksum(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `rows` (one entry per layer, one row per token of `meta.tokens`) to `path`: to a
/// new temporary file beside it first, then renamed, so a reader never sees half a file and no
/// other file is touched. The caller decides whether `path` may be replaced.
pub fn save(path: &Path, meta: &PromptCacheMeta, rows: &[LayerRows]) -> Result<()> {
    save_with(path, meta, rows, None)
}

/// [`save`] with the dense copies a `--kv-residual` run held (`held`'s module doc).
pub fn save_with(
    path: &Path,
    meta: &PromptCacheMeta,
    rows: &[LayerRows],
    held: Option<&HeldRows>,
) -> Result<()> {
    let fail = |msg: String| PromptCacheError::Write {
        path: path.to_path_buf(),
        msg,
    };
    if rows.len() != meta.num_layers || meta.formats.len() != meta.num_layers {
        return Err(fail(format!(
            "{} layers of rows and {} formats for {} layers",
            rows.len(),
            meta.formats.len(),
            meta.num_layers
        )));
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (l, (r, f)) in rows.iter().zip(&meta.formats).enumerate() {
        if r.format() != *f || r.len()? != meta.tokens.len() {
            return Err(fail(format!(
                "layer {l} holds {} rows as {}, expected {} as {}",
                r.len()?,
                format_name(&r.format()),
                meta.tokens.len(),
                format_name(f)
            )));
        }
        let names = file_tensors(l, &r.format(), meta.num_kv_heads * meta.head_dim);
        for ((name, _, _), t) in names.into_iter().zip(r.tensors()) {
            tensors.push((name, t.to_device(&Device::Cpu)?.contiguous()?));
        }
    }
    for (l, mu) in meta.centers.iter().enumerate() {
        if let Some(mu) = mu {
            let t = Tensor::from_slice(mu, mu.len(), &Device::Cpu)?;
            tensors.push((center_name(l), t));
        }
    }
    let mut fields = Vec::new();
    if let Some(h) = held {
        let (ts, f) = held::tensors(meta, h).map_err(fail)?;
        tensors.extend(ts);
        fields = f;
    }
    let tokens = serde_json::to_string(&meta.tokens).map_err(|e| fail(e.to_string()))?;
    let sums: BTreeMap<&str, String> = tensors
        .iter()
        .map(|(n, t)| (n.as_str(), checksum(&safetensors::View::data(t))))
        .collect();
    let sums = serde_json::to_string(&sums).map_err(|e| fail(e.to_string()))?;
    let header: HashMap<String, String> = [
        ("kvq.prompt_cache", VERSION.to_string()),
        ("kvq.fingerprint", meta.fingerprint.clone()),
        ("kvq.model", meta.model.clone()),
        ("kvq.weights", meta.weights.clone()),
        (
            "kvq.shape",
            format!(
                "{},{},{}",
                meta.num_layers, meta.num_kv_heads, meta.head_dim
            ),
        ),
        (
            "kvq.layers",
            meta.formats
                .iter()
                .map(format_tag)
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("kvq.tokens", tokens),
        ("kvq.checksums", sums),
    ]
    .into_iter()
    .chain(fields)
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut bytes =
        safetensors::tensor::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(header))
            .map_err(|e| fail(e.to_string()))?;
    sort_header(&mut bytes).map_err(fail)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".kvq-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e.to_string()));
    }
    Ok(())
}

/// safetensors writes the header's metadata in hash-map order, which differs from run to run:
/// rewritten with every object's keys sorted (the same length, padded as safetensors pads it,
/// so the data offsets hold), the same cache is saved as the same bytes.
fn sort_header(bytes: &mut [u8]) -> std::result::Result<(), String> {
    use serde_json::Value;
    fn sorted(v: Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut entries: Vec<(String, Value)> = m.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            other => other,
        }
    }
    let len = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or("no safetensors header length")?;
    let header = bytes
        .get_mut(8..8usize.saturating_add(len))
        .ok_or("the safetensors header runs past the data")?;
    let v: Value = serde_json::from_slice(header).map_err(|e| e.to_string())?;
    let mut text = serde_json::to_vec(&sorted(v)).map_err(|e| e.to_string())?;
    if text.len() > header.len() {
        return Err("the sorted header is longer than safetensors' own".into());
    }
    text.resize(header.len(), b' ');
    header.copy_from_slice(&text);
    Ok(())
}

/// An opened, checked prompt-cache file. The data stays memory-mapped until rows are loaded, so
/// many requests can share one file and long histories are not copied twice.
pub struct PromptCacheFile {
    path: PathBuf,
    meta: PromptCacheMeta,
    held: HeldMeta,
    mmap: memmap2::Mmap,
}

impl std::fmt::Debug for PromptCacheFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptCacheFile")
            .field("path", &self.path)
            .field("meta", &self.meta)
            .finish()
    }
}

impl PromptCacheFile {
    /// Opens `path` and checks that its header and tensors are a complete, consistent cache.
    pub fn open(path: &Path) -> Result<Self> {
        // Looked at before opening: opening a FIFO would wait for a writer.
        let meta = std::fs::metadata(path).map_err(|source| PromptCacheError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if !meta.is_file() {
            return Err(PromptCacheError::Invalid {
                path: path.to_path_buf(),
                msg: if meta.is_dir() {
                    "it is a directory; give the file --save-prompt-cache wrote".into()
                } else {
                    "it is not a regular file (a device, FIFO or socket)".into()
                },
            });
        }
        let file = std::fs::File::open(path).map_err(|source| PromptCacheError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the file is not modified while mapped (the usual safetensors contract; a
        // prompt cache is written to a temporary file and renamed, never rewritten in place).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| PromptCacheError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (meta, expected) = read_meta(path, &mmap)?;
        let held = held::check(path, &mmap, &meta, expected)?;
        Ok(Self {
            path: path.to_path_buf(),
            meta,
            held,
            mmap,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn meta(&self) -> &PromptCacheMeta {
        &self.meta
    }

    /// Saved tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.meta.tokens
    }

    fn mismatch(&self, msg: String) -> PromptCacheError {
        PromptCacheError::Mismatch {
            path: self.path.clone(),
            msg,
        }
    }

    /// Refuses a cache made by another model (shape, weights fingerprint, or weight mode).
    pub fn check_model(&self, m: &ModelIdentity) -> Result<()> {
        let s = &self.meta;
        let (a, b) = (
            (s.num_layers, s.num_kv_heads, s.head_dim),
            (m.num_layers, m.num_kv_heads, m.head_dim),
        );
        if a != b {
            return Err(self.mismatch(format!(
                "was saved for a model of {} layers x {} KV heads x head_dim {}, this one has \
                 {} x {} x {}",
                a.0, a.1, a.2, b.0, b.1, b.2
            )));
        }
        if s.fingerprint != m.fingerprint {
            return Err(self.mismatch(format!(
                "was saved with other weights: model fingerprint {} (from {}), this model's is {}",
                short(&s.fingerprint),
                s.model,
                short(&m.fingerprint)
            )));
        }
        if s.weights != m.weights {
            return Err(self.mismatch(format!(
                "was computed with {} weights, this run uses {} weights (--dequantize / --keep-quantized must match)",
                s.weights, m.weights
            )));
        }
        Ok(())
    }

    /// Refuses a cache whose rows are not stored the way this run stores the first tokens of a
    /// sequence (`want`, one format per layer; see `PagedKvCache::formats_for_prefix`).
    pub fn check_formats(&self, want: &[KvFormat], hint: &str) -> Result<()> {
        if want.len() != self.meta.formats.len() {
            return Err(self.mismatch(format!(
                "has {} layers, this cache {}",
                self.meta.formats.len(),
                want.len()
            )));
        }
        for (l, (have, want)) in self.meta.formats.iter().zip(want).enumerate() {
            if have != want && have.with_scale_dtype(DType::F16) == *want {
                return Err(self.mismatch(format!(
                    "was saved by an earlier kvq, which stored the scales and biases of a \
                     quantized cache computing in f32 as f32 (layer {l} is {}); this one stores \
                     them as f16 (half a bit per value less), and the codes differ: save it \
                     again with --save-prompt-cache",
                    format_name(have)
                )));
            }
            if have != want {
                return Err(self.mismatch(format!(
                    "stores the KV cache in another format: layer {l} is {}, this run keeps it \
                     as {}{hint}",
                    format_name(have),
                    format_name(want)
                )));
            }
        }
        Ok(())
    }

    /// The first `n` rows of every layer, on `device`, as stored.
    pub fn load_rows(&self, n: usize, device: &Device) -> Result<Vec<LayerRows>> {
        let total = self.meta.tokens.len();
        if n > total {
            return Err(self.mismatch(format!("holds {total} tokens, {n} were asked for")));
        }
        let st = SafeTensors::deserialize(&self.mmap).map_err(|e| self.invalid(e.to_string()))?;
        let width = self.meta.num_kv_heads * self.meta.head_dim;
        let load = |name: &str, cols: usize, dtype: DType| -> Result<Tensor> {
            let view = st.tensor(name).map_err(|e| self.invalid(e.to_string()))?;
            let bytes = n * cols * dtype.size_in_bytes();
            let data = view
                .data()
                .get(..bytes)
                .ok_or_else(|| self.invalid(format!("{name} holds fewer than {n} rows")))?;
            Ok(Tensor::from_raw_buffer(data, dtype, &[n, cols], device)?)
        };
        let mut out = Vec::with_capacity(self.meta.num_layers);
        for (l, f) in self.meta.formats.iter().enumerate() {
            let ts = file_tensors(l, f, width)
                .iter()
                .map(|(name, cols, dtype)| load(name, *cols, *dtype))
                .collect::<Result<Vec<_>>>()?;
            out.push(LayerRows::from_tensors(f, ts)?);
        }
        Ok(out)
    }

    fn invalid(&self, msg: String) -> PromptCacheError {
        PromptCacheError::Invalid {
            path: self.path.clone(),
            msg,
        }
    }
}

/// How many leading tokens of a saved cache a prompt can reuse: the longest common prefix, but
/// at most all but the prompt's last two tokens. The last one must run through the model to give
/// the first logits; leaving two keeps that rest on the prefill path, which computes it exactly
/// as a run without the cache does (one lone token would take the decode kernel, whose rounding
/// differs).
pub fn reusable_prefix(saved: &[u32], prompt: &[u32]) -> usize {
    let common = saved.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    common.min(prompt.len().saturating_sub(2))
}

/// The first 16 characters (a fingerprint read from a file may hold any text).
fn short(fingerprint: &str) -> &str {
    let end = fingerprint
        .char_indices()
        .nth(16)
        .map_or(fingerprint.len(), |(i, _)| i);
    fingerprint.get(..end).unwrap_or(fingerprint)
}

/// Parses and checks the header: metadata, then every tensor's dtype and shape. Returns the
/// tensors it checked with the metadata.
fn read_meta(path: &Path, bytes: &[u8]) -> Result<(PromptCacheMeta, usize)> {
    let invalid = |msg: String| PromptCacheError::Invalid {
        path: path.to_path_buf(),
        msg,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| invalid(format!("{e}")))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| invalid(format!("{e}")))?;
    let md = header
        .metadata()
        .as_ref()
        .ok_or_else(|| invalid("no metadata in the header".into()))?;
    let field = |k: &str| -> Result<&String> {
        md.get(k)
            .ok_or_else(|| invalid(format!("the header has no \"{k}\"")))
    };
    let version = field("kvq.prompt_cache")?;
    if version != VERSION {
        return Err(invalid(format!(
            "format version {version}, this kvq reads version {VERSION} (save it again with \
             --save-prompt-cache)"
        )));
    }
    let sums: HashMap<String, String> = serde_json::from_str(field("kvq.checksums")?)
        .map_err(|e| invalid(format!("bad \"kvq.checksums\": {e}")))?;
    let shape: Vec<usize> = field("kvq.shape")?
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| invalid("bad \"kvq.shape\"".into()))?;
    let [num_layers, num_kv_heads, head_dim] = shape[..] else {
        return Err(invalid(
            "\"kvq.shape\" must be layers,kv_heads,head_dim".into(),
        ));
    };
    let formats = field("kvq.layers")?
        .split(',')
        .map(|t| parse_format(t).ok_or_else(|| invalid(format!("unknown layer format '{t}'"))))
        .collect::<Result<Vec<_>>>()?;
    if formats.len() != num_layers {
        return Err(invalid(format!(
            "{} layer formats for {num_layers} layers",
            formats.len()
        )));
    }
    let tokens: Vec<u32> = serde_json::from_str(field("kvq.tokens")?)
        .map_err(|e| invalid(format!("bad \"kvq.tokens\": {e}")))?;
    let width = num_kv_heads
        .checked_mul(head_dim)
        .ok_or_else(|| invalid("\"kvq.shape\" is too large".into()))?;
    let mut expected = 0;
    for (l, f) in formats.iter().enumerate() {
        f.check_dim(head_dim)
            .map_err(|e| invalid(format!("layer {l}: {e}")))?;
        for (name, cols, dtype) in file_tensors(l, f, width) {
            let view = st
                .tensor(&name)
                .map_err(|_| invalid(format!("tensor {name} is missing")))?;
            let want_shape = [tokens.len(), cols];
            if view.dtype() != StDtype::from(dtype) || view.shape() != want_shape {
                return Err(invalid(format!(
                    "tensor {name} is {:?} {:?}, expected {:?} {want_shape:?}",
                    view.dtype(),
                    view.shape(),
                    StDtype::from(dtype)
                )));
            }
            if sums.get(&name) != Some(&checksum(view.data())) {
                return Err(invalid(format!(
                    "tensor {name} is damaged (its data does not match the checksum stored \
                     with it)"
                )));
            }
            expected += 1;
        }
    }
    let mut centers = Vec::with_capacity(num_layers);
    for l in 0..num_layers {
        let name = center_name(l);
        let Ok(view) = st.tensor(&name) else {
            centers.push(None);
            continue;
        };
        if view.dtype() != StDtype::F32 || view.shape() != [width] {
            return Err(invalid(format!(
                "tensor {name} is {:?} {:?}, expected F32 [{width}]",
                view.dtype(),
                view.shape()
            )));
        }
        if sums.get(&name) != Some(&checksum(view.data())) {
            return Err(invalid(format!(
                "tensor {name} is damaged (its data does not match the checksum stored with it)"
            )));
        }
        let mu: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        centers.push(Some(mu));
        expected += 1;
    }
    if centers.iter().all(Option::is_none) {
        centers.clear();
    }
    let meta = PromptCacheMeta {
        fingerprint: field("kvq.fingerprint")?.clone(),
        model: md.get("kvq.model").cloned().unwrap_or_default(),
        weights: field("kvq.weights")?.clone(),
        num_layers,
        num_kv_heads,
        head_dim,
        formats,
        tokens,
        centers,
    };
    Ok((meta, expected))
}

#[cfg(test)]
mod tests;
