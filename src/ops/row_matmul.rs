//! Row-invariant `y = x·Wᵀ` on the CPU (f32, f16 or bf16 operands, f32 accumulation).
//!
//! candle's CPU matmul (the gemm crate) picks its blocking, and with it the order in which a dot
//! product is summed, from the shape of the call: one row of `x` rounds differently alone
//! (decode, m = 1) than among many rows (a prefill chunk, a batch of decode steps). A
//! sequence's activations then depend on what else shared its forward pass, and a quantized KV
//! cache turns that last-bit noise into flipped codes.
//!
//! Here every output element is one dot product of a row of `x` with a row of `W` (both
//! contiguous along k), summed in one fixed order whatever the shape: `LANES` partial sums
//! (lane l takes the k ≡ l (mod LANES) terms in increasing k, by multiply-adds), the vector's
//! fixed horizontal-sum tree, then the `k % LANES` tail one product at a time. Blocking (up to
//! [`MR`] rows of `x` × 4 rows of `W` in registers) and the rayon split into tiles only decide
//! which elements are computed together, never the order inside one. The vector implementation
//! is chosen once per process (the widest the CPU has, whatever the shape), so a row's result
//! is the same in every call on one machine. f16/bf16 operands are widened exactly to f32 (`x`
//! once, `W` as it is read) and the f32 result rounded once to the operands' dtype.

use super::tiles::{for_each_tile, Tile};
use candle_core::{DType, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2, avx512};
use crate::simd::{Elem, Isa, Portable, Simd};

/// Rows of `x` per register block.
const MR: usize = 4;
/// Rows of `x` and of `W` per tile (one rayon task): the tile's rows of `x` stay in L2 while
/// each block of `W` rows is reused from L1 across them.
const MC: usize = 32;
const NC: usize = 64;

/// Whether [`matmul_t`] takes these operands: CPU tensors of one dtype (f32, f16 or bf16), `x`
/// `[.., k]`, `w` `[n, k]`.
pub fn supports(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && w.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && w.dtype() == x.dtype()
        && w.rank() == 2
        && x.rank() >= 1
        && x.dims().last() == Some(&w.dims()[1])
}

/// `x·Wᵀ`: `x` `[.., k]`, `w` `[n, k]` (CPU, one dtype) → `[.., n]` in that dtype; each row of
/// the result depends only on its own row of `x` (see the module docs).
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !supports(x, w) {
        candle_core::bail!(
            "row_matmul: needs CPU tensors of one float dtype, x [.., k] and w [n, k], got x {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    let (n, k) = w.dims2()?;
    let lead = &x.dims()[..x.rank() - 1];
    let m: usize = lead.iter().product();
    let dtype = x.dtype();
    let (x, w) = (x.to_dtype(DType::F32)?.contiguous()?, w.contiguous()?);
    let mut y = vec![0f32; m * n];
    {
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let xd = cpu_slice::<f32>(&xs, xl)?;
        let isa = Isa::widest();
        match dtype {
            DType::F16 => run(xd, cpu_slice::<f16>(&ws, wl)?, m, n, k, &mut y, isa),
            DType::BF16 => run(xd, cpu_slice::<bf16>(&ws, wl)?, m, n, k, &mut y, isa),
            _ => run(xd, cpu_slice::<f32>(&ws, wl)?, m, n, k, &mut y, isa),
        }
    }
    let mut dims = lead.to_vec();
    dims.push(n);
    Tensor::from_vec(y, dims, x.device())?.to_dtype(dtype)
}

pub(crate) fn cpu_slice<'a, T: WithDType>(s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    let Storage::Cpu(s) = s else {
        candle_core::bail!("row_matmul: expected CPU storage");
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("row_matmul: non-contiguous operand".into()))?;
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

