//! Launches the fused CUDA kernels of `kernels/quant.cu` (one thread per 8 values).

use super::quantized::{with_last, wrap, Quantized};
use super::side::{DenseCopies, SideWrites};
use super::{QuantError, QuantFormat};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Result, Storage, StorageRef, Tensor, WithDType};
use half::{bf16, f16};

use crate::device::kernels::{aligned, dtype_suffix, kernel, view, Module};

const THREADS: u32 = 256;
/// Chunks of 8 values per quantize thread (`KVQ_Q_UNROLL` in kernels/quant.cu).
const QUANT_UNROLL: usize = 4;

fn launch_cfg(nchunks: usize, per_thread: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (nchunks.div_ceil(THREADS as usize * per_thread) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn dtype_name(dtype: DType) -> Result<&'static str> {
    dtype_suffix(dtype).ok_or_else(|| {
        QuantError::DType {
            op: "quantize",
            dtype,
        }
        .into()
    })
}

fn cuda_parts(t: &Tensor) -> Result<(StorageRef<'_>, usize, usize)> {
    let (s, l) = t.storage_and_layout();
    let (o1, o2) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("kvq quant: non-contiguous CUDA input".into()))?;
    Ok((s, o1, o2))
}

fn as_cuda(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => Err(candle_core::Error::Msg(
            "kvq quant: expected CUDA storage".into(),
        )),
    }
}

/// The device and the freshly written codes, scales and biases of one quantize launch.
type Outputs<T> = (CudaDevice, CudaSlice<u32>, CudaSlice<T>, CudaSlice<T>);

/// Quantizes `x` (contiguous; of `sdt`, or f32) with parameters of `sdt`
/// (`quantize_<x>_<s>_b<bits>`).
pub(super) fn quantize(x: &Tensor, fmt: QuantFormat, d: usize, sdt: DType) -> Result<Quantized> {
    let x = aligned(x)?;
    fn run<X: CudaDType + DeviceRepr + WithDType, T: CudaDType + DeviceRepr + WithDType>(
        x: &Tensor,
        fmt: QuantFormat,
        d: usize,
    ) -> Result<Outputs<T>> {
        let (st, o1, o2) = cuda_parts(x)?;
        let cs = as_cuda(&st)?;
        let dev = cs.device.clone();
        let xs = cs.as_cuda_slice::<X>()?.slice(o1..o2);
        let n = o2 - o1;
        let rows = n / d;
        let codes = unsafe { dev.alloc::<u32>(rows * fmt.words_per_row(d))? };
        let scales = unsafe { dev.alloc::<T>(rows * fmt.groups_per_row(d))? };
        let biases = unsafe { dev.alloc::<T>(rows * fmt.groups_per_row(d))? };
        let name = format!(
            "quantize_{}_{}_b{}",
            dtype_name(X::DTYPE)?,
            dtype_name(T::DTYPE)?,
            fmt.bits()
        );
        let f = kernel(&dev, Module::Quant, &name)?;
        let (nchunks, group) = ((n / 8) as u64, fmt.group_size() as i32);
        let mut b = f.builder();
        b.arg(&xs)
            .arg(&codes)
            .arg(&scales)
            .arg(&biases)
            .arg(&nchunks)
            .arg(&group);
        unsafe { b.launch(launch_cfg(n / 8, QUANT_UNROLL)) }.w()?;
        drop(st);
        Ok((dev, codes, scales, biases))
    }
    let (words, groups) = (fmt.words_per_row(d), fmt.groups_per_row(d));
    macro_rules! done {
        ($x:ty, $t:ty) => {{
            let (dev, c, s, b) = run::<$x, $t>(&x, fmt, d)?;
            Quantized {
                codes: wrap(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(c, dev.clone())),
                    with_last(&x, words),
                ),
                scales: wrap(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                    with_last(&x, groups),
                ),
                biases: wrap(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(b, dev)),
                    with_last(&x, groups),
                ),
            }
        }};
    }
    Ok(match (x.dtype(), sdt) {
        (DType::F32, DType::F32) => done!(f32, f32),
        (DType::F32, DType::F16) => done!(f32, f16),
        (DType::F32, DType::BF16) => done!(f32, bf16),
        (DType::F16, DType::F16) => done!(f16, f16),
        (DType::BF16, DType::BF16) => done!(bf16, bf16),
        (other, _) => {
            return Err(QuantError::DType {
                op: "quantize",
                dtype: other,
            }
            .into())
        }
    })
}

