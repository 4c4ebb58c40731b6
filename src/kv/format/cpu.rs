//! The fused CPU kernels: one pass over the input per op, rayon over blocks of rows.
//!
//! On x86-64 with AVX2 and F16C (detected at run time) the blocks run the vector kernels of
//! [`x86`]; elsewhere the portable kernels below, which compute the same IEEE operations one value
//! at a time and give bit-identical results (tested). Quantize reads each group, takes min/max,
//! derives the parameters and writes packed codes; dequantize unpacks 32 codes at a time and
//! applies `code*scale + bias`. For f16/bf16 the dequantized value is rounded to the narrow type
//! after the product and after the sum, which is what MLX computes in half precision (f32 has more
//! than 2p+2 bits, so f32 arithmetic followed by one rounding equals native half arithmetic).

use super::pack::{code_of, group_params, min_max, pack32, unpack32};
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

/// Quantizes contiguous rows of `d` values. Output slices are sized by the caller from the format;
/// every element of them is written.
pub(crate) fn quantize<T: Elem>(
    x: &[T],
    d: usize,
    bits: u32,
    group: usize,
    codes: &mut [MaybeUninit<u32>],
    scales: &mut [MaybeUninit<T>],
    biases: &mut [MaybeUninit<T>],
) {
    match bits {
        2 => quantize_b::<T, 2>(x, d, group, codes, scales, biases),
        3 => quantize_b::<T, 3>(x, d, group, codes, scales, biases),
        4 => quantize_b::<T, 4>(x, d, group, codes, scales, biases),
        5 => quantize_b::<T, 5>(x, d, group, codes, scales, biases),
        6 => quantize_b::<T, 6>(x, d, group, codes, scales, biases),
        8 => quantize_b::<T, 8>(x, d, group, codes, scales, biases),
        _ => unreachable!("QuantFormat admits only 2, 3, 4, 5, 6, 8 bits"),
    }
}

fn quantize_b<T: Elem, const B: u32>(
    x: &[T],
    d: usize,
    group: usize,
    codes: &mut [MaybeUninit<u32>],
    scales: &mut [MaybeUninit<T>],
    biases: &mut [MaybeUninit<T>],
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
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx2::available() {
            // SAFETY: AVX2 and F16C were detected; the block checks its slice lengths.
            return unsafe { x86::quantize_block::<T, B>(x, d, group, codes, scales, biases) };
        }
        let zero = T::from_f64(0.0);
        let (codes, scales, biases) = (init(codes, 0), init(scales, zero), init(biases, zero));
        quantize_task::<T, B>(x, d, group, codes, scales, biases)
    });
}

/// Quantizes a block of whole rows (one task), portable version.
fn quantize_task<T: Elem, const B: u32>(
    x: &[T],
    d: usize,
    group: usize,
    codes: &mut [u32],
    scales: &mut [T],
    biases: &mut [T],
) {
    let (words, groups) = (d * B as usize / 32, d / group);
    let gw = group * B as usize / 32;
    let n = ((1u32 << B) - 1) as f32;
    let mut buf = [0f32; MAX_GROUP];
    let mut s32 = [0f32; MAX_GROUP];
    let mut b32 = [0f32; MAX_GROUP];
    let mut q = [0u32; 32];
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
            T::load(xg, buf);
            let (mn, mx) = min_max(buf);
            let (scale, bias) = group_params(mn, mx, n);
            s32[gi] = scale;
            b32[gi] = bias;
            for (xc, cc) in buf.chunks_exact(32).zip(cg.chunks_exact_mut(B as usize)) {
                for (qk, &xk) in q.iter_mut().zip(xc) {
                    *qk = code_of(xk, scale, bias, n);
                }
                pack32::<B>(&q, cc);
            }
        }
        T::store(&s32[..groups], sr);
        T::store(&b32[..groups], br);
    }
}

