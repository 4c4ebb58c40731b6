//! The attention columns of `kvq bench-kv-cache` (see the parent module): one decode step of
//! paged attention per context length and mode, timed, and its largest difference from the
//! dense cache's output.

use super::{residual, time_ms, BenchConfig, Progress};
use crate::kv::attend::decode::decode_attention_rotated;
use crate::kv::format::rotation::{Rotation, DEFAULT_SEED};
use crate::kv::format::{KvFormat, KvWidths, LayerKv, QuantFormat};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;
use serde::Serialize;

/// One decode-step attention measurement; `bits == None` is the dense baseline.
#[derive(Debug, Clone, Serialize)]
pub struct AttnRow {
    pub seq_len: usize,
    pub mode: String,
    pub bits: Option<KvWidths>,
    /// Median time of one layer's decode attention for the whole batch.
    pub ms: f64,
    /// Dense time / this time, same context length.
    pub speedup_vs_dense: f64,
    /// max |output - dense output|.
    pub max_abs_error: f64,
    /// K and V bytes of the attended tokens (the bytes a step must read).
    pub kv_bytes: u64,
    /// kv_bytes / ms.
    pub kv_gbps: f64,
}

/// Seeded N(0,1) values, generated in parallel chunks (each chunk its own seeded generator, so
/// the data does not depend on the thread count).
fn randn_par(n: usize, seed: u64) -> Vec<f32> {
    const CH: usize = 1 << 16;
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CH).enumerate().for_each(|(i, c)| {
        let mut rng = StdRng::seed_from_u64(
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).rotate_left(32),
        );
        for x in c {
            *x = rng.sample(StandardNormal);
        }
    });
    v
}

