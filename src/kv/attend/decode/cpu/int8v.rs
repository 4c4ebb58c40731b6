//! The reduced-precision V pass of the fused CPU decode kernel: 4-bit (and 3-bit) values in
//! groups of 64 at head_dim 64 or 128, summed with softmax weights held in 8 bits.
//!
//! Why: the exact V pass rebuilds every code in f32 and spends a float multiply-add per code
//! and query head — after the 8-bit K pass ([`super::int8`]) the larger half of a 4-bit
//! call. Here a tile's weights `w_t = p_t·s_t` (softmax numerator times the row's V scale, per
//! query head and group) are rounded once to integers in −127..=127 against the tile's
//! largest, and the code bytes of four rows are interleaved so that one `vpdpbusd` (AVX-512
//! VNNI; both groups of a 128-wide row on 512 bits) or `vpmaddubsw` (AVX2; 16-bit pair sums,
//! one `vpmaddwd` per tile) adds four rows' products for eight output values. No crate offers
//! these kernels over kvq's pool layout.
//!
//! Arithmetic, per tile, query head and group (codes `c` in 0..=15, value `v̂ = s·c + b`,
//! `ω = max_t |w_t| / 127`, `w8 = round(w / ω)`):
//! `Σ_t p_t·v̂_t = Σ_t w_t·c_t + Σ_t p_t·b_t` and `Σ w·c ≈ ω·Σ w8·c + 7.5·Σ (w − ω·w8)`: as in
//! the K pass, the rounding error's share along the codes' mean is put back; `Σ p·b` is exact.
//! Both passes run where the 8-bit K pass does (`--exact-attention` keeps both exact).
//!
//! 3-bit values (the `--kv-bits 3.5` split: 4-bit keys) take the same pass: each tile's rows are
//! first widened to nibbles ([`widen3`]: three bytes of eight codes to four, in a few shifts
//! and masks per 64 codes), the mean put back is then 3.5, and the rest is the 4-bit pass. The
//! exact V pass instead rebuilds every code in f32 per query head — measured at 16K on the
//! default model's shape, K4/V3 cost ~20% more than 4-bit that way.
//!
//! Output order: lane `k` of the `i`-th vector of eight of a group (pass order, [`natural`])
//! holds one value of the row bytes the interleave puts there; [`finish`] writes each to its
//! place in the kernel's decoded order.

// Elsewhere than x86-64 the pass does not run; its types stay so the kernel has one signature.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use super::int8::{nibbles, nibbles512, Dot};
#[cfg(target_arch = "x86_64")]
use super::rows::Params;
#[cfg(target_arch = "x86_64")]
use crate::simd::Simd;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Values per group this pass reads (as the K pass).
const GROUP: usize = super::int8::GROUP;

/// Most positions of a V tile (`kernel::tile_len` keeps to it): the bytes of a (query head,
/// group)'s weights.
pub(super) const MAX_TILE: usize = 32;

/// Largest weight below which a tile's weights are all rounded to zero (their sum goes to the
/// shared part whole).
const TINY: f32 = 1e-30;

/// Per-thread buffers of the pass, grown as needed.
#[derive(Default)]
pub(super) struct Scratch {
    /// A tile's weights in 8 bits, `[query head][group][MAX_TILE]`, and their `ω`.
    w: Vec<i8>,
    omega: Vec<f32>,
    /// The task's sums in pass order, `[KV head][query head][group][64]`, and per (KV head,
    /// query head, group) eight partial sums of the part every value of the group shares
    /// (`Σ p·b` and the correction).
    acc: Vec<f32>,
    shared: Vec<f32>,
}

/// Sizes of a task for the pass.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    /// Query heads per KV head, groups per head row, KV heads.
    pub g: usize,
    pub groups: usize,
    pub kv_heads: usize,
    /// The pitch of the task's per-head arrays.
    pub pitch: usize,
    /// Bits of the values' codes (4, or 3 widened to nibbles): the codes' mean `(2^bits − 1) / 2`
    /// and the kernel's decoded order of the values (interleaved for 4-bit, natural for 3-bit).
    pub bits: u32,
}