/// Dequantizes contiguous rows of `d` values into `out`, writing every element.
pub(crate) fn dequantize<T: Elem>(
    codes: &[u32],
    scales: &[T],
    biases: &[T],
    d: usize,
    bits: u32,
    group: usize,
    out: &mut [MaybeUninit<T>],
) {
    match bits {
        2 => dequantize_b::<T, 2>(codes, scales, biases, d, group, out),
        3 => dequantize_b::<T, 3>(codes, scales, biases, d, group, out),
        4 => dequantize_b::<T, 4>(codes, scales, biases, d, group, out),
        5 => dequantize_b::<T, 5>(codes, scales, biases, d, group, out),
        6 => dequantize_b::<T, 6>(codes, scales, biases, d, group, out),
        8 => dequantize_b::<T, 8>(codes, scales, biases, d, group, out),
        _ => unreachable!("QuantFormat admits only 2, 3, 4, 5, 6, 8 bits"),
    }
}

fn dequantize_b<T: Elem, const B: u32>(
    codes: &[u32],
    scales: &[T],
    biases: &[T],
    d: usize,
    group: usize,
    out: &mut [MaybeUninit<T>],
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
            return unsafe { x86::dequantize_block::<T, B>(codes, scales, biases, d, group, out) };
        }
        let out = init(out, T::from_f64(0.0));
        dequantize_task::<T, B>(codes, scales, biases, d, group, out)
    });
}

/// Piece `i` of `s` cut in pieces of `len` (the last may be shorter).
fn chunk<T>(s: &[T], i: usize, len: usize) -> &[T] {
    let at = (i * len).min(s.len());
    &s[at..(at + len).min(s.len())]
}

/// Dequantizes a block of whole rows (one task), portable version.
fn dequantize_task<T: Elem, const B: u32>(
    codes: &[u32],
    scales: &[T],
    biases: &[T],
    d: usize,
    group: usize,
    out: &mut [T],
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
        T::load(sr, &mut s32[..groups]);
        T::load(br, &mut b32[..groups]);
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
            T::narrow(buf);
            for v in buf.iter_mut() {
                *v += bias;
            }
            T::store(buf, og);
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

    fn check<T: Elem, const B: u32>(group: usize) {
        let (rows, d) = (9, 256);
        let x: Vec<T> = data(rows, d, B as u64 * 1000 + group as u64)
            .into_iter()
            .map(|v| T::from_f64(v as f64))
            .collect();
        let (nw, ng) = (rows * d * B as usize / 32, rows * d / group);
        let z = T::from_f64(0.0);
        let (mut c0, mut s0, mut b0) = (vec![0u32; nw], vec![z; ng], vec![z; ng]);
        let (mut c1, mut s1, mut b1) = (vec![0u32; nw], vec![z; ng], vec![z; ng]);
        quantize_task::<T, B>(&x, d, group, &mut c0, &mut s0, &mut b0);
        let (c1u, s1u, b1u) = (uninit(&mut c1), uninit(&mut s1), uninit(&mut b1));
        // SAFETY: only reached when AVX2 and F16C are present (checked by the caller).
        unsafe { x86::quantize_block::<T, B>(&x, d, group, c1u, s1u, b1u) };
        let what = format!("{:?} bits {B} group {group}", T::DTYPE);
        assert_eq!(c0, c1, "codes, {what}");
        assert_eq!(bits(&s0), bits(&s1), "scales, {what}");
        assert_eq!(bits(&b0), bits(&b1), "biases, {what}");
        let (mut o0, mut o1) = (vec![z; rows * d], vec![z; rows * d]);
        dequantize_task::<T, B>(&c0, &s0, &b0, d, group, &mut o0);
        // SAFETY: as above.
        unsafe { x86::dequantize_block::<T, B>(&c0, &s0, &b0, d, group, uninit(&mut o1)) };
        assert_eq!(bits(&o0), bits(&o1), "dequantized, {what}");
    }

    fn all_bits<T: Elem>() {
        for g in [32, 64, 128] {
            check::<T, 2>(g);
            check::<T, 3>(g);
            check::<T, 4>(g);
            check::<T, 5>(g);
            check::<T, 6>(g);
            check::<T, 8>(g);
        }
    }

    #[test]
    fn vector_kernels_match_portable_bit_for_bit() {
        if !crate::simd::avx2::available() {
            eprintln!("skipped: no AVX2/F16C on this CPU");
            return;
        }
        all_bits::<f32>();
        all_bits::<f16>();
        all_bits::<bf16>();
    }
}
