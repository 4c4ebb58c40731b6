//! Decoder ops that run as one kernel on CUDA (kernels/fused.cu) and as the same composition of
//! candle ops everywhere else, where they stay bit-identical to the unfused code (the CPU's
//! exactness and batch-invariance tests see no change).
//!
//! Why kernels of our own: on a GPU a decode step of a small model is bound by how many kernels
//! it launches, not by arithmetic. Candle launches one kernel per op, so a residual add followed
//! by an RMSNorm is two launches, RoPE on q and k from a stacked q|k|v projection six (three
//! copies to contiguous rows, two rotations, a reshape copy), and a SwiGLU three; candle has no
//! fused forms of these.

use candle_core::{Result, Tensor};

/// `(s, rms_norm(s) * w)` with `s = x + r` (or `s = x` when `r` is `None`): the residual
/// stream and the next block's normalized input, as candle's add and `rms_norm` compute them.
pub fn add_rms_norm(
    x: &Tensor,
    r: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::add_rms_norm(x, r, w, eps);
    }
    let s = match r {
        Some(r) => (x + r)?,
        None => x.clone(),
    };
    let y = candle_nn::ops::rms_norm(&s, w, eps)?;
    Ok((s, y))
}

/// Gated linear unit from a stacked gate|up projection `gu` `[T, 2F]`: `act(gate) * up`,
/// `[T, F]`, with SiLU (SwiGLU) or, for `gelu`, GELU's tanh approximation (GeGLU).
pub fn glu(gu: &Tensor, ff: usize, gelu: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gu.device().is_cuda() {
        return cuda::glu(gu, ff, gelu);
    }
    if !gelu && super::fused_cpu::applies(gu) {
        return super::fused_cpu::swiglu(gu, ff);
    }
    glu_split(&gu.narrow(1, 0, ff)?, &gu.narrow(1, ff, ff)?, gelu)
}

/// [`glu`] of separate gate and up rows (the composition of candle ops).
pub fn glu_split(gate: &Tensor, up: &Tensor, gelu: bool) -> Result<Tensor> {
    let act = if gelu {
        gate.gelu()? // tanh approximation (gelu_pytorch_tanh)
    } else {
        candle_nn::ops::silu(gate)?
    };
    (act * up)?.contiguous()
}

/// Where [`rope_qkv`] has a kernel: CUDA.
pub fn has_rope_qkv(x: &Tensor) -> bool {
    cfg!(feature = "cuda") && x.device().is_cuda()
}

/// Per-head RMSNorm weights of q and k (`[D]` each, Qwen3's `q_norm` / `k_norm`) and the
/// norm's epsilon: applied to every q and k head before RoPE.
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f32,
}

/// From the rows of a stacked q|k|v projection `qkv` `[T, (H + 2 KVH) * D]`: q `[T, H, D]` and
/// k `[T, KVH * D]` rotated by RoPE at positions `pos` (u32 `[T]`) with the f32 tables
/// `cos`, `sin` `[positions, D / 2]` (halves layout, candle's `rope_thd` arithmetic), after
/// `norm` (candle's `rms_norm` of each head) where given, and v `[T, KVH * D]`. CUDA only
/// ([`has_rope_qkv`]).
pub fn rope_qkv(
    qkv: &Tensor,
    pos: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (heads, kv_heads, head_dim): (usize, usize, usize),
    norm: Option<QkNorm<'_>>,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return cuda::rope_qkv(qkv, pos, (cos, sin), (heads, kv_heads, head_dim), norm);
    }
    let _ = (qkv, pos, cos, sin, heads, kv_heads, head_dim, norm);
    candle_core::bail!("rope_qkv has a CUDA kernel only")
}