/// Decode-step attention at context `len`: dense baseline, then each format, same data.
pub(super) fn rows(
    cfg: &BenchConfig,
    fmts: &[(QuantFormat, QuantFormat)],
    len: usize,
    device: &Device,
    progress: &dyn Progress,
) -> Result<Vec<AttnRow>> {
    let (kvh, d, bs, batch) = (cfg.heads, cfg.head_dim, cfg.block_size, cfg.batch);
    let heads = kvh * cfg.gqa;
    let per_seq = len.div_ceil(bs);
    let num_blocks = batch * per_seq;
    let (slots, width) = (num_blocks * bs, kvh * d);
    // Blocks in shuffled order, as a long-running pool hands them out.
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut StdRng::seed_from_u64(cfg.seed ^ 0xB10C));
    let tables = Tensor::from_vec(ids.clone(), (batch, per_seq), device)?;
    let starts = Tensor::zeros(batch, DType::U32, device)?;
    let lens = Tensor::from_vec(vec![len as u32; batch], batch, device)?;
    let salt = (len as u64) << 20;
    let k = Tensor::from_vec(
        randn_par(slots * width, cfg.seed ^ salt ^ 1),
        (slots, width),
        &Device::Cpu,
    )?;
    let v = Tensor::from_vec(
        randn_par(slots * width, cfg.seed ^ salt ^ 2),
        (slots, width),
        &Device::Cpu,
    )?;
    let q = Tensor::from_vec(
        randn_par(batch * heads * d, cfg.seed ^ salt ^ 3),
        (batch, heads, d),
        &Device::Cpu,
    )?
    .to_dtype(cfg.dtype)?
    .to_device(device)?;
    progress.step(&format!("attention data, {len} tokens"));
    let scale = 1.0 / (d as f32).sqrt();
    // (label, widths, format, through a cache with dense residual rows).
    let mut modes: Vec<(String, Option<KvWidths>, KvFormat, bool)> = vec![(
        format!("{} (dense)", cfg.dtype.as_str()),
        None,
        KvFormat::Dense(cfg.dtype),
        false,
    )];
    for (&widths, &(key, value)) in cfg.bits.iter().zip(fmts) {
        for rotated in [false, true] {
            if rotated && !cfg.rotated {
                continue;
            }
            let label = format!("{widths}-bit{}", if rotated { " rotated" } else { "" });
            let format = KvFormat::Affine {
                key,
                value,
                scale_dtype: cfg.scale_dtype(),
                rotated,
            };
            modes.push((label.clone(), Some(widths), format, false));
            if cfg.residual > 0 {
                modes.push((cfg.residual_label(&label), Some(widths), format, true));
            }
        }
    }
    let rotation = if cfg.rotated {
        Some(Rotation::new(d, DEFAULT_SEED, device)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    let mut dense: Option<(Tensor, f64)> = None;
    for (mode, bits, format, dense_rows) in modes {
        let what = format!("attention {mode}, {len} tokens");
        // (time per layer, output, bytes of dense copies read besides the rows).
        let (ms, out, copies) = if cfg.residual > 0 {
            let data = residual::Data {
                k: &k,
                v: &v,
                q: &q,
                ids: &ids,
                len,
            };
            let mode_of = (format, dense_rows);
            let (ms, out) = residual::time(cfg, mode_of, &data, device, progress, &what)?;
            let copied = if dense_rows {
                (cfg.residual + cfg.sinks).min(len)
            } else {
                0
            };
            (ms, out, (batch * copied * 2 * width * 2) as u64)
        } else {
            let rot = rotation.as_ref().filter(|_| format.is_rotated());
            let stored = |x: &Tensor| -> Result<Tensor> {
                let x = x.to_device(device)?;
                Ok(match rot {
                    Some(r) => r.rotate(&x)?,
                    None => x,
                })
            };
            // One pool per layer of the step (same contents, own memory, so no layer reads
            // another's bytes from cache), written in slices so the device never holds a second
            // f32 copy.
            let mut pools = Vec::with_capacity(cfg.attn_layers);
            for _ in 0..cfg.attn_layers {
                let pool = LayerKv::zeros(format, slots, width, device)?;
                let step = (1 << 24) / width.max(1);
                let mut first = 0;
                while first < slots {
                    let n = step.min(slots - first);
                    pool.write_run(
                        first,
                        &stored(&k.narrow(0, first, n)?)?,
                        &stored(&v.narrow(0, first, n)?)?,
                    )?;
                    first += n;
                }
                pools.push(pool);
            }
            let mut out = None;
            let step_ms = time_ms(cfg, device, progress, &what, || {
                for pool in &pools {
                    out = Some(decode_attention_rotated(
                        &q, pool, &tables, &starts, &lens, bs, kvh, scale, rot,
                    )?);
                }
                Ok(())
            })?;
            let out = out.context("no attention run")?.to_dtype(DType::F32)?;
            (step_ms / cfg.attn_layers as f64, out, 0)
        };
        let at = (bits, len, format, width, copies);
        rows.push(row(&mode, at, ms, &out, dense.as_ref())?);
        if dense.is_none() {
            dense = Some((out, ms));
        }
    }
    Ok(rows)
}

/// A measured mode's row: its time and output against the dense baseline's (`None`: this is
/// the baseline); `len` positions of each sequence in `format` (rows of `width` values), and
/// `copies` bytes of dense copies read besides them.
fn row(
    mode: &str,
    (bits, len, format, width, copies): (Option<KvWidths>, usize, KvFormat, usize, u64),
    ms: f64,
    out: &Tensor,
    dense: Option<&(Tensor, f64)>,
) -> Result<AttnRow> {
    let (err, base_ms) = match dense {
        None => (0.0, ms),
        Some((o, m)) => ((out - o)?.abs()?.max_all()?.to_scalar::<f32>()? as f64, *m),
    };
    let batch = out.dim(0)? as u64;
    let kv_bytes = batch * len as u64 * format.kv_row_bytes(width) as u64 + copies;
    Ok(AttnRow {
        seq_len: len,
        mode: mode.to_string(),
        bits,
        ms,
        speedup_vs_dense: base_ms / ms,
        max_abs_error: err,
        kv_bytes,
        kv_gbps: kv_bytes as f64 / (ms * 1e-3) / 1e9,
    })
}
