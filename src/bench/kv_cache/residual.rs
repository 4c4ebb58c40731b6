//! The attention rows of `kvq bench-kv-cache --residual N` (see the parent module): a decode
//! step over a whole [`PagedKvCache`], timed through [`paged_attention`] as the model calls it —
//! for the rows with dense copies (each sequence's newest `N` rows, and first `--sinks S`) the
//! quantized part, the dense part and their merge. Every mode of such a run goes through a
//! cache, so all read blocks in the order the cache hands them out.

use super::{time_ms, BenchConfig, Progress};
use crate::kv::attend::{paged_attention, plan_decode, SeqSlice};
use crate::kv::cache::{CacheConfig, PagedKvCache};
use crate::kv::format::KvFormat;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

/// What every mode of one context length shares: K and V rows by pool slot (`[slots, width]`,
/// on the host), the queries (`[batch, heads, head_dim]`) and each sequence's block ids.
pub(super) struct Data<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub q: &'a Tensor,
    pub ids: &'a [u32],
    pub len: usize,
}

/// Median time of one layer's decode attention, and its output (`[batch, heads, head_dim]`),
/// for a cache of `--attn-layers` layers in `format` holding `batch` sequences of `len`
/// positions, the last one written as a decode step writes it; `dense_rows`: with the run's
/// `--residual`, `--sinks` and `--center`.
pub(super) fn time(
    cfg: &BenchConfig,
    (format, dense_rows): (KvFormat, bool),
    data: &Data,
    device: &Device,
    progress: &dyn Progress,
    what: &str,
) -> Result<(f64, Tensor)> {
    let (len, bs) = (data.len, cfg.block_size);
    let per_seq = len.div_ceil(bs);
    let mut cc = CacheConfig::dense(
        cfg.attn_layers,
        cfg.heads,
        cfg.head_dim,
        bs,
        cfg.batch * per_seq,
        cfg.dtype,
    );
    cc.formats = vec![format; cfg.attn_layers];
    if dense_rows {
        (cc.residual, cc.sinks, cc.center) = (cfg.residual, cfg.sinks, cfg.center);
    }
    let mut cache = PagedKvCache::new(cc, device).context("--residual")?;
    // Sequence b's position p holds the row the dense baseline reads there: slot
    // ids[b·per_seq + p / bs]·bs + p % bs.
    const CHUNK: usize = 4096;
    for b in 0..cfg.batch {
        let seq = b as u64;
        cache.add_sequence(seq)?;
        let mut at = 0;
        while at < len {
            // Prompt chunks up to the last position, then that one alone (a decode step).
            let n = CHUNK.min(len - 1 - at).max(1);
            let slots: Vec<u32> = (at..at + n)
                .map(|p| data.ids[b * per_seq + p / bs] * bs as u32 + (p % bs) as u32)
                .collect();
            let idx = Tensor::new(slots.as_slice(), &Device::Cpu)?;
            let rows = |x: &Tensor| -> Result<Tensor> {
                Ok(x.index_select(&idx, 0)?
                    .to_dtype(cfg.dtype)?
                    .to_device(device)?)
            };
            let (k, v) = (rows(data.k)?, rows(data.v)?);
            cache.reserve(seq, n)?;
            for layer in 0..cfg.attn_layers {
                cache.write(layer, seq, at, &k, &v)?;
            }
            if at + n < len {
                cache.advance(seq, n)?;
            }
            at += n;
        }
    }
    let batch: Vec<SeqSlice> = (0..cfg.batch)
        .map(|b| SeqSlice::new(&cache, b as u64, b, len - 1, 1))
        .collect();
    let plan = plan_decode(&cache, &batch, true)?;
    let scale = 1.0 / (cfg.head_dim as f64).sqrt();
    let mut out = None;
    let ms = time_ms(cfg, device, progress, what, || {
        for layer in 0..cfg.attn_layers {
            out = Some(paged_attention(
                data.q, &cache, layer, &batch, &plan, scale, None,
            )?);
        }
        Ok(())
    })?;
    let out = out.context("no attention run")?.to_dtype(DType::F32)?;
    Ok((ms / cfg.attn_layers as f64, out))
}
