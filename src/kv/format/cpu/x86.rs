//! AVX2 + F16C bodies of the fused kernels, entered only after runtime detection.
//!
//! Eight values per vector, the same IEEE operations as the portable path (so the results are
//! bit-identical): quantize takes the group's min/max, the scalar parameters of the format
//! (docs/ARCHITECTURE.md), then `clamp(round((x - bias) / scale), 0, n)` with a true division,
//! `max`/`min` whose NaN handling matches [`code_of`](super::super::pack::code_of), and rounding by
//! the 1.5·2^23 magic number, whose bit pattern then *is* the integer code. Eight codes are shifted
//! to their bit offsets with one variable shift and OR-reduced within each 128-bit half, giving 8·B
//! stream bits; four such pieces fill the B words of a 32-code chunk through a u128 accumulator
//! whose shifts are all compile-time constants. Dequantize pulls 8·B bits out of the chunk's words,
//! broadcasts them, shifts per lane, masks, and applies `code*scale + bias` with the narrow-type
//! rounding of MLX when the output is f16/bf16 (none for f32 output).

use super::super::pack::group_params;
use crate::simd::lanes::Lanes;

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Horizontal min and max of two vectors whose lanes are never NaN.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_min_max(lo: __m256, hi: __m256) -> (f32, f32) {
    let lo = _mm_min_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps::<1>(lo));
    let hi = _mm_max_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps::<1>(hi));
    let lo = _mm_min_ps(lo, _mm_movehl_ps(lo, lo));
    let hi = _mm_max_ps(hi, _mm_movehl_ps(hi, hi));
    let lo = _mm_min_ss(lo, _mm_movehdup_ps(lo));
    let hi = _mm_max_ss(hi, _mm_movehdup_ps(hi));
    (_mm_cvtss_f32(lo), _mm_cvtss_f32(hi))
}

/// Per-lane bit offsets `[0, B, 2B, 3B]` within each 128-bit half.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn lane_shifts<const B: u32>() -> __m256i {
    let b = B as i32;
    _mm256_setr_epi32(0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b)
}

/// `1.5 * 2^23` (see [`code_of`](super::super::pack::code_of)).
const MAGIC: f32 = 12_582_912.0;

/// Groups whose parameters are computed together (stack buffers of this many f32).
const GROUPS_PER_PASS: usize = 256;

/// Scales and biases of 8 groups from their min/max: [`group_params`] lane by lane, with the
/// same operations in the same order (so the same bits, NaN and infinity cases included).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn group_params8(mn: __m256, mx: __m256, n: __m256) -> (__m256, __m256) {
    let sign = _mm256_set1_ps(-0.0);
    let side = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_andnot_ps(sign, mn), _mm256_andnot_ps(sign, mx));
    // `f32::max` returns the non-NaN operand; `max_ps(a, b)` returns b when a is NaN.
    let scale = _mm256_max_ps(
        _mm256_div_ps(_mm256_sub_ps(mx, mn), n),
        _mm256_set1_ps(1e-7),
    );
    let scale = _mm256_blendv_ps(_mm256_xor_ps(scale, sign), scale, side);
    let edge = _mm256_blendv_ps(mx, mn, side);
    let q0 = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_div_ps(
        edge, scale,
    ));
    let nonzero = _mm256_cmp_ps::<_CMP_NEQ_UQ>(q0, _mm256_setzero_ps());
    let scale = _mm256_blendv_ps(scale, _mm256_div_ps(edge, q0), nonzero);
    (scale, _mm256_and_ps(edge, nonzero))
}

/// Codes of 8 values: `v > 0 ? v : 0` (NaN → 0), then `v < n ? v : n`, then round half to
/// even by the magic number, whose low mantissa bits are then the code.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn code8(x: __m256, scale: __m256, bias: __m256, n: __m256) -> __m256i {
    let v = _mm256_div_ps(_mm256_sub_ps(x, bias), scale);
    let v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), n);
    let magic = _mm256_set1_ps(MAGIC);
    _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(v, magic)),
        _mm256_castps_si256(magic),
    )
}

