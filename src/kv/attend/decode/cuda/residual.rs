//! `--kv-residual`'s dense rows on the GPU. The warp kernels take them as one more split
//! (kernels/decode/window.cuh; [`WinViews`] are those arguments); after the block-wide kernels
//! (f32 queries over half scales), `residual_merge_*` (kernels/decode/residual.cuh) attends
//! them and merges its result with the quantized part's output by the log-sum-exp that
//! `decode_merge` returns. Kernels of kvq's own because no crate attends a per-query mix of ring
//! rows and a step's fresh rows.

use super::err;
use crate::device::kernels::{aligned, kernel, view, Module};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

/// Threads per block (four warps).
const THREADS: u32 = 128;
/// Largest head_dim.
const MAX_HEAD_DIM: usize = 512;
/// Shared memory a block may have without opting in.
const MAX_SMEM: usize = 48 * 1024;

/// Dense rows per tile (`residual_tile` in residual.cuh): one per thread, at most 16 KB of V.
fn tile(head_dim: usize) -> usize {
    (THREADS as usize).min(8192 / head_dim)
}

/// The dense rows one call reads: the layer's rings (`[slots · (sinks + ring), width]` f16),
/// the step's fresh rows (`[T, width]` f16) and, per query row, the eight u32 of `info`
/// (residual.cuh).
pub struct DenseRows<'a> {
    pub ring_k: &'a Tensor,
    pub ring_v: &'a Tensor,
    pub new_k: &'a Tensor,
    pub new_v: &'a Tensor,
    pub info: &'a Tensor,
    pub sinks: usize,
    pub ring: usize,
}

impl DenseRows<'_> {
    /// Whether these rows fit queries of `n_q` rows over `kvh` KV heads of head_dim `hd`.
    pub(super) fn check(&self, n_q: usize, kvh: usize, hd: usize) -> Result<()> {
        let width = kvh * hd;
        for (name, t) in [("ring_k", self.ring_k), ("ring_v", self.ring_v)] {
            match t.dims2() {
                Ok((rows, w)) if w == width && t.dtype() == DType::F16 && rows > 0 => {}
                _ => return Err(err(format!("residual window: {name} is {:?}", t.shape()))),
            }
        }
        for (name, t) in [("new_k", self.new_k), ("new_v", self.new_v)] {
            match t.dims2() {
                Ok((_, w)) if w == width && t.dtype() == DType::F16 => {}
                _ => return Err(err(format!("residual window: {name} is {:?}", t.shape()))),
            }
        }
        if self.info.dims() != [n_q, 8] || self.info.dtype() != DType::U32 {
            return Err(err(format!(
                "residual window: info is {:?}, not [{n_q}, 8] u32",
                self.info.shape()
            )));
        }
        Ok(())
    }

    /// The rows contiguous, in the warp kernel's order: ring K, ring V, new K, new V, info.
    pub(super) fn tensors(&self) -> Result<[Tensor; 5]> {
        let [a, b, c, d, e] =
            [self.ring_k, self.ring_v, self.new_k, self.new_v, self.info].map(aligned);
        Ok([a?, b?, c?, d?, e?])
    }
}

/// Rows per window block of the warp kernels (WIN_ROWS in kernels/decode/window.cuh).
pub(super) const WIN_ROWS: usize = 16;

/// The window's arguments of a warp kernel (after its `nsplit`): the four row pools, `info`,
/// then sinks, ring length, row width and window splits.
pub(super) struct WinViews<'a> {
    pub(super) rows: Vec<CudaView<'a, f16>>,
    pub(super) info: CudaView<'a, u32>,
    pub(super) ints: [i32; 4],
}

impl DenseRows<'_> {
    /// The most rows a query reads here: its sinks and a full ring.
    pub(super) fn most(&self) -> usize {
        self.sinks + self.ring
    }
}

impl<'a> WinViews<'a> {
    /// Views of `held` (the storages of [`DenseRows::tensors`], in order).
    pub(super) fn new<G: std::ops::Deref<Target = Storage>>(
        held: &'a [(G, &'a Layout)],
        d: &DenseRows,
        width: usize,
        splits: usize,
    ) -> Result<Self> {
        let rows = held[..4]
            .iter()
            .map(|(s, l)| view::<f16>(s, l))
            .collect::<Result<_>>()?;
        let i32_of =
            |v: usize| i32::try_from(v).map_err(|_| err(format!("residual window: {v} too large")));
        Ok(WinViews {
            rows,
            info: view::<u32>(&held[4].0, held[4].1)?,
            ints: [
                i32_of(d.sinks)?,
                i32_of(d.ring.max(1))?,
                i32_of(width)?,
                i32_of(splits)?,
            ],
        })
    }
}