/// Where value `i` of a group in pass order lies in the group (natural order). Vector `i / 8`
/// is `(m, nibble)` = `(i / 16, i / 8 % 2)` of the interleave; lane `k` sums the code bytes
/// `4m + k` (lanes 0..4) or `16 + 4m + k − 4` (4..8) of four rows.
pub(super) fn natural(i: usize) -> usize {
    let (m, nib, k) = (i / 16, i / 8 % 2, i % 8);
    let byte = if k < 4 { 4 * m + k } else { 16 + 4 * m + k - 4 };
    2 * byte + nib
}

/// Where natural value `i` of a head row sits in the kernel's decoded order of 4-bit rows on
/// `lanes`-wide vectors (the inverse of `simd::element(4, …)`).
pub(super) fn decoded(lanes: usize, i: usize) -> usize {
    let (pair, r) = (i / (2 * lanes), i % (2 * lanes));
    (2 * pair + r % 2) * lanes + r / 2
}

/// Readies the scratch for a task: sums zeroed.
pub(super) fn start(s: &mut Scratch, d: Dims) {
    let heads = d.kv_heads * d.g * d.groups;
    for (v, len) in [(&mut s.acc, heads * GROUP), (&mut s.shared, heads * 8)] {
        v.clear();
        v.resize(len, 0.0);
    }
    s.w.resize(d.g * d.groups * MAX_TILE, 0);
    s.omega.resize(d.g * d.groups, 0.0);
}

/// Adds the task's sums to `out` (per KV head `[max (G) | sum (G) | G × head_dim]`, values in
/// the kernel's decoded order: for 4-bit rows on `lanes`-wide vectors [`decoded`], for 3-bit
/// rows natural).
pub(super) fn finish(s: &Scratch, d: Dims, out: &mut [f32], lanes: usize) {
    let hd = d.groups * GROUP;
    let stride = 2 * d.g + d.g * hd;
    // Pass order → decoded order, once per task (head_dim is at most two groups).
    let mut place = [0usize; 2 * GROUP];
    for (i, p) in place.iter_mut().take(hd).enumerate() {
        let at = i / GROUP * GROUP + natural(i % GROUP);
        *p = if d.bits == 4 { decoded(lanes, at) } else { at };
    }
    for kh in 0..d.kv_heads {
        for j in 0..d.g {
            let o = &mut out[kh * stride + 2 * d.g + j * hd..][..hd];
            for gi in 0..d.groups {
                let at = (kh * d.g + j) * d.groups + gi;
                let c: f32 = s.shared[at * 8..][..8].iter().sum();
                let acc = &s.acc[at * GROUP..][..GROUP];
                for (&x, &p) in acc.iter().zip(&place[gi * GROUP..]) {
                    o[p] += x + c;
                }
            }
        }
    }
}

