//! AVX2 + FMA + F16C implementation of the kernel's vector operations (eight lanes), entered
//! only after runtime detection ([`available`]).
//!
//! Code decoders (lane order: [`element`](super::element)): 8-bit codes are eight bytes
//! zero-extended; 4-bit codes are eight bytes zero-extended, then masked (low nibbles) or
//! shifted (high nibbles); 2-bit codes are half a word likewise; 3-, 5- and
//! 6-bit codes (which straddle words) are the `B` bytes at byte `v*B`, broadcast, byte-shuffled
//! so each lane holds the 4 bytes around its code, shifted per lane and masked.

use super::Simd;
use std::arch::x86_64::*;

/// Whether [`Avx2`] may be used on this CPU.
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

/// pshufb control for `B`-bit codes: lane `l` takes the 4 bytes from byte `l*B/8` of an 8-byte
/// window (bytes past the window read as 0).
const fn shuffle_ctrl(b: u32) -> [i8; 32] {
    let mut c = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        let (lane, byte) = (i / 4, i % 4);
        // Lanes 4..8 live in the upper 128-bit half, which holds the same 8 bytes.
        let src = (lane as u32 * b / 8) as usize + byte;
        c[i] = if src < 8 { src as i8 } else { -128 };
        i += 1;
    }
    c
}

/// Per-lane right shift that brings code `l` to bit 0 after [`shuffle_ctrl`].
const fn shuffle_shift(b: u32) -> [i32; 8] {
    let mut s = [0i32; 8];
    let mut l = 0;
    while l < 8 {
        s[l] = (l as u32 * b % 8) as i32;
        l += 1;
    }
    s
}

impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4(a: [__m256; 4]) -> [f32; 4] {
        let ab = _mm256_hadd_ps(a[0], a[1]);
        let cd = _mm256_hadd_ps(a[2], a[3]);
        let h = _mm256_hadd_ps(ab, cd);
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), s);
        out
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes<const B: u32>(row: *const u32, words: usize, v: usize) -> __m256 {
        let mask = _mm256_set1_epi32((1i32 << B) - 1);
        let ints = match B {
            8 => _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.cast::<u8>().add(8 * v).cast())),
            4 => {
                let w =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.cast::<u8>().add(v / 2 * 8).cast()));
                if v.is_multiple_of(2) {
                    _mm256_and_si256(w, mask)
                } else {
                    _mm256_srli_epi32::<4>(w)
                }
            }
            2 => {
                let w = _mm256_set1_epi32(row.add(v / 2).read() as i32);
                let base = _mm256_set1_epi32(16 * (v % 2) as i32);
                let sh = _mm256_add_epi32(base, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
                _mm256_and_si256(_mm256_srlv_epi32(w, sh), mask)
            }
            _ => {
                let at = v * B as usize;
                let bytes = row.cast::<u8>().add(at);
                let x = if at + 8 <= words * 4 {
                    bytes.cast::<u64>().read_unaligned()
                } else if at + B as usize >= 8 {
                    // The row's last vector: the 8 bytes that end with its B, shifted down (no
                    // read past the row, no copy through memory).
                    let end = bytes.add(B as usize).sub(8).cast::<u64>().read_unaligned();
                    end >> (8 * (8 - B))
                } else {
                    // A row shorter than 8 bytes: read only its B bytes.
                    let mut buf = [0u8; 8];
                    std::ptr::copy_nonoverlapping(bytes, buf.as_mut_ptr(), B as usize);
                    u64::from_le_bytes(buf)
                };
                let ctrl = const { shuffle_ctrl(B) };
                let sh = const { shuffle_shift(B) };
                let y = _mm256_shuffle_epi8(
                    _mm256_set1_epi64x(x as i64),
                    _mm256_loadu_si256(ctrl.as_ptr().cast()),
                );
                let y = _mm256_srlv_epi32(y, _mm256_loadu_si256(sh.as_ptr().cast()));
                _mm256_and_si256(y, mask)
            }
        };
        _mm256_cvtepi32_ps(ints)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn code_pair<const B: u32>(row: *const u32, words: usize, u: usize) -> [__m256; 2] {
        if B != 4 {
            return [
                Self::codes::<B>(row, words, 2 * u),
                Self::codes::<B>(row, words, 2 * u + 1),
            ];
        }
        let w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.cast::<u8>().add(8 * u).cast()));
        [
            _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15))),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(w)),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p.cast())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Portable;
    use super::*;

    /// Every code decoder agrees with the portable bit-stream reader on random words, for every
    /// vector of rows of 32, 64 and 128 values (the last one included, where 3/5/6-bit reads stop short).
    #[test]
    fn code_decoders_match_portable() {
        if !available() {
            return;
        }
        fn check<const B: u32>(words: &[u32], len: usize) {
            let n = len * B as usize / 32;
            for v in 0..len / 8 {
                // SAFETY: `available` was checked; `words` holds the row's n words.
                let (got, want) = unsafe {
                    let mut got = [0f32; 8];
                    Avx2::store(got.as_mut_ptr(), Avx2::codes::<B>(words.as_ptr(), n, v));
                    (got, Portable::codes::<B>(words.as_ptr(), n, v))
                };
                assert_eq!(got, want, "bits {B} vector {v}");
            }
            for u in 0..len / 16 {
                // SAFETY: as above.
                let (mut pair, mut one) = ([0f32; 16], [0f32; 16]);
                unsafe {
                    let [a, b] = Avx2::code_pair::<B>(words.as_ptr(), n, u);
                    Avx2::store(pair.as_mut_ptr(), a);
                    Avx2::store(pair.as_mut_ptr().add(8), b);
                    for h in 0..2 {
                        let x = Avx2::codes::<B>(words.as_ptr(), n, 2 * u + h);
                        Avx2::store(one.as_mut_ptr().add(8 * h), x);
                    }
                }
                assert_eq!(pair, one, "bits {B} pair {u}");
            }
        }
        crate::simd::for_random_code_rows(
            0x9E37_79B9_7F4A_7C15u64,
            |bits, words, len| match bits {
                2 => check::<2>(words, len),
                3 => check::<3>(words, len),
                4 => check::<4>(words, len),
                5 => check::<5>(words, len),
                6 => check::<6>(words, len),
                _ => check::<8>(words, len),
            },
        );
    }
}
