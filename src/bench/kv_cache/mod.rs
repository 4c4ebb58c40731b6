//! The measurement behind `kvq bench-kv-cache`: memory, error and speed of quantized KV tensors
//! against the dense cache, on seeded N(0,1) K and V for every layer.
//!
//! Memory figures are computed from the format (exact stored bytes, no allocation needed).
//! Times are medians over repeats of quantizing (resp. dequantizing) K and V of every layer,
//! device-synchronised, and a copy of the same dense tensors is timed in the same run so that
//! throughputs are comparable: every GB/s here is (bytes read + bytes written) / time, 1 GB =
//! 1e9 bytes. Quantize reads the dense tensors and writes codes + scales + biases; dequantize
//! does the reverse; the copy reads and writes the dense tensors.
//!
//! Attention columns: for each context length of `seq_lens`, one decode step of attention
//! ([`decode_attention`]) for a batch of `batch` sequences over one layer's paged pool (blocks of
//! `block_size` tokens in shuffled order, `heads` KV heads, `heads * gqa` query heads), per mode:
//! the dense cache of `dtype` and each setting of `bits` (one width, or keys and values of
//! different widths as `--kv-bits 4.5` stores them). Times are per layer, medians, device-synchronised;
//! the error is max |out - out_dense| over the attention outputs (same K/V data, same queries).

use crate::kv::format::rotation::Rotation;
use crate::kv::format::{self, KvWidths, QuantFormat, Quantized};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

mod attention;
mod residual;
pub use attention::AttnRow;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct BenchConfig {
    pub layers: usize,
    /// Layers per timed decode-attention step (each its own pool; time reported per layer).
    pub attn_layers: usize,
    /// Tokens per sequence of the memory/quantize table (the first of `--seq-len`).
    pub seq_len: usize,
    /// Context lengths of the attention measurement (all of `--seq-len`); empty = none.
    pub seq_lens: Vec<usize>,
    /// Query heads per KV head in the attention measurement.
    pub gqa: usize,
    /// Tokens per cache block in the attention measurement.
    pub block_size: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub batch: usize,
    /// The quantized settings, one table row each.
    pub bits: Vec<KvWidths>,
    pub group_size: usize,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub seed: u64,
    pub warmup: usize,
    pub repeats: usize,
    /// Also time the rotated scheme in the attention table (its query and output rotations
    /// included in the time).
    pub rotated: bool,
    /// Also time each quantized mode with this many newest positions (and `sinks` first ones)
    /// attended through dense copies (`--kv-residual`, `--kv-sinks`), keys centred or not
    /// (`--kv-center`); 0: no such rows.
    pub residual: usize,
    pub sinks: usize,
    pub center: bool,
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.as_str())
}

