//! The integer lane operations GGUF blocks are unpacked with, on top of the f32 vector
//! operations of [`Simd`]: bytes widened to i32 lanes, shifts, masks, the conversion to f32 and
//! a plain multiply. Every block type's decoder ([`super::blocks`]) is written once over these,
//! so the portable, AVX2 and AVX-512 kernels unpack the same codes and round the same products
//! (integer ops are exact; `cvt`, `mul` and `add` round once, as IEEE says, on every ISA).
//!
//! Every method is `unsafe`: pointers must be valid for `LANES` bytes, and an implementation may
//! need the CPU features its caller has checked.

use crate::simd::{Portable, Simd};

/// i32 lanes beside the f32 lanes of `Self` (as many of them).
pub(crate) trait Codes: Simd {
    type I: Copy;
    /// `LANES` bytes at `p`, zero-extended.
    unsafe fn u8s(p: *const u8) -> Self::I;
    /// `LANES` bytes at `p`, sign-extended.
    unsafe fn i8s(p: *const u8) -> Self::I;
    unsafe fn splat_i(x: i32) -> Self::I;
    /// Lane `l` holds `l + base`.
    unsafe fn iota(base: i32) -> Self::I;
    unsafe fn and(a: Self::I, mask: i32) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add_i(a: Self::I, b: i32) -> Self::I;
    /// Logical right shift of every lane by `n` (< 32).
    unsafe fn srl(a: Self::I, n: u32) -> Self::I;
    /// Left shift of every lane by `n` (< 32).
    unsafe fn sll(a: Self::I, n: u32) -> Self::I;
    /// Logical right shift of lane `l` by `n[l]` (< 32).
    unsafe fn srlv(a: Self::I, n: Self::I) -> Self::I;
    /// The lanes as f32 (exact for |x| < 2²⁴).
    unsafe fn to_f32(a: Self::I) -> Self::V;
    /// `a * b`, rounded once.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
}

impl Codes for Portable {
    type I = [i32; 8];
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> Self::I {
        let b = p.cast::<[u8; 8]>().read_unaligned();
        b.map(|x| x as i32)
    }
    #[inline(always)]
    unsafe fn i8s(p: *const u8) -> Self::I {
        let b = p.cast::<[u8; 8]>().read_unaligned();
        b.map(|x| x as i8 as i32)
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> Self::I {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn iota(base: i32) -> Self::I {
        std::array::from_fn(|l| l as i32 + base)
    }
    #[inline(always)]
    unsafe fn and(a: Self::I, mask: i32) -> Self::I {
        a.map(|x| x & mask)
    }
    #[inline(always)]
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
        std::array::from_fn(|l| a[l] | b[l])
    }
    #[inline(always)]
    unsafe fn add_i(a: Self::I, b: i32) -> Self::I {
        a.map(|x| x + b)
    }
    #[inline(always)]
    unsafe fn srl(a: Self::I, n: u32) -> Self::I {
        a.map(|x| ((x as u32) >> n) as i32)
    }
    #[inline(always)]
    unsafe fn sll(a: Self::I, n: u32) -> Self::I {
        a.map(|x| ((x as u32) << n) as i32)
    }
    #[inline(always)]
    unsafe fn srlv(a: Self::I, n: Self::I) -> Self::I {
        std::array::from_fn(|l| ((a[l] as u32) >> n[l]) as i32)
    }
    #[inline(always)]
    unsafe fn to_f32(a: Self::I) -> Self::V {
        a.map(|x| x as f32)
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] * b[l])
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Codes;
    use crate::simd::avx2::Avx2;
    use crate::simd::avx512::Avx512;
    use std::arch::x86_64::*;

    impl Codes for Avx2 {
        type I = __m256i;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn u8s(p: *const u8) -> __m256i {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn i8s(p: *const u8) -> __m256i {
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn splat_i(x: i32) -> __m256i {
            _mm256_set1_epi32(x)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn iota(base: i32) -> __m256i {
            _mm256_add_epi32(
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_set1_epi32(base),
            )
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn and(a: __m256i, mask: i32) -> __m256i {
            _mm256_and_si256(a, _mm256_set1_epi32(mask))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
            _mm256_or_si256(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn add_i(a: __m256i, b: i32) -> __m256i {
            _mm256_add_epi32(a, _mm256_set1_epi32(b))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn srl(a: __m256i, n: u32) -> __m256i {
            _mm256_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sll(a: __m256i, n: u32) -> __m256i {
            _mm256_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn srlv(a: __m256i, n: __m256i) -> __m256i {
            _mm256_srlv_epi32(a, n)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn to_f32(a: __m256i) -> __m256 {
            _mm256_cvtepi32_ps(a)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
    }

    impl Codes for Avx512 {
        type I = __m512i;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn u8s(p: *const u8) -> __m512i {
            _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn i8s(p: *const u8) -> __m512i {
            _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn splat_i(x: i32) -> __m512i {
            _mm512_set1_epi32(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn iota(base: i32) -> __m512i {
            _mm512_add_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(base),
            )
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn and(a: __m512i, mask: i32) -> __m512i {
            _mm512_and_si512(a, _mm512_set1_epi32(mask))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
            _mm512_or_si512(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn add_i(a: __m512i, b: i32) -> __m512i {
            _mm512_add_epi32(a, _mm512_set1_epi32(b))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn srl(a: __m512i, n: u32) -> __m512i {
            _mm512_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn sll(a: __m512i, n: u32) -> __m512i {
            _mm512_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn srlv(a: __m512i, n: __m512i) -> __m512i {
            _mm512_srlv_epi32(a, n)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn to_f32(a: __m512i) -> __m512 {
            _mm512_cvtepi32_ps(a)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
    }
}
