//! Projections of a few rows as one CUDA kernel each, with what surrounds them in a decoder
//! layer fused in (kernels/gemv.cu): the residual add and RMSNorm before a projection, and after
//! it the residual add, the gated unit (SwiGLU / GeGLU) or the widening of logits to f32.
//!
//! Why: a decode step of one to a few sequences is bound by launches, not by bytes. cuBLAS
//! spends a launch per projection and candle one per add, norm, activation and cast around it —
//! about ten kernels per layer, each a few microseconds. Here a layer is five kernels (the norm
//! and q|k|v, RoPE, attention, the output projection with its residual add, the norm and gate|up
//! with the gated unit, the down projection with its residual add). Each weight is read once
//! for all rows of the step with 16-byte loads, so at one to eight rows the kernels stream the
//! weights at close to the memory's rate, where cuBLAS's tiles sit mostly idle.
//!
//! When: by default for steps of one row only — measured on an H100 (default model, 512 × 1,
//! 128 new tokens) a one-sequence step runs 184 kernels instead of 306 and decodes 5–25% faster,
//! while from 4 rows on the kernels lose to cuBLAS (8 rows: 4.2K tok/s against 6.9–7.2K) and at
//! two rows it depends on the model (default model 2.13–2.18K against 1.66–1.75K; Qwen3-0.6B's
//! shape at 50K context 466.5 against 486.5, where cuBLAS streams the larger weights better).
//! A variant with one wave of blocks looping over units, 6 blocks per SM and fewer loads in
//! flight per thread was faster at 2–8 rows but 1–8% slower at one row, so it was not kept.
//! `KVQ_GPU_GEMV` (read once per process) sets the most rows: `off`, `on` (all 8), or a number.
//! The kernels are tested against the unfused ops by this module's CUDA tests and the engine's
//! graph-vs-eager test (tests/it/cuda_graphs.rs) runs with them on and off.
//!
//! The arithmetic is candle's for everything but the order of the dot products' sums (f32
//! accumulation, one fixed order per row): intermediate values are rounded to the compute dtype
//! where the unfused ops round them. Eager decode steps and replayed CUDA graphs take the same
//! kernels for the same number of rows, so their outputs are identical.

use candle_core::{DType, Result, Tensor};

/// The most rows of a decode step that take the fused projections (0: never): 1 by default,
/// else `KVQ_GPU_GEMV` — `off`/`0`, `on` ([`MAX_ROWS`]) or a number of rows up to [`MAX_ROWS`].
pub fn max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| rows_setting(std::env::var("KVQ_GPU_GEMV").ok().as_deref()))
}

/// [`max_rows`] from the variable's value; an unknown value keeps the default (1).
fn rows_setting(v: Option<&str>) -> usize {
    match v.map(str::trim) {
        Some("off") => 0,
        Some("on") => MAX_ROWS,
        Some(n) => n.parse::<usize>().map_or(1, |n| n.min(MAX_ROWS)),
        None => 1,
    }
}

/// The most rows the fused projections take (the CUDA-graph buckets up to 8).
pub const MAX_ROWS: usize = 8;

/// Inputs are staged as f32 in shared memory: rows × in-width × 4 bytes at most this (the
/// kernels are allowed that much dynamic shared memory; Hopper has 227 KiB per block).
const SHARED_BYTES: usize = 96 * 1024;

/// What a projection's outputs become.
pub enum Epilogue<'a> {
    /// `y` in the input dtype.
    Store,
    /// `y + res`, `res` of `y`'s shape (the residual stream).
    Add(&'a Tensor),
    /// The weight is gate rows then up rows (`[2F, in]`): `act(gate) * up`, `[rows, F]`, with
    /// SiLU or, for `gelu`, GELU's tanh approximation.
    Glu { gelu: bool },
    /// `y` widened to f32 (logits).
    Logits,
}

/// Whether `rows` rows of `width` inputs each fit the kernels: at most [`MAX_ROWS`], staged in
/// shared memory, `width` a multiple of 8 (16-byte loads).
pub fn rows_fit(rows: usize, width: usize) -> bool {
    (1..=MAX_ROWS).contains(&rows) && width.is_multiple_of(8) && rows * width * 4 <= SHARED_BYTES
}

