//! Affine group quantization of KV tensors, bit-exact with MLX's `mx.quantize` /
//! `mx.dequantize` (docs/ARCHITECTURE.md).
//!
//! A tensor `[..., D]` becomes `codes` (u32 `[..., D*bits/32]`, one LSB-first bit stream per
//! row), `scales` and `biases` (`[..., D/g]`). Parameters are computed in f32 and cast to the
//! scales' dtype — the input's for [`quantize`] (MLX; codes from the f32 parameters), or a
//! narrower one for f32 rows ([`quantize_as`]: f16 scales, what a cache computing in f32 stores;
//! codes from the rounded parameters).
//! [`dequantize`] runs in the scales' dtype (for f16/bf16: rounded after the product and after
//! the sum) — the golden vectors show MLX does exactly this; [`dequantize_as`] into f32 widens
//! the parameters and computes in f32.
//!
//! Three implementations, one contract:
//! - `cpu`: fused single-pass kernels, rayon over row blocks (the default path on CPU);
//! - `cuda` (`--features cuda`): fused kernels, one thread per 8 values;
//! - [`generic`]: candle tensor ops only, for every other backend and as the test reference.
//!
//! Why not `CustomOp`: a quantize produces three tensors and candle's custom ops return one.
//! The fused paths therefore read the input storage directly and build the three outputs with
//! `Tensor::from_storage` — one pass, no packed intermediate to split.
//!
//! Writing into a paged pool: the new rows are quantized into fresh (small) tensors by the fused
//! kernel and then copied into the pool's three tensors in place — a run of consecutive rows
//! with `slice_set` ([`quantize_rows_into`], the cache's write path: bounds checked on the host,
//! nothing read back from the device), arbitrary rows with `scatter_set` ([`quantize_into`]).
//! This keeps one kernel per backend, works on every backend, and costs one extra copy of the
//! *compressed* bytes of the new tokens only; history is never touched or re-quantized.

#[cfg(feature = "cuda")]
use super::cuda;
pub use super::quantized::Quantized;
use super::quantized::{check_input, check_quantized, with_last, wrap};
use super::side::SideWrites;
use super::{cpu, generic, Fit, QuantError, QuantFormat};

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};
use half::{bf16, f16};

/// Quantizes `x [..., D]` (f32, f16 or bf16), scales and biases in `x`'s dtype: MLX's
/// `mx.quantize`. Fused kernel on CPU (multi-threaded, rayon) and CUDA; generic candle ops on
/// every other backend.
pub fn quantize(x: &Tensor, fmt: QuantFormat) -> Result<Quantized> {
    quantize_as(x, fmt, x.dtype())
}

/// Quantizes `x [..., D]` with scales and biases stored as `scale_dtype` (f32, f16 or bf16),
/// from `x`'s own values (f32 rows are not rounded to a narrower `scale_dtype` first):
/// `quantize_as(x, fmt, x.dtype())` is [`quantize`]. For f32 rows into f16 / bf16 parameters
/// (what a cache computing in f32 stores, `super::scale_dtype_for`) the parameters are computed
/// in f32 as [`quantize`] does, rounded, and the codes computed from the rounded values: the
/// rounding of a group's bias is then absorbed by the codes instead of shifting the whole group
/// (a coherent error in every `q·k̂`). A half `x` with the other half type's parameters is
/// widened to f32 first (exact).
pub fn quantize_as(x: &Tensor, fmt: QuantFormat, scale_dtype: DType) -> Result<Quantized> {
    quantize_fitted(x, fmt, scale_dtype, Fit::MinMax)
}

