//! Launches the fused decode kernels of `kernels/decode.cu`: the split kernel over
//! (sequence × KV head, position split, query-head chunk), then, for the block-wide quantized
//! kernels, `decode_merge` (the dense and warp kernels merge their splits themselves).

mod launch;
mod plan;
pub(super) mod residual;

use super::Dims;
use crate::device::kernels::{aligned, dtype_suffix, kernel, view, Kernel, Module};
use crate::kv::format::rotation::Rotation;
use crate::kv::format::LayerKv;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Storage, Tensor};
use launch::{launch_affine, launch_dense, launch_dense_warp, merge, Launch, Merged, WarpArgs};
pub(super) use plan::warp_reads;
use plan::{
    affine_warp, choose, plan, resident_blocks, sm_count, DENSE_GRANULE, MAX_HEAD_DIM,
    TARGET_BLOCKS, THREADS, TILE,
};
use residual::{DenseRows, WinViews};

fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("decode_attention (cuda): {}", msg.into()))
}

fn dtype_name(d: DType) -> Result<&'static str> {
    dtype_suffix(d).ok_or_else(|| err(format!("unsupported cache dtype {d:?}")))
}

/// The queries as the chosen kernel reads them: the warp kernel in the pool's element type (it
/// scales and rotates them itself), the dense kernel as they come (it scales them itself), the
/// block-wide quantized kernels scaled, in f32; rotated here (`outer_rot`) for the block-wide
/// kernels.
fn query_input(
    q: &Tensor,
    kv: &LayerKv,
    warp: bool,
    outer_rot: Option<&Rotation>,
    scale: f32,
) -> Result<Tensor> {
    let rotated = || match outer_rot {
        Some(r) => r.rotate(q),
        None => Ok(q.clone()),
    };
    match (kv, warp) {
        (LayerKv::Affine { k, .. }, true) => aligned(&q.to_dtype(k.scales.dtype())?),
        (LayerKv::Dense { .. }, _) => aligned(&rotated()?),
        _ => aligned(&(rotated()?.to_dtype(DType::F32)? * scale as f64)?),
    }
}

