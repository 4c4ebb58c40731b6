//! The dense copies (`--kv-residual`, `--kv-sinks`) a prompt-cache file keeps beside its rows
//! (`kv::cache::held` says why a start under the window needs them).
//!
//! Per quantized layer `L`, f16 `[rows, kv_heads*head_dim]`: `L.k.sinks` / `L.v.sinks`, the
//! first `min(S, tokens)` positions' rows, and `L.k.window` / `L.v.window`, the last
//! `min(N − 1, tokens)` positions' rows (tensors of no rows are left out); checksummed like the
//! others. The header records `kvq.residual` (N) and `kvq.sinks` (S) of the saving run; a file
//! without `kvq.residual` holds no copies.

// Data here comes from files: no unwrap, expect or indexing that could panic on it.
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;

use super::{checksum, PromptCacheError, PromptCacheFile, PromptCacheMeta, Result};
use crate::kv::cache::held::{HeldLayer, HeldRows};
use crate::kv::format::KvFormat;
use std::path::Path;

/// `--kv-residual` (N) and `--kv-sinks` (S) of the run that saved a file; 0, 0 for a file
/// without dense copies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldMeta {
    pub residual: usize,
    pub sinks: usize,
}

/// The held tensors of layer `l` with their rows, for a file of `tokens` rows (only those
/// holding rows): sinks K, V, then window K, V.
fn names(l: usize, h: HeldMeta, tokens: usize) -> Vec<(String, usize)> {
    let (ns, nw) = (
        h.sinks.min(tokens),
        HeldRows::window_rows(h.residual, tokens),
    );
    let mut out = Vec::new();
    for (what, n) in [("sinks", ns), ("window", nw)] {
        if n > 0 {
            out.push((format!("{l}.k.{what}"), n));
            out.push((format!("{l}.v.{what}"), n));
        }
    }
    out
}

/// Whether layer format `f` keeps dense copies (`--kv-residual` applies to quantized layers).
fn keeps_copies(f: &KvFormat) -> bool {
    matches!(f, KvFormat::Affine { .. })
}