/// Quantizes `x [n, d]` (the pool's dtype or f32, contiguous) into rows `rows` (u32 `[n]`, on
/// the device) of `dst` in place: one launch, the pool's buffers written by the kernel (as
/// `slice_set` writes them through its storage). The caller has checked shapes and bounds.
pub(super) fn quantize_into_rows(
    x: &Tensor,
    fmt: QuantFormat,
    dst: &Quantized,
    rows: &Tensor,
) -> Result<()> {
    let x = aligned(x)?;
    let (d, n) = (x.dim(1)?, x.elem_count());
    fn run<X: CudaDType + DeviceRepr + WithDType, T: CudaDType + DeviceRepr + WithDType>(
        x: &Tensor,
        fmt: QuantFormat,
        dst: &Quantized,
        rows: &Tensor,
        d: usize,
        n: usize,
    ) -> Result<()> {
        let (st, o1, o2) = cuda_parts(x)?;
        let cs = as_cuda(&st)?;
        let dev = cs.device.clone();
        let xs = cs.as_cuda_slice::<X>()?.slice(o1..o2);
        let (cst, cl) = dst.codes.storage_and_layout();
        let (sst, sl) = dst.scales.storage_and_layout();
        let (bst, bl) = dst.biases.storage_and_layout();
        let whole = |l: &candle_core::Layout| -> Result<()> {
            if l.start_offset() == 0 && l.is_contiguous() {
                Ok(())
            } else {
                Err(candle_core::Error::Msg(
                    "quantize_into_rows: the pool must be a whole contiguous tensor".into(),
                ))
            }
        };
        whole(cl)?;
        whole(sl)?;
        whole(bl)?;
        let codes = as_cuda(&cst)?.as_cuda_slice::<u32>()?;
        let scales = as_cuda(&sst)?.as_cuda_slice::<T>()?;
        let biases = as_cuda(&bst)?.as_cuda_slice::<T>()?;
        let (rst, r1, r2) = cuda_parts(rows)?;
        let rows_dev = as_cuda(&rst)?.as_cuda_slice::<u32>()?.slice(r1..r2);
        let name = format!(
            "quantize_rows_{}_{}_b{}",
            dtype_name(X::DTYPE)?,
            dtype_name(T::DTYPE)?,
            fmt.bits()
        );
        let f = kernel(&dev, Module::Quant, &name)?;
        let (nchunks, group, cpr) = ((n / 8) as u64, fmt.group_size() as i32, (d / 8) as u64);
        let mut b = f.builder();
        b.arg(&xs)
            .arg(codes)
            .arg(scales)
            .arg(biases)
            .arg(&nchunks)
            .arg(&group)
            .arg(&rows_dev)
            .arg(&cpr);
        unsafe { b.launch(launch_cfg(n / 8, QUANT_UNROLL)) }.w()?;
        Ok(())
    }
    match (x.dtype(), dst.scales.dtype()) {
        (DType::F32, DType::F32) => run::<f32, f32>(&x, fmt, dst, rows, d, n),
        (DType::F32, DType::F16) => run::<f32, f16>(&x, fmt, dst, rows, d, n),
        (DType::F32, DType::BF16) => run::<f32, bf16>(&x, fmt, dst, rows, d, n),
        (DType::F16, DType::F16) => run::<f16, f16>(&x, fmt, dst, rows, d, n),
        (DType::BF16, DType::BF16) => run::<bf16, bf16>(&x, fmt, dst, rows, d, n),
        (other, _) => Err(QuantError::DType {
            op: "quantize_into_rows",
            dtype: other,
        }
        .into()),
    }
}