/// Whether [`decode`] reads `kv` with queries `q`: one width for K and V, or keys one bit wider
/// than values on the warp kernel (the block-wide kernel reads one width). Asked per layer and
/// step: the planner's rule alone, not the whole choice (whose kernel name `decode` builds).
pub(super) fn reads(q: &Tensor, kv: &LayerKv, dims: &Dims) -> bool {
    match kv {
        LayerKv::Affine { kfmt, vfmt, k, .. } if kfmt != vfmt => {
            affine_warp(q.dtype(), (kfmt, vfmt), k.scales.dtype(), dims)
        }
        _ => true,
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn decode(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    scale: f32,
    rot: Option<&Rotation>,
) -> Result<Tensor> {
    let tables = (block_tables, starts, lens);
    Ok(run(q, kv, dims, tables, scale, rot, None)?.0)
}

/// [`decode`] merged with `--kv-residual`'s dense rows `rows` (each query's sinks and window):
/// on the warp kernels as one more split of the same launch (kernels/decode/window.cuh), after
/// the block-wide ones by `residual_merge` with the log-sum-exp their merge returns.
pub(super) fn decode_window(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    tables: (&Tensor, &Tensor, &Tensor),
    scale: f32,
    rot: Option<&Rotation>,
    rows: &DenseRows,
) -> Result<Tensor> {
    rows.check(dims.batch, dims.kv_heads, dims.head_dim)?;
    match run(q, kv, dims, tables, scale, rot, Some(rows))? {
        (out, None) => Ok(out),
        (oq, Some(lse)) => residual::residual_merge(q, &oq, &lse, rows, dims.kv_heads, scale),
    }
}

/// [`decode`], with the residual window's dense rows `window` when given (quantized pools only):
/// a warp kernel attends them as more splits of its launch; a block-wide kernel does not, and
/// returns each query head's log-sum-exp of its scaled scores (`[B·H]` f32; NaN for a sequence
/// the kernels refuse, such as one with no positions) for the caller's `residual_merge`.
fn run(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    (block_tables, starts, lens): (&Tensor, &Tensor, &Tensor),
    scale: f32,
    rot: Option<&Rotation>,
    window: Option<&DenseRows>,
) -> Result<(Tensor, Option<Tensor>)> {
    let d = dims.head_dim;
    let ints = kernel_ints(dims)?;
    let choice = choose(q, kv, dims)?;
    let warp_kernel = choice.warp;
    if window.is_some() && matches!(kv, LayerKv::Dense { .. }) {
        return Err(err("the residual window needs a quantized pool"));
    }
    // The window's rows for a warp kernel; a block-wide one returns the log-sum-exp instead.
    let (win_rows, want_lse) = match window {
        Some(rows) if warp_kernel => (Some(rows), false),
        w => (None, w.is_some()),
    };
    let window = win_rows.map_or(0, |rows| rows.most());
    let cdev = q.device().as_cuda_device()?;
    // The window takes the kernel's instance with window blocks (kernels/decode.cu).
    let name = match window {
        0 => choice.name.clone(),
        _ => format!("{}_w", choice.name),
    };
    let f = kernel(cdev, Module::Decode, &name)?;
    let chunk = choice.chunk;
    let head_chunks = dims.group.div_ceil(chunk);
    let (nsplit, split_len, wsplits) =
        split_plan((&f, &name), &choice, cdev, dims, head_chunks, window)?;
    // The warp kernel rotates q in its prologue and the merge rotates the output back; the
    // block-wide kernel gets q rotated here and its output rotated back below.
    let fused_rot = rot.filter(|_| warp_kernel);
    let outer_rot = rot.filter(|_| !warp_kernel);
    let qf = query_input(q, kv, warp_kernel, outer_rot, scale)?;
    let (tables, starts, lens) = (
        aligned(block_tables)?,
        starts.contiguous()?,
        lens.contiguous()?,
    );
    let bh = dims.batch * dims.heads;

    let (qs, ql) = qf.storage_and_layout();
    let Storage::Cuda(qc) = &*qs else {
        return Err(err("expected CUDA storage"));
    };
    let dev: CudaDevice = qc.device.clone();
    let (ts, tl) = tables.storage_and_layout();
    let (ss, sl) = starts.storage_and_layout();
    let (ls, ll) = lens.storage_and_layout();
    let (tv, sv, lv) = (
        view::<u32>(&ts, tl)?,
        view::<u32>(&ss, sl)?,
        view::<u32>(&ls, ll)?,
    );

    // The window's splits (window.cuh) come after the quantized ones.
    let ysplits = nsplit + wsplits;
    let part_acc: CudaSlice<f32> = unsafe { dev.alloc::<f32>(ysplits * bh * d)? };
    let part_ml: CudaSlice<f32> = unsafe { dev.alloc::<f32>(ysplits * bh * 2)? };
    // Every head row's merge writes its entry.
    let lse: Option<CudaSlice<f32>> = want_lse
        .then(|| unsafe { dev.alloc::<f32>(bh) })
        .transpose()?;
    let win_t = win_rows.map(|rows| rows.tensors()).transpose()?;
    let win_held: Vec<_> = win_t
        .iter()
        .flatten()
        .map(|t| t.storage_and_layout())
        .collect();
    let win = win_rows
        .map(|rows| WinViews::new(&win_held, rows, dims.kv_heads * d, wsplits))
        .transpose()?;
    let smem = if warp_kernel {
        choice.smem // staging of the tensor-core kernels; the rest is static
    } else {
        4 * (chunk * d + chunk * (d / 32) + chunk * TILE + TILE + chunk * d)
    };
    let launch = Launch {
        f: &f,
        cfg: LaunchConfig {
            grid_dim: (
                to_i32(dims.batch * dims.kv_heads, "batch x kv_heads")? as u32,
                ysplits as u32,
                head_chunks as u32,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        },
        dev: &dev,
        scale,
        tables: &tv,
        starts: &sv,
        lens: &lv,
        ints,
        split_len: to_i32(split_len, "split length")?,
        part_acc: &part_acc,
        part_ml: &part_ml,
        lse: lse.as_ref(),
        win: win.as_ref(),
    };
    // Where the kernels that merge their own splits put them.
    let merged = || Merged {
        counters: dims.batch * dims.kv_heads * head_chunks,
        out_len: bh * d,
        nsplit,
    };
    let fused = match kv {
        LayerKv::Dense { k, v } if warp_kernel => {
            Some(launch_dense_warp(&launch, &qs, ql, k, v, merged())?)
        }
        LayerKv::Dense { k, v } => {
            Some(launch_dense(&launch, &qs, ql, qf.dtype(), k, v, merged())?)
        }
        LayerKv::Affine {
            kfmt: fmt, k, v, ..
        } => {
            let warp = warp_kernel.then_some(WarpArgs {
                rot: fused_rot,
                merged: merged(),
            });
            launch_affine(&launch, &qs, ql, fmt, k, v, warp)?
        }
    };

    let out = match fused {
        Some(out) => out,
        None => merge(&launch, q.dtype(), nsplit, bh, d)?,
    };
    let out = tensor_of(out, (dims.batch, dims.heads, d)).to_dtype(q.dtype())?;
    let out = match outer_rot {
        Some(r) => r.unrotate(&out)?,
        None => out,
    };
    let lse = lse.map(|l| tensor_of(CudaStorage::wrap_cuda_slice(l, dev.clone()), bh));
    Ok((out, lse))
}

/// Splits per (sequence, KV head), positions per split and window splits for kernel `f` (named
/// `name`, an instance of `choice`) when queries read up to `window` dense rows: the warp kernels aim at one full wave
/// of blocks, the window's included (two or four waves of shorter splits measured slower:
/// seed-002 4-bit, 512 → 449 / 396 tok/s). A window block walks about as many rows per warp as
/// a quantized block does tiles, so neither waits for the other: at 16K, one sequence of 3 KV
/// heads walks one tile per block and takes 4 window blocks of 16 rows for 64 rows (H200,
/// 4-bit: 0.027–0.028 ms a layer against 0.030–0.031 with one), 4 sequences of 8 walk 7 tiles
/// and take one window block.
fn split_plan(
    (f, name): (&Kernel, &str),
    choice: &plan::Choice,
    cdev: &CudaDevice,
    dims: &Dims,
    head_chunks: usize,
    window: usize,
) -> Result<(usize, usize, usize)> {
    if !choice.warp {
        let dense = choice.name.contains("_dense_");
        let granule = if dense { DENSE_GRANULE } else { TILE };
        let (n, len) = plan(dims, head_chunks, TARGET_BLOCKS, false, granule);
        return Ok((n, len, 0));
    }
    let key = format!("{name}@{:?}", cdev.id());
    let wave = resident_blocks(f, &key, choice.smem)? * sm_count(cdev);
    let (n, len) = plan(dims, head_chunks, wave, true, TILE);
    if window == 0 {
        return Ok((n, len, 0));
    }
    let tiles = (len / TILE).max(1);
    let wsplits = window.div_ceil(residual::WIN_ROWS * tiles).max(1);
    let target = wave.saturating_sub(dims.batch * dims.kv_heads * head_chunks * wsplits);
    let (n, len) = plan(dims, head_chunks, target, true, TILE);
    Ok((n, len, wsplits))
}

/// The integer arguments every decode kernel takes (max_blocks, num_blocks, block_size,
/// kv_heads, query heads per KV head, head_dim), once head_dim is checked.
fn kernel_ints(dims: &Dims) -> Result<[i32; 6]> {
    let d = dims.head_dim;
    if !d.is_multiple_of(8) || d > MAX_HEAD_DIM {
        return Err(err(format!(
            "head_dim {d} must be a multiple of 8 and at most {MAX_HEAD_DIM}"
        )));
    }
    let named = [
        (dims.max_blocks, "max_blocks"),
        (dims.num_blocks, "num_blocks"),
        (dims.block_size, "block_size"),
        (dims.kv_heads, "kv_heads"),
        (dims.group, "query heads per KV head"),
        (d, "head_dim"),
    ];
    let mut ints = [0i32; 6];
    for (slot, (v, what)) in ints.iter_mut().zip(named) {
        *slot = to_i32(v, what)?;
    }
    Ok(ints)
}

/// `v` as a kernel's int.
fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit the kernel's int")))
}

/// A kernel's output buffer as a tensor of `shape`.
fn tensor_of(st: CudaStorage, shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
}