impl BenchConfig {
    /// Refuses settings that cannot be measured, with one-line causes.
    pub fn validate(&self) -> Result<Vec<(QuantFormat, QuantFormat)>> {
        for (name, v) in [
            ("--layers", self.layers),
            ("--attn-layers", self.attn_layers),
            ("--seq-len", self.seq_len),
            ("--heads", self.heads),
            ("--head-dim", self.head_dim),
            ("--batch", self.batch),
            ("--repeats", self.repeats),
            ("--gqa", self.gqa),
            ("--block-size", self.block_size),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1");
            }
        }
        if self.seq_lens.contains(&0) {
            bail!("--seq-len entries must be at least 1");
        }
        self.check_memory(crate::device::available_memory_bytes())?;
        if !matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!("--dtype must be f16, bf16 or f32");
        }
        if self.bits.is_empty() {
            bail!("--bits needs at least one bit width (allowed: 2, 3, 4, 5, 6, 8)");
        }
        let fmts = self
            .bits
            .iter()
            .map(|&b| b.formats(self.group_size))
            .collect::<Result<Vec<_>, _>>()
            .context("invalid --bits / --group-size")?;
        if let Some((k, _)) = fmts.first() {
            k.check_dim(self.head_dim)
                .context("--head-dim must be a multiple of --group-size")?;
        }
        if self.rotated {
            Rotation::check(self.head_dim).map_err(|e| anyhow::anyhow!("--rotated: {e}"))?;
        }
        self.validate_residual()?;
        Ok(fmts)
    }

    /// Checks `--residual`, `--sinks` and `--center` as the cache flags they stand for.
    fn validate_residual(&self) -> Result<()> {
        use crate::kv::cache::config::{MAX_RESIDUAL, MAX_SINKS};
        if self.residual > MAX_RESIDUAL {
            bail!(
                "--residual must be between 0 and {MAX_RESIDUAL} (got {})",
                self.residual
            );
        }
        if self.sinks > MAX_SINKS {
            bail!(
                "--sinks must be between 0 and {MAX_SINKS} (got {})",
                self.sinks
            );
        }
        if (self.sinks > 0 || self.center) && self.residual == 0 {
            bail!("--sinks and --center time the --residual rows: add --residual N");
        }
        if self.residual > 0 && self.seq_lens.is_empty() {
            bail!("--residual times decode attention: drop --no-attention");
        }
        Ok(())
    }

    /// The label of a mode's row with dense residual rows.
    pub fn residual_label(&self, mode: &str) -> String {
        let mut label = format!("{mode} + {} dense", self.residual);
        if self.sinks > 0 {
            label += &format!(" + {} sinks", self.sinks);
        }
        if self.center {
            label += ", centred keys";
        }
        label
    }

    /// Refuses shapes whose tensors (K and V of every layer, and the attention pools) need more
    /// than `available` bytes, or whose sizes overflow: before anything is allocated.
    fn check_memory(&self, available: usize) -> Result<()> {
        let longest = self
            .seq_lens
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(self.seq_len);
        let mul = |xs: &[usize]| xs.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        let size = self.dtype.size_in_bytes();
        let tensors = mul(&[
            2,
            self.layers,
            self.batch,
            self.heads,
            self.seq_len,
            self.head_dim,
            size,
        ]);
        let kv_heads = self.heads.div_ceil(self.gqa);
        let pools = mul(&[
            2,
            self.attn_layers,
            self.batch,
            longest,
            kv_heads,
            self.head_dim,
            4,
        ]);
        let need = tensors.zip(pools).and_then(|(a, b)| a.checked_add(b));
        match need {
            Some(n) if n <= available => Ok(()),
            _ => bail!(
                "these shapes need {} of memory (2 x --layers {} x --batch {} x --heads {} x \
                 --seq-len {} x --head-dim {}, plus the attention pools), more than the {} \
                 available now: lower them",
                need.map_or("more than 16 EiB".into(), crate::engine::stats::fmt_bytes),
                self.layers,
                self.batch,
                self.heads,
                self.seq_len,
                self.head_dim,
                crate::engine::stats::fmt_bytes(available)
            ),
        }
    }

    /// Values in K (or V) of one layer.
    pub fn values_per_tensor(&self) -> usize {
        self.batch * self.heads * self.seq_len * self.head_dim
    }

    /// Values in K and V of all layers.
    pub fn values(&self) -> u64 {
        2 * self.layers as u64 * self.values_per_tensor() as u64
    }

    /// Bytes of the dense cache (K and V, all layers).
    pub fn dense_bytes(&self) -> u64 {
        self.values() * self.dtype.size_in_bytes() as u64
    }

    /// Bytes of the quantized cache: codes plus scales and biases as the cache stores them, K in
    /// `key`'s format and V in `value`'s.
    pub fn quantized_bytes(&self, key: QuantFormat, value: QuantFormat) -> u64 {
        // Rows of K (or V) of all layers.
        let rows = self.values() / 2 / self.head_dim as u64;
        let row = |f: QuantFormat| f.bytes_per_row(self.head_dim, self.scale_dtype()) as u64;
        rows * (row(key) + row(value))
    }

    /// The dtype of the scales and biases a cache computing in `dtype` stores
    /// ([`format::scale_dtype_for`]).
    pub fn scale_dtype(&self) -> DType {
        format::scale_dtype_for(self.dtype)
    }
}

/// One table row; `bits == None` is the dense baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub mode: String,
    pub bits: Option<KvWidths>,
    pub bytes: u64,
    pub compression: f64,
    pub bits_per_value: f64,
    pub mean_error: f64,
    pub max_error: f64,
    pub quantize_ms: Option<f64>,
    pub dequantize_ms: Option<f64>,
    /// Quantize + dequantize bytes moved over their summed time (the copy's GB/s for the baseline).
    pub gbps: f64,
    pub quantize_gbps: Option<f64>,
    pub dequantize_gbps: Option<f64>,
    /// quantize_gbps / memcpy_gbps of the same run.
    pub quantize_vs_memcpy: Option<f64>,
    pub dequantize_vs_memcpy: Option<f64>,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: BenchConfig,
    pub device: String,
    pub threads: usize,
    pub memcpy_ms: f64,
    pub memcpy_gbps: f64,
    pub rows: Vec<Row>,
    pub attention: Vec<AttnRow>,
}