/// Packs 32 codes (< 2^B, one per u32 lane of `q`, in order) into B words at `out`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn pack32<const B: u32>(q: [__m256i; 4], out: *mut u32) {
    if B == 8 || B == 4 {
        // Codes to bytes, in order: the packs interleave 128-bit halves, the permute undoes it.
        let w = _mm256_packus_epi32(q[0], q[1]);
        let w = _mm256_packus_epi16(w, _mm256_packus_epi32(q[2], q[3]));
        let bytes = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if B == 8 {
            return _mm256_storeu_si256(out as *mut __m256i, bytes);
        }
        // Byte pairs to one byte each: b0 + 16*b1, packed and gathered into 16 bytes.
        let nib = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
        let nib = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi16(nib, nib));
        return _mm_storeu_si128(out as *mut __m128i, _mm256_castsi256_si128(nib));
    }
    // Any width: 8 codes shifted to their offsets and OR-ed within each 128-bit half give 8·B
    // stream bits; a u128 accumulator (all shifts constant) cuts them into words.
    let shifts = lane_shifts::<B>();
    let mut acc = 0u128;
    let mut have = 0u32;
    let mut out = out;
    for v in q {
        let s = _mm256_sllv_epi32(v, shifts);
        let s = _mm256_or_si256(s, _mm256_shuffle_epi32::<0x4E>(s));
        let s = _mm256_or_si256(s, _mm256_shuffle_epi32::<0xB1>(s));
        let low = _mm256_cvtsi256_si32(s) as u32 as u128;
        let high = _mm256_extract_epi32::<4>(s) as u32 as u128;
        acc |= (low | high << (4 * B)) << have;
        have += 8 * B;
        while have >= 32 {
            out.write(acc as u32);
            out = out.add(1);
            acc >>= 32;
            have -= 32;
        }
    }
}

/// Quantizes a block of whole rows of `X`, writing every element of the three outputs (the
/// parameters as `S`). Slice lengths must follow the format (`x.len() = rows*d`,
/// `codes.len() = rows*d*B/32`, `scales.len() = biases.len() = rows*d/group`); they are checked.
/// Groups go in passes: min/max of each group, then the parameters of 8 groups per vector, then
/// the codes (the group's values are re-read from cache).
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn quantize_block<X: Lanes, S: Lanes, const B: u32>(
    x: &[X],
    d: usize,
    group: usize,
    codes: &mut [MaybeUninit<u32>],
    scales: &mut [MaybeUninit<S>],
    biases: &mut [MaybeUninit<S>],
) {
    let b = B as usize;
    let rows = x.len() / d;
    let groups = rows * (d / group);
    assert!(
        group.is_multiple_of(32)
            && x.len() == rows * d
            && codes.len() == rows * d * b / 32
            && scales.len() == groups
            && biases.len() == groups
    );
    let n = ((1u32 << B) - 1) as f32;
    let vn = _mm256_set1_ps(n);
    // f32 rows into half parameters: codes from the rounded parameters (as the portable kernel).
    let narrow = std::mem::size_of::<X>() > std::mem::size_of::<S>();
    let mut lo_buf = [0f32; GROUPS_PER_PASS];
    let mut hi_buf = [0f32; GROUPS_PER_PASS];
    let mut scale_buf = [0f32; GROUPS_PER_PASS];
    let mut bias_buf = [0f32; GROUPS_PER_PASS];
    for g0 in (0..groups).step_by(GROUPS_PER_PASS) {
        let count = GROUPS_PER_PASS.min(groups - g0);
        let xp = x.as_ptr().add(g0 * group);
        for j in 0..count {
            let gp = xp.add(j * group);
            let mut lo = _mm256_set1_ps(f32::INFINITY);
            let mut hi = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in (0..group).step_by(8) {
                let v = X::load8(gp.add(i));
                // `v < lo ? v : lo` and `v > hi ? v : hi`: NaNs never enter.
                lo = _mm256_min_ps(v, lo);
                hi = _mm256_max_ps(v, hi);
            }
            (lo_buf[j], hi_buf[j]) = reduce_min_max(lo, hi);
        }
        let whole = count - count % 8;
        for j in (0..whole).step_by(8) {
            let mn = _mm256_loadu_ps(lo_buf.as_ptr().add(j));
            let mx = _mm256_loadu_ps(hi_buf.as_ptr().add(j));
            let (scale, bias) = group_params8(mn, mx, vn);
            let (scale, bias) = if narrow {
                (S::narrow8(scale), S::narrow8(bias))
            } else {
                (scale, bias)
            };
            _mm256_storeu_ps(scale_buf.as_mut_ptr().add(j), scale);
            _mm256_storeu_ps(bias_buf.as_mut_ptr().add(j), bias);
            S::store8(scales.as_mut_ptr().add(g0 + j) as *mut S, scale);
            S::store8(biases.as_mut_ptr().add(g0 + j) as *mut S, bias);
        }
        for j in whole..count {
            let (scale, bias) = group_params(lo_buf[j], hi_buf[j], n);
            let (scale, bias) = if narrow {
                (S::from_f32(scale).to_f32(), S::from_f32(bias).to_f32())
            } else {
                (scale, bias)
            };
            (scale_buf[j], bias_buf[j]) = (scale, bias);
            scales.get_unchecked_mut(g0 + j).write(S::from_f32(scale));
            biases.get_unchecked_mut(g0 + j).write(S::from_f32(bias));
        }
        let mut out = codes.as_mut_ptr().add(g0 * group * b / 32) as *mut u32;
        for j in 0..count {
            let gp = xp.add(j * group);
            let (vs, vb) = (_mm256_set1_ps(scale_buf[j]), _mm256_set1_ps(bias_buf[j]));
            for c in (0..group).step_by(32) {
                let q = [0, 8, 16, 24].map(|k| code8(X::load8(gp.add(c + k)), vs, vb, vn));
                pack32::<B>(q, out);
                out = out.add(b);
            }
        }
    }
}