/// Dequantizes into `out`: the scales' dtype, or f32 (`dequantize_<s>_<o>_b<bits>`).
pub(super) fn dequantize(q: &Quantized, fmt: QuantFormat, d: usize, out: DType) -> Result<Tensor> {
    let (codes, scales, biases) = (
        q.codes.contiguous()?,
        q.scales.contiguous()?,
        q.biases.contiguous()?,
    );
    fn run<T: CudaDType + DeviceRepr + WithDType, O: CudaDType + DeviceRepr + WithDType>(
        codes: &Tensor,
        scales: &Tensor,
        biases: &Tensor,
        fmt: QuantFormat,
    ) -> Result<CudaStorage> {
        let (cst, c1, c2) = cuda_parts(codes)?;
        let (sst, s1, s2) = cuda_parts(scales)?;
        let (bst, b1, b2) = cuda_parts(biases)?;
        let cs = as_cuda(&cst)?;
        let dev = cs.device.clone();
        let cv = cs.as_cuda_slice::<u32>()?.slice(c1..c2);
        let sv = as_cuda(&sst)?.as_cuda_slice::<T>()?.slice(s1..s2);
        let bv = as_cuda(&bst)?.as_cuda_slice::<T>()?.slice(b1..b2);
        let n = (s2 - s1) * fmt.group_size();
        let out = unsafe { dev.alloc::<O>(n)? };
        let name = format!(
            "dequantize_{}_{}_b{}",
            dtype_name(T::DTYPE)?,
            dtype_name(O::DTYPE)?,
            fmt.bits()
        );
        let f = kernel(&dev, Module::Quant, &name)?;
        let (nchunks, group) = ((n / 8) as u64, fmt.group_size() as i32);
        let mut b = f.builder();
        b.arg(&cv)
            .arg(&sv)
            .arg(&bv)
            .arg(&out)
            .arg(&nchunks)
            .arg(&group);
        unsafe { b.launch(launch_cfg(n / 8, 1)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let (c, s, b) = (&codes, &scales, &biases);
    let storage = match (scales.dtype(), out) {
        (DType::F32, DType::F32) => run::<f32, f32>(c, s, b, fmt)?,
        (DType::F16, DType::F16) => run::<f16, f16>(c, s, b, fmt)?,
        (DType::BF16, DType::BF16) => run::<bf16, bf16>(c, s, b, fmt)?,
        (DType::F16, DType::F32) => run::<f16, f32>(c, s, b, fmt)?,
        (DType::BF16, DType::F32) => run::<bf16, f32>(c, s, b, fmt)?,
        (other, _) => {
            return Err(QuantError::DType {
                op: "dequantize",
                dtype: other,
            }
            .into())
        }
    };
    Ok(wrap(Storage::Cuda(storage), with_last(&q.scales, d)))
}

/// Rotates (`signs`, head_dim `hd` ∈ {64, 128}) and quantizes K and V (`[n, d]`, f32 or the
/// pools' dtype) into rows
/// `rows` of `dk` / `dv` in one launch (`quantize_rot_rows_*`). The caller has checked shapes,
/// bounds and that both pools share `fmt` and dtype; `side` (checked too) rides along.
#[allow(clippy::too_many_arguments)]
pub(super) fn quantize_rot_into_rows(
    xk: &Tensor,
    xv: &Tensor,
    (fmt, vfmt): (QuantFormat, QuantFormat),
    dk: &Quantized,
    dv: &Quantized,
    rows: &Tensor,
    signs: &Tensor,
    hd: usize,
    side: SideWrites,
) -> Result<()> {
    let (xk, xv) = (aligned(xk)?, aligned(xv)?);
    let (d, n) = (xk.dim(1)?, xk.elem_count());
    let means = side.means.map(|m| m.contiguous()).transpose()?;
    #[allow(clippy::too_many_arguments)]
    fn run<I: CudaDType + DeviceRepr, T: CudaDType + DeviceRepr>(
        x: [&Tensor; 2],
        pools: [&Quantized; 2],
        (fmt, vfmt): (QuantFormat, QuantFormat),
        rows: &Tensor,
        signs: &Tensor,
        (hd, d, n): (usize, usize, usize),
        means: Option<&Tensor>,
        copies: Option<DenseCopies>,
    ) -> Result<()> {
        let (kst, k1, k2) = cuda_parts(x[0])?;
        let (vst, v1, v2) = cuda_parts(x[1])?;
        let dev = as_cuda(&kst)?.device.clone();
        let xk = as_cuda(&kst)?.as_cuda_slice::<I>()?.slice(k1..k2);
        let xv = as_cuda(&vst)?.as_cuda_slice::<I>()?.slice(v1..v2);
        let parts = pools.map(|q| {
            [&q.codes, &q.scales, &q.biases].map(|t| {
                let (s, l) = t.storage_and_layout();
                (s, l.start_offset() == 0 && l.is_contiguous())
            })
        });
        if parts.iter().flatten().any(|(_, whole)| !whole) {
            return Err(candle_core::Error::Msg(
                "quantize_rot_into_rows: the pools must be whole contiguous tensors".into(),
            ));
        }
        let [[kc, ks, kb], [vc, vs, vb]] = &parts;
        let (kc, vc) = (
            as_cuda(&kc.0)?.as_cuda_slice::<u32>()?,
            as_cuda(&vc.0)?.as_cuda_slice::<u32>()?,
        );
        let [ks, kb, vs, vb] = [ks, kb, vs, vb].map(|p| &p.0);
        let (ks, kb, vs, vb) = (
            as_cuda(ks)?.as_cuda_slice::<T>()?,
            as_cuda(kb)?.as_cuda_slice::<T>()?,
            as_cuda(vs)?.as_cuda_slice::<T>()?,
            as_cuda(vb)?.as_cuda_slice::<T>()?,
        );
        let (rst, r1, r2) = cuda_parts(rows)?;
        let rows_dev = as_cuda(&rst)?.as_cuda_slice::<u32>()?.slice(r1..r2);
        let (sst, s1, s2) = cuda_parts(signs)?;
        let signs_dev = as_cuda(&sst)?.as_cuda_slice::<f32>()?.slice(s1..s2);
        // One width: b<bits>; keys one bit wider than values: b<key bits>v<value bits>.
        let widths = if fmt == vfmt {
            format!("{}", fmt.bits())
        } else {
            format!("{}v{}", fmt.bits(), vfmt.bits())
        };
        let name = format!(
            "quantize_rot_rows_{}_{}_b{widths}_d{hd}",
            dtype_name(x[0].dtype())?,
            dtype_name(pools[0].scales.dtype())?,
        );
        let f = kernel(&dev, Module::Quant, &name)?;
        let (nchunks, group, cpr) = ((n / 8) as u64, fmt.group_size() as i32, (d / 8) as u64);
        let mut b = f.pdl_builder();
        b.arg(&xk)
            .arg(&xv)
            .arg(kc)
            .arg(ks)
            .arg(kb)
            .arg(vc)
            .arg(vs)
            .arg(vb);
        b.arg(&nchunks)
            .arg(&group)
            .arg(&rows_dev)
            .arg(&cpr)
            .arg(&signs_dev);
        // The side writes, null where absent (their views live until the launch).
        let null = 0u64;
        let ms = means.map(|m| m.storage_and_layout());
        let mv = ms.as_ref().map(|(s, l)| view::<I>(s, l)).transpose()?;
        match &mv {
            Some(m) => b.arg(m),
            None => b.arg(&null),
        };
        let cs = copies.map(|c| [c.k, c.v, c.rows, c.sinks].map(|t| t.storage_and_layout()));
        let cv = match &cs {
            Some([(ks, kl), (vs, vl), (rs, rl), (ss, sl)]) => Some((
                view::<f16>(ks, kl)?,
                view::<f16>(vs, vl)?,
                view::<u32>(rs, rl)?,
                view::<u32>(ss, sl)?,
            )),
            None => None,
        };
        match &cv {
            Some((ck, cvv, cr, csk)) => b.arg(ck).arg(cvv).arg(cr).arg(csk),
            None => b.arg(&null).arg(&null).arg(&null).arg(&null),
        };
        let mut cfg = launch_cfg(n / 8, 1);
        cfg.grid_dim.1 = 2;
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
    let sizes = (hd, d, n);
    let (x, pools, fmts) = ([&xk, &xv], [dk, dv], (fmt, vfmt));
    let (m, c) = (means.as_ref(), side.copies);
    match (xk.dtype(), dk.scales.dtype()) {
        (DType::F32, DType::F32) => run::<f32, f32>(x, pools, fmts, rows, signs, sizes, m, c),
        (DType::F32, DType::F16) => run::<f32, f16>(x, pools, fmts, rows, signs, sizes, m, c),
        (DType::F32, DType::BF16) => run::<f32, bf16>(x, pools, fmts, rows, signs, sizes, m, c),
        (DType::F16, DType::F16) => run::<f16, f16>(x, pools, fmts, rows, signs, sizes, m, c),
        (DType::BF16, DType::BF16) => run::<bf16, bf16>(x, pools, fmts, rows, signs, sizes, m, c),
        (_, other) => Err(QuantError::DType {
            op: "quantize_rot_into_rows",
            dtype: other,
        }
        .into()),
    }
}