/// [`quantize_as`] with each group's parameters chosen as `fit` says. [`Fit::LeastSquares`] runs
/// on the CPU; other backends keep [`Fit::MinMax`] (the same format: only the encoder differs).
pub fn quantize_fitted(
    x: &Tensor,
    fmt: QuantFormat,
    scale_dtype: DType,
    fit: Fit,
) -> Result<Quantized> {
    let (_, d) = check_input(x, fmt, "quantize")?;
    if !matches!(scale_dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(QuantError::DType {
            op: "quantize",
            dtype: scale_dtype,
        }
        .into());
    }
    let widened;
    let x = if x.dtype() != scale_dtype && x.dtype() != DType::F32 {
        widened = x.to_dtype(DType::F32)?;
        &widened
    } else {
        x
    };
    match x.device() {
        Device::Cpu => {
            let x = x.contiguous()?;
            quantize_cpu(&x, fmt, d, scale_dtype, fit)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let x = x.contiguous()?;
            cuda::quantize(&x, fmt, d, scale_dtype)
        }
        _ => generic::quantize_as(x, fmt, scale_dtype),
    }
}

/// Dequantizes into the scales' dtype, shape `[..., D]`: MLX's `mx.dequantize` (half types round
/// after the product and after the sum). Same dispatch as [`quantize`].
pub fn dequantize(q: &Quantized, fmt: QuantFormat) -> Result<Tensor> {
    dequantize_as(q, fmt, q.scales.dtype())
}

/// Dequantizes into `dtype`: [`dequantize`] when `dtype` is the scales' dtype; otherwise each
/// group's scale and bias widened to f32 and `code*scale + bias` computed in f32 (what the fused
/// decode kernels compute), then cast to `dtype` where that is not f32.
pub fn dequantize_as(q: &Quantized, fmt: QuantFormat, dtype: DType) -> Result<Tensor> {
    let (_, d) = check_quantized(q, fmt, "dequantize")?;
    let out = if dtype == q.scales.dtype() {
        dtype
    } else {
        DType::F32
    };
    let x = match q.codes.device() {
        Device::Cpu => dequantize_cpu(q, fmt, d, out)?,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::dequantize(q, fmt, d, out)?,
        _ => generic::dequantize_as(q, fmt, out)?,
    };
    x.to_dtype(dtype)
}

/// Checks `x [n, D]` against a pool of rank 2 in `fmt`; returns (pool rows, n).
fn check_rows_into(
    x: &Tensor,
    fmt: QuantFormat,
    dst: &Quantized,
    op: &'static str,
) -> Result<(usize, usize)> {
    let (pool_rows, d) = check_quantized(dst, fmt, op)?;
    if dst.codes.rank() != 2 || x.rank() != 2 || x.dim(1)? != d {
        let msg = format!(
            "expected x [n, {d}] and a pool of rank 2, got x {:?} and codes {:?}",
            x.dims(),
            dst.codes.dims()
        );
        return Err(QuantError::Shape { op, msg }.into());
    }
    Ok((pool_rows, x.dim(0)?))
}