/// Progress callback: called once per finished step, with the total number of steps first.
pub trait Progress {
    fn start(&self, total: u64);
    fn step(&self, msg: &str);
}

/// Steps [`run`] reports, for sizing a progress bar.
fn total_steps(cfg: &BenchConfig) -> u64 {
    let timed = (cfg.warmup + cfg.repeats) as u64;
    let schemes = 1 + cfg.rotated as u64;
    let modes = 1 + cfg.bits.len() as u64 * schemes * (1 + (cfg.residual > 0) as u64);
    1 + timed
        + cfg.bits.len() as u64 * (2 * timed + 1)
        + cfg.seq_lens.len() as u64 * (1 + modes * timed)
}

fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// Seeded N(0,1) K and V for every layer, in the cache dtype on `device`.
fn make_tensors(cfg: &BenchConfig, device: &Device) -> Result<Vec<Tensor>> {
    let n = cfg.values_per_tensor();
    let shape = (cfg.batch, cfg.heads, cfg.seq_len, cfg.head_dim);
    (0..2 * cfg.layers)
        .map(|i| {
            // One generator per (layer, K|V), seeded from --seed: the data does not depend on
            // how many threads ran.
            let mut rng =
                StdRng::seed_from_u64(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
            let v: Vec<f32> = (0..n).map(|_| rng.sample(StandardNormal)).collect();
            Ok(Tensor::from_vec(v, shape, &Device::Cpu)?
                .to_dtype(cfg.dtype)?
                .to_device(device)?)
        })
        .collect()
}

/// Copies a contiguous tensor into new storage: rayon over chunks on CPU (as many threads as the
/// kernels), the device's own copy elsewhere.
fn copy(t: &Tensor) -> Result<Tensor> {
    // Like the quantize / dequantize outputs, the destination is written once, with no zero
    // fill before it.
    fn par_copy<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
        let mut dst = Vec::with_capacity(src.len());
        dst.spare_capacity_mut()[..src.len()]
            .par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| {
                // SAFETY: `d` and `s` have the same length and do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), d.as_mut_ptr().cast(), s.len()) }
            });
        // SAFETY: every element was written above.
        unsafe { dst.set_len(src.len()) };
        dst
    }
    if !t.device().is_cpu() {
        return Ok(t.copy()?);
    }
    let (s, l) = t.storage_and_layout();
    let (a, b) = l
        .contiguous_offsets()
        .context("copy of a non-contiguous tensor")?;
    let out = match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => CpuStorage::F32(par_copy(&v[a..b])),
        Storage::Cpu(CpuStorage::F16(v)) => CpuStorage::F16(par_copy(&v[a..b])),
        Storage::Cpu(CpuStorage::BF16(v)) => CpuStorage::BF16(par_copy(&v[a..b])),
        _ => bail!("copy: unsupported dtype {:?}", t.dtype()),
    };
    Ok(Tensor::from_storage(
        Storage::Cpu(out),
        t.shape().clone(),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median wall time in ms of `f` over `repeats`, after `warmup` untimed runs; `f` must leave the
/// device idle (it is synchronised before the clock stops).
fn time_ms(
    cfg: &BenchConfig,
    device: &Device,
    progress: &dyn Progress,
    what: &str,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let mut times = Vec::with_capacity(cfg.repeats);
    for i in 0..cfg.warmup + cfg.repeats {
        device.synchronize()?;
        let t0 = Instant::now();
        f()?;
        device.synchronize()?;
        if i >= cfg.warmup {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        progress.step(what);
    }
    Ok(median(times))
}

/// Mean and max |x - x̂| over all tensors (tensor `i` in format `fmt_of(i)`), accumulated in f64.
fn errors(
    xs: &[Tensor],
    qs: &[Quantized],
    fmt_of: impl Fn(usize) -> QuantFormat,
) -> Result<(f64, f64)> {
    let (mut sum, mut max, mut count) = (0f64, 0f64, 0u64);
    for (i, (x, q)) in xs.iter().zip(qs).enumerate() {
        let deq = format::dequantize_as(q, fmt_of(i), DType::F32)?;
        let diff = (x.to_dtype(DType::F32)? - deq)?.abs()?;
        sum += diff.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        max = max.max(diff.max_all()?.to_scalar::<f32>()? as f64);
        count += x.elem_count() as u64;
    }
    Ok((sum / count as f64, max))
}

/// Runs the whole measurement.
pub fn run(cfg: &BenchConfig, device: &Device, progress: &dyn Progress) -> Result<Report> {
    let fmts = cfg.validate()?;
    progress.start(total_steps(cfg));
    let xs = make_tensors(cfg, device).context("cannot build the K/V tensors")?;
    progress.step("generated K/V");
    let dense = cfg.dense_bytes();
    let gb = |bytes: u64, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;

    let memcpy_ms = time_ms(cfg, device, progress, "memcpy", || {
        for x in &xs {
            drop(copy(x)?);
        }
        Ok(())
    })?;
    let memcpy_gbps = gb(2 * dense, memcpy_ms);
    let dense_bits = (cfg.dtype.size_in_bytes() * 8) as f64;
    let mut rows = vec![Row {
        mode: format!("{} (dense)", cfg.dtype.as_str()),
        bits: None,
        bytes: dense,
        compression: 1.0,
        bits_per_value: dense_bits,
        mean_error: 0.0,
        max_error: 0.0,
        quantize_ms: None,
        dequantize_ms: None,
        gbps: memcpy_gbps,
        quantize_gbps: None,
        dequantize_gbps: None,
        quantize_vs_memcpy: None,
        dequantize_vs_memcpy: None,
    }];

    for (&widths, &(kf, vf)) in cfg.bits.iter().zip(&fmts) {
        // `xs` alternates K and V of each layer; each takes its own side's format.
        let fmt_of = |i: usize| if i.is_multiple_of(2) { kf } else { vf };
        // Each result is dropped before the next tensor, exactly like the copy's and the
        // dequantize's, so all three time the same allocation pattern; the kept set is made
        // untimed.
        let q_ms = time_ms(
            cfg,
            device,
            progress,
            &format!("quantize {widths}-bit"),
            || {
                for (i, x) in xs.iter().enumerate() {
                    drop(format::quantize_as(x, fmt_of(i), cfg.scale_dtype())?);
                }
                Ok(())
            },
        )?;
        let qs = xs
            .iter()
            .enumerate()
            .map(|(i, x)| format::quantize_as(x, fmt_of(i), cfg.scale_dtype()))
            .collect::<candle_core::Result<Vec<Quantized>>>()?;
        let dq_ms = time_ms(
            cfg,
            device,
            progress,
            &format!("dequantize {widths}-bit"),
            || {
                for (i, q) in qs.iter().enumerate() {
                    drop(format::dequantize_as(q, fmt_of(i), cfg.dtype)?);
                }
                Ok(())
            },
        )?;
        let bytes: u64 = qs.iter().map(|q| q.bytes() as u64).sum();
        debug_assert_eq!(bytes, cfg.quantized_bytes(kf, vf));
        let (mean_error, max_error) = errors(&xs, &qs, fmt_of)?;
        progress.step(&format!("errors {widths}-bit"));
        let moved = dense + bytes;
        let (qg, dqg) = (gb(moved, q_ms), gb(moved, dq_ms));
        let scales = cfg.scale_dtype();
        rows.push(Row {
            mode: format!("{widths}-bit"),
            bits: Some(widths),
            bytes,
            compression: dense as f64 / bytes as f64,
            bits_per_value: (kf.bits_per_value(scales) + vf.bits_per_value(scales)) / 2.0,
            mean_error,
            max_error,
            quantize_ms: Some(q_ms),
            dequantize_ms: Some(dq_ms),
            gbps: gb(2 * moved, q_ms + dq_ms),
            quantize_gbps: Some(qg),
            dequantize_gbps: Some(dqg),
            quantize_vs_memcpy: Some(qg / memcpy_gbps),
            dequantize_vs_memcpy: Some(dqg / memcpy_gbps),
        });
    }
    drop(xs);
    let mut attention = Vec::new();
    for &len in &cfg.seq_lens {
        attention.extend(attention::rows(cfg, &fmts, len, device, progress)?);
    }
    Ok(Report {
        config: cfg.clone(),
        device: device_name(device),
        threads: crate::ops::pool::threads(),
        memcpy_ms,
        memcpy_gbps,
        rows,
        attention,
    })
}