/// `y = x·Wᵀ` on slices: `x` `[m, k]`, `w` `[n, k]`, `y` `[m, n]`, row-major.
pub(crate) fn run<T: Elem>(
    x: &[f32],
    w: &[T],
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
    isa: Isa,
) {
    assert!(x.len() == m * k && w.len() == n * k && y.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    for_each_tile(y, (m, n, k), (MC, NC), |y, tile| {
        // SAFETY: the slices hold m·k, n·k and m·n values (asserted above); tiles are disjoint;
        // an ISA runs only after its detection.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => tile_avx512(x, w, y, tile),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => tile_avx2(x, w, y, tile),
                Isa::Portable => tile_run::<Portable, T>(x, w, y, tile),
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn tile_avx512<T: Elem>(x: &[f32], w: &[T], y: *mut f32, t: Tile) {
    tile_run::<avx512::Avx512, T>(x, w, y, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<T: Elem>(x: &[f32], w: &[T], y: *mut f32, t: Tile) {
    tile_run::<avx2::Avx2, T>(x, w, y, t)
}

/// Register blocks over a tile: for each block of 4 `W` rows (kept in L1), every block of up
/// to [`MR`] rows of `x`. Safety: as [`micro`], for every block of the tile.
#[inline(always)]
unsafe fn tile_run<S: Simd, T: Elem>(x: &[f32], w: &[T], y: *mut f32, t: Tile) {
    let Tile { rows, cols, n, k } = t;
    let mut j = cols.0;
    while j < cols.1 {
        let nr = (cols.1 - j).min(4);
        let mut i = rows.0;
        while i < rows.1 {
            let mr = (rows.1 - i).min(MR);
            let (xp, wp, yp) = (
                x.as_ptr().add(i * k),
                w.as_ptr().add(j * k),
                y.add(i * n + j),
            );
            macro_rules! arms {
                ($(($r:literal, $c:literal)),*) => {
                    match (mr, nr) {
                        $(($r, $c) => micro::<S, T, $r, $c>(xp, wp, yp, n, k),)*
                        _ => unreachable!("register block {mr}x{nr}"),
                    }
                };
            }
            arms!(
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 4),
                (2, 1),
                (2, 2),
                (2, 3),
                (2, 4),
                (3, 1),
                (3, 2),
                (3, 3),
                (3, 4),
                (4, 1),
                (4, 2),
                (4, 3),
                (4, 4)
            );
            i += MR;
        }
        j += 4;
    }
}

/// `R` rows of `x` (at `x`, stride `k`) times `C` rows of `W` (at `w`, stride `k`) into
/// `y[r·n + c]`, each element in the fixed order of the module docs.
///
/// Safety: `x` and `w` are valid for `R·k` and `C·k` reads, `y` for the `R × C` writes, and the
/// CPU supports `S`.
#[inline(always)]
unsafe fn micro<S: Simd, T: Elem, const R: usize, const C: usize>(
    x: *const f32,
    w: *const T,
    y: *mut f32,
    n: usize,
    k: usize,
) {
    let kv = k - k % S::LANES;
    let mut acc = [[S::zero(); C]; R];
    let mut p = 0;
    while p < kv {
        let mut wv = [S::zero(); C];
        for (c, v) in wv.iter_mut().enumerate() {
            *v = T::load::<S>(w.add(c * k + p));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = S::load(x.add(r * k + p));
            for (a, &wc) in row.iter_mut().zip(&wv) {
                *a = S::fma(xv, wc, *a);
            }
        }
        p += S::LANES;
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            let mut s = S::hsum(a);
            for q in kv..k {
                s += *x.add(r * k + q) * (*w.add(c * k + q)).to_f32::<S>();
            }
            *y.add(r * n + c) = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    const SHAPES: [(usize, usize, usize); 7] = [
        (1, 1, 1),
        (7, 5, 3),
        (33, 70, 17),
        (5, 129, 64),
        (37, 66, 576),
        (64, 9, 100),
        (3, 200, 1537),
    ];

    /// Every element is close to the f64 dot product (error bound: k ulps of Σ|x·w|).
    #[test]
    fn matches_f64_reference() {
        for (m, n, k) in SHAPES {
            let (x, w) = (values(m * k, 1), values(n * k, 2));
            for isa in Isa::all_available() {
                let mut y = vec![0f32; m * n];
                run(&x, &w, m, n, k, &mut y, isa);
                for i in 0..m {
                    for j in 0..n {
                        let (xr, wr) = (&x[i * k..][..k], &w[j * k..][..k]);
                        let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = xr.iter().zip(wr).map(|(a, b)| (*a * *b).abs() as f64).sum();
                        let err = (y[i * n + j] as f64 - want).abs();
                        assert!(
                            err <= mag * k as f64 * f32::EPSILON as f64 + 1e-30,
                            "{isa:?} {m}x{n}x{k} ({i},{j}): {} vs {want}",
                            y[i * n + j]
                        );
                    }
                }
            }
        }
    }

    /// The rows of an m-row call are bit-identical to 1-row calls and to calls on other row
    /// subsets of the same rows.
    #[test]
    fn rows_do_not_depend_on_the_batch() {
        for (m, n, k) in SHAPES {
            let (x, w) = (values(m * k, 3), values(n * k, 4));
            for isa in Isa::all_available() {
                let mut all = vec![0f32; m * n];
                run(&x, &w, m, n, k, &mut all, isa);
                for i in 0..m {
                    let mut one = vec![0f32; n];
                    run(&x[i * k..][..k], &w, 1, n, k, &mut one, isa);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&one),
                        bits(&all[i * n..][..n]),
                        "{isa:?} {m}x{n}x{k} row {i}"
                    );
                }
                // An odd-sized window of rows starting mid-block.
                let (a, b) = (m / 3, m - m / 4);
                let mut part = vec![0f32; (b - a) * n];
                run(&x[a * k..b * k], &w, b - a, n, k, &mut part, isa);
                assert!(
                    part.iter()
                        .zip(&all[a * n..b * n])
                        .all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{isa:?} {m}x{n}x{k} rows {a}..{b}"
                );
            }
        }
    }

    #[test]
    fn tensor_wrapper_keeps_leading_dims_and_refuses_other_dtypes() {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(values(2 * 3 * 10, 5), (2, 3, 10), &dev).unwrap();
        let w = Tensor::from_vec(values(7 * 10, 6), (7, 10), &dev).unwrap();
        let y = matmul_t(&x, &w).unwrap();
        assert_eq!(y.dims(), [2, 3, 7]);
        let want = x.broadcast_matmul(&w.t().unwrap()).unwrap();
        let err: f32 = (&y - &want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(err < 1e-5, "{err}");
        let e = matmul_t(&x.to_dtype(DType::F16).unwrap(), &w).unwrap_err();
        assert!(e.to_string().contains("one float dtype"), "{e}");
        let e = matmul_t(&x, &w.narrow(1, 0, 9).unwrap()).unwrap_err();
        assert!(e.to_string().contains("row_matmul"), "{e}");
    }

    /// f16 and bf16 operands: each row alone equals its row in a batch, bit for bit, and the
    /// result is the f32 product of the widened operands rounded once.
    #[test]
    fn half_operands_are_row_invariant_and_widened_exactly() {
        let dev = Device::Cpu;
        let (m, n, k) = (19, 37, 133);
        let x = Tensor::from_vec(values(m * k, 7), (m, k), &dev).unwrap();
        let w = Tensor::from_vec(values(n * k, 8), (n, k), &dev).unwrap();
        for dt in [DType::F16, DType::BF16] {
            let (xh, wh) = (x.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap());
            let y = matmul_t(&xh, &wh).unwrap();
            assert_eq!(y.dtype(), dt);
            let want = matmul_t(
                &xh.to_dtype(DType::F32).unwrap(),
                &wh.to_dtype(DType::F32).unwrap(),
            )
            .unwrap()
            .to_dtype(dt)
            .unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v: Vec<f32> = t
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                v.iter().map(|f| f.to_bits()).collect()
            };
            assert_eq!(bits(&y), bits(&want), "{dt:?}");
            for i in [0, 4, 18] {
                let one = matmul_t(&xh.narrow(0, i, 1).unwrap(), &wh).unwrap();
                assert_eq!(
                    bits(&one),
                    bits(&y.narrow(0, i, 1).unwrap()),
                    "{dt:?} row {i}"
                );
            }
        }
    }

    #[test]
    fn empty_reduction_gives_zeros() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((3, 0), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((4, 0), DType::F32, &dev).unwrap();
        let y = matmul_t(&x, &w).unwrap();
        assert_eq!(y.dims(), [3, 4]);
        assert_eq!(
            y.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }
}
