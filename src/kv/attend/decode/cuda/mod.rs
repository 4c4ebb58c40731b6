//! Launches the fused decode kernels of `kernels/decode.cu`: the split kernel over
//! (sequence × KV head, position split, query-head chunk), then, for the block-wide quantized
//! kernels, `decode_merge` (the dense and warp kernels merge their splits themselves).

mod plan;
pub(super) mod residual;

use super::Dims;
use crate::device::kernels::{aligned, dtype_suffix, kernel, view, Kernel, Module};
use crate::kv::format::rotation::Rotation;
use crate::kv::format::{LayerKv, QuantFormat, Quantized};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};
pub(super) use plan::warp_reads;
use plan::{
    affine_warp, choose, plan, resident_blocks, sm_count, DENSE_GRANULE, MAX_HEAD_DIM,
    TARGET_BLOCKS, THREADS, TILE,
};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

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

/// What every launch of one decode takes besides the pool: the kernel, its grid, the tables,
/// the integer arguments and the split partials.
struct Launch<'a> {
    f: &'a Kernel,
    cfg: LaunchConfig,
    dev: &'a CudaDevice,
    scale: f32,
    tables: &'a CudaView<'a, u32>,
    starts: &'a CudaView<'a, u32>,
    lens: &'a CudaView<'a, u32>,
    /// max_blocks, num_blocks, block_size, kv_heads, query heads per KV head, head_dim.
    ints: [i32; 6],
    split_len: i32,
    part_acc: &'a CudaSlice<f32>,
    part_ml: &'a CudaSlice<f32>,
    /// Where the merge puts each head's log-sum-exp (`[B·H]`), if asked.
    lse: Option<&'a CudaSlice<f32>>,
}

impl Launch<'_> {
    /// Passes the log-sum-exp output, or a null pointer (the kernel writes none).
    fn arg_lse(&self, b: &mut crate::device::kernels::pdl::Args<'_>) {
        match self.lse {
            Some(l) => b.arg(l),
            None => b.arg(&NULL),
        };
    }
}

/// A null device pointer, for the kernels' optional outputs.
static NULL: u64 = 0;

/// Where a kernel that merges its own splits puts them: `counters` slots of finished blocks
/// (one per sequence, KV head and head chunk), an output of `out_len` values, `nsplit` splits.
struct Merged {
    counters: usize,
    out_len: usize,
    nsplit: usize,
}

impl Merged {
    /// The split count as the kernel's int.
    fn nsplit_arg(&self) -> Result<i32> {
        i32::try_from(self.nsplit).map_err(|_| err("too many splits"))
    }
}

/// This device's merge counters in `guard` (held from [`counters`] until the launch is queued).
fn device_counters<'g>(guard: &'g Counters, dev: &CudaDevice) -> Result<&'g CudaSlice<u32>> {
    guard
        .get(&dev.id())
        .ok_or_else(|| err("no merge counters for the device"))
}

/// The signs argument of a warp kernel without rotation: the lens buffer stands in, unread.
fn no_signs<'b>(lens: &'b CudaView<'_, u32>) -> Result<CudaView<'b, f32>> {
    unsafe { lens.transmute::<f32>(lens.len()) }.ok_or_else(|| err("signs placeholder"))
}

