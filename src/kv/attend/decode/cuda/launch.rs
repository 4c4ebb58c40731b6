//! Queues the decode kernels of `kernels/decode.cu` for [`super::run`]: the launch's common
//! arguments ([`Launch`]), one launcher per kernel family (dense, dense on the warp kernel,
//! affine block-wide or warp), the block-wide kernels' `decode_merge`, and the warp kernels'
//! merge counters.

use super::dtype_name;
use super::err;
use super::residual::WinViews;
use crate::device::kernels::{aligned, kernel, view, Kernel, Module};
use crate::kv::format::rotation::Rotation;
use crate::kv::format::{QuantFormat, Quantized};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// What every launch of one decode takes besides the pool: the kernel, its grid, the tables,
/// the integer arguments and the split partials.
pub(super) struct Launch<'a> {
    pub(super) f: &'a Kernel,
    pub(super) cfg: LaunchConfig,
    pub(super) dev: &'a CudaDevice,
    pub(super) scale: f32,
    pub(super) tables: &'a CudaView<'a, u32>,
    pub(super) starts: &'a CudaView<'a, u32>,
    pub(super) lens: &'a CudaView<'a, u32>,
    /// max_blocks, num_blocks, block_size, kv_heads, query heads per KV head, head_dim.
    pub(super) ints: [i32; 6],
    pub(super) split_len: i32,
    pub(super) part_acc: &'a CudaSlice<f32>,
    pub(super) part_ml: &'a CudaSlice<f32>,
    /// Where the block-wide merge puts each head's log-sum-exp (`[B·H]`), if asked.
    pub(super) lse: Option<&'a CudaSlice<f32>>,
    /// The window's dense rows, read by a warp kernel's extra split.
    pub(super) win: Option<&'a WinViews<'a>>,
}

impl Launch<'_> {
    /// Passes the log-sum-exp output, or a null pointer (the kernel writes none).
    fn arg_lse(&self, b: &mut crate::device::kernels::pdl::Args<'_>) {
        match self.lse {
            Some(l) => b.arg(l),
            None => b.arg(&NULL),
        };
    }

    /// Passes the window's arguments to a window instance (`_w`; the plain ones take none).
    pub(super) fn arg_win(&self, b: &mut crate::device::kernels::pdl::Args<'_>) {
        if let Some(w) = self.win {
            for r in &w.rows {
                b.arg(r);
            }
            b.arg(&w.info);
            for i in &w.ints {
                b.arg(i);
            }
        }
    }
}

/// A null device pointer, for the kernels' optional outputs.
static NULL: u64 = 0;

/// Where a kernel that merges its own splits puts them: `counters` slots of finished blocks
/// (one per sequence, KV head and head chunk), an output of `out_len` values, `nsplit` splits.
pub(super) struct Merged {
    pub(super) counters: usize,
    pub(super) out_len: usize,
    pub(super) nsplit: usize,
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
pub(super) fn launch_dense(
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
pub(super) fn launch_dense_warp(
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
            a.arg_win(&mut b);
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
pub(super) struct WarpArgs<'a> {
    pub(super) rot: Option<&'a Rotation>,
    pub(super) merged: Merged,
}

/// An affine kernel over the quantized pools `k`, `v` with queries `qs`: the block-wide kernel
/// (`warp` None; the partials are merged after) or the warp kernel, whose merged output this
/// returns.
pub(super) fn launch_affine(
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
                a.arg_win(&mut b);
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
pub(super) fn merge(
    a: &Launch,
    q_dtype: DType,
    nsplit: usize,
    bh: usize,
    d: usize,
) -> Result<CudaStorage> {
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
