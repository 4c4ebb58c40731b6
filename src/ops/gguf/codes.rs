//! The integer lane operations GGUF blocks are unpacked with, on top of the f32 vector
//! operations of [`Simd`]: bytes widened to i32 lanes, shifts, masks, the conversion to f32 and
//! a plain multiply. Every block type's decoder ([`super::blocks`]) is written once over these,
//! so the portable, AVX2 and AVX-512 kernels unpack the same codes and round the same products
//! (integer ops are exact; `cvt`, `mul` and `add` round once, as IEEE says, on every ISA).
//!
//! 4-bit codes may instead be rebuilt by a lookup in a 16-entry table of the block's values
//! ([`Codes::table16`], [`Codes::lookup16`]): one permute per vector on AVX-512, where a vector
//! holds the whole table ([`Codes::TABLE16`]); the entries are the values [`super::blocks::widen`]
//! computes, so both ways give the same f32 values.
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
    /// [`Codes::u8s`] kept whole: shifts of it stay shifts of the widened lanes. (LLVM turns a
    /// shift of zero-extended bytes into a byte shift, a mask and a second widening; on AVX-512
    /// the widening competes with the table lookups for one port.)
    #[inline(always)]
    unsafe fn u8s_kept(p: *const u8) -> Self::I {
        Self::u8s(p)
    }
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

    /// A table of 16 f32 values.
    type T16: Copy;
    /// Whether [`Codes::lookup16`] is one instruction (the kernels then rebuild nibbles with it).
    const TABLE16: bool = false;
    /// Entry i (0..16) is `(i + offset)·scale + bias` (`bias`: one rounding, the product being
    /// exact) or, without `biased`, `(i + offset)·scale`; `scale` and `bias` splat.
    unsafe fn table16(scale: Self::V, bias: Self::V, offset: i32, biased: bool) -> Self::T16;
    /// Lane l is `t[idx[l] & 15]`.
    unsafe fn lookup16(t: Self::T16, idx: Self::I) -> Self::V;
}

/// `(i + offset)` for i in 0..16, as f32.
#[inline(always)]
fn iota16(offset: i32) -> [f32; 16] {
    std::array::from_fn(|i| (i as i32 + offset) as f32)
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
    type T16 = [f32; 16];
    #[inline(always)]
    unsafe fn table16(scale: Self::V, bias: Self::V, offset: i32, biased: bool) -> Self::T16 {
        iota16(offset).map(|i| {
            if biased {
                i * scale[0] + bias[0]
            } else {
                i * scale[0]
            }
        })
    }
    #[inline(always)]
    unsafe fn lookup16(t: Self::T16, idx: Self::I) -> Self::V {
        idx.map(|i| t[(i & 15) as usize])
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{iota16, Codes};
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
        type T16 = [__m256; 2];
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn table16(scale: __m256, bias: __m256, offset: i32, biased: bool) -> [__m256; 2] {
            let i = iota16(offset);
            let half = |p: *const f32| {
                let v = _mm256_loadu_ps(p);
                if biased {
                    _mm256_fmadd_ps(v, scale, bias)
                } else {
                    _mm256_mul_ps(v, scale)
                }
            };
            [half(i.as_ptr()), half(i.as_ptr().add(8))]
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn lookup16(t: [__m256; 2], idx: __m256i) -> __m256 {
            // Two 8-entry permutes (3 index bits each), chosen by bit 3 moved to the sign.
            let lo = _mm256_permutevar8x32_ps(t[0], idx);
            let hi = _mm256_permutevar8x32_ps(t[1], idx);
            _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
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
        unsafe fn u8s_kept(p: *const u8) -> __m512i {
            let mut v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
            // An empty asm block the value passes through: LLVM cannot see into it.
            std::arch::asm!("/* {0} */", inout(zmm_reg) v, options(pure, nomem, nostack));
            v
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
        type T16 = __m512;
        const TABLE16: bool = true;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn table16(scale: __m512, bias: __m512, offset: i32, biased: bool) -> __m512 {
            let i = _mm512_loadu_ps(iota16(offset).as_ptr());
            if biased {
                _mm512_fmadd_ps(i, scale, bias)
            } else {
                _mm512_mul_ps(i, scale)
            }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn lookup16(t: __m512, idx: __m512i) -> __m512 {
            _mm512_permutexvar_ps(idx, t)
        }
    }
}