/// Quantizes `x [n, D]` into rows `slots` (u32 `[n]`) of a preallocated pool: `dst.codes [slots,
/// D*bits/32]`, `dst.scales` / `dst.biases [slots, D/g]` (the pool's scale dtype; `x` is
/// quantized from its own values, as [`quantize_as`] does). Rows not named in `slots` are left
/// untouched.
pub fn quantize_into(x: &Tensor, fmt: QuantFormat, dst: &Quantized, slots: &Tensor) -> Result<()> {
    let op = "quantize_into";
    let (pool_rows, n) = check_rows_into(x, fmt, dst, op)?;
    let shape_err = |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
    if slots.dims() != [n] || slots.dtype() != DType::U32 {
        return Err(shape_err(format!(
            "slots must be u32 [{n}], got {:?} {:?}",
            slots.dtype(),
            slots.dims()
        )));
    }
    let max_slot = slots.max(0)?.to_scalar::<u32>()? as usize;
    if n > 0 && max_slot >= pool_rows {
        return Err(shape_err(format!(
            "slot {max_slot} is outside the pool of {pool_rows} rows"
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let q = quantize_as(x, fmt, dst.scales.dtype())?;
    let scatter = |pool: &Tensor, src: &Tensor| -> Result<()> {
        let idx = slots
            .unsqueeze(1)?
            .broadcast_as(src.shape())?
            .contiguous()?;
        pool.scatter_set(&idx, src, 0)
    };
    scatter(&dst.codes, &q.codes)?;
    scatter(&dst.scales, &q.scales)?;
    scatter(&dst.biases, &q.biases)
}

/// Quantizes `x [n, D]` into the consecutive rows `first..first + n` of a preallocated pool
/// (layout as in [`quantize_into`]); other rows are left untouched. This is the write path of
/// the cache (a run of tokens inside one block): the bounds are checked on the host from the
/// numbers given, with no index tensor to build and no device read-back, and the rows are
/// copied in place with `slice_set`.
pub fn quantize_rows_into(
    x: &Tensor,
    fmt: QuantFormat,
    fit: Fit,
    dst: &Quantized,
    first: usize,
) -> Result<()> {
    let op = "quantize_rows_into";
    let (pool_rows, n) = check_rows_into(x, fmt, dst, op)?;
    let shape_err = |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
    if first + n > pool_rows {
        return Err(shape_err(format!(
            "rows {first}..{} are outside the pool of {pool_rows} rows",
            first + n
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let q = quantize_fitted(x, fmt, dst.scales.dtype(), fit)?;
    dst.codes.slice_set(&q.codes, 0, first)?;
    dst.scales.slice_set(&q.scales, 0, first)?;
    dst.biases.slice_set(&q.biases, 0, first)
}

/// The pool slots of a batch's new rows, for [`quantize_into_rows`]: the list (bounds are
/// checked on the host) and its device copy, uploaded on first use and kept, so the K and V of
/// every layer of a step that write the same slots share one upload.
#[derive(Debug)]
pub struct SlotRows {
    host: Vec<u32>,
    dev: std::sync::OnceLock<Tensor>,
    /// `[n, width]`: each slot repeated along a row, the index a dense scatter takes.
    wide: std::sync::OnceLock<Tensor>,
}

impl SlotRows {
    pub fn new(host: Vec<u32>) -> Self {
        SlotRows {
            host,
            dev: std::sync::OnceLock::new(),
            wide: std::sync::OnceLock::new(),
        }
    }

    /// Slots whose device copies already exist: `dev` (u32 `[n]`) and `wide` (u32
    /// `[n, width]`, each slot repeated along its row), e.g. buffers a captured CUDA graph reads.
    pub fn preset(host: Vec<u32>, dev: Tensor, wide: Tensor) -> Self {
        SlotRows {
            host,
            dev: dev.into(),
            wide: wide.into(),
        }
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.host
    }

    /// The slots as a u32 tensor on `device` (uploaded once; another device gets its own copy).
    pub fn on(&self, device: &Device) -> Result<Tensor> {
        if let Some(t) = self.dev.get().filter(|t| t.device().same_device(device)) {
            return Ok(t.clone());
        }
        let t = Tensor::from_slice(&self.host, self.host.len(), device)?;
        let _ = self.dev.set(t.clone());
        Ok(t)
    }

    /// The slots as a contiguous u32 `[n, width]` tensor on `device`, slot `i` repeated along
    /// row `i` (the index of a row scatter), built once and shared by every layer's K and V.
    pub fn wide_on(&self, device: &Device, width: usize) -> Result<Tensor> {
        if let Some(t) = self
            .wide
            .get()
            .filter(|t| t.device().same_device(device) && t.dims() == [self.host.len(), width])
        {
            return Ok(t.clone());
        }
        let n = self.host.len();
        let t = self
            .on(device)?
            .reshape((n, 1))?
            .broadcast_as((n, width))?
            .contiguous()?;
        let _ = self.wide.set(t.clone());
        Ok(t)
    }
}

/// Quantizes `x [n, D]` into rows `rows[i]` of a preallocated pool (bounds checked on the host;
/// other rows untouched). On CUDA one fused launch quantizes every row straight into the pool;
/// elsewhere each run of consecutive rows goes through [`quantize_rows_into`]. This is the
/// cache's write path for a batch: one launch per layer and tensor, however many sequences
/// (a run per sequence would launch four kernels each).
pub fn quantize_into_rows(
    x: &Tensor,
    fmt: QuantFormat,
    fit: Fit,
    dst: &Quantized,
    slots: &SlotRows,
) -> Result<()> {
    let rows = slots.as_slice();
    let op = "quantize_into_rows";
    let (pool_rows, n) = check_rows_into(x, fmt, dst, op)?;
    check_slots(rows, n, pool_rows, op)?;
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(_) = x.device() {
        // As `quantize_as`: f32 rows stay f32, a half type other than the pool's is widened.
        let x = if matches!(x.dtype(), DType::F32) || x.dtype() == dst.scales.dtype() {
            x.contiguous()?
        } else {
            x.to_dtype(DType::F32)?
        };
        return cuda::quantize_into_rows(&x, fmt, dst, &slots.on(x.device())?);
    }
    for (i, len) in slot_runs(rows) {
        quantize_rows_into(&x.narrow(0, i, len)?, fmt, fit, dst, rows[i] as usize)?;
    }
    Ok(())
}

/// One slot per input row, each inside the pool.
fn check_slots(rows: &[u32], n: usize, pool_rows: usize, op: &'static str) -> Result<()> {
    let shape_err = |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
    if rows.len() != n {
        return Err(shape_err(format!("{} rows for {n} input rows", rows.len())));
    }
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= pool_rows) {
        return Err(shape_err(format!(
            "row {r} is outside the pool of {pool_rows} rows"
        )));
    }
    Ok(())
}

/// Whether [`quantize_rotated_into_rows`] has a fused kernel for rows like `x` into a pool of
/// `pool_dtype`: CUDA, rows in f32 or the pool's dtype, head_dim 64 or 128.
pub fn fused_rotation(x: &Tensor, pool_dtype: DType, head_dim: usize) -> bool {
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && (x.dtype() == DType::F32 || x.dtype() == pool_dtype)
        && matches!(head_dim, 64 | 128)
}

/// [`quantize_into_rows`] of K and V (`[n, d]`, `d` whole head vectors) after the rotated
/// scheme's rotation, whose sign vector is `signs` (f32 `[head_dim]`, see
/// [`Rotation`](super::rotation::Rotation)): one launch rotates and quantizes both, so a decode
/// step's write costs one kernel per layer instead of two matmuls, two casts and two quantize
/// launches. Only where [`fused_rotation`] holds; K in `kfmt`, V in `vfmt`: one format, or keys
/// one bit wider ([`QuantFormat::one_bit_wider`]).
/// `side`: what a captured decode step writes in the same launch ([`SideWrites`]).
#[allow(clippy::too_many_arguments)]
pub fn quantize_rotated_into_rows(
    k: &Tensor,
    v: &Tensor,
    (kfmt, vfmt): (QuantFormat, QuantFormat),
    dk: &Quantized,
    dv: &Quantized,
    slots: &SlotRows,
    signs: &Tensor,
    head_dim: usize,
    side: SideWrites,
) -> Result<()> {
    let op = "quantize_rotated_into_rows";
    let shape_err = |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
    side.check(k, op)?;
    if kfmt != vfmt && !QuantFormat::one_bit_wider(kfmt, vfmt) {
        return Err(shape_err(format!(
            "no fused kernel for {}-bit g{} keys with {}-bit g{} values",
            kfmt.bits(),
            kfmt.group_size(),
            vfmt.bits(),
            vfmt.group_size()
        )));
    }
    let (pool_rows, n) = check_rows_into(k, kfmt, dk, op)?;
    let (pool_rows_v, n_v) = check_rows_into(v, vfmt, dv, op)?;
    let pool_dtype = dk.scales.dtype();
    if k.dtype() != v.dtype()
        || !fused_rotation(k, pool_dtype, head_dim)
        || !fused_rotation(v, pool_dtype, head_dim)
    {
        return Err(shape_err(format!(
            "no fused kernel for {:?} rows of head_dim {head_dim} on {:?}",
            k.dtype(),
            k.device().location()
        )));
    }
    if (pool_rows_v, n_v) != (pool_rows, n) || dk.scales.dtype() != dv.scales.dtype() {
        return Err(shape_err(format!(
            "K and V differ: {n} / {n_v} rows into pools of {pool_rows} / {pool_rows_v} rows"
        )));
    }
    if !k.dim(1)?.is_multiple_of(head_dim) || signs.dims() != [head_dim] {
        return Err(shape_err(format!(
            "rows of {} values and signs {:?} do not fit head_dim {head_dim}",
            k.dim(1)?,
            signs.dims()
        )));
    }
    check_slots(slots.as_slice(), n, pool_rows, op)?;
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        let signs = signs.to_dtype(DType::F32)?.contiguous()?;
        let fmts = (kfmt, vfmt);
        let rows = slots.on(k.device())?;
        cuda::quantize_rot_into_rows(k, v, fmts, dk, dv, &rows, &signs, head_dim, side)
    }
    #[cfg(not(feature = "cuda"))]
    Err(shape_err("kvq was built without the cuda feature".into()))
}

/// The runs of consecutive slots in `rows`, as (first index, length).
pub(crate) fn slot_runs(rows: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= rows.len() {
            return None;
        }
        let start = i;
        i += 1;
        while i < rows.len() && rows[i] == rows[i - 1] + 1 {
            i += 1;
        }
        Some((start, i - start))
    })
}

/// [`quantize_as`] on the CPU: input of the scales' dtype, or f32 (the caller widened the rest).
fn quantize_cpu(x: &Tensor, fmt: QuantFormat, d: usize, sdt: DType, fit: Fit) -> Result<Quantized> {
    let rows = x.elem_count() / d;
    let (words, groups) = (fmt.words_per_row(d), fmt.groups_per_row(d));
    let (storage, layout) = x.storage_and_layout();
    let (lo, hi) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("quantize: input is not contiguous".into()))?;
    let nc = rows * words;
    let mut codes = Vec::with_capacity(nc);
    fn run<X: cpu::Elem, S: cpu::Elem>(
        x: &[X],
        d: usize,
        (fmt, fit): (QuantFormat, Fit),
        codes: &mut Vec<u32>,
        nc: usize,
        n: usize,
    ) -> (Vec<S>, Vec<S>) {
        let (mut s, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
        cpu::quantize(
            x,
            d,
            (fmt.bits(), fmt.group_size()),
            fit,
            &mut codes.spare_capacity_mut()[..nc],
            &mut s.spare_capacity_mut()[..n],
            &mut b.spare_capacity_mut()[..n],
        );
        // SAFETY: the kernel writes every element of the slices it is given (no zero fill pass
        // before the one real write).
        unsafe {
            codes.set_len(nc);
            s.set_len(n);
            b.set_len(n);
        }
        (s, b)
    }
    let n = rows * groups;
    macro_rules! go {
        ($v:expr, $s:ty, $variant:ident) => {{
            let (s, b) = run::<_, $s>(&$v[lo..hi], d, (fmt, fit), &mut codes, nc, n);
            (CpuStorage::$variant(s), CpuStorage::$variant(b))
        }};
    }
    let (scales, biases) = match (&*storage, sdt) {
        (Storage::Cpu(CpuStorage::F32(v)), DType::F32) => go!(v, f32, F32),
        (Storage::Cpu(CpuStorage::F32(v)), DType::F16) => go!(v, f16, F16),
        (Storage::Cpu(CpuStorage::F32(v)), DType::BF16) => go!(v, bf16, BF16),
        (Storage::Cpu(CpuStorage::F16(v)), DType::F16) => go!(v, f16, F16),
        (Storage::Cpu(CpuStorage::BF16(v)), DType::BF16) => go!(v, bf16, BF16),
        _ => {
            return Err(QuantError::DType {
                op: "quantize",
                dtype: x.dtype(),
            }
            .into())
        }
    };
    Ok(Quantized {
        codes: wrap(Storage::Cpu(CpuStorage::U32(codes)), with_last(x, words)),
        scales: wrap(Storage::Cpu(scales), with_last(x, groups)),
        biases: wrap(Storage::Cpu(biases), with_last(x, groups)),
    })
}

/// [`dequantize_as`] on the CPU into `out`: the scales' dtype or f32.
fn dequantize_cpu(q: &Quantized, fmt: QuantFormat, d: usize, out: DType) -> Result<Tensor> {
    let (codes, scales, biases) = (
        q.codes.contiguous()?,
        q.scales.contiguous()?,
        q.biases.contiguous()?,
    );
    let rows = scales.elem_count() / fmt.groups_per_row(d);
    let (cs, cl) = codes.storage_and_layout();
    let (ss, sl) = scales.storage_and_layout();
    let (bs, bl) = biases.storage_and_layout();
    let range = |l: &candle_core::Layout| {
        l.contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("dequantize: input is not contiguous".into()))
    };
    let ((c0, c1), (s0, s1), (b0, b1)) = (range(cl)?, range(sl)?, range(bl)?);
    let Storage::Cpu(CpuStorage::U32(cv)) = &*cs else {
        return Err(candle_core::Error::Msg(
            "dequantize: codes must be u32 on the CPU".into(),
        ));
    };
    let cv = &cv[c0..c1];
    fn run<S: cpu::Elem, O: cpu::Elem>(
        cv: &[u32],
        s: &[S],
        b: &[S],
        d: usize,
        fmt: QuantFormat,
        len: usize,
    ) -> Vec<O> {
        let mut out = Vec::with_capacity(len);
        cpu::dequantize(
            cv,
            s,
            b,
            d,
            fmt.bits(),
            fmt.group_size(),
            &mut out.spare_capacity_mut()[..len],
        );
        // SAFETY: the kernel writes every element of `out` (no zero fill pass before it).
        unsafe { out.set_len(len) };
        out
    }
    let len = rows * d;
    macro_rules! go {
        ($s:expr, $b:expr, $o:ty, $variant:ident) => {
            CpuStorage::$variant(run::<_, $o>(cv, &$s[s0..s1], &$b[b0..b1], d, fmt, len))
        };
    }
    use Storage::Cpu;
    let out = match (&*ss, &*bs, out) {
        (Cpu(CpuStorage::F32(s)), Cpu(CpuStorage::F32(b)), DType::F32) => go!(s, b, f32, F32),
        (Cpu(CpuStorage::F16(s)), Cpu(CpuStorage::F16(b)), DType::F16) => go!(s, b, f16, F16),
        (Cpu(CpuStorage::BF16(s)), Cpu(CpuStorage::BF16(b)), DType::BF16) => go!(s, b, bf16, BF16),
        (Cpu(CpuStorage::F16(s)), Cpu(CpuStorage::F16(b)), DType::F32) => go!(s, b, f32, F32),
        (Cpu(CpuStorage::BF16(s)), Cpu(CpuStorage::BF16(b)), DType::F32) => go!(s, b, f32, F32),
        _ => {
            return Err(QuantError::DType {
                op: "dequantize",
                dtype: q.scales.dtype(),
            }
            .into())
        }
    };
    Ok(wrap(Storage::Cpu(out), with_last(&q.scales, d)))
}

#[cfg(test)]
mod slot_run_tests {
    use super::slot_runs;

    #[test]
    fn runs_split_at_gaps_and_descents() {
        let runs: Vec<_> = slot_runs(&[3, 4, 5, 9, 1, 0, 1]).collect();
        assert_eq!(runs, [(0, 3), (3, 1), (4, 1), (5, 2)]);
        assert_eq!(slot_runs(&[]).count(), 0);
        assert_eq!(slot_runs(&[7]).collect::<Vec<_>>(), [(0, 1)]);
    }
}