/// Whether the dense weight `w` (`[out, in]`) can be a fused projection's: CUDA, f16 or bf16,
/// contiguous and 16-byte aligned.
pub fn weight_fits(w: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && w.device().is_cuda()
        && matches!(w.dtype(), DType::F16 | DType::BF16)
        && w.rank() == 2
        && w.is_contiguous()
        && (w.layout().start_offset() * 2).is_multiple_of(16)
}

/// Whether `x` (`[rows, in]`) times `w` runs fused ([`rows_fit`], [`weight_fits`], one dtype).
pub fn fits(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((rows, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    weight_fits(w) && x.dtype() == w.dtype() && k == wk && rows_fit(rows, k)
}

/// `epilogue(norm(x + res) · wᵀ + bias)` for the rows of `x` (`[rows, in]`), where `norm` is
/// `(weight, eps)` of an RMSNorm and `res` a residual added to `x` first. Returns the sum
/// `x + res` (when `res` is given: the residual stream the layer goes on with) and the output.
/// Callers check [`fits`] first.
pub fn project(
    x: &Tensor,
    res: Option<&Tensor>,
    norm: Option<(&Tensor, f32)>,
    w: &Tensor,
    bias: Option<&Tensor>,
    epilogue: Epilogue<'_>,
) -> Result<(Option<Tensor>, Tensor)> {
    if !fits(x, w) {
        candle_core::bail!(
            "fused projection of {:?} {:?} by {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    {
        cuda::project(x, res, norm, w, bias, epilogue)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (res, norm, bias, epilogue);
        unreachable!("fits() is false without CUDA")
    }
}

/// RoPE and the K/V destination of [`project_rope`].
pub struct RopeOut<'a> {
    /// u32 `[rows]`: each row's position.
    pub pos: &'a Tensor,
    /// f32 `[positions, D/2]` (halves layout).
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `(k_pool, v_pool, slots)`: k and v rows go to rows `slots[r]` of the dense pools
    /// (`[slots, KVH * D]`); `None`: to fresh `[rows, KVH * D]` tensors.
    pub pool: Option<(&'a Tensor, &'a Tensor, &'a Tensor)>,
}

/// The stacked q|k|v projection (`w`: `[(H + 2 KVH) * D, in]`) of [`project`]'s prologue,
/// with RoPE at each row's position on q and k as [`super::fused::rope_qkv`] does it: returns
/// `(x + res, q [rows, H, D], (k, v))`, k and v `None` when they went into the pools.
#[allow(clippy::type_complexity)]
pub fn project_rope(
    x: &Tensor,
    res: Option<&Tensor>,
    norm: Option<(&Tensor, f32)>,
    w: &Tensor,
    bias: Option<&Tensor>,
    rope: RopeOut<'_>,
) -> Result<(Option<Tensor>, Tensor, Option<(Tensor, Tensor)>)> {
    if !fits(x, w) {
        candle_core::bail!("fused q|k|v projection of {:?} by {:?}", x.dims(), w.dims());
    }
    #[cfg(feature = "cuda")]
    {
        cuda::project_rope(x, res, norm, w, bias, rope)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (res, norm, bias, rope);
        unreachable!("fits() is false without CUDA")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Epilogue, RopeOut, MAX_ROWS, SHARED_BYTES};
    use crate::device::kernels::{aligned, cuda_device, kernel, view, wrap, Kernel, Module};
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{DType, Result, Tensor};
    use half::{bf16, f16};

    fn err(msg: String) -> candle_core::Error {
        candle_core::Error::Msg(format!("fused projection (cuda): {msg}"))
    }

    /// The kernel's epilogue code (kernels/gemv.cu's `mode`).
    fn mode(e: &Epilogue<'_>) -> i32 {
        match e {
            Epilogue::Store => 0,
            Epilogue::Add(_) => 1,
            Epilogue::Glu { .. } => 2,
            Epilogue::Logits => 3,
        }
    }

    /// Warps per block (kernels/gemv.cu's GEMV_WARPS); each computes two weight rows.
    const WARPS: usize = 4;

    /// `t`, checked to be `dims` of `dtype`, contiguous and 16-byte aligned (the prologue reads
    /// 16-byte chunks).
    fn same(t: &Tensor, dims: &[usize], dtype: DType, what: &str) -> Result<Tensor> {
        if t.dims() != dims || t.dtype() != dtype {
            return Err(err(format!(
                "{what} is {:?} {:?}, expected {dims:?} {dtype:?}",
                t.dims(),
                t.dtype()
            )));
        }
        aligned(t)
    }

    fn int(v: usize, what: &str) -> Result<i32> {
        i32::try_from(v).map_err(|_| err(format!("{what} {v} does not fit an int")))
    }

    /// What every fused projection reads: the rows, the residual and norm of the prologue, the
    /// weight and its bias, checked and contiguous.
    struct Inputs {
        x: Tensor,
        res_in: Option<Tensor>,
        norm_w: Option<Tensor>,
        eps: f32,
        w: Tensor,
        bias: Option<Tensor>,
        rows: usize,
        k: usize,
        n: usize,
        dev: CudaDevice,
    }

    impl Inputs {
        fn new(
            x: &Tensor,
            res: Option<&Tensor>,
            norm: Option<(&Tensor, f32)>,
            w: &Tensor,
            bias: Option<&Tensor>,
        ) -> Result<Self> {
            let dtype = x.dtype();
            let x = aligned(x)?;
            let (rows, k) = x.dims2()?;
            let n = w.dim(0)?;
            Ok(Inputs {
                res_in: res
                    .map(|r| same(r, &[rows, k], dtype, "residual"))
                    .transpose()?,
                norm_w: norm
                    .map(|(nw, _)| same(&nw.to_dtype(dtype)?, &[k], dtype, "norm weight"))
                    .transpose()?,
                eps: norm.map_or(0.0, |(_, e)| e),
                bias: bias
                    .map(|b| same(&b.to_dtype(dtype)?, &[n], dtype, "bias"))
                    .transpose()?,
                w: w.clone(),
                dev: cuda_device(&x)?,
                x,
                rows,
                k,
                n,
            })
        }

        /// Kernel `op` for these rows' dtype and row bucket, and its launch over `units` warps.
        fn kernel(&self, op: &str, units: usize) -> Result<(Kernel, LaunchConfig)> {
            let suffix = match self.x.dtype() {
                DType::F16 => "f16",
                DType::BF16 => "bf16",
                d => return Err(err(format!("dtype {d:?}"))),
            };
            let r = self.rows.next_power_of_two().min(MAX_ROWS);
            let name = format!("{op}_{suffix}_{r}");
            let f = kernel(&self.dev, Module::Gemv, &name)?;
            allow_shared(&f, &format!("{:?}/{name}", self.dev.id()))?;
            let cfg = LaunchConfig {
                grid_dim: (units.div_ceil(WARPS) as u32, 1, 1),
                block_dim: (WARPS as u32 * 32, 1, 1),
                shared_mem_bytes: (self.rows * self.k * 4) as u32,
            };
            Ok((f, cfg))
        }
    }

    /// Lets kernel `f` (`key`: its device and name) use [`SHARED_BYTES`] of dynamic shared
    /// memory (once per kernel and device).
    fn allow_shared(f: &Kernel, key: &str) -> Result<()> {
        static DONE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
            std::sync::OnceLock::new();
        let mut done = DONE
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| err("poisoned kernel set".into()))?;
        if done.insert(key.to_string()) {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                SHARED_BYTES as i32,
            )
            .w()?;
        }
        Ok(())
    }

    /// Pushes an optional device buffer, or a null pointer.
    macro_rules! opt_arg {
        ($b:expr, $v:expr, $null:expr) => {
            match &$v {
                Some(v) => $b.arg(v),
                None => $b.arg(&$null),
            }
        };
    }

    /// Views of the prologue's and the weight's buffers as `$t`, the residual-sum output, and
    /// the builder of `$f` with the first seven arguments (a, res_in, norm_w, eps, s_out, w,
    /// bias) pushed. Binds `$b` (builder) and `$s_out`.
    macro_rules! common_args {
        ($inp:expr, $t:ty, $f:expr, $b:ident, $s_out:ident, $null:expr) => {
            let inp = &$inp;
            let (xs, xl) = inp.x.storage_and_layout();
            let (ws, wl) = inp.w.storage_and_layout();
            let ri = inp.res_in.as_ref().map(|t| t.storage_and_layout());
            let nw = inp.norm_w.as_ref().map(|t| t.storage_and_layout());
            let bs = inp.bias.as_ref().map(|t| t.storage_and_layout());
            let xv = view::<$t>(&xs, xl)?;
            let wv = view::<$t>(&ws, wl)?;
            let ri_v = ri.as_ref().map(|(s, l)| view::<$t>(s, l)).transpose()?;
            let nw_v = nw.as_ref().map(|(s, l)| view::<$t>(s, l)).transpose()?;
            let bs_v = bs.as_ref().map(|(s, l)| view::<$t>(s, l)).transpose()?;
            let $s_out = match &ri_v {
                Some(_) => Some(unsafe { inp.dev.alloc::<$t>(inp.rows * inp.k)? }),
                None => None,
            };
            let mut $b = $f.pdl_builder();
            $b.arg(&xv);
            opt_arg!($b, ri_v, $null);
            opt_arg!($b, nw_v, $null);
            $b.arg(&inp.eps);
            opt_arg!($b, $s_out, $null);
            $b.arg(&wv);
            opt_arg!($b, bs_v, $null);
        };
    }

    pub fn project(
        x: &Tensor,
        res: Option<&Tensor>,
        norm: Option<(&Tensor, f32)>,
        w: &Tensor,
        bias: Option<&Tensor>,
        epilogue: Epilogue<'_>,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let inp = Inputs::new(x, res, norm, w, bias)?;
        let (rows, n, dtype) = (inp.rows, inp.n, x.dtype());
        let (mode, gelu) = (
            mode(&epilogue),
            matches!(epilogue, Epilogue::Glu { gelu: true }),
        );
        let (outs, units) = match epilogue {
            Epilogue::Glu { .. } if n % 2 == 0 => (n / 2, n / 2),
            Epilogue::Glu { .. } => return Err(err(format!("gated unit of {n} rows"))),
            _ => (n, n.div_ceil(2)),
        };
        let res_out = match &epilogue {
            Epilogue::Add(r) => Some(same(r, &[rows, outs], dtype, "output residual")?),
            _ => None,
        };
        let (f, cfg) = inp.kernel("gemv", units)?;
        let ints = [int(rows, "rows")?, int(inp.k, "in")?, int(n, "out")?];
        let gelu_i = i32::from(gelu);
        let null = 0u64;
        let dev = inp.dev.clone();
        macro_rules! launch {
            ($t:ty) => {{
                common_args!(inp, $t, f, b, s_out, null);
                let ro = res_out.as_ref().map(|t| t.storage_and_layout());
                let ro_v = ro.as_ref().map(|(s, l)| view::<$t>(s, l)).transpose()?;
                opt_arg!(b, ro_v, null);
                let y = match epilogue {
                    Epilogue::Logits => {
                        let y = unsafe { dev.alloc::<f32>(rows * outs)? };
                        b.arg(&y).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
                        b.arg(&mode).arg(&gelu_i);
                        unsafe { b.launch(cfg) }?;
                        wrap(y, &dev, (rows, outs))
                    }
                    _ => {
                        let y = unsafe { dev.alloc::<$t>(rows * outs)? };
                        b.arg(&y).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
                        b.arg(&mode).arg(&gelu_i);
                        unsafe { b.launch(cfg) }?;
                        wrap(y, &dev, (rows, outs))
                    }
                };
                (s_out.map(|s| wrap(s, &dev, (rows, inp.k))), y)
            }};
        }
        Ok(match dtype {
            DType::F16 => launch!(f16),
            _ => launch!(bf16),
        })
    }

    #[allow(clippy::type_complexity)]
    pub fn project_rope(
        x: &Tensor,
        res: Option<&Tensor>,
        norm: Option<(&Tensor, f32)>,
        w: &Tensor,
        bias: Option<&Tensor>,
        rope: RopeOut<'_>,
    ) -> Result<(Option<Tensor>, Tensor, Option<(Tensor, Tensor)>)> {
        let inp = Inputs::new(x, res, norm, w, bias)?;
        let (rows, n, dtype) = (inp.rows, inp.n, x.dtype());
        let (heads, kv_heads, d) = (rope.heads, rope.kv_heads, rope.head_dim);
        if n != (heads + 2 * kv_heads) * d || !d.is_multiple_of(2) {
            return Err(err(format!(
                "{n} rows for ({heads} + 2 x {kv_heads}) heads of {d}"
            )));
        }
        if rope.pos.dims() != [rows] || rope.pos.dtype() != DType::U32 {
            return Err(err("positions must be u32 [rows]".into()));
        }
        let (cos, sin) = (rope.cos.contiguous()?, rope.sin.contiguous()?);
        if cos.dtype() != DType::F32 || cos.dim(1)? != d / 2 || sin.dims() != cos.dims() {
            return Err(err("RoPE tables must be f32 [positions, D/2]".into()));
        }
        if let Some(pool) = rope.pool {
            if !crate::model::fused::cuda::pool_fits(pool, dtype, rows, kv_heads * d)? {
                return Err(err("pools or slots do not fit".into()));
            }
        }
        let (f, cfg) = inp.kernel("gemv_rope", n / 2)?;
        let ints = [
            int(rows, "rows")?,
            int(inp.k, "in")?,
            int(heads, "heads")?,
            int(kv_heads, "kv heads")?,
            int(d, "head_dim")?,
        ];
        let null = 0u64;
        let dev = inp.dev.clone();
        let (ps, pl) = rope.pos.storage_and_layout();
        let (cs, cl) = cos.storage_and_layout();
        let (ss, sl) = sin.storage_and_layout();
        let pool = rope.pool.map(|(kp, vp, slots)| {
            (
                kp.storage_and_layout(),
                vp.storage_and_layout(),
                slots.storage_and_layout(),
            )
        });
        macro_rules! launch {
            ($t:ty) => {{
                common_args!(inp, $t, f, b, s_out, null);
                let pv = view::<u32>(&ps, pl)?;
                let (cv, sv) = (view::<f32>(&cs, cl)?, view::<f32>(&ss, sl)?);
                b.arg(&pv).arg(&cv).arg(&sv);
                let q = unsafe { dev.alloc::<$t>(rows * heads * d)? };
                let pool_views = match &pool {
                    Some(((ks, kl), (vs, vl), (sls, sll))) => Some((
                        view::<$t>(ks, kl)?,
                        view::<$t>(vs, vl)?,
                        view::<u32>(sls, sll)?,
                    )),
                    None => None,
                };
                let fresh = match pool_views {
                    Some(_) => None,
                    None => Some((unsafe { dev.alloc::<$t>(rows * kv_heads * d)? }, unsafe {
                        dev.alloc::<$t>(rows * kv_heads * d)?
                    })),
                };
                match (&pool_views, &fresh) {
                    (Some((kv, vv, slv)), _) => b.arg(slv).arg(&q).arg(kv).arg(vv),
                    (None, Some((k, v))) => b.arg(&null).arg(&q).arg(k).arg(v),
                    (None, None) => unreachable!("fresh is allocated where no pool is given"),
                };
                for i in &ints {
                    b.arg(i);
                }
                unsafe { b.launch(cfg) }?;
                let kv = fresh.map(|(k, v)| {
                    (
                        wrap(k, &dev, (rows, kv_heads * d)),
                        wrap(v, &dev, (rows, kv_heads * d)),
                    )
                });
                (
                    s_out.map(|s| wrap(s, &dev, (rows, inp.k))),
                    wrap(q, &dev, (rows, heads, d)),
                    kv,
                )
            }};
        }
        Ok(match dtype {
            DType::F16 => launch!(f16),
            _ => launch!(bf16),
        })
    }
}

#[cfg(test)]
mod setting_tests {
    use super::{rows_setting, MAX_ROWS};

    #[test]
    fn the_variable_sets_the_most_rows() {
        assert_eq!(rows_setting(None), 1);
        assert_eq!(rows_setting(Some("off")), 0);
        assert_eq!(rows_setting(Some("0")), 0);
        assert_eq!(rows_setting(Some("on")), MAX_ROWS);
        assert_eq!(rows_setting(Some(" 4 ")), 4);
        assert_eq!(rows_setting(Some("64")), MAX_ROWS);
        assert_eq!(rows_setting(Some("fast")), 1);
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests;