/// The dense kernel over pools `k`, `v` with queries `qs` (in their own element type); returns
/// its merged output, in the queries' type.
fn launch_dense(
    a: &Launch,
    qs: &Storage,
    ql: &Layout,
    q_dtype: DType,
    k: &Tensor,
    v: &Tensor,
    m: Merged,
) -> Result<CudaStorage> {
    let dev = a.dev;
    let (k, v) = (aligned(k)?, aligned(v)?);
    let (kst, kl) = k.storage_and_layout();
    let (vst, vl) = v.storage_and_layout();
    let ns = m.nsplit_arg()?;
    macro_rules! launch {
        ($t:ty, $qt:ty) => {{
            let (kv_, vv_) = (view::<$t>(&kst, kl)?, view::<$t>(&vst, vl)?);
            let qv = view::<$qt>(qs, ql)?;
            let guard = counters(dev, m.counters)?;
            let c = device_counters(&guard, dev)?;
            let out: CudaSlice<$qt> = unsafe { dev.alloc::<$qt>(m.out_len)? };
            let mut b = a.f.pdl_builder();
            b.arg(&qv)
                .arg(&a.scale)
                .arg(&kv_)
                .arg(&vv_)
                .arg(a.tables)
                .arg(a.starts)
                .arg(a.lens);
            for i in &a.ints {
                b.arg(i);
            }
            b.arg(&a.split_len).arg(a.part_acc).arg(a.part_ml);
            b.arg(&out).arg(c).arg(&ns);
            unsafe { b.launch(a.cfg) }?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    macro_rules! by_query {
        ($t:ty) => {
            match q_dtype {
                DType::F32 => launch!($t, f32),
                DType::F16 => launch!($t, f16),
                _ => launch!($t, bf16),
            }
        };
    }
    Ok(match k.dtype() {
        DType::F32 => by_query!(f32),
        DType::F16 => by_query!(f16),
        _ => by_query!(bf16),
    })
}

/// The warp kernel's SIMT steps over dense f16 / bf16 pools `k`, `v` (decode_q_*_b16_*): the
/// pools stand where the codes go, no scales or biases, no rotation; queries in the pools'
/// type. Returns its merged output.
fn launch_dense_warp(
    a: &Launch,
    qs: &Storage,
    ql: &Layout,
    k: &Tensor,
    v: &Tensor,
    m: Merged,
) -> Result<CudaStorage> {
    let dev = a.dev;
    let (k, v) = (aligned(k)?, aligned(v)?);
    let (kst, kl) = k.storage_and_layout();
    let (vst, vl) = v.storage_and_layout();
    let ns = m.nsplit_arg()?;
    let (group, rotated, null) = (a.ints[5], 0i32, 0u64);
    let signs = no_signs(a.lens)?;
    macro_rules! launch {
        ($t:ty) => {{
            let (kv_, vv_, qv) = (
                view::<$t>(&kst, kl)?,
                view::<$t>(&vst, vl)?,
                view::<$t>(qs, ql)?,
            );
            let guard = counters(dev, m.counters)?;
            let c = device_counters(&guard, dev)?;
            let out: CudaSlice<$t> = unsafe { dev.alloc::<$t>(m.out_len)? };
            let mut b = a.f.pdl_builder();
            b.arg(&qv).arg(&a.scale).arg(&kv_).arg(&null).arg(&null);
            b.arg(&vv_).arg(&null).arg(&null);
            b.arg(a.tables).arg(a.starts).arg(a.lens);
            for i in &a.ints[..5] {
                b.arg(i);
            }
            b.arg(&group)
                .arg(&a.split_len)
                .arg(a.part_acc)
                .arg(a.part_ml);
            b.arg(&signs).arg(&rotated).arg(&out).arg(c).arg(&ns);
            a.arg_lse(&mut b);
            unsafe { b.launch(a.cfg) }?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    Ok(match k.dtype() {
        DType::F16 => launch!(f16),
        DType::BF16 => launch!(bf16),
        d => return Err(err(format!("no warp kernel for dense {d:?} pools"))),
    })
}

/// What the warp kernel takes beyond the block-wide one: it merges the splits itself
/// (`merged`) and rotates q in and the output back (`rot`).
struct WarpArgs<'a> {
    rot: Option<&'a Rotation>,
    merged: Merged,
}

/// An affine kernel over the quantized pools `k`, `v` with queries `qs`: the block-wide kernel
/// (`warp` None; the partials are merged after) or the warp kernel, whose merged output this
/// returns.
fn launch_affine(
    a: &Launch,
    qs: &Storage,
    ql: &Layout,
    fmt: &QuantFormat,
    k: &Quantized,
    v: &Quantized,
    warp: Option<WarpArgs>,
) -> Result<Option<CudaStorage>> {
    let dev = a.dev;
    let ts6 = [
        &k.codes, &k.scales, &k.biases, &v.codes, &v.scales, &v.biases,
    ];
    let ts6 = ts6.map(aligned);
    let [a_, b_, c, d_, e, f_] = ts6;
    let ts6 = [a_?, b_?, c?, d_?, e?, f_?];
    let sl6 = [
        ts6[0].storage_and_layout(),
        ts6[1].storage_and_layout(),
        ts6[2].storage_and_layout(),
        ts6[3].storage_and_layout(),
        ts6[4].storage_and_layout(),
        ts6[5].storage_and_layout(),
    ];
    let group = i32::try_from(fmt.group_size()).map_err(|_| {
        err(format!(
            "group size {} does not fit the kernel's int",
            fmt.group_size()
        ))
    })?;
    // Signs of the rotation for the warp kernel (the lens buffer stands in, unread, when none).
    let rot = warp.as_ref().and_then(|w| w.rot);
    let signs = rot.map(|r| r.signs().contiguous()).transpose()?;
    let rotated: i32 = rot.is_some().into();
    let sg_storage = signs.as_ref().map(|t| t.storage_and_layout());
    let sgv = match &sg_storage {
        Some((st, l)) => view::<f32>(st, l)?,
        None => no_signs(a.lens)?,
    };
    let mut fused: Option<CudaStorage> = None;
    macro_rules! launch {
        ($t:ty) => {{
            let kc = view::<u32>(&sl6[0].0, sl6[0].1)?;
            let ks = view::<$t>(&sl6[1].0, sl6[1].1)?;
            let kb = view::<$t>(&sl6[2].0, sl6[2].1)?;
            let vc = view::<u32>(&sl6[3].0, sl6[3].1)?;
            let vs = view::<$t>(&sl6[4].0, sl6[4].1)?;
            let vb = view::<$t>(&sl6[5].0, sl6[5].1)?;
            // The in-kernel merge's counters, locked until the launch is queued.
            let guard = match &warp {
                Some(w) => Some(counters(dev, w.merged.counters)?),
                None => None,
            };
            let mut b = a.f.pdl_builder();
            // Alive until the launch: the q view in the kernel's type.
            let (qv32, qvt);
            if warp.is_some() {
                qvt = view::<$t>(qs, ql)?;
                b.arg(&qvt).arg(&a.scale);
            } else {
                qv32 = view::<f32>(qs, ql)?;
                b.arg(&qv32);
            }
            b.arg(&kc).arg(&ks).arg(&kb).arg(&vc).arg(&vs).arg(&vb);
            b.arg(a.tables).arg(a.starts).arg(a.lens);
            if warp.is_some() {
                // max_blocks, num_blocks, block_size, kv_heads, group of query heads
                for i in &a.ints[..5] {
                    b.arg(i);
                }
            } else {
                for i in &a.ints {
                    b.arg(i);
                }
            }
            b.arg(&group)
                .arg(&a.split_len)
                .arg(a.part_acc)
                .arg(a.part_ml);
            if let (Some(w), Some(guard)) = (&warp, &guard) {
                // The kernel merges the splits itself (last block per head chunk).
                let out: CudaSlice<$t> = unsafe { dev.alloc::<$t>(w.merged.out_len)? };
                let ns = w.merged.nsplit_arg()?;
                let c = device_counters(guard, dev)?;
                b.arg(&sgv).arg(&rotated).arg(&out).arg(c).arg(&ns);
                a.arg_lse(&mut b);
                unsafe { b.launch(a.cfg) }?;
                fused = Some(CudaStorage::wrap_cuda_slice(out, dev.clone()));
            } else {
                unsafe { b.launch(a.cfg) }?;
            }
        }};
    }
    match ts6[1].dtype() {
        DType::F32 => launch!(f32),
        DType::F16 => launch!(f16),
        _ => launch!(bf16),
    }
    Ok(fused)
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
    Ok(decode_lse(q, kv, dims, tables, scale, rot, false)?.0)
}

/// [`decode`], with each query head's log-sum-exp of its scaled scores (`[B·H]` f32; NaN for a
/// sequence the kernels refuse, such as one with no positions) when `want_lse`: quantized pools
/// only, whose kernels merge through `merge_splits`.
pub(super) fn decode_lse(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    (block_tables, starts, lens): (&Tensor, &Tensor, &Tensor),
    scale: f32,
    rot: Option<&Rotation>,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if want_lse && matches!(kv, LayerKv::Dense { .. }) {
        return Err(err("log-sum-exp is only returned for quantized pools"));
    }
    let d = dims.head_dim;
    if !d.is_multiple_of(8) || d > MAX_HEAD_DIM {
        return Err(err(format!(
            "head_dim {d} must be a multiple of 8 and at most {MAX_HEAD_DIM}"
        )));
    }
    let to_i32 = |v: usize, what: &str| -> Result<i32> {
        i32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit the kernel's int")))
    };
    let choice = choose(q, kv, dims)?;
    let warp_kernel = choice.warp;
    let cdev = q.device().as_cuda_device()?;
    let f = kernel(cdev, Module::Decode, &choice.name)?;
    let dense = matches!(kv, LayerKv::Dense { .. });
    let target = if warp_kernel {
        // One full wave of blocks; two or four waves of shorter splits measured slower
        // (seed-002 4-bit: 512 → 449 / 396 tok/s).
        let key = format!("{}@{:?}", choice.name, cdev.id());
        resident_blocks(&f, &key, choice.smem)? * sm_count(cdev)
    } else {
        TARGET_BLOCKS
    };
    let chunk = choice.chunk;
    let head_chunks = dims.group.div_ceil(chunk);
    let granule = if dense && !warp_kernel {
        DENSE_GRANULE
    } else {
        TILE
    };
    let (nsplit, split_len) = plan(dims, head_chunks, target, warp_kernel, granule);
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

    let part_acc: CudaSlice<f32> = unsafe { dev.alloc::<f32>(nsplit * bh * d)? };
    let part_ml: CudaSlice<f32> = unsafe { dev.alloc::<f32>(nsplit * bh * 2)? };
    // Every head row's last block (or the merge) writes its entry.
    let lse: Option<CudaSlice<f32>> = want_lse
        .then(|| unsafe { dev.alloc::<f32>(bh) })
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
                nsplit as u32,
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
        ints: [
            to_i32(dims.max_blocks, "max_blocks")?,
            to_i32(dims.num_blocks, "num_blocks")?,
            to_i32(dims.block_size, "block_size")?,
            to_i32(dims.kv_heads, "kv_heads")?,
            to_i32(dims.group, "query heads per KV head")?,
            to_i32(d, "head_dim")?,
        ],
        split_len: to_i32(split_len, "split length")?,
        part_acc: &part_acc,
        part_ml: &part_ml,
        lse: lse.as_ref(),
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

/// A kernel's output buffer as a tensor of `shape`.
fn tensor_of(st: CudaStorage, shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
}

/// Per-device counters of finished blocks for the warp kernel's in-kernel merge, all zero
/// between calls (the last block of a head chunk resets its own); grown as needed.
fn counters(dev: &CudaDevice, n: usize) -> Result<MutexGuard<'static, Counters>> {
    static C: std::sync::OnceLock<Mutex<Counters>> = std::sync::OnceLock::new();
    let mut m = C
        .get_or_init(Default::default)
        .lock()
        .expect("poisoned counters");
    let have = m.get(&dev.id()).map_or(0, |c| c.len());
    if have < n {
        // At least 64K (256 KiB, more than any batch here needs) from the start: a buffer
        // that moves would leave captured CUDA graphs pointing at the old one.
        m.insert(
            dev.id(),
            dev.alloc_zeros::<u32>(n.next_power_of_two().max(1 << 16))?,
        );
    }
    Ok(m)
}

type Counters = HashMap<DeviceId, CudaSlice<u32>>;

/// Combines the splits of the block-wide kernels into the output, in q's element type (their
/// queries were rotated outside, so the output needs no rotation here), with the heads'
/// log-sum-exp where `a` asks for it.
fn merge(a: &Launch, q_dtype: DType, nsplit: usize, bh: usize, d: usize) -> Result<CudaStorage> {
    let dev = a.dev;
    let bh_i = i32::try_from(bh).map_err(|_| err(format!("batch x heads {bh} too large")))?;
    let (ns, d_i) = (nsplit as i32, d as i32);
    let mcfg = LaunchConfig {
        grid_dim: (bh as u32, 1, 1),
        block_dim: (d.min(256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let merge = kernel(
        dev,
        Module::Decode,
        &format!("decode_merge_{}", dtype_name(q_dtype)?),
    )?;
    macro_rules! merge {
        ($t:ty) => {{
            let out: CudaSlice<$t> = unsafe { dev.alloc::<$t>(bh * d)? };
            let mut b = merge.pdl_builder();
            b.arg(a.part_acc)
                .arg(a.part_ml)
                .arg(&out)
                .arg(&ns)
                .arg(&bh_i)
                .arg(&d_i);
            a.arg_lse(&mut b);
            unsafe { b.launch(mcfg) }?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    Ok(match q_dtype {
        DType::F32 => merge!(f32),
        DType::F16 => merge!(f16),
        _ => merge!(bf16),
    })
}