/// [`rope_qkv`] writing the rotated k and the v rows straight into a dense cache layer: row `i`
/// into row `slots[i]` (u32 `[T]`, on the device) of `k_pool`, `v_pool` (`[slots, KVH * D]`, the
/// projection's dtype); returns q. One launch instead of the rotation and two scatters. CUDA
/// only ([`has_rope_qkv`]).
pub fn rope_qkv_into(
    qkv: &Tensor,
    pos: &Tensor,
    tables: (&Tensor, &Tensor),
    shape: (usize, usize, usize),
    norm: Option<QkNorm<'_>>,
    (k_pool, v_pool, slots): (&Tensor, &Tensor, &Tensor),
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return cuda::rope_qkv_into(qkv, pos, tables, shape, norm, (k_pool, v_pool, slots));
    }
    let _ = (qkv, pos, tables, shape, norm, k_pool, v_pool, slots);
    candle_core::bail!("rope_qkv_into has a CUDA kernel only")
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use super::QkNorm;
    use crate::device::kernels::{cuda_device as device, dtype_suffix, kernel, view, wrap, Module};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Tensor};
    use half::{bf16, f16};

    fn err(msg: String) -> candle_core::Error {
        candle_core::Error::Msg(format!("fused op (cuda): {msg}"))
    }

    fn name(op: &str, dtype: DType) -> Result<String> {
        let t = dtype_suffix(dtype).ok_or_else(|| err(format!("unsupported dtype {dtype:?}")))?;
        Ok(format!("{op}_{t}"))
    }

    /// Whether K/V pools `[slots, width]` of `dtype` and u32 slot ids `[rows]` can take a
    /// step's K/V rows written in place.
    pub(crate) fn pool_fits(
        (kp, vp, sl): (&Tensor, &Tensor, &Tensor),
        dtype: DType,
        rows: usize,
        width: usize,
    ) -> Result<bool> {
        Ok(kp.dtype() == dtype
            && vp.dtype() == dtype
            && kp.is_contiguous()
            && vp.is_contiguous()
            && kp.dims().len() == 2
            && kp.dim(1)? == width
            && vp.dims() == kp.dims()
            && sl.dims() == [rows]
            && sl.dtype() == DType::U32)
    }

    fn int(v: usize, what: &str) -> Result<i32> {
        i32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit the kernel's int")))
    }

    pub fn add_rms_norm(
        x: &Tensor,
        r: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let x = x.contiguous()?;
        let r = r.map(|r| r.contiguous()).transpose()?;
        let w = w.to_dtype(x.dtype())?.contiguous()?;
        let (rows, cols) = x.dims2()?;
        if r.as_ref().is_some_and(|r| r.dims() != x.dims()) || w.dims() != [cols] {
            return Err(err(format!(
                "add_rms_norm: shapes {:?}, {:?}, {:?}",
                x.dims(),
                r.as_ref().map(|r| r.dims().to_vec()),
                w.dims()
            )));
        }
        if rows == 0 {
            return Ok((x.clone(), x));
        }
        let dev = device(&x)?;
        let f = kernel(&dev, Module::Fused, &name("add_rms_norm", x.dtype())?)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (cols.div_ceil(32).clamp(1, 32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let cols_i = int(cols, "row length")?;
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let rsl = r.as_ref().map(|r| r.storage_and_layout());
        macro_rules! launch {
            ($t:ty) => {{
                let (xv, wv) = (view::<$t>(&xs, xl)?, view::<$t>(&ws, wl)?);
                let y = unsafe { dev.alloc::<$t>(rows * cols)? };
                let mut b = f.builder();
                let rv;
                let s;
                match &rsl {
                    Some((rs, rl)) => {
                        rv = view::<$t>(rs, rl)?;
                        s = Some(unsafe { dev.alloc::<$t>(rows * cols)? });
                        b.arg(&xv)
                            .arg(&rv)
                            .arg(&wv)
                            .arg(s.as_ref().expect("allocated"));
                    }
                    None => {
                        s = None;
                        // No residual: null r and s (the kernel reads x).
                        b.arg(&xv).arg(&0u64).arg(&wv).arg(&0u64);
                    }
                }
                b.arg(&y).arg(&cols_i).arg(&eps);
                unsafe { b.launch(cfg) }.w()?;
                let s = match s {
                    Some(s) => wrap(s, &dev, (rows, cols)),
                    None => x.clone(),
                };
                (s, wrap(y, &dev, (rows, cols)))
            }};
        }
        Ok(match x.dtype() {
            DType::F32 => launch!(f32),
            DType::F16 => launch!(f16),
            DType::BF16 => launch!(bf16),
            d => return Err(err(format!("unsupported dtype {d:?}"))),
        })
    }

    pub fn glu(gu: &Tensor, ff: usize, gelu: bool) -> Result<Tensor> {
        let gu = gu.contiguous()?;
        let (rows, two_ff) = gu.dims2()?;
        if two_ff != 2 * ff {
            return Err(err(format!("glu: rows of {two_ff} for 2 x {ff}")));
        }
        let n = rows * ff;
        if n == 0 {
            return Tensor::zeros((rows, ff), gu.dtype(), gu.device());
        }
        let dev = device(&gu)?;
        let f = kernel(&dev, Module::Fused, &name("glu", gu.dtype())?)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ff_i, gelu_i, n_u) = (int(ff, "intermediate size")?, i32::from(gelu), n as u64);
        let (gs, gl) = gu.storage_and_layout();
        macro_rules! launch {
            ($t:ty) => {{
                let gv = view::<$t>(&gs, gl)?;
                let y = unsafe { dev.alloc::<$t>(n)? };
                let mut b = f.builder();
                b.arg(&gv).arg(&y).arg(&ff_i).arg(&gelu_i).arg(&n_u);
                unsafe { b.launch(cfg) }.w()?;
                wrap(y, &dev, (rows, ff))
            }};
        }
        Ok(match gu.dtype() {
            DType::F32 => launch!(f32),
            DType::F16 => launch!(f16),
            DType::BF16 => launch!(bf16),
            d => return Err(err(format!("unsupported dtype {d:?}"))),
        })
    }

    /// Where [`launch_rope`] puts K and V: fresh buffers, or rows of a dense pool.
    enum KvOut<'a> {
        Fresh,
        Pool(&'a Tensor, &'a Tensor, &'a Tensor),
    }

    pub fn rope_qkv(
        qkv: &Tensor,
        pos: &Tensor,
        tables: (&Tensor, &Tensor),
        shape: (usize, usize, usize),
        norm: Option<QkNorm<'_>>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, kv) = launch_rope(qkv, pos, tables, shape, norm, KvOut::Fresh)?;
        let (k, v) = kv.ok_or_else(|| err("rope_qkv: no k/v".into()))?;
        Ok((q, k, v))
    }

    pub fn rope_qkv_into(
        qkv: &Tensor,
        pos: &Tensor,
        tables: (&Tensor, &Tensor),
        shape: (usize, usize, usize),
        norm: Option<QkNorm<'_>>,
        (k_pool, v_pool, slots): (&Tensor, &Tensor, &Tensor),
    ) -> Result<Tensor> {
        let out = KvOut::Pool(k_pool, v_pool, slots);
        Ok(launch_rope(qkv, pos, tables, shape, norm, out)?.0)
    }

    /// The norm weights in the projection's dtype, `[d]` each, or `None`.
    fn norm_weights(
        norm: Option<QkNorm<'_>>,
        dtype: DType,
        d: usize,
    ) -> Result<Option<(Tensor, Tensor, f32)>> {
        let Some(n) = norm else { return Ok(None) };
        let (q, k) = (
            n.q.to_dtype(dtype)?.contiguous()?,
            n.k.to_dtype(dtype)?.contiguous()?,
        );
        if q.dims() != [d] || k.dims() != [d] {
            return Err(err(format!(
                "rope_qkv: q/k norm weights {:?}, {:?} for heads of {d}",
                q.dims(),
                k.dims()
            )));
        }
        Ok(Some((q, k, n.eps)))
    }

    #[allow(clippy::type_complexity)]
    fn launch_rope(
        qkv: &Tensor,
        pos: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        (heads, kv_heads, d): (usize, usize, usize),
        norm: Option<QkNorm<'_>>,
        out: KvOut<'_>,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let qkv = qkv.contiguous()?;
        let (rows, width) = qkv.dims2()?;
        if width != (heads + 2 * kv_heads) * d || !d.is_multiple_of(2) || d > 2048 {
            return Err(err(format!(
                "rope_qkv: rows of {width} for ({heads} + 2 x {kv_heads}) heads of {d}"
            )));
        }
        if pos.dims() != [rows] || pos.dtype() != DType::U32 {
            return Err(err("rope_qkv: positions must be u32 [T]".into()));
        }
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        if cos.dtype() != DType::F32 || cos.dim(1)? != d / 2 || sin.dims() != cos.dims() {
            return Err(err("rope_qkv: tables must be f32 [positions, D/2]".into()));
        }
        if let KvOut::Pool(kp, vp, sl) = &out {
            if !pool_fits((kp, vp, sl), qkv.dtype(), rows, kv_heads * d)? {
                return Err(err("rope_qkv_into: pools or slots do not fit".into()));
            }
        }
        let norms = norm_weights(norm, qkv.dtype(), d)?;
        let eps = norms.as_ref().map_or(0f32, |n| n.2);
        let norm_sl = norms
            .as_ref()
            .map(|(q, k, _)| (q.storage_and_layout(), k.storage_and_layout()));
        let dev = device(&qkv)?;
        let f = kernel(&dev, Module::Fused, &name("rope_qkv", qkv.dtype())?)?;
        let ints = [
            int(heads, "heads")?,
            int(kv_heads, "kv heads")?,
            int(d, "head_dim")?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (heads + 2 * kv_heads) as u32, 1),
            block_dim: ((d / 2).div_ceil(32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (xs, xl) = qkv.storage_and_layout();
        let (ps, pl) = pos.storage_and_layout();
        let (cs, cl) = cos.storage_and_layout();
        let (ss, sl) = sin.storage_and_layout();
        let pools = match &out {
            KvOut::Pool(kp, vp, slots) => Some((
                kp.storage_and_layout(),
                vp.storage_and_layout(),
                slots.storage_and_layout(),
            )),
            KvOut::Fresh => None,
        };
        macro_rules! launch {
            ($t:ty) => {{
                let xv = view::<$t>(&xs, xl)?;
                let (pv, cv, sv) = (
                    view::<u32>(&ps, pl)?,
                    view::<f32>(&cs, cl)?,
                    view::<f32>(&ss, sl)?,
                );
                let q = unsafe { dev.alloc::<$t>(rows * heads * d)? };
                let (fresh, kvp);
                let mut b = f.builder();
                b.arg(&xv).arg(&pv).arg(&cv).arg(&sv).arg(&q);
                match &pools {
                    Some(((ks, kl), (vs, vl), (ss2, sl2))) => {
                        kvp = (
                            view::<$t>(ks, kl)?,
                            view::<$t>(vs, vl)?,
                            view::<u32>(ss2, sl2)?,
                        );
                        b.arg(&kvp.0).arg(&kvp.1).arg(&kvp.2);
                        fresh = None;
                    }
                    None => {
                        let k = unsafe { dev.alloc::<$t>(rows * kv_heads * d)? };
                        let v = unsafe { dev.alloc::<$t>(rows * kv_heads * d)? };
                        fresh = Some((k, v));
                        let (k, v) = fresh.as_ref().expect("allocated");
                        b.arg(k).arg(v).arg(&0u64);
                    }
                }
                let nv = match &norm_sl {
                    Some(((qs, ql), (ks, kl))) => Some((view::<$t>(qs, ql)?, view::<$t>(ks, kl)?)),
                    None => None,
                };
                match &nv {
                    Some((qv, kv)) => b.arg(qv).arg(kv),
                    None => b.arg(&0u64).arg(&0u64),
                };
                b.arg(&eps);
                for i in &ints {
                    b.arg(i);
                }
                if rows > 0 {
                    unsafe { b.launch(cfg) }.w()?;
                }
                (
                    wrap(q, &dev, (rows, heads, d)),
                    fresh.map(|(k, v)| {
                        (
                            wrap(k, &dev, (rows, kv_heads * d)),
                            wrap(v, &dev, (rows, kv_heads * d)),
                        )
                    }),
                )
            }};
        }
        Ok(match qkv.dtype() {
            DType::F32 => launch!(f32),
            DType::F16 => launch!(f16),
            DType::BF16 => launch!(bf16),
            dt => return Err(err(format!("unsupported dtype {dt:?}"))),
        })
    }
}

/// The fused RoPE kernel against candle's composition (the CPU path's ops, run on the GPU):
/// q/k norms per head where given, then `rope_thd`, for head sizes whose half is and is not a
/// multiple of a warp.
#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::{rope_qkv, QkNorm};
    use crate::ops::testing::max_abs_diff;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn rope_qkv_with_and_without_qk_norms_matches_candle_ops() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let (heads, kv_heads, rows, eps) = (6, 2, 5, 1e-6f32);
        for d in [64, 96, 128] {
            let inv: Vec<f32> = (0..d / 2)
                .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
                .collect();
            let angles: Vec<f32> = (0..512)
                .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
                .collect();
            let ang = Tensor::from_vec(angles, (512, d / 2), &dev).unwrap();
            let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
            let pos = Tensor::from_vec(vec![0u32, 3, 77, 300, 511], rows, &dev).unwrap();
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 4e-3), (DType::BF16, 3e-2)] {
                let width = (heads + 2 * kv_heads) * d;
                let qkv = Tensor::randn(0f32, 2.0, (rows, width), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let qn = Tensor::randn(1f32, 0.3, d, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let kn = Tensor::randn(1f32, 0.3, d, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let cs = pos.to_dtype(DType::U32).unwrap();
                let cos_r = cos.index_select(&cs, 0).unwrap().to_dtype(dtype).unwrap();
                let sin_r = sin.index_select(&cs, 0).unwrap().to_dtype(dtype).unwrap();
                for with_norm in [false, true] {
                    let norm = with_norm.then_some(QkNorm {
                        q: &qn,
                        k: &kn,
                        eps,
                    });
                    let (q, k, v) =
                        rope_qkv(&qkv, &pos, (&cos, &sin), (heads, kv_heads, d), norm).unwrap();
                    let part = |at: usize, n: usize| {
                        qkv.narrow(1, at * d, n * d)
                            .unwrap()
                            .reshape((rows, n, d))
                            .unwrap()
                    };
                    let (mut q0, mut k0) = (part(0, heads), part(heads, kv_heads));
                    if with_norm {
                        q0 = candle_nn::ops::rms_norm(&q0.contiguous().unwrap(), &qn, eps).unwrap();
                        k0 = candle_nn::ops::rms_norm(&k0.contiguous().unwrap(), &kn, eps).unwrap();
                    }
                    let rope = |x: &Tensor| {
                        let x = x.unsqueeze(0).unwrap().contiguous().unwrap();
                        candle_nn::rotary_emb::rope_thd(&x, &cos_r, &sin_r).unwrap()
                    };
                    let what = format!("d {d} {dtype:?} norms {with_norm}");
                    assert!(max_abs_diff(&q, &rope(&q0)) <= tol, "{what}: q");
                    assert!(max_abs_diff(&k, &rope(&k0)) <= tol, "{what}: k");
                    assert_eq!(
                        max_abs_diff(&v, &part(heads + kv_heads, kv_heads)),
                        0.0,
                        "{what}: v"
                    );
                }
            }
        }
    }
}
