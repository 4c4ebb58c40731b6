//! AVX-512 (F + BW) implementation of the kernel's vector operations (sixteen lanes), entered
//! only after runtime detection ([`available`]). On cores with full-width 512-bit units it does
//! twice the multiply-adds of AVX2 per instruction, and decode attention is bound by them.
//!
//! Code decoders (lane order: [`element`](super::element)): 8-bit codes are sixteen
//! bytes zero-extended; 4-bit codes are sixteen bytes zero-extended, then masked (low nibbles)
//! or shifted (high nibbles); 2-bit codes are one word broadcast and shifted per lane; 3-, 5- and 6-bit codes are the `2B`
//! bytes at byte `2Bv`, broadcast to every 128-bit lane, byte-shuffled so each lane holds the 4
//! bytes around its code, shifted per lane and masked.

use super::Simd;
use std::arch::x86_64::*;

/// Whether [`Avx512`] may be used on this CPU.
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

/// pshufb control for `B`-bit codes: lane `l` takes the 4 bytes from byte `l*B/8` of a 16-byte
/// window replicated in every 128-bit lane (bytes past the window read as 0).
const fn shuffle_ctrl(b: u32) -> [i8; 64] {
    let mut c = [0i8; 64];
    let mut i = 0;
    while i < 64 {
        let (lane, byte) = (i / 4, i % 4);
        let src = (lane as u32 * b / 8) as usize + byte;
        c[i] = if src < 16 { src as i8 } else { -128 };
        i += 1;
    }
    c
}

/// Per-lane right shift that brings code `l` to bit 0 after [`shuffle_ctrl`].
const fn shuffle_shift(b: u32) -> [i32; 16] {
    let mut s = [0i32; 16];
    let mut l = 0;
    while l < 16 {
        s[l] = (l as u32 * b % 8) as i32;
        l += 1;
    }
    s
}

