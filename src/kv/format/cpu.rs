//! The fused CPU kernels: one pass over the input per op, rayon over blocks of rows.
//!
//! On x86-64 with AVX2 and F16C (detected at run time) the blocks run the vector kernels of
//! [`x86`]; elsewhere the portable kernels below, which compute the same IEEE operations one value
//! at a time and give bit-identical results (tested). Quantize reads each group (widened to f32),
//! takes min/max, derives the parameters and writes packed codes, the parameters stored in their
//! own type: the input's (MLX: codes from the f32 parameters), or f16 / bf16 for f32 input
//! (`kv::format::scale_dtype_for`; the parameters are rounded first and the codes computed from
//! the rounded values, so the rounding of a group's bias is not a shift of the whole group, which
//! a dot product with a query would add up coherently); dequantize widens
//! each group's scale and bias to f32, unpacks 32 codes at a time and applies `code*scale + bias`.
//! For f16/bf16 output the dequantized value is rounded to the narrow type after the product and
//! after the sum, which is what MLX computes in half precision (f32 has more than 2p+2 bits, so
//! f32 arithmetic followed by one rounding equals native half arithmetic); f32 output keeps the
//! f32 product and sum.

use super::fit::{self, Fit};
use super::pack::{code_of, pack32, unpack32};
use crate::ops::pool;
use candle_core::WithDType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::mem::MaybeUninit;

#[cfg(target_arch = "x86_64")]
mod x86;

/// Largest allowed group size; sizes the per-group stack buffers.
const MAX_GROUP: usize = 128;
/// Values per rayon task: large enough to amortise scheduling, small enough to balance.
const VALUES_PER_TASK: usize = 1 << 15;

/// The vector conversions an element type needs on x86-64; nothing elsewhere.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Simd: crate::simd::lanes::Lanes {}
#[cfg(target_arch = "x86_64")]
impl<T: crate::simd::lanes::Lanes> Simd for T {}
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Simd {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Simd for T {}

/// A float element type the kernels read and write, converted through f32.
pub(crate) trait Elem: WithDType + Copy + Send + Sync + Simd {
    fn load(src: &[Self], dst: &mut [f32]);
    fn store(src: &[f32], dst: &mut [Self]);
    /// Rounds each value to this type's precision (identity for f32).
    fn narrow(buf: &mut [f32]);
}

impl Elem for f32 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn narrow(_: &mut [f32]) {}
}

impl Elem for f16 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
    #[inline(always)]
    fn narrow(buf: &mut [f32]) {
        let mut tmp = [f16::ZERO; MAX_GROUP];
        let tmp = &mut tmp[..buf.len()];
        Self::store(buf, tmp);
        Self::load(tmp, buf);
    }
}

/// bf16 is the top half of an f32: widening is a shift, narrowing rounds to nearest even
/// (NaNs stay quiet NaNs). Plain integer code, so it vectorizes.
impl Elem for bf16 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            let b = s.to_bits();
            let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
            let nan = ((b >> 16) as u16) | 0x40;
            *d = bf16::from_bits(if s.is_nan() { nan } else { rounded });
        }
    }
    #[inline(always)]
    fn narrow(buf: &mut [f32]) {
        let mut tmp = [bf16::ZERO; MAX_GROUP];
        let tmp = &mut tmp[..buf.len()];
        Self::store(buf, tmp);
        Self::load(tmp, buf);
    }
}

