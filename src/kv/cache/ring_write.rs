//! The residual window's rows of a captured decode step on CUDA (kernels/ring.cu): one launch
//! writes each new row's K — minus its key mean where keys are centred — and V into the rings,
//! at its ring row and its sink row, and returns the centred keys for the pool's write. A kernel
//! of kvq's own because in a replayed step it replaces a subtraction and four of candle's
//! scatters per layer (150 of a step's 334 kernels on the default model). Its arithmetic is
//! candle's: the subtraction in the keys' dtype, the f16 rounding of its cast.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

use crate::device::kernels::{cuda_device, dtype_suffix, kernel, view, wrap, Module};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("ring_write: {msg}"))
}

/// Writes rows `k`, `v` (`[rows, width]`, one dtype; `k` minus `means` of the same shape when
/// given) into the f16 pools `ring_k`, `ring_v` at rows `ring[i]` and `sink[i]` (u32 `[rows]`;
/// equal for a row that is no sink). Returns the keys as written (`k` itself without means).
pub(super) fn ring_write(
    (k, v): (&Tensor, &Tensor),
    means: Option<&Tensor>,
    (ring_k, ring_v): (&Tensor, &Tensor),
    (ring, sink): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let means = means.map(|m| m.contiguous()).transpose()?;
    let (rows, width) = k.dims2()?;
    let (pool_rows, pool_width) = ring_k.dims2()?;
    let fits = v.dims() == k.dims()
        && v.dtype() == k.dtype()
        && means
            .as_ref()
            .is_none_or(|m| m.dims() == k.dims() && m.dtype() == k.dtype())
        && pool_width == width
        && ring_v.dims() == ring_k.dims()
        && [ring_k, ring_v]
            .iter()
            .all(|p| p.dtype() == DType::F16 && p.is_contiguous())
        && [ring, sink]
            .iter()
            .all(|r| r.dims() == [rows] && r.dtype() == DType::U32 && r.is_contiguous());
    if !fits || pool_rows == 0 {
        return Err(err(format!(
            "rows {:?} {:?} into pools {:?} at {:?}",
            k.shape(),
            v.shape(),
            ring_k.shape(),
            ring.shape()
        )));
    }
    if rows == 0 {
        return Ok(k);
    }
    let dev = cuda_device(&k)?;
    let suffix = dtype_suffix(k.dtype()).ok_or_else(|| err(format!("{:?} rows", k.dtype())))?;
    let f = kernel(&dev, Module::Ring, &format!("ring_write_{suffix}"))?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (width.div_ceil(32).clamp(1, 8) as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let width_i = i32::try_from(width).map_err(|_| err(format!("width {width}")))?;
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let ms = means.as_ref().map(|m| m.storage_and_layout());
    let (pks, pkl) = ring_k.storage_and_layout();
    let (pvs, pvl) = ring_v.storage_and_layout();
    let (rs, rl) = ring.storage_and_layout();
    let (ss, sl) = sink.storage_and_layout();
    let (pk, pv) = (view::<f16>(&pks, pkl)?, view::<f16>(&pvs, pvl)?);
    let (rv, sv) = (view::<u32>(&rs, rl)?, view::<u32>(&ss, sl)?);
    macro_rules! launch {
        ($t:ty) => {{
            let (kv, vv) = (view::<$t>(&ks, kl)?, view::<$t>(&vs, vl)?);
            let mv = ms.as_ref().map(|(s, l)| view::<$t>(s, l)).transpose()?;
            // The centred keys, when there are means to subtract.
            let out = match mv {
                Some(_) => Some(unsafe { dev.alloc::<$t>(rows * width)? }),
                None => None,
            };
            let mut b = f.builder();
            b.arg(&kv).arg(&vv);
            match (&mv, &out) {
                (Some(m), Some(o)) => b.arg(m).arg(o),
                _ => b.arg(&0u64).arg(&0u64),
            };
            b.arg(&pk).arg(&pv).arg(&rv).arg(&sv).arg(&width_i);
            unsafe { b.launch(cfg) }.w()?;
            match out {
                Some(o) => wrap(o, &dev, (rows, width)),
                None => k.clone(),
            }
        }};
    }
    Ok(match k.dtype() {
        DType::F32 => launch!(f32),
        DType::F16 => launch!(f16),
        DType::BF16 => launch!(bf16),
        d => return Err(err(format!("{d:?} rows"))),
    })
}
