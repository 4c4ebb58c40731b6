//! Eight-lane conversions between the cache's element types and f32 with the rounding of a
//! store (f16 through F16C, bf16 to nearest even with quiet NaNs): what the fused quantize and
//! dequantize kernels need beyond [`Simd`](super::Simd)'s widening loads.

use half::{bf16, f16};
use std::arch::x86_64::*;

/// Eight-lane (and one-lane) conversions between an element type and f32. Callers must have
/// checked [`avx2::available`](super::avx2::available).
pub(crate) trait Lanes: Copy {
    /// Loads 8 values widened to f32.
    unsafe fn load8(p: *const Self) -> __m256;
    /// Stores 8 f32 values rounded to nearest-even in this type.
    unsafe fn store8(p: *mut Self, v: __m256);
    /// Rounds 8 f32 values to this type's precision, staying in f32.
    unsafe fn narrow8(v: __m256) -> __m256;
    /// One value, rounded like [`Lanes::store8`].
    unsafe fn from_f32(x: f32) -> Self;
    unsafe fn to_f32(self) -> f32;
}

impl Lanes for f32 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store8(p: *mut Self, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn narrow8(v: __m256) -> __m256 {
        v
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn to_f32(self) -> f32 {
        self
    }
}

impl Lanes for f16 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store8(p: *mut Self, v: __m256) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(p as *mut __m128i, h)
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn narrow8(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn from_f32(x: f32) -> Self {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
        f16::from_bits(_mm_cvtsi128_si32(h) as u16)
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn to_f32(self) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(self.to_bits() as i32)))
    }
}

/// bf16 is the top half of an f32: widening is a shift; narrowing rounds to nearest even on the
/// integer bits, NaNs becoming quiet NaNs (the rule of the portable path).
impl Lanes for bf16 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store8(p: *mut Self, v: __m256) {
        let r = bf16_bits(v);
        // Each u32 lane holds < 2^16: pack to u16 and gather the two 64-bit halves.
        let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
        _mm_storeu_si128(p as *mut __m128i, _mm256_castsi256_si128(packed))
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn narrow8(v: __m256) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bf16_bits(v)))
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn from_f32(x: f32) -> Self {
        bf16::from_bits(_mm256_cvtsi256_si32(bf16_bits(_mm256_set1_ps(x))) as u16)
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// The bf16 bit patterns of 8 f32 values, one per u32 lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn bf16_bits(v: __m256) -> __m256i {
    let b = _mm256_castps_si256(v);
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let up = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    let rounded = _mm256_srli_epi32::<16>(up);
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, quiet, nan)
}