/// Zero-fills an output chunk for the portable kernels, which take initialised slices. (The
/// vector kernels write every output element exactly once and need no such pass.)
fn init<T: Copy>(s: &mut [MaybeUninit<T>], zero: T) -> &mut [T] {
    for v in s.iter_mut() {
        v.write(zero);
    }
    // SAFETY: every element was just written, and MaybeUninit<T> has T's layout.
    unsafe { &mut *(s as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// Rows per task for rows of `d` values.
fn rows_per_task(d: usize) -> usize {
    (VALUES_PER_TASK / d).max(1)
}

/// Quantizes contiguous rows of `d` values of type `X`, the parameters stored as `S` and chosen
/// as `fit` says. Output slices are sized by the caller from the format; every element of them
/// is written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize<X: Elem, S: Elem>(
    x: &[X],
    d: usize,
    (bits, group): (u32, usize),
    fit: Fit,
    codes: &mut [MaybeUninit<u32>],
    scales: &mut [MaybeUninit<S>],
    biases: &mut [MaybeUninit<S>],
) {
    let out = (codes, scales, biases);
    match bits {
        2 => quantize_b::<X, S, 2>(x, d, group, fit, out),
        3 => quantize_b::<X, S, 3>(x, d, group, fit, out),
        4 => quantize_b::<X, S, 4>(x, d, group, fit, out),
        5 => quantize_b::<X, S, 5>(x, d, group, fit, out),
        6 => quantize_b::<X, S, 6>(x, d, group, fit, out),
        8 => quantize_b::<X, S, 8>(x, d, group, fit, out),
        _ => unreachable!("QuantFormat admits only 2, 3, 4, 5, 6, 8 bits"),
    }
}

type QuantOut<'a, S> = (
    &'a mut [MaybeUninit<u32>],
    &'a mut [MaybeUninit<S>],
    &'a mut [MaybeUninit<S>],
);

fn quantize_b<X: Elem, S: Elem, const B: u32>(
    x: &[X],
    d: usize,
    group: usize,
    fit: Fit,
    (codes, scales, biases): QuantOut<'_, S>,
) {
    let rpt = rows_per_task(d);
    let (words, groups) = (d * B as usize / 32, d / group);
    let tasks = (x.len() / d.max(1)).div_ceil(rpt);
    let (codes, scales, biases) = (
        pool::Shared::new(codes),
        pool::Shared::new(scales),
        pool::Shared::new(biases),
    );
    pool::for_each(tasks, |i| {
        let x = chunk(x, i, rpt * d);
        // SAFETY: task i takes rows i·rpt.. of every output, disjoint from the other tasks'.
        let (codes, scales, biases) = unsafe {
            (
                codes.piece(i * rpt * words, rpt * words),
                scales.piece(i * rpt * groups, rpt * groups),
                biases.piece(i * rpt * groups, rpt * groups),
            )
        };
        // The least-squares search is scalar (kvq's rotated formats only; see `fit`).
        #[cfg(target_arch = "x86_64")]
        if fit == Fit::MinMax && crate::simd::avx2::available() {
            // SAFETY: AVX2 and F16C were detected; the block checks its slice lengths.
            return unsafe { x86::quantize_block::<X, S, B>(x, d, group, codes, scales, biases) };
        }
        let zero = S::from_f64(0.0);
        let (codes, scales, biases) = (init(codes, 0), init(scales, zero), init(biases, zero));
        quantize_task::<X, S, B>(x, d, group, fit, codes, scales, biases)
    });
}

/// Quantizes a block of whole rows (one task), portable version.
fn quantize_task<X: Elem, S: Elem, const B: u32>(
    x: &[X],
    d: usize,
    group: usize,
    fit: Fit,
    codes: &mut [u32],
    scales: &mut [S],
    biases: &mut [S],
) {
    let (words, groups) = (d * B as usize / 32, d / group);
    let gw = group * B as usize / 32;
    let n = ((1u32 << B) - 1) as f32;
    let mut buf = [0f32; MAX_GROUP];
    let mut s32 = [0f32; MAX_GROUP];
    let mut b32 = [0f32; MAX_GROUP];
    let mut q = [0u32; 32];
    // f32 rows into half parameters: the codes are computed from the stored (rounded) values.
    let narrow = std::mem::size_of::<X>() > std::mem::size_of::<S>();
    let row_iter = x
        .chunks_exact(d)
        .zip(codes.chunks_exact_mut(words))
        .zip(scales.chunks_exact_mut(groups))
        .zip(biases.chunks_exact_mut(groups));
    for (((xr, cr), sr), br) in row_iter {
        for (gi, (xg, cg)) in xr
            .chunks_exact(group)
            .zip(cr.chunks_exact_mut(gw))
            .enumerate()
        {
            let buf = &mut buf[..group];
            X::load(xg, buf);
            let (mut scale, mut bias) = fit::params(buf, n, fit);
            if narrow {
                let mut p = [scale, bias];
                S::narrow(&mut p);
                [scale, bias] = p;
            }
            s32[gi] = scale;
            b32[gi] = bias;
            for (xc, cc) in buf.chunks_exact(32).zip(cg.chunks_exact_mut(B as usize)) {
                for (qk, &xk) in q.iter_mut().zip(xc) {
                    *qk = code_of(xk, scale, bias, n);
                }
                pack32::<B>(&q, cc);
            }
        }
        S::store(&s32[..groups], sr);
        S::store(&b32[..groups], br);
    }
}

/// Dequantizes contiguous rows of `d` values into `out` (type `O`), writing every element; the
/// parameters (type `S`) are widened to f32 per group and the product and the sum rounded to
/// `O` (see the module doc).
pub(crate) fn dequantize<S: Elem, O: Elem>(
    codes: &[u32],
    scales: &[S],
    biases: &[S],
    d: usize,
    bits: u32,
    group: usize,
    out: &mut [MaybeUninit<O>],
) {
    match bits {
        2 => dequantize_b::<S, O, 2>(codes, scales, biases, d, group, out),
        3 => dequantize_b::<S, O, 3>(codes, scales, biases, d, group, out),
        4 => dequantize_b::<S, O, 4>(codes, scales, biases, d, group, out),
        5 => dequantize_b::<S, O, 5>(codes, scales, biases, d, group, out),
        6 => dequantize_b::<S, O, 6>(codes, scales, biases, d, group, out),
        8 => dequantize_b::<S, O, 8>(codes, scales, biases, d, group, out),
        _ => unreachable!("QuantFormat admits only 2, 3, 4, 5, 6, 8 bits"),
    }
}

fn dequantize_b<S: Elem, O: Elem, const B: u32>(
    codes: &[u32],
    scales: &[S],
    biases: &[S],
    d: usize,
    group: usize,
    out: &mut [MaybeUninit<O>],
) {
    let rpt = rows_per_task(d);
    let (words, groups) = (d * B as usize / 32, d / group);
    let tasks = (codes.len() / words.max(1)).div_ceil(rpt);
    let out = pool::Shared::new(out);
    pool::for_each(tasks, |i| {
        let (codes, scales, biases) = (
            chunk(codes, i, rpt * words),
            chunk(scales, i, rpt * groups),
            chunk(biases, i, rpt * groups),
        );
        // SAFETY: task i takes rows i·rpt.. of the output, disjoint from the other tasks'.
        let out = unsafe { out.piece(i * rpt * d, rpt * d) };
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx2::available() {
            // SAFETY: AVX2 and F16C were detected; the block checks its slice lengths.
            return unsafe {
                x86::dequantize_block::<S, O, B>(codes, scales, biases, d, group, out)
            };
        }
        let out = init(out, O::from_f64(0.0));
        dequantize_task::<S, O, B>(codes, scales, biases, d, group, out)
    });
}

/// Piece `i` of `s` cut in pieces of `len` (the last may be shorter).
fn chunk<T>(s: &[T], i: usize, len: usize) -> &[T] {
    let at = (i * len).min(s.len());
    &s[at..(at + len).min(s.len())]
}

/// Dequantizes a block of whole rows (one task), portable version.
fn dequantize_task<S: Elem, O: Elem, const B: u32>(
    codes: &[u32],
    scales: &[S],
    biases: &[S],
    d: usize,
    group: usize,
    out: &mut [O],
) {
    let (words, groups) = (d * B as usize / 32, d / group);
    let gw = group * B as usize / 32;
    let mut buf = [0f32; MAX_GROUP];
    let mut s32 = [0f32; MAX_GROUP];
    let mut b32 = [0f32; MAX_GROUP];
    let mut q = [0u32; 32];
    let row_iter = out
        .chunks_exact_mut(d)
        .zip(codes.chunks_exact(words))
        .zip(scales.chunks_exact(groups))
        .zip(biases.chunks_exact(groups));
    for (((or, cr), sr), br) in row_iter {
        S::load(sr, &mut s32[..groups]);
        S::load(br, &mut b32[..groups]);
        for (gi, (og, cg)) in or
            .chunks_exact_mut(group)
            .zip(cr.chunks_exact(gw))
            .enumerate()
        {
            let (scale, bias) = (s32[gi], b32[gi]);
            let buf = &mut buf[..group];
            for (bc, cc) in buf.chunks_exact_mut(32).zip(cg.chunks_exact(B as usize)) {
                unpack32::<B>(cc, &mut q);
                for (v, &c) in bc.iter_mut().zip(q.iter()) {
                    *v = c as f32 * scale;
                }
            }
            O::narrow(buf);
            for v in buf.iter_mut() {
                *v += bias;
            }
            O::store(buf, og);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    //! The vector kernels against the portable ones, bit for bit, on data with the edge cases of
    //! the golden file mixed in (zero, constant, tiny and huge groups, NaN).
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn data(rows: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut x: Vec<f32> = (0..rows * d)
            .map(|_| rng.random_range(-3.0f32..3.0))
            .collect();
        let specials: [&dyn Fn(usize) -> f32; 6] = [
            &|_| 0.0,
            &|_| 1.25,
            &|i| if i % 2 == 0 { -7.5 } else { 0.5 },
            &|i| i as f32 * 1e-9,
            &|i| (i as f32 - 20.0) * 3e4,
            &|i| if i == 3 { f32::NAN } else { i as f32 },
        ];
        for (r, f) in specials.iter().enumerate().take(rows) {
            for (i, v) in x[r * d..(r + 1) * d].iter_mut().enumerate() {
                *v = f(i);
            }
        }
        x
    }

    /// An initialised slice seen as an output slice (only valid values are written to it).
    fn uninit<T>(s: &mut [T]) -> &mut [MaybeUninit<T>] {
        // SAFETY: same layout; writing initialised values keeps the Vec valid.
        unsafe { &mut *(s as *mut [T] as *mut [MaybeUninit<T>]) }
    }

    fn bits<T: Elem>(v: &[T]) -> Vec<u64> {
        v.iter().map(|x| x.to_f64().to_bits()).collect()
    }

    /// Input `X`, parameters `S`, dequantized into `S` and into f32.
    fn check<X: Elem, S: Elem, const B: u32>(group: usize) {
        let (rows, d) = (9, 256);
        let x: Vec<X> = data(rows, d, B as u64 * 1000 + group as u64)
            .into_iter()
            .map(|v| X::from_f64(v as f64))
            .collect();
        let (nw, ng) = (rows * d * B as usize / 32, rows * d / group);
        let z = S::from_f64(0.0);
        let (mut c0, mut s0, mut b0) = (vec![0u32; nw], vec![z; ng], vec![z; ng]);
        let (mut c1, mut s1, mut b1) = (vec![0u32; nw], vec![z; ng], vec![z; ng]);
        quantize_task::<X, S, B>(&x, d, group, Fit::MinMax, &mut c0, &mut s0, &mut b0);
        let (c1u, s1u, b1u) = (uninit(&mut c1), uninit(&mut s1), uninit(&mut b1));
        // SAFETY: only reached when AVX2 and F16C are present (checked by the caller).
        unsafe { x86::quantize_block::<X, S, B>(&x, d, group, c1u, s1u, b1u) };
        let what = format!("{:?} into {:?} bits {B} group {group}", X::DTYPE, S::DTYPE);
        assert_eq!(c0, c1, "codes, {what}");
        assert_eq!(bits(&s0), bits(&s1), "scales, {what}");
        assert_eq!(bits(&b0), bits(&b1), "biases, {what}");
        let (mut o0, mut o1) = (vec![z; rows * d], vec![z; rows * d]);
        dequantize_task::<S, S, B>(&c0, &s0, &b0, d, group, &mut o0);
        // SAFETY: as above.
        unsafe { x86::dequantize_block::<S, S, B>(&c0, &s0, &b0, d, group, uninit(&mut o1)) };
        assert_eq!(bits(&o0), bits(&o1), "dequantized, {what}");
        let (mut w0, mut w1) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        dequantize_task::<S, f32, B>(&c0, &s0, &b0, d, group, &mut w0);
        // SAFETY: as above.
        unsafe { x86::dequantize_block::<S, f32, B>(&c0, &s0, &b0, d, group, uninit(&mut w1)) };
        assert_eq!(bits(&w0), bits(&w1), "dequantized to f32, {what}");
    }

    fn all_bits<X: Elem, S: Elem>() {
        for g in [32, 64, 128] {
            check::<X, S, 2>(g);
            check::<X, S, 3>(g);
            check::<X, S, 4>(g);
            check::<X, S, 5>(g);
            check::<X, S, 6>(g);
            check::<X, S, 8>(g);
        }
    }

    #[test]
    fn vector_kernels_match_portable_bit_for_bit() {
        if !crate::simd::avx2::available() {
            eprintln!("skipped: no AVX2/F16C on this CPU");
            return;
        }
        all_bits::<f32, f32>();
        all_bits::<f16, f16>();
        all_bits::<bf16, bf16>();
        all_bits::<f32, f16>();
        all_bits::<f32, bf16>();
    }
}
