//! Launches the fused decode kernels of `kernels/decode.cu`: the split kernel over
//! (sequence × KV head, position split, query-head chunk), then `decode_merge`.

use super::Dims;
use crate::kv::layer::LayerKv;
use crate::kv::rotation::Rotation;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const MODULE: &str = "kvq_decode";
/// Must match NT, TILE and MAXG in decode.cu.
const THREADS: u32 = 128;
const TILE: usize = 128;
const MAXG: usize = 8;
/// Blocks to aim for: about four waves on an H100's 132 SMs.
const TARGET_BLOCKS: usize = 512;
/// Query heads per block of the warp-independent quantized kernel (QG in decode.cu).
const QG: usize = 4;
/// Blocks to aim for with that kernel: 4 resident per SM, about two waves.
const TARGET_BLOCKS_Q: usize = 1024;
/// Largest head_dim the shared-memory layout is sized for (stays under 48 KiB).
const MAX_HEAD_DIM: usize = 512;

fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("decode_attention (cuda): {}", msg.into()))
}

/// A contiguous tensor whose data starts 16-byte aligned (the kernel uses vector loads);
/// copies only when the view starts mid-buffer at an unaligned offset.
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    if (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 == 0 {
        Ok(t)
    } else {
        t.copy()
    }
}

fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a Storage,
    l: &candle_core::Layout,
) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(c) = s else {
        return Err(err("expected CUDA storage"));
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err("non-contiguous input"))?;
    Ok(c.as_cuda_slice::<T>()?.slice(a..b))
}

fn dtype_name(d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => return Err(err(format!("unsupported cache dtype {other:?}"))),
    })
}