impl Simd for Avx512 {
    const LANES: usize = 16;
    const REGS: usize = 32;
    type V = __m512;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn hsum(a: __m512) -> f32 {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(a),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
        );
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn hsum16(a: [[__m512; 4]; 4]) -> [[f32; 4]; 4] {
        // Input i = 4·row + head. Each round halves the partial sums per input and doubles the
        // inputs per vector: 30 shuffles and 15 adds for all sixteen, one vector at the end.
        let halves = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(x, y),
                _mm512_shuffle_f32x4::<0xEE>(x, y),
            )
        };
        let quarters = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            )
        };
        let pairs = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(x, y),
                _mm512_shuffle_ps::<0b11_01_11_01>(x, y),
            )
        };
        // w[k]: quarters 0-1 hold 8 partial sums of input 2k, quarters 2-3 of input 2k + 1.
        let w: [__m512; 8] =
            std::array::from_fn(|k| halves(a[k / 2][2 * (k % 2)], a[k / 2][2 * (k % 2) + 1]));
        // z[m]: quarter l holds 4 partial sums of input 4m + l.
        let z: [__m512; 4] = std::array::from_fn(|m| quarters(w[2 * m], w[2 * m + 1]));
        // Quarter l of u0: two partial sums of inputs l, 4 + l; of u1: of inputs 8 + l, 12 + l.
        let (u0, u1) = (pairs(z[0], z[1]), pairs(z[2], z[3]));
        // Lane 4l + k: input 4k + l, i.e. row k of head l: out[head][row] as stored.
        let mut out = [[0f32; 4]; 4];
        _mm512_storeu_ps(out.as_mut_ptr().cast(), pairs(u0, u1));
        out
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn half(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn hsum4(a: [__m512; 4]) -> [f32; 4] {
        // 512-bit quarters: [a0+a2, a1+a3, b0+b2, b1+b3], then one quarter per input.
        let pair = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(x, y),
                _mm512_shuffle_f32x4::<0xEE>(x, y),
            )
        };
        let (x, y) = (pair(a[0], a[1]), pair(a[2], a[3]));
        let z = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        );
        // Within each quarter: sum of its four lanes into lane 0.
        let z = _mm512_add_ps(z, _mm512_permute_ps::<0b01_00_11_10>(z));
        let z = _mm512_add_ps(z, _mm512_permute_ps::<0b10_11_00_01>(z));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut out = [0f32; 4];
        _mm_storeu_ps(
            out.as_mut_ptr(),
            _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, z)),
        );
        out
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn hsum8(a: [__m512; 8]) -> [f32; 8] {
        // Halve the lanes while doubling the inputs per vector: after three rounds lane pairs
        // (2i, 2i+1) hold input i's partial sums, and one more add leaves its sum in lane 2i.
        let half = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(x, y),
                _mm512_shuffle_f32x4::<0xEE>(x, y),
            )
        };
        // Lanes 0-3 | 4-7 | 8-11 | 12-15 of the result hold quarters of x, x, y, y.
        let (b0, b1, b2, b3) = (
            half(a[0], a[1]),
            half(a[2], a[3]),
            half(a[4], a[5]),
            half(a[6], a[7]),
        );
        // Each 128-bit quarter k of b holds 4 partial sums of one input; pair up quarters
        // 0+1 and 2+3 of two such vectors: quarters (x, y, z, w) of inputs.
        let quart = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            )
        };
        // c0 quarters: inputs 0, 1, 2, 3; c1: inputs 4, 5, 6, 7 (4 lanes each).
        let (c0, c1) = (quart(b0, b1), quart(b2, b3));
        // Within 128-bit lanes: [c0 0+1, c0 2+3, c1 0+1, c1 2+3] pairs, then the last add.
        let d = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(c0, c1),
            _mm512_shuffle_ps::<0b11_01_11_01>(c0, c1),
        );
        // Lane 4q+0/1: input q's pair from c0, lanes 4q+2/3: input 4+q's pair from c1.
        let e = _mm512_add_ps(d, _mm512_permute_ps::<0b10_11_00_01>(d));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut out = [0f32; 8];
        _mm256_storeu_ps(
            out.as_mut_ptr(),
            _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, e)),
        );
        out
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn codes<const B: u32>(row: *const u32, words: usize, v: usize) -> __m512 {
        let mask = _mm512_set1_epi32((1i32 << B) - 1);
        let ints = match B {
            8 => _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(4 * v).cast())),
            4 => {
                let bytes = _mm_loadu_si128(row.cast::<u8>().add(v / 2 * 16).cast());
                let w = _mm512_cvtepu8_epi32(bytes);
                if v.is_multiple_of(2) {
                    _mm512_and_si512(w, mask)
                } else {
                    _mm512_srli_epi32::<4>(w)
                }
            }
            2 => {
                let w = _mm512_set1_epi32(row.add(v).read() as i32);
                let sh =
                    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                _mm512_and_si512(_mm512_srlv_epi32(w, sh), mask)
            }
            _ => {
                let n = 2 * B as usize;
                let at = v * n;
                let bytes = row.cast::<u8>().add(at);
                let x = if at + 16 <= words * 4 {
                    _mm_loadu_si128(bytes.cast())
                } else if at + n >= 16 {
                    // Near the row's end: the 16 bytes that end with this vector's 2B, shifted
                    // down (no read past the row, no copy through memory). B is 3, 5 or 6 here
                    // (2, 4 and 8 have arms of their own; QuantFormat allows no other width).
                    let end = _mm_loadu_si128(bytes.add(n).sub(16).cast());
                    match B {
                        3 => _mm_srli_si128::<10>(end),
                        5 => _mm_srli_si128::<6>(end),
                        _ => _mm_srli_si128::<4>(end),
                    }
                } else {
                    // A row shorter than 16 bytes: read only its 2B bytes.
                    let mut buf = [0u8; 16];
                    std::ptr::copy_nonoverlapping(bytes, buf.as_mut_ptr(), n);
                    _mm_loadu_si128(buf.as_ptr().cast())
                };
                let ctrl = const { shuffle_ctrl(B) };
                let sh = const { shuffle_shift(B) };
                let y = _mm512_shuffle_epi8(
                    _mm512_broadcast_i32x4(x),
                    _mm512_loadu_si512(ctrl.as_ptr().cast()),
                );
                let y = _mm512_srlv_epi32(y, _mm512_loadu_si512(sh.as_ptr().cast()));
                _mm512_and_si512(y, mask)
            }
        };
        _mm512_cvtepi32_ps(ints)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn code_pair<const B: u32>(row: *const u32, words: usize, u: usize) -> [__m512; 2] {
        if B != 4 {
            return [
                Self::codes::<B>(row, words, 2 * u),
                Self::codes::<B>(row, words, 2 * u + 1),
            ];
        }
        let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.cast::<u8>().add(16 * u).cast()));
        [
            _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15))),
            _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(w)),
        ]
    }
    const TABLE4: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn table4(scale: __m512, bias: __m512) -> __m512 {
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        _mm512_fmadd_ps(iota, scale, bias)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn rebuild4_pair(
        row: *const u32,
        _words: usize,
        u: usize,
        table: __m512,
        _scale: __m512,
        _bias: __m512,
    ) -> [__m512; 2] {
        // The permute reads only the low 4 bits of each index: the low nibble needs no mask.
        let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.cast::<u8>().add(16 * u).cast()));
        [
            _mm512_permutexvar_ps(w, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(w), table),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p.cast())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{element, Portable};
    use super::*;

    /// Every code decoder agrees with the portable bit-stream reader on random words, for every
    /// vector of rows of 32, 64 and 128 values (the last ones included, where 3/5/6-bit reads stop short).
    #[test]
    fn code_decoders_match_portable() {
        if !available() {
            return;
        }
        fn check<const B: u32>(words: &[u32], len: usize) {
            let n = len * B as usize / 32;
            for v in 0..len / 16 {
                // SAFETY: `available` was checked; `words` holds the row's n words.
                let (mut got, mut want) = ([0f32; 16], [0f32; 16]);
                unsafe {
                    Avx512::store(got.as_mut_ptr(), Avx512::codes::<B>(words.as_ptr(), n, v));
                    let mut all = [0f32; 128];
                    for u in 0..len / 8 {
                        let p = Portable::codes::<B>(words.as_ptr(), n, u);
                        for (l, &x) in p.iter().enumerate() {
                            all[element(B, 8, u, l)] = x;
                        }
                    }
                    for (l, w) in want.iter_mut().enumerate() {
                        *w = all[element(B, 16, v, l)];
                    }
                }
                assert_eq!(got, want, "bits {B} vector {v}");
            }
            for u in 0..len / 32 {
                // SAFETY: as above.
                let (mut pair, mut one) = ([0f32; 32], [0f32; 32]);
                unsafe {
                    let [a, b] = Avx512::code_pair::<B>(words.as_ptr(), n, u);
                    Avx512::store(pair.as_mut_ptr(), a);
                    Avx512::store(pair.as_mut_ptr().add(16), b);
                    for h in 0..2 {
                        let x = Avx512::codes::<B>(words.as_ptr(), n, 2 * u + h);
                        Avx512::store(one.as_mut_ptr().add(16 * h), x);
                    }
                }
                assert_eq!(pair, one, "bits {B} pair {u}");
            }
        }
        crate::simd::for_random_code_rows(
            0x2545_F491_4F6C_DD1Du64,
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

    /// The eight-way horizontal sum gives each input's sum in order (integers: exact).
    #[test]
    fn hsum8_sums_each_input() {
        if !available() {
            return;
        }
        let vals: Vec<f32> = (0..128).map(|i| ((i * 37) % 101) as f32).collect();
        // SAFETY: `available` was checked; `vals` holds 8 vectors.
        let got = unsafe {
            Avx512::hsum8(std::array::from_fn(|i| {
                Avx512::load(vals.as_ptr().add(16 * i))
            }))
        };
        let want: Vec<f32> = vals.chunks(16).map(|c| c.iter().sum()).collect();
        assert_eq!(got.to_vec(), want);
    }

    #[test]
    fn hsum16_sums_each_input_by_head_then_row() {
        if !available() {
            return;
        }
        let vals: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32).collect();
        let sum = |i: usize| vals[16 * i..16 * (i + 1)].iter().sum::<f32>();
        // SAFETY: `available` was checked; `vals` holds 16 vectors.
        let got = unsafe {
            Avx512::hsum16(std::array::from_fn(|r| {
                std::array::from_fn(|j| Avx512::load(vals.as_ptr().add(16 * (4 * r + j))))
            }))
        };
        let want: [[f32; 4]; 4] = std::array::from_fn(|j| std::array::from_fn(|r| sum(4 * r + j)));
        assert_eq!(got, want);
    }
}