/// One KV head's V tile: positions `t0..t0 + rows.len()` whose head rows of 4-bit codes start
/// at the addresses `rows`, softmax numerators `p` (`G` rows at the task's pitch), the task's
/// widened V scales and biases `vp` and the head's first group among them, `col`. Adds to the
/// task's sums of KV head `kh`.
///
/// Safety: as the kernel's V pass; the rows are 4-bit codes of groups of 64 and head_dim 64 or
/// 128, `rows.len() <= MAX_TILE`, [`start`] ran for this task, and the CPU has `S`'s and `D`'s
/// features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile<S: Simd, D: Dot>(
    rows: &[usize],
    p: &[f32],
    vp: Params,
    col: usize,
    (t0, kh): (usize, usize),
    d: Dims,
    s: &mut Scratch,
) {
    let n = rows.len();
    for gi in 0..d.groups {
        let at = kh * d.g * d.groups + gi;
        weights(p, vp, (col + gi, t0, n), d, gi, s, at);
    }
    // Four query heads' sums (16 vectors) need 32 registers.
    let nj = if S::REGS >= 32 { 4 } else { 2 };
    if D::WIDE && d.groups == 2 {
        // Both groups of a head row in one 512-bit vector.
        for half in 0..2 {
            let mut j0 = 0;
            while j0 < d.g {
                let at = (kh, j0, half);
                match d.g - j0 {
                    1 => block_wide::<D, 1>(rows, at, d, s),
                    2 => block_wide::<D, 2>(rows, at, d, s),
                    3 => block_wide::<D, 3>(rows, at, d, s),
                    _ => block_wide::<D, 4>(rows, at, d, s),
                }
                j0 += 4;
            }
        }
        return;
    }
    for gi in 0..d.groups {
        for half in 0..2 {
            let mut j0 = 0;
            while j0 < d.g {
                let at = (kh, j0, gi, half);
                match (d.g - j0).min(nj) {
                    1 => block::<D, 1>(rows, at, d, s),
                    2 => block::<D, 2>(rows, at, d, s),
                    3 => block::<D, 3>(rows, at, d, s),
                    _ => block::<D, 4>(rows, at, d, s),
                }
                j0 += nj;
            }
        }
    }
}

/// Eight floats from `p`, the first `n` of them (zeros past): no read past the tile.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load8(p: *const f32, n: usize) -> __m256 {
    if n >= 8 {
        _mm256_loadu_ps(p)
    } else {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
        _mm256_maskload_ps(p, mask)
    }
}

/// Group `gi` (slot group `col`) of a tile of `n` positions from `t0`, every query head `j`:
/// writes the 8-bit weights `round(p·s / ω)` in −127..=127 (scales may be negative: MLX's edge
/// rule; zeros past `n`) and `ω = max |p·s| / 127`, and adds the shared part
/// `Σ p·b + mid·Σ (p·s − ω·w8)` to its eight partial sums (from `(KV head, 0, gi)` = `at`).
/// The tile's scales and biases are gathered once for all query heads.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn weights(
    p: &[f32],
    vp: Params,
    (col, t0, n): (usize, usize, usize),
    d: Dims,
    gi: usize,
    s: &mut Scratch,
    at: usize,
) {
    const VECS: usize = MAX_TILE / 8;
    let stride = 2 * vp.groups;
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(stride as i32));
    let base = vp.data.as_ptr().add(stride * t0 + col);
    let (mut sc, mut bi) = ([_mm256_setzero_ps(); VECS], [_mm256_setzero_ps(); VECS]);
    let vecs = n.div_ceil(8);
    for k in 0..vecs {
        let m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((n - 8 * k) as i32),
            lane,
        ));
        let b = base.add(8 * k * stride);
        let z = _mm256_setzero_ps();
        sc[k] = _mm256_mask_i32gather_ps::<4>(z, b, idx, m);
        bi[k] = _mm256_mask_i32gather_ps::<4>(z, b.add(vp.groups), idx, m);
    }
    for j in 0..d.g {
        let pj = p.as_ptr().add(j * d.pitch + t0);
        let mut x = [_mm256_setzero_ps(); VECS];
        let mut pb = _mm256_setzero_ps();
        let mut mx = _mm256_setzero_ps();
        for k in 0..vecs {
            let pk = load8(pj.add(8 * k), n - 8 * k);
            x[k] = _mm256_mul_ps(pk, sc[k]);
            pb = _mm256_fmadd_ps(pk, bi[k], pb);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.0), x[k]));
        }
        // The largest in every lane (no trip through a scalar).
        let m = _mm256_max_ps(mx, _mm256_permute2f128_ps::<1>(mx, mx));
        let m = _mm256_max_ps(m, _mm256_permute_ps::<0b01_00_11_10>(m));
        let top = _mm256_max_ps(m, _mm256_permute_ps::<0b10_11_00_01>(m));
        // Weights this small (numerators near exp's floor, tiny scales) contribute nothing the
        // shared part does not already hold; 127 / top would overflow.
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(top, _mm256_set1_ps(TINY));
        let inv = _mm256_and_ps(big, _mm256_div_ps(_mm256_set1_ps(127.0), top));
        let omega = _mm256_and_ps(big, _mm256_mul_ps(top, _mm256_set1_ps(1.0 / 127.0)));
        let mut err = _mm256_setzero_ps();
        let mut ints = [_mm256_setzero_si256(); VECS];
        for k in 0..VECS {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x[k], inv),
            );
            err = _mm256_add_ps(err, _mm256_fnmadd_ps(r, omega, x[k]));
            ints[k] = _mm256_cvtps_epi32(r);
        }
        // i32 → i8: the packs interleave 128-bit lanes; one dword permute restores the order.
        let w = s.w.as_mut_ptr().add((j * d.groups + gi) * MAX_TILE);
        for (c, i) in ints.chunks_exact(4).enumerate() {
            let a = _mm256_packs_epi32(i[0], i[1]);
            let b = _mm256_packs_epi32(i[2], i[3]);
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(a, b),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            _mm256_storeu_si256(w.add(32 * c) as *mut __m256i, bytes);
        }
        *s.omega.get_unchecked_mut(j * d.groups + gi) =
            _mm_cvtss_f32(_mm256_castps256_ps128(omega));
        let sh = s.shared.as_mut_ptr().add((at + j * d.groups) * 8);
        let mid = ((1u32 << d.bits) - 1) as f32 / 2.0;
        let part = _mm256_fmadd_ps(err, _mm256_set1_ps(mid), pb);
        _mm256_storeu_ps(sh, _mm256_add_ps(_mm256_loadu_ps(sh), part));
    }
}

