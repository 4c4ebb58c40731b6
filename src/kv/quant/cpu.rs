//! The fused CPU kernels: one pass over the input per op, rayon over blocks of rows.
//!
//! Quantize reads each group once into an f32 buffer, takes min/max, derives the parameters and
//! writes packed codes; dequantize unpacks 32 codes at a time and applies `code*scale + bias`.
//! For f16/bf16 the dequantized value is rounded to the narrow type after the product and after
//! the sum, which is what MLX computes in half precision (f32 has more than 2p+2 bits, so f32
//! arithmetic followed by one rounding equals native half arithmetic exactly).

use super::pack::{code_of, group_params, min_max, pack32, unpack32};
use candle_core::WithDType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Largest allowed group size; sizes the per-group stack buffers.
const MAX_GROUP: usize = 128;
/// Values per rayon task: large enough to amortise scheduling, small enough to balance.
const VALUES_PER_TASK: usize = 1 << 15;

/// A float element type the kernels read and write, converted through f32. `SIMD` is true inside
/// the AVX2/F16C-compiled copies of the kernels (only entered after runtime detection).
pub(crate) trait Elem: WithDType + Copy + Send + Sync {
    fn load<const SIMD: bool>(src: &[Self], dst: &mut [f32]);
    fn store<const SIMD: bool>(src: &[f32], dst: &mut [Self]);
    /// Rounds each value to this type's precision (identity for f32).
    fn narrow<const SIMD: bool>(buf: &mut [f32]);
}

impl Elem for f32 {
    #[inline(always)]
    fn load<const SIMD: bool>(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn store<const SIMD: bool>(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn narrow<const SIMD: bool>(_: &mut [f32]) {}
}

impl Elem for f16 {
    #[inline(always)]
    fn load<const SIMD: bool>(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if SIMD {
            // SAFETY: SIMD copies run only when AVX2 and F16C were detected at runtime.
            return unsafe { x86::f16_to_f32(src, dst) };
        }
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn store<const SIMD: bool>(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if SIMD {
            // SAFETY: as above.
            return unsafe { x86::f32_to_f16(src, dst) };
        }
        dst.convert_from_f32_slice(src)
    }
    #[inline(always)]
    fn narrow<const SIMD: bool>(buf: &mut [f32]) {
        let mut tmp = [f16::ZERO; MAX_GROUP];
        let tmp = &mut tmp[..buf.len()];
        Self::store::<SIMD>(buf, tmp);
        Self::load::<SIMD>(tmp, buf);
    }
}

/// bf16 is the top half of an f32: widening is a shift, narrowing rounds to nearest even
/// (NaNs stay quiet NaNs). Plain integer code, so both kernel copies vectorize it.
impl Elem for bf16 {
    #[inline(always)]
    fn load<const SIMD: bool>(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn store<const SIMD: bool>(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            let b = s.to_bits();
            let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
            let nan = ((b >> 16) as u16) | 0x40;
            *d = bf16::from_bits(if s.is_nan() { nan } else { rounded });
        }
    }
    #[inline(always)]
    fn narrow<const SIMD: bool>(buf: &mut [f32]) {
        let mut tmp = [bf16::ZERO; MAX_GROUP];
        let tmp = &mut tmp[..buf.len()];
        Self::store::<SIMD>(buf, tmp);
        Self::load::<SIMD>(tmp, buf);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// Whether the AVX2/F16C kernel copies may run on this CPU.
    pub(super) fn available() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for k in i..n {
            dst[k] = src[k].to_f32();
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            i += 8;
        }
        for k in i..n {
            dst[k] = f16::from_f32(src[k]);
        }
    }
}

/// Rows per rayon task for rows of `d` values.
fn rows_per_task(d: usize) -> usize {
    (VALUES_PER_TASK / d).max(1)
}

/// Quantizes contiguous rows of `d` values. Output slices are sized by the caller from the format.
pub(crate) fn quantize<T: Elem>(
    x: &[T],
    d: usize,
    bits: u32,
    group: usize,
    codes: &mut [u32],
    scales: &mut [T],
    biases: &mut [T],
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
    codes: &mut [u32],
    scales: &mut [T],
    biases: &mut [T],
) {
    let rpt = rows_per_task(d);
    let (words, groups) = (d * B as usize / 32, d / group);
    x.par_chunks(rpt * d)
        .zip(codes.par_chunks_mut(rpt * words))
        .zip(scales.par_chunks_mut(rpt * groups))
        .zip(biases.par_chunks_mut(rpt * groups))
        .for_each(|(((x, codes), scales), biases)| {
            #[cfg(target_arch = "x86_64")]
            if x86::available() {
                // SAFETY: AVX2 and F16C were detected.
                return unsafe { quantize_task_avx2::<T, B>(x, d, group, codes, scales, biases) };
            }
            quantize_task::<T, B, false>(x, d, group, codes, scales, biases)
        });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quantize_task_avx2<T: Elem, const B: u32>(
    x: &[T],
    d: usize,
    group: usize,
    codes: &mut [u32],
    scales: &mut [T],
    biases: &mut [T],
) {
    quantize_task::<T, B, true>(x, d, group, codes, scales, biases)
}

/// Quantizes a block of whole rows (one rayon task).
#[inline(always)]
fn quantize_task<T: Elem, const B: u32, const SIMD: bool>(
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
            T::load::<SIMD>(xg, buf);
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
        T::store::<SIMD>(&s32[..groups], sr);
        T::store::<SIMD>(&b32[..groups], br);
    }
}

/// Dequantizes contiguous rows of `d` values into `out`.
pub(crate) fn dequantize<T: Elem>(
    codes: &[u32],
    scales: &[T],
    biases: &[T],
    d: usize,
    bits: u32,
    group: usize,
    out: &mut [T],
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
    out: &mut [T],
) {
    let rpt = rows_per_task(d);
    let (words, groups) = (d * B as usize / 32, d / group);
    out.par_chunks_mut(rpt * d)
        .zip(codes.par_chunks(rpt * words))
        .zip(scales.par_chunks(rpt * groups))
        .zip(biases.par_chunks(rpt * groups))
        .for_each(|(((out, codes), scales), biases)| {
            #[cfg(target_arch = "x86_64")]
            if x86::available() {
                // SAFETY: AVX2 and F16C were detected.
                return unsafe {
                    dequantize_task_avx2::<T, B>(codes, scales, biases, d, group, out)
                };
            }
            dequantize_task::<T, B, false>(codes, scales, biases, d, group, out)
        });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn dequantize_task_avx2<T: Elem, const B: u32>(
    codes: &[u32],
    scales: &[T],
    biases: &[T],
    d: usize,
    group: usize,
    out: &mut [T],
) {
    dequantize_task::<T, B, true>(codes, scales, biases, d, group, out)
}

/// Dequantizes a block of whole rows (one rayon task).
#[inline(always)]
fn dequantize_task<T: Elem, const B: u32, const SIMD: bool>(
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
        T::load::<SIMD>(sr, &mut s32[..groups]);
        T::load::<SIMD>(br, &mut b32[..groups]);
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
            T::narrow::<SIMD>(buf);
            for v in buf.iter_mut() {
                *v += bias;
            }
            T::store::<SIMD>(buf, og);
        }
    }
}