/// Attention of `q` (`[Q, H, D]`) merged from the quantized part (`oq`, same shape, and its
/// log-sum-exp `lse`, `[Q·H]`) and the dense rows `d`; `kvh` KV heads. Returns `[Q, H, D]` in
/// q's dtype.
pub fn residual_merge(
    q: &Tensor,
    oq: &Tensor,
    lse: &Tensor,
    d: &DenseRows,
    kvh: usize,
    scale: f32,
) -> Result<Tensor> {
    let (n_q, heads, hd) = q.dims3()?;
    let width = kvh * hd;
    if kvh == 0 || heads % kvh != 0 || hd > MAX_HEAD_DIM || !hd.is_multiple_of(8) {
        return Err(err(format!(
            "residual merge: {heads} query heads over {kvh} KV heads of head_dim {hd}"
        )));
    }
    d.check(n_q, kvh, hd)?;
    let same = oq.dims() == q.dims() && oq.dtype() == q.dtype();
    if !same || lse.dims() != [n_q * heads] {
        return Err(err(
            "residual merge: info, output or log-sum-exp of the wrong shape",
        ));
    }
    if n_q == 0 {
        return Ok(oq.clone());
    }
    let group = heads / kvh;
    let [q, oq, lse, rk, rv, nk, nv, info] =
        [q, oq, lse, d.ring_k, d.ring_v, d.new_k, d.new_v, d.info].map(aligned);
    let (q, oq, lse, rk, rv) = (q?, oq?, lse?, rk?, rv?);
    let (nk, nv, info) = (nk?, nv?, info?);
    let dev = q.device().as_cuda_device()?.clone();
    let f = kernel(
        &dev,
        Module::Decode,
        &format!("residual_merge_{}", super::dtype_name(q.dtype())?),
    )?;
    let i32_of =
        |v: usize| i32::try_from(v).map_err(|_| err(format!("residual merge: {v} too large")));
    let ints = [
        i32_of(heads)?,
        i32_of(kvh)?,
        i32_of(hd)?,
        i32_of(d.sinks)?,
        i32_of(d.ring.max(1))?,
        i32_of(width)?,
    ];
    let tj = tile(hd);
    let smem = tj * hd * 2 + 4 * (2 * group * hd + group * tj + 3 * group);
    if smem > MAX_SMEM {
        return Err(err(format!(
            "residual merge: {group} query heads per KV head at head_dim {hd} need {smem} bytes \
             of shared memory (at most {MAX_SMEM})"
        )));
    }
    let cfg = LaunchConfig {
        grid_dim: (n_q as u32, kvh as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let sl: Vec<_> = [&q, &oq, &lse, &rk, &rv, &nk, &nv, &info]
        .iter()
        .map(|t| t.storage_and_layout())
        .collect();
    macro_rules! launch {
        ($t:ty) => {{
            let (qv, ov) = (
                view::<$t>(&sl[0].0, sl[0].1)?,
                view::<$t>(&sl[1].0, sl[1].1)?,
            );
            let lv = view::<f32>(&sl[2].0, sl[2].1)?;
            let rows: Vec<_> = (3..7)
                .map(|i| view::<f16>(&sl[i].0, sl[i].1))
                .collect::<Result<_>>()?;
            let iv = view::<u32>(&sl[7].0, sl[7].1)?;
            let out: CudaSlice<$t> = unsafe { dev.alloc::<$t>(n_q * heads * hd)? };
            let mut b = f.pdl_builder();
            b.arg(&qv).arg(&ov).arg(&lv).arg(&out);
            for r in &rows {
                b.arg(r);
            }
            b.arg(&iv);
            for i in &ints {
                b.arg(i);
            }
            b.arg(&scale);
            unsafe { b.launch(cfg) }?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match q.dtype() {
        DType::F32 => launch!(f32),
        DType::F16 => launch!(f16),
        DType::BF16 => launch!(bf16),
        d => return Err(err(format!("residual merge: queries of {d:?}"))),
    };
    Ok(super::tensor_of(out, (n_q, heads, hd)))
}