/// Query heads `j0..j0+NJ` (`at` = (KV head, j0, group, half)) over one half of a group's
/// code bytes — bytes 0..8 and 16..24 (`half` 0) or 8..16 and 24..32 — four rows a step.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn block<D: Dot, const NJ: usize>(
    rows: &[usize],
    (kh, j0, gi, half): (usize, usize, usize, usize),
    d: Dims,
    s: &mut Scratch,
) {
    let n = rows.len();
    // Eight steps of four rows at most per accumulator ([`Dot::dot16`]).
    debug_assert!(n <= MAX_TILE && MAX_TILE <= 32);
    let mut acc = [[_mm256_setzero_si256(); 4]; NJ];
    let w = s.w.as_ptr();
    let mut t = 0;
    while t < n {
        // Rows past the tile repeat its last (their weights are zero).
        let x: [__m256i; 4] = std::array::from_fn(|r| {
            let row = *rows.get_unchecked((t + r).min(n - 1)) as *const u8;
            _mm256_loadu_si256(row.add(32 * gi) as *const __m256i)
        });
        let (a, b) = if half == 0 {
            (
                _mm256_unpacklo_epi8(x[0], x[1]),
                _mm256_unpacklo_epi8(x[2], x[3]),
            )
        } else {
            (
                _mm256_unpackhi_epi8(x[0], x[1]),
                _mm256_unpackhi_epi8(x[2], x[3]),
            )
        };
        // Dwords of the four rows' bytes: `4m + k` (lanes 0..4), `16 + 4m + k - 4` (4..8).
        let (l0, h0) = nibbles(_mm256_unpacklo_epi16(a, b));
        let (l1, h1) = nibbles(_mm256_unpackhi_epi16(a, b));
        for j in 0..NJ {
            let wp = w.add(((j0 + j) * d.groups + gi) * MAX_TILE + t) as *const i32;
            let wj = _mm256_set1_epi32(wp.read_unaligned());
            let a = &mut acc[j];
            a[0] = D::dot16(a[0], l0, wj);
            a[1] = D::dot16(a[1], h0, wj);
            a[2] = D::dot16(a[2], l1, wj);
            a[3] = D::dot16(a[3], h1, wj);
        }
        t += 4;
    }
    for j in 0..NJ {
        let at = (j0 + j) * d.groups + gi;
        let om = _mm256_set1_ps(*s.omega.get_unchecked(at));
        let o = s
            .acc
            .as_mut_ptr()
            .add(((kh * d.g) * d.groups + at) * GROUP + 32 * half);
        for (k, a) in acc[j].iter().enumerate() {
            let o = o.add(8 * k);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(D::widen(*a)), om, _mm256_loadu_ps(o)),
            );
        }
    }
}