/// Splits per (sequence, KV head) and positions per split, from the table's capacity (the
/// lengths stay on the device).
fn plan(dims: &Dims, head_chunks: usize, target: usize) -> (usize, usize) {
    let cap = dims.max_blocks * dims.block_size;
    let per_split_blocks = dims.batch * dims.kv_heads * head_chunks;
    let want = target.div_ceil(per_split_blocks.max(1));
    let max_splits = cap.div_ceil(TILE).max(1);
    let nsplit = want.clamp(1, max_splits);
    let split_len = cap.div_ceil(nsplit).div_ceil(TILE) * TILE;
    (cap.div_ceil(split_len).max(1), split_len)
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
    let d = dims.head_dim;
    if !d.is_multiple_of(8) || d > MAX_HEAD_DIM {
        return Err(err(format!(
            "head_dim {d} must be a multiple of 8 and at most {MAX_HEAD_DIM}"
        )));
    }
    let to_i32 = |v: usize, what: &str| -> Result<i32> {
        i32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit the kernel's int")))
    };
    // Quantized pools with one width for K and V and head_dim 64 or 128 take the
    // warp-independent kernel (decode_q_*); KVQ_CUDA_DECODE=v1 keeps the block-wide one (A/B).
    let warp_kernel = match kv {
        LayerKv::Affine { kfmt, vfmt, .. } => {
            kfmt == vfmt
                && matches!(d, 64 | 128)
                && std::env::var("KVQ_CUDA_DECODE").map_or(true, |v| v != "v1")
        }
        LayerKv::Dense { .. } => false,
    };
    let (chunk, target) = if warp_kernel {
        (QG, TARGET_BLOCKS_Q)
    } else {
        (MAXG, TARGET_BLOCKS)
    };
    let head_chunks = dims.group.div_ceil(chunk);
    let (nsplit, split_len) = plan(dims, head_chunks, target);
    // The warp kernel rotates q in its prologue and the merge rotates the output back; the
    // block-wide kernel gets q rotated here and its output rotated back below.
    let fused_rot = rot.filter(|_| warp_kernel);
    let outer_rot = rot.filter(|_| !warp_kernel);
    let q_in = match outer_rot {
        Some(r) => r.rotate(q)?,
        None => q.clone(),
    };
    let qf = aligned(&(q_in.to_dtype(DType::F32)? * scale as f64)?)?;
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
    let qv = view::<f32>(&qs, ql)?;
    let (ts, tl) = tables.storage_and_layout();
    let (ss, sl) = starts.storage_and_layout();
    let (ls, ll) = lens.storage_and_layout();
    let (tv, sv, lv) = (
        view::<u32>(&ts, tl)?,
        view::<u32>(&ss, sl)?,
        view::<u32>(&ls, ll)?,
    );

    let part_acc: CudaSlice<f32> = unsafe { dev.alloc::<f32>(nsplit * bh * d)? };
    let part_ml: CudaSlice<f32> = unsafe { dev.alloc::<f32>(nsplit * bh * 2)? };
    let smem = if warp_kernel {
        0 // static
    } else {
        4 * (MAXG * d + MAXG * (d / 32) + MAXG * TILE + TILE + MAXG * d)
    };
    let cfg = LaunchConfig {
        grid_dim: (
            to_i32(dims.batch * dims.kv_heads, "batch x kv_heads")? as u32,
            nsplit as u32,
            head_chunks as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let ints = [
        to_i32(dims.max_blocks, "max_blocks")?,
        to_i32(dims.num_blocks, "num_blocks")?,
        to_i32(dims.block_size, "block_size")?,
        to_i32(dims.kv_heads, "kv_heads")?,
        to_i32(dims.group, "query heads per KV head")?,
        to_i32(d, "head_dim")?,
    ];
    let split_len = to_i32(split_len, "split length")?;

    // Signs of the rotation for the kernels (the lens buffer stands in, unread, when none).
    let signs = fused_rot.map(|r| r.signs().contiguous()).transpose()?;
    let rotated: i32 = fused_rot.is_some().into();
    let sg_storage = signs.as_ref().map(|t| t.storage_and_layout());
    let sgv = match &sg_storage {
        Some((st, l)) => view::<f32>(st, l)?,
        None => {
            let v = view::<u32>(&ls, ll)?;
            // Same device pointer, read as nothing.
            unsafe { v.transmute::<f32>(v.len()) }.ok_or_else(|| err("signs placeholder"))?
        }
    };
    match kv {
        LayerKv::Dense { k, v } => {
            let (k, v) = (aligned(k)?, aligned(v)?);
            let (kst, kl) = k.storage_and_layout();
            let (vst, vl) = v.storage_and_layout();
            let name = format!("decode_{}_dense", dtype_name(k.dtype())?);
            let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            macro_rules! launch {
                ($t:ty) => {{
                    let (kv_, vv_) = (view::<$t>(&kst, kl)?, view::<$t>(&vst, vl)?);
                    let mut b = f.builder();
                    b.arg(&qv).arg(&kv_).arg(&vv_).arg(&tv).arg(&sv).arg(&lv);
                    for i in &ints {
                        b.arg(i);
                    }
                    b.arg(&split_len).arg(&part_acc).arg(&part_ml);
                    unsafe { b.launch(cfg) }.w()?;
                }};
            }
            match k.dtype() {
                DType::F32 => launch!(f32),
                DType::F16 => launch!(f16),
                _ => launch!(bf16),
            }
        }
        LayerKv::Affine {
            kfmt: fmt, k, v, ..
        } => {
            let ts6 = [
                &k.codes, &k.scales, &k.biases, &v.codes, &v.scales, &v.biases,
            ];
            let ts6 = ts6.map(aligned);
            let [a, b_, c, d_, e, f_] = ts6;
            let ts6 = [a?, b_?, c?, d_?, e?, f_?];
            let sl6 = [
                ts6[0].storage_and_layout(),
                ts6[1].storage_and_layout(),
                ts6[2].storage_and_layout(),
                ts6[3].storage_and_layout(),
                ts6[4].storage_and_layout(),
                ts6[5].storage_and_layout(),
            ];
            let name = if warp_kernel {
                format!(
                    "decode_q_{}_b{}_d{d}",
                    dtype_name(ts6[1].dtype())?,
                    fmt.bits()
                )
            } else {
                format!("decode_{}_b{}", dtype_name(ts6[1].dtype())?, fmt.bits())
            };
            let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let group = to_i32(fmt.group_size(), "group size")?;
            macro_rules! launch {
                ($t:ty) => {{
                    let kc = view::<u32>(&sl6[0].0, sl6[0].1)?;
                    let ks = view::<$t>(&sl6[1].0, sl6[1].1)?;
                    let kb = view::<$t>(&sl6[2].0, sl6[2].1)?;
                    let vc = view::<u32>(&sl6[3].0, sl6[3].1)?;
                    let vs = view::<$t>(&sl6[4].0, sl6[4].1)?;
                    let vb = view::<$t>(&sl6[5].0, sl6[5].1)?;
                    let mut b = f.builder();
                    b.arg(&qv)
                        .arg(&kc)
                        .arg(&ks)
                        .arg(&kb)
                        .arg(&vc)
                        .arg(&vs)
                        .arg(&vb);
                    b.arg(&tv).arg(&sv).arg(&lv);
                    if warp_kernel {
                        // max_blocks, num_blocks, block_size, kv_heads, group of query heads
                        for i in &ints[..5] {
                            b.arg(i);
                        }
                    } else {
                        for i in &ints {
                            b.arg(i);
                        }
                    }
                    b.arg(&group).arg(&split_len).arg(&part_acc).arg(&part_ml);
                    if warp_kernel {
                        b.arg(&sgv).arg(&rotated);
                    }
                    unsafe { b.launch(cfg) }.w()?;
                }};
            }
            match ts6[1].dtype() {
                DType::F32 => launch!(f32),
                DType::F16 => launch!(f16),
                _ => launch!(bf16),
            }
        }
    }

    let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(bh * d)? };
    let merge = dev.get_or_load_custom_func("decode_merge", MODULE, PTX)?;
    let (ns, bh_i, d_i) = (nsplit as i32, to_i32(bh, "batch x heads")?, d as i32);
    let mut b = merge.builder();
    b.arg(&part_acc)
        .arg(&part_ml)
        .arg(&out)
        .arg(&ns)
        .arg(&bh_i)
        .arg(&d_i)
        .arg(&sgv)
        .arg(&rotated);
    let mcfg = LaunchConfig {
        grid_dim: (bh as u32, 1, 1),
        block_dim: (d.min(256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(mcfg) }.w()?;
    let out = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev)),
        (dims.batch, dims.heads, d),
        BackpropOp::none(),
        false,
    );
    let out = out.to_dtype(q.dtype())?;
    match outer_rot {
        Some(r) => r.unrotate(&out),
        None => Ok(out),
    }
}