/// Named file tensors, and header fields.
type Parts = (Vec<(String, Tensor)>, Vec<(&'static str, String)>);

/// The file tensors and header fields of `held` for `meta`'s rows.
pub(super) fn tensors(
    meta: &PromptCacheMeta,
    held: &HeldRows,
) -> std::result::Result<Parts, String> {
    let h = HeldMeta {
        residual: held.residual,
        sinks: held.sinks,
    };
    if held.len != meta.tokens.len() || held.layers.len() != meta.formats.len() {
        return Err(format!(
            "dense copies of {} layers of {} positions for {} layers of {} tokens",
            held.layers.len(),
            held.len,
            meta.formats.len(),
            meta.tokens.len()
        ));
    }
    let mut out = Vec::new();
    for (l, (layer, f)) in held.layers.iter().zip(&meta.formats).enumerate() {
        let layer = match (layer, keeps_copies(f)) {
            (Some(x), true) => x,
            (None, false) => continue,
            _ => return Err(format!("layer {l}: dense copies do not match its format")),
        };
        let rows = [
            &layer.sink_k,
            &layer.sink_v,
            &layer.window_k,
            &layer.window_v,
        ];
        let want = names(l, h, held.len);
        let kept: Vec<&&Tensor> = rows.iter().filter(|t| t.dim(0).unwrap_or(0) > 0).collect();
        if kept.len() != want.len() {
            return Err(format!("layer {l}: {} tensors of dense copies", kept.len()));
        }
        for ((name, n), t) in want.into_iter().zip(kept) {
            if t.dim(0).map_err(|e| e.to_string())? != n {
                return Err(format!("{name}: {:?} rows, {n} expected", t.dims()));
            }
            let t = t
                .to_dtype(DType::F16)
                .and_then(|t| t.to_device(&Device::Cpu));
            out.push((
                name,
                t.and_then(|t| t.contiguous()).map_err(|e| e.to_string())?,
            ));
        }
    }
    let header = vec![
        ("kvq.residual", h.residual.to_string()),
        ("kvq.sinks", h.sinks.to_string()),
    ];
    Ok((out, header))
}

/// Reads and checks the held tensors' header fields, dtypes, shapes and checksums; returns
/// what they are and how many tensors they take.
pub(super) fn read(
    st: &SafeTensors,
    md: &HashMap<String, String>,
    meta: &PromptCacheMeta,
    sums: &HashMap<String, String>,
) -> std::result::Result<(HeldMeta, usize), String> {
    let number = |k: &str| -> std::result::Result<usize, String> {
        md.get(k)
            .map_or(Ok(0), |v| v.parse().map_err(|_| format!("bad \"{k}\"")))
    };
    let h = HeldMeta {
        residual: number("kvq.residual")?,
        sinks: number("kvq.sinks")?,
    };
    if h.residual == 0 && h.sinks > 0 {
        return Err("\"kvq.sinks\" without \"kvq.residual\"".into());
    }
    let width = meta.num_kv_heads * meta.head_dim;
    let mut count = 0;
    for (l, f) in meta.formats.iter().enumerate() {
        if !keeps_copies(f) || h.residual == 0 {
            continue;
        }
        for (name, n) in names(l, h, meta.tokens.len()) {
            let view = st
                .tensor(&name)
                .map_err(|_| format!("tensor {name} is missing"))?;
            if view.dtype() != StDtype::F16 || view.shape() != [n, width] {
                return Err(format!(
                    "tensor {name} is {:?} {:?}, expected F16 [{n}, {width}]",
                    view.dtype(),
                    view.shape()
                ));
            }
            if sums.get(&name) != Some(&checksum(view.data())) {
                return Err(format!(
                    "tensor {name} is damaged (its data does not match the checksum stored \
                     with it)"
                ));
            }
            count += 1;
        }
    }
    Ok((h, count))
}

impl PromptCacheFile {
    /// `--kv-residual` and `--kv-sinks` of the run that saved the file (0, 0: no dense copies).
    pub fn held_meta(&self) -> HeldMeta {
        self.held
    }

    /// The file's dense copies on `device` (`None`: it has none).
    pub fn load_held(&self, device: &Device) -> Result<Option<HeldRows>> {
        let h = self.held;
        if h.residual == 0 {
            return Ok(None);
        }
        let st = SafeTensors::deserialize(&self.mmap).map_err(|e| self.invalid(e.to_string()))?;
        let meta = &self.meta;
        let width = meta.num_kv_heads * meta.head_dim;
        let len = meta.tokens.len();
        let load = |name: &str, n: usize| -> Result<Tensor> {
            if n == 0 {
                return Ok(Tensor::zeros((0, width), DType::F16, device)?);
            }
            let view = st.tensor(name).map_err(|e| self.invalid(e.to_string()))?;
            Ok(Tensor::from_raw_buffer(
                view.data(),
                DType::F16,
                &[n, width],
                device,
            )?)
        };
        let (ns, nw) = (h.sinks.min(len), HeldRows::window_rows(h.residual, len));
        let layers = meta
            .formats
            .iter()
            .enumerate()
            .map(|(l, f)| {
                if !keeps_copies(f) {
                    return Ok(None);
                }
                Ok(Some(HeldLayer {
                    sink_k: load(&format!("{l}.k.sinks"), ns)?,
                    sink_v: load(&format!("{l}.v.sinks"), ns)?,
                    window_k: load(&format!("{l}.k.window"), nw)?,
                    window_v: load(&format!("{l}.v.window"), nw)?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(HeldRows {
            residual: h.residual,
            sinks: h.sinks,
            len,
            layers,
        }))
    }
}

/// Reads the dense copies' header fields and tensors, and checks that the file holds no other
/// tensors than those and the `rows` its other tensors are (as `read_meta` counted them).
pub(super) fn check(
    path: &Path,
    bytes: &[u8],
    meta: &PromptCacheMeta,
    rows: usize,
) -> Result<HeldMeta> {
    let invalid = |msg: String| invalid(path, msg);
    // The checksums were parsed by `read_meta` already: a file that got here has them.
    let st = SafeTensors::deserialize(bytes).map_err(|e| invalid(format!("{e}")))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| invalid(format!("{e}")))?;
    let md = header.metadata().clone().unwrap_or_default();
    let sums: HashMap<String, String> = md
        .get("kvq.checksums")
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    let (h, more) = read(&st, &md, meta, &sums).map_err(invalid)?;
    if st.len() != rows + more {
        return Err(invalid(format!(
            "{} tensors, expected {}",
            st.len(),
            rows + more
        )));
    }
    Ok(h)
}

/// A file error of `path`.
fn invalid(path: &Path, msg: String) -> PromptCacheError {
    PromptCacheError::Invalid {
        path: path.to_path_buf(),
        msg,
    }
}