/// [`block`] for both groups of a head_dim-128 row at once on 512 bits ([`Dot::WIDE`]): the
/// row's 64 bytes in one vector, whose 128-bit lanes 0–1 hold group 0 and 2–3 group 1, so the
/// interleave and the sums are [`block`]'s per 256-bit half.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn block_wide<D: Dot, const NJ: usize>(
    rows: &[usize],
    (kh, j0, half): (usize, usize, usize),
    d: Dims,
    s: &mut Scratch,
) {
    let n = rows.len();
    let mut acc = [[_mm512_setzero_si512(); 4]; NJ];
    let w = s.w.as_ptr();
    let mut t = 0;
    while t < n {
        let x: [__m512i; 4] = std::array::from_fn(|r| {
            let row = *rows.get_unchecked((t + r).min(n - 1)) as *const u8;
            _mm512_loadu_si512(row as *const __m512i)
        });
        let (a, b) = if half == 0 {
            (
                _mm512_unpacklo_epi8(x[0], x[1]),
                _mm512_unpacklo_epi8(x[2], x[3]),
            )
        } else {
            (
                _mm512_unpackhi_epi8(x[0], x[1]),
                _mm512_unpackhi_epi8(x[2], x[3]),
            )
        };
        let (l0, h0) = nibbles512(_mm512_unpacklo_epi16(a, b));
        let (l1, h1) = nibbles512(_mm512_unpackhi_epi16(a, b));
        for j in 0..NJ {
            // Group 0's weights in the low half, group 1's (MAX_TILE bytes on) in the high.
            let wp = w.add((j0 + j) * 2 * MAX_TILE + t) as *const i32;
            let lo = _mm256_set1_epi32(wp.read_unaligned());
            let hi = _mm256_set1_epi32(wp.add(MAX_TILE / 4).read_unaligned());
            let wj = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let a = &mut acc[j];
            a[0] = D::dot512(a[0], l0, wj);
            a[1] = D::dot512(a[1], h0, wj);
            a[2] = D::dot512(a[2], l1, wj);
            a[3] = D::dot512(a[3], h1, wj);
        }
        t += 4;
    }
    for j in 0..NJ {
        let at = (j0 + j) * 2;
        let halves = |lo: __m256, hi: __m256| {
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                _mm256_castps_pd(hi),
            ))
        };
        let om = halves(
            _mm256_set1_ps(*s.omega.get_unchecked(at)),
            _mm256_set1_ps(*s.omega.get_unchecked(at + 1)),
        );
        let o = s
            .acc
            .as_mut_ptr()
            .add(((kh * d.g) * 2 + at) * GROUP + 32 * half);
        for (k, a) in acc[j].iter().enumerate() {
            let (o0, o1) = (o.add(8 * k), o.add(GROUP + 8 * k));
            let prev = halves(_mm256_loadu_ps(o0), _mm256_loadu_ps(o1));
            let r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*a), om, prev);
            _mm256_storeu_ps(o0, _mm512_castps512_ps256(r));
            _mm256_storeu_ps(
                o1,
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(r))),
            );
        }
    }
}