/// The 8 codes `8k..8k+8` of a 32-code chunk starting at `w` (B words), one per u32 lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn codes8<const B: u32>(w: *const u32, k: usize) -> __m256i {
    if B == 8 {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(w.add(2 * k) as *const __m128i));
    }
    let mask = _mm256_set1_epi32(((1u32 << B) - 1) as i32);
    if B == 4 || B == 2 {
        // 8 codes lie in one word: broadcast it, shift each lane to its code.
        let bit = 8 * B as usize * k;
        let v = _mm256_set1_epi32(w.add(bit / 32).read() as i32);
        let (s, b) = ((bit % 32) as i32, B as i32);
        let shifts = _mm256_setr_epi32(
            s,
            s + b,
            s + 2 * b,
            s + 3 * b,
            s + 4 * b,
            s + 5 * b,
            s + 6 * b,
            s + 7 * b,
        );
        return _mm256_and_si256(_mm256_srlv_epi32(v, shifts), mask);
    }
    let bit = 8 * B as usize * k;
    let (i, s) = (bit / 32, bit % 32);
    // 8·B bits from offset s fit in 64 bits for every allowed B (s ∈ {0, 8, 16, 24}).
    let next = if i + 1 < B as usize {
        (w.add(i + 1).read() as u64) << 32
    } else {
        0
    };
    let bits = (w.add(i).read() as u64 | next) >> s;
    let low = _mm_set1_epi32(bits as u32 as i32);
    let high = _mm_set1_epi32((bits >> (4 * B)) as u32 as i32);
    let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(low), high);
    _mm256_and_si256(_mm256_srlv_epi32(v, lane_shifts::<B>()), mask)
}

/// Dequantizes a block of whole rows into `O`, writing every element of `out` (each group's
/// scale and bias widened from `S` once); slice lengths as for [`quantize_block`], checked.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dequantize_block<S: Lanes, O: Lanes, const B: u32>(
    codes: &[u32],
    scales: &[S],
    biases: &[S],
    d: usize,
    group: usize,
    out: &mut [MaybeUninit<O>],
) {
    let b = B as usize;
    let rows = out.len() / d;
    let groups = rows * (d / group);
    assert!(
        group.is_multiple_of(32)
            && out.len() == rows * d
            && codes.len() == rows * d * b / 32
            && scales.len() == groups
            && biases.len() == groups
    );
    for gi in 0..groups {
        let vs = _mm256_set1_ps(scales.get_unchecked(gi).to_f32());
        let vb = _mm256_set1_ps(biases.get_unchecked(gi).to_f32());
        let op = out.as_mut_ptr().add(gi * group) as *mut O;
        let wp = codes.as_ptr().add(gi * group * b / 32);
        for c in 0..group / 32 {
            let w = wp.add(c * b);
            for k in 0..4 {
                let v = _mm256_mul_ps(_mm256_cvtepi32_ps(codes8::<B>(w, k)), vs);
                O::store8(op.add(32 * c + 8 * k), _mm256_add_ps(O::narrow8(v), vb));
            }
        }
    }
}