/// Widens the 3-bit head rows at the addresses `rows` (`groups` groups of 64 codes, 24 bytes
/// each) into 4-bit rows of `32 · groups` bytes in `out`, one after the other, and points `rows`
/// at them. Eight codes take three bytes (LSB first) and become four: in each 32-bit lane the
/// 12-bit halves move 16 bits apart, then the 6-bit quarters 8 bits apart, then each 3-bit
/// code to its nibble.
///
/// Safety: every address is a row of at least `24 · groups` readable bytes; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn widen3(rows: &mut [usize], groups: usize, out: &mut Vec<u8>) {
    let rb = 32 * groups;
    out.resize(rows.len() * rb, 0);
    // Low 128 bits from bytes 0..16 (lanes take 0..12), high from bytes 8..24 (lanes 12..24).
    let pick = _mm256_setr_epi8(
        0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1, //
        4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1,
    );
    let m = |x: i32| _mm256_set1_epi32(x);
    for (i, r) in rows.iter_mut().enumerate() {
        let src = *r as *const u8;
        let dst = out.as_mut_ptr().add(i * rb);
        for gi in 0..groups {
            let g = src.add(24 * gi);
            let lo = _mm_loadu_si128(g as *const __m128i);
            let hi = _mm_loadu_si128(g.add(8) as *const __m128i);
            let x = _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), pick);
            let x = _mm256_or_si256(
                _mm256_and_si256(x, m(0x0000_0FFF)),
                _mm256_slli_epi32::<4>(_mm256_and_si256(x, m(0x00FF_F000))),
            );
            let x = _mm256_or_si256(
                _mm256_and_si256(x, m(0x003F_003F)),
                _mm256_slli_epi32::<2>(_mm256_and_si256(x, m(0x0FC0_0FC0))),
            );
            let x = _mm256_or_si256(
                _mm256_and_si256(x, m(0x0707_0707)),
                _mm256_slli_epi32::<1>(_mm256_and_si256(x, m(0x3838_3838))),
            );
            _mm256_storeu_si256(dst.add(32 * gi) as *mut __m256i, x);
        }
        *r = dst as usize;
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "x86_64")]
    use super::widen3;
    use super::{decoded, natural};

    /// Pass order covers each value of a group once.
    #[test]
    fn pass_order_is_a_permutation() {
        let mut seen = [false; 64];
        for i in 0..64 {
            assert!(!seen[natural(i)], "{i}");
            seen[natural(i)] = true;
        }
        assert_eq!(natural(8), 1);
        assert_eq!(natural(4), 32);
    }

    /// `decoded` inverts the kernel's decoded order of 4-bit rows.
    #[test]
    fn decoded_inverts_element() {
        for lanes in [8usize, 16] {
            for i in 0..128 {
                let p = decoded(lanes, i);
                assert_eq!(crate::simd::element(4, lanes, p / lanes, p % lanes), i);
            }
        }
    }

    /// Widened 3-bit rows hold each code in its nibble, 4-bit stream order, for one and two
    /// groups a row.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widen3_puts_each_code_in_its_nibble() {
        if !crate::simd::avx2::available() {
            return;
        }
        for groups in [1usize, 2] {
            let n = 64 * groups;
            let codes: Vec<u8> = (0..n).map(|i| ((i * 37 + i / 7) % 8) as u8).collect();
            // LSB-first 3-bit stream.
            let mut packed = vec![0u8; 3 * n / 8];
            for (k, &c) in codes.iter().enumerate() {
                for b in 0..3 {
                    let bit = 3 * k + b;
                    packed[bit / 8] |= ((c >> b) & 1) << (bit % 8);
                }
            }
            let mut rows = vec![packed.as_ptr() as usize; 3];
            let mut out = Vec::new();
            // SAFETY: AVX2 is present; each row holds 24 bytes a group.
            unsafe { widen3(&mut rows, groups, &mut out) };
            for (i, &r) in rows.iter().enumerate() {
                // SAFETY: widen3 points each row at 32 bytes a group of `out`.
                let got = unsafe { std::slice::from_raw_parts(r as *const u8, 32 * groups) };
                let want: Vec<u8> = codes.chunks(2).map(|p| p[0] | p[1] << 4).collect();
                assert_eq!(got, want.as_slice(), "groups {groups} row {i}");
            }
        }
    }
}
