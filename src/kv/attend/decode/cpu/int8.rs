//! The reduced-precision K pass of the fused CPU decode kernel: 4-bit keys in groups of 64 at
//! head_dim 64 or 128, scored against queries held in 8 bits.
//!
//! Why: the exact pass is bound by instructions, not bytes — every code is widened to f32,
//! rebuilt and multiplied by a float multiply-add per query head (8 or 16 codes an instruction).
//! Here each group of a query is rounded once to 8-bit integers with its own scale, and the key
//! bytes are dotted with them as they are stored — `vpdpbusd` (AVX-512 VNNI: 32 code products an
//! instruction on 256 bits) or `vpmaddubsw` + `vpmaddwd` (AVX2) — then one float epilogue per
//! row applies the groups' scales. No crate offers these kernels over kvq's pool layout.
//!
//! Arithmetic, per group of 64 values (codes `c` in 0..=15, key `k̂ = s·c + b`, query scale
//! `σ = max|q| / 127`, `q8 = round(q / σ)`):
//! `q·k̂ = s·Σ q·c + b·Σ q` and `Σ q·c ≈ σ·Σ q8·c + 7.5·(Σ q − σ·Σ q8)`: the rounding error's
//! share along the codes' mean (7.5) is put back, so what is left is the error against the
//! codes' spread around it; `Σ q` is exact. 4-bit values take the 8-bit-weight V pass
//! ([`super::int8v`]) in the same calls. `kvq perplexity` measures
//! what this costs against the exact pass (README); `--exact-attention` keeps the exact pass.

// Elsewhere than x86-64 the pass does not run (every call scores exactly); its types stay so
// the kernel has one signature.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use super::rows::{Params, Rows};
#[cfg(target_arch = "x86_64")]
use crate::simd::Simd;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Values per key group this pass reads.
pub(super) const GROUP: usize = 64;

/// The query rows of one call in 8 bits, and per row and group of 64 values its scale `σ`, its
/// mean-code correction `7.5·(Σ q − σ·Σ q8)` and its exact sum `Σ q`.
///
/// Bytes, per row, in the order the pass reads the key bytes ([`QueryI8::byte`]): at head_dim
/// 64, the 32 even values (the low nibbles of the key bytes), then the 32 odd ones (the high
/// nibbles); at 128, where a step reads the first 16 key bytes of both groups side by side, then
/// the last 16, the even and odd values of those halves: `[lo 0..16 of each group | hi … |
/// lo 16..32 of each group | hi …]`. Floats group-major (`[group][row]`, eight padding values
/// per group: the pass loads four or eight lanes from a row).
pub(super) struct QueryI8 {
    bytes: Vec<i8>,
    scale: Vec<f32>,
    corr: Vec<f32>,
    sum: Vec<f32>,
    /// Floats per group: rows + 8.
    stride: usize,
}

impl QueryI8 {
    /// `q`: rows of `head_dim` (64 or 128) values in their natural order (scaled).
    pub(super) fn new(q: &[f32], head_dim: usize) -> Self {
        let rows = q.len() / head_dim;
        let stride = rows + 8;
        let ng = head_dim / GROUP;
        let (mut scale, mut corr, mut sum) = (
            vec![0f32; ng * stride],
            vec![0f32; ng * stride],
            vec![0f32; ng * stride],
        );
        let mut bytes = vec![0i8; q.len()];
        for (gi, x) in q.chunks_exact(GROUP).enumerate() {
            let (h, g) = (gi / ng, gi % ng);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut q8sum = 0i32;
            for (i, &v) in x.iter().enumerate() {
                let b = (v * inv).round().clamp(-127.0, 127.0) as i8;
                q8sum += b as i32;
                bytes[h * head_dim + Self::byte(head_dim, g * GROUP + i)] = b;
            }
            let total: f32 = x.iter().sum();
            scale[g * stride + h] = s;
            sum[g * stride + h] = total;
            corr[g * stride + h] = 7.5 * (total - s * q8sum as f32);
        }
        QueryI8 {
            bytes,
            scale,
            corr,
            sum,
            stride,
        }
    }

    /// Where value `v` of a row sits among the row's bytes (the layout above). Value `v` is in
    /// key byte `v / 2` of its row, the low nibble for even `v`.
    fn byte(head_dim: usize, v: usize) -> usize {
        let (hi, k) = (v % 2, v / 2);
        if head_dim == 2 * GROUP {
            // Key byte k: group k / 32, half (k % 32) / 16, byte k % 16 of that half.
            let (g, half, b) = (k / 32, (k % 32) / 16, k % 16);
            half * 64 + hi * 32 + g * 16 + b
        } else {
            (k / 32) * 64 + hi * 32 + k % 32
        }
    }

    /// The 8-bit query of row `h`, group `g`, as a reference computes it: `σ·Σ q8·c + corr`
    /// for `codes` (one per value of the group, natural order).
    #[cfg(test)]
    pub(super) fn dot_codes(&self, h: usize, g: usize, codes: &[u8]) -> f32 {
        let hd = self.bytes.len() / (self.stride - 8);
        let row = &self.bytes[h * hd..][..hd];
        let dot: i32 = codes
            .iter()
            .enumerate()
            .map(|(v, &c)| row[Self::byte(hd, g * GROUP + v)] as i32 * c as i32)
            .sum();
        let i = g * self.stride + h;
        self.scale[i] * dot as f32 + self.corr[i]
    }
}

/// Integer dot products of code bytes with 8-bit query bytes.
pub(super) trait Dot: Copy {
    /// Whether the pass runs at all (`Exact`: the float pass instead).
    const INT: bool;
    /// `acc + lo·qlo + hi·qhi` per i32 lane, each lane summing its 4 bytes of each pair:
    /// `lo`, `hi` unsigned (0..=15), `qlo`, `qhi` signed.
    ///
    /// Safety: the CPU has the implementation's features.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot2(acc: __m256i, lo: __m256i, qlo: __m256i, hi: __m256i, qhi: __m256i) -> __m256i;
    /// `acc + u·w` per lane, each summing its 4 byte products (`u` unsigned, 0..=15; `w`
    /// signed, −127..=127), into an accumulator of [`Dot::widen`]'s kind: `vpmaddubsw`'s
    /// 16-bit pair sums added as they are (at most 2·15·127 each: eight of them fit 16 bits),
    /// so one `vpmaddwd` per accumulator replaces one per product; VNNI sums into 32 bits
    /// directly. At most eight calls per accumulator.
    ///
    /// Safety: the CPU has the implementation's features.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot16(acc: __m256i, u: __m256i, w: __m256i) -> __m256i;
    /// An accumulator of [`Dot::dot16`] as 32-bit lane sums. Safety: as [`Dot::dot16`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(acc: __m256i) -> __m256i;
    /// Whether [`Dot::dot512`] is the CPU's own (AVX-512 VNNI), not a stand-in never run.
    const WIDE: bool = false;
    /// [`Dot::dot16`] on 512 bits (32-bit sums). Safety: [`Dot::WIDE`], and the CPU has its
    /// features.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot512(acc: __m512i, u: __m512i, w: __m512i) -> __m512i {
        let _ = (u, w);
        acc
    }
}

/// No integer pass: the exact float K pass.
#[derive(Clone, Copy)]
pub(super) struct Exact;

impl Dot for Exact {
    const INT: bool = false;
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot2(acc: __m256i, _: __m256i, _: __m256i, _: __m256i, _: __m256i) -> __m256i {
        acc
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot16(acc: __m256i, _: __m256i, _: __m256i) -> __m256i {
        acc
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(acc: __m256i) -> __m256i {
        acc
    }
}

/// AVX-512 VNNI on 256 bits (`vpdpbusd`, with AVX-512 VL).
#[derive(Clone, Copy)]
pub(super) struct Vnni;

#[cfg(target_arch = "x86_64")]
impl Dot for Vnni {
    const INT: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dot2(acc: __m256i, lo: __m256i, qlo: __m256i, hi: __m256i, qhi: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, qlo), hi, qhi)
    }
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dot16(acc: __m256i, u: __m256i, w: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, w)
    }
    #[inline(always)]
    unsafe fn widen(acc: __m256i) -> __m256i {
        acc
    }
    const WIDE: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dot512(acc: __m512i, u: __m512i, w: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(acc, u, w)
    }
}

/// AVX2: `vpmaddubsw` (pairs into 16 bits: at most 2·15·127 each, two of them add without
/// overflow) and `vpmaddwd` against ones.
#[derive(Clone, Copy)]
pub(super) struct Madd;

#[cfg(target_arch = "x86_64")]
impl Dot for Madd {
    const INT: bool = true;
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot2(acc: __m256i, lo: __m256i, qlo: __m256i, hi: __m256i, qhi: __m256i) -> __m256i {
        let s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, qlo), _mm256_maddubs_epi16(hi, qhi));
        _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)))
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot16(acc: __m256i, u: __m256i, w: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, w))
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn widen(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }
}

/// Whether the CPU has [`Vnni`]'s features.
#[cfg(target_arch = "x86_64")]
pub(super) fn vnni_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
    })
}

/// Whether this pass reads keys of `bits` in groups of `group` at `head_dim`.
pub(super) fn takes(bits: u32, group: usize, head_dim: usize) -> bool {
    bits == 4 && group == GROUP && (head_dim == 64 || head_dim == 128)
}

/// Scores of every query head against every row, as the exact K pass writes them
/// (`scores[(kh · G + j) · np + t]`, `G` = `g`). `qi` holds the task's query rows from row `h0`
/// (`[KV heads · G]` of them); `two`: two groups a row (head_dim 128); `dist`: how many
/// positions ahead rows are prefetched. Rows two at a time.
///
/// Safety: as the exact pass; `K` is a 4-bit row view ([`Rows::row_bytes`]) of groups of 64
/// and head_dim 64 or 128 (`qi`'s); the CPU has `S`'s and `D`'s features.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn k_pass<S: Simd, D: Dot, K: Rows<S>, V: Rows<S>>(
    heads: &[(K, V)],
    qi: &QueryI8,
    h0: usize,
    slots: &[u32],
    (g, two, np, dist): (usize, bool, usize, usize),
    kp: Params,
    scores: &mut [f32],
) {
    let n = slots.len();
    let (k0, v0) = &heads[0];
    let mut t = 0;
    while t < n {
        let rw = if t + 1 < n { 2 } else { 1 };
        for ahead in t + dist..(t + dist + rw).min(2 * n) {
            if ahead < n {
                k0.prefetch(slots[ahead] as usize);
            } else {
                v0.prefetch(slots[ahead - n] as usize);
            }
        }
        let at = (g, np, t);
        match (two, rw) {
            (true, 2) => k_heads::<S, D, K, V, 2, 2>(heads, qi, h0, slots, at, kp, scores),
            (true, _) => k_heads::<S, D, K, V, 2, 1>(heads, qi, h0, slots, at, kp, scores),
            (false, 2) => k_heads::<S, D, K, V, 1, 2>(heads, qi, h0, slots, at, kp, scores),
            _ => k_heads::<S, D, K, V, 1, 1>(heads, qi, h0, slots, at, kp, scores),
        }
        t += rw;
    }
}

/// The rows `t..t+RW` for every KV head and chunk of four query heads (`G` = `g`, scores at
/// pitch `np`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn k_heads<S: Simd, D: Dot, K: Rows<S>, V: Rows<S>, const NG: usize, const RW: usize>(
    heads: &[(K, V)],
    qi: &QueryI8,
    h0: usize,
    slots: &[u32],
    (g, np, t): (usize, usize, usize),
    kp: Params,
    scores: &mut [f32],
) {
    for (kh, (k, _)) in heads.iter().enumerate() {
        let sc = scores.get_unchecked_mut(kh * g * np..(kh + 1) * g * np);
        let mut j0 = 0;
        while j0 < g {
            let h = h0 + kh * g + j0;
            macro_rules! rows {
                ($nj:literal) => {
                    if NG == 2 {
                        k_rows2::<S, D, K, $nj, RW>(k, qi, h, slots, kp, t, j0, np, sc)
                    } else {
                        k_rows1::<S, D, K, $nj, RW>(k, qi, h, slots, kp, t, j0, np, sc)
                    }
                };
            }
            match g - j0 {
                1 => rows!(1),
                2 => rows!(2),
                3 => rows!(3),
                _ => rows!(4),
            }
            j0 += 4;
        }
    }
}

/// The 16 low nibbles and 16 high nibbles of each 16 bytes of `x`, as bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn nibbles(x: __m256i) -> (__m256i, __m256i) {
    let m = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(x, m),
        _mm256_and_si256(_mm256_srli_epi16::<4>(x), m),
    )
}

/// [`nibbles`] on 512 bits (AVX-512 BW).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn nibbles512(x: __m512i) -> (__m512i, __m512i) {
    let m = _mm512_set1_epi8(0x0F);
    (
        _mm512_and_si512(x, m),
        _mm512_and_si512(_mm512_srli_epi16::<4>(x), m),
    )
}

/// `acc` plus the dot products of code nibbles `(lo, hi)` with the 64 query bytes at `qb`
/// (32 for the low nibbles, then 32 for the high).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_bytes<D: Dot>(acc: __m256i, (lo, hi): (__m256i, __m256i), qb: *const i8) -> __m256i {
    let ld = |p: *const i8| _mm256_loadu_si256(p as *const __m256i);
    D::dot2(acc, lo, ld(qb), hi, ld(qb.add(32)))
}

/// Lanes `[a ×4 | b ×4]` from the two floats at `p` (a row's two key scales or biases).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pair_halves(p: *const f32) -> __m256 {
    let ab = _mm256_castpd_ps(_mm256_set1_pd((p as *const f64).read_unaligned()));
    _mm256_permutevar_ps(ab, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
}

/// Writes `x` (lanes: query heads 0..4 of `RW` rows, rows in `r`) to the scores of heads
/// `j0..j0+NJ` at rows `t..t+RW`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_rows<const NJ: usize, const RW: usize>(
    r: [__m128; 2],
    scores: &mut [f32],
    j0: usize,
    np: usize,
    t: usize,
) {
    let base = scores.as_mut_ptr();
    let at = |j: usize| base.add((j0 + j) * np + t) as *mut f64;
    if RW == 2 {
        // [r0 j0, r1 j0, r0 j1, r1 j1] and the same for j2, j3: two rows of a head at once.
        let lo = _mm_castps_pd(_mm_unpacklo_ps(r[0], r[1]));
        let hi = _mm_castps_pd(_mm_unpackhi_ps(r[0], r[1]));
        _mm_store_sd(at(0), lo);
        if NJ > 1 {
            _mm_storeh_pd(at(1), lo);
        }
        if NJ > 2 {
            _mm_store_sd(at(2), hi);
        }
        if NJ > 3 {
            _mm_storeh_pd(at(3), hi);
        }
    } else {
        let mut o = [0f32; 4];
        _mm_storeu_ps(o.as_mut_ptr(), r[0]);
        for (j, &x) in o.iter().enumerate().take(NJ) {
            *scores.get_unchecked_mut((j0 + j) * np + t) = x;
        }
    }
}

/// Rows `t..t+RW` at head_dim 128 for query heads `j0..j0+NJ` (8-bit rows from `h`). A row is
/// read as `[first 16 bytes of group 0 | of group 1]` and `[last 16 | last 16]`, so each query
/// head's sums stay in one vector — group 0 in the low half, group 1 in the high — and three
/// horizontal adds give `[group 0: heads 0..4 | group 1: heads 0..4]`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k_rows2<S: Simd, D: Dot, R: Rows<S>, const NJ: usize, const RW: usize>(
    k: &R,
    qi: &QueryI8,
    h: usize,
    slots: &[u32],
    kp: Params,
    t: usize,
    j0: usize,
    np: usize,
    scores: &mut [f32],
) {
    let f = |p: *const f32| _mm256_loadu2_m128(p.add(qi.stride), p);
    let (qs, qc, qt) = (
        f(qi.scale.as_ptr().add(h)),
        f(qi.corr.as_ptr().add(h)),
        f(qi.sum.as_ptr().add(h)),
    );
    let mut out = [_mm_setzero_ps(); 2];
    for r in 0..RW {
        let p = k.row_bytes(k.row(*slots.get_unchecked(t + r) as usize));
        let x = _mm256_loadu2_m128i(p.add(32) as *const __m128i, p as *const __m128i);
        let y = _mm256_loadu2_m128i(p.add(48) as *const __m128i, p.add(16) as *const __m128i);
        let ((xl, xh), (yl, yh)) = (nibbles(x), nibbles(y));
        let mut acc = [_mm256_setzero_si256(); 4];
        for j in 0..NJ {
            let qb = qi.bytes.as_ptr().add((h + j) * 2 * GROUP);
            let a = dot_bytes::<D>(acc[j], (xl, xh), qb);
            acc[j] = dot_bytes::<D>(a, (yl, yh), qb.add(64));
        }
        let sums = _mm256_hadd_epi32(
            _mm256_hadd_epi32(acc[0], acc[1]),
            _mm256_hadd_epi32(acc[2], acc[3]),
        );
        let pp = kp
            .data
            .as_ptr()
            .add(2 * kp.groups * (t + r) + k.head_group());
        let (ks, kb) = (pair_halves(pp), pair_halves(pp.add(kp.groups)));
        let y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), qs, qc);
        let z = _mm256_fmadd_ps(kb, qt, _mm256_mul_ps(y, ks));
        out[r] = _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps::<1>(z));
    }
    store_rows::<NJ, RW>(out, scores, j0, np, t);
}

/// Rows `t..t+RW` at head_dim 64 (one group) for query heads `j0..j0+NJ`: the step's `(row,
/// head)` sums fill one vector's lanes `4·r + j`, reduced together.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k_rows1<S: Simd, D: Dot, R: Rows<S>, const NJ: usize, const RW: usize>(
    k: &R,
    qi: &QueryI8,
    h: usize,
    slots: &[u32],
    kp: Params,
    t: usize,
    j0: usize,
    np: usize,
    scores: &mut [f32],
) {
    let mut acc = [_mm256_setzero_si256(); 8];
    for r in 0..RW {
        let p = k.row_bytes(k.row(*slots.get_unchecked(t + r) as usize));
        let (lo, hi) = nibbles(_mm256_loadu_si256(p as *const __m256i));
        for j in 0..NJ {
            let qb = qi.bytes.as_ptr().add((h + j) * GROUP);
            acc[4 * r + j] = dot_bytes::<D>(acc[4 * r + j], (lo, hi), qb);
        }
    }
    let f = _mm256_cvtepi32_ps(reduce8(acc));
    // Per lane: the query's scale, correction and sum of the lane's head, the key scale and
    // bias of the lane's row.
    let half = |v: &Vec<f32>| {
        let x = _mm_loadu_ps(v.as_ptr().add(h));
        _mm256_set_m128(x, x)
    };
    let param = |off: usize| {
        let p = |r: usize| {
            let r = r.min(RW - 1);
            *kp.data
                .as_ptr()
                .add(2 * kp.groups * (t + r) + off + k.head_group())
        };
        _mm256_set_m128(_mm_set1_ps(p(1)), _mm_set1_ps(p(0)))
    };
    let y = _mm256_fmadd_ps(f, half(&qi.scale), half(&qi.corr));
    let z = _mm256_fmadd_ps(param(kp.groups), half(&qi.sum), _mm256_mul_ps(y, param(0)));
    let out = [_mm256_castps256_ps128(z), _mm256_extractf128_ps::<1>(z)];
    store_rows::<NJ, RW>(out, scores, j0, np, t);
}

/// The lane sums of eight vectors: lane `i` of the result is the sum of vector `i`'s lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce8(x: [__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(x[0], x[1]);
    let b = _mm256_hadd_epi32(x[2], x[3]);
    let c = _mm256_hadd_epi32(x[4], x[5]);
    let d = _mm256_hadd_epi32(x[6], x[7]);
    let (ab, cd) = (_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(ab, cd),
        _mm256_permute2x128_si256::<0x31>(ab, cd),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 8-bit query's dot product with any codes is `Σ q·c` up to the rounding error against
    /// the codes' spread around 7.5 (each value rounds by at most σ/2), whatever the codes: the
    /// bytes sit where the pass reads them (even values, then odd) and the correction restores
    /// the share along the mean.
    #[test]
    fn query_bytes_and_correction() {
        for hd in [64usize, 128] {
            let rows = 3usize;
            let mut x = 12345u32;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x
            };
            let q: Vec<f32> = (0..rows * hd)
                .map(|_| (next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
                .collect();
            let qi = QueryI8::new(&q, hd);
            for h in 0..rows {
                for g in 0..hd / GROUP {
                    let x = &q[h * hd + g * GROUP..][..GROUP];
                    let sigma = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                    for trial in 0..20 {
                        let codes: Vec<u8> = (0..GROUP)
                            .map(|i| match trial {
                                0 => 15,
                                1 => (i % 2 * 15) as u8,
                                _ => (next() % 16) as u8,
                            })
                            .collect();
                        let exact: f32 = x.iter().zip(&codes).map(|(q, &c)| q * c as f32).sum();
                        let bound: f32 = codes.iter().map(|&c| (c as f32 - 7.5).abs()).sum::<f32>()
                            * sigma
                            / 2.0;
                        let got = qi.dot_codes(h, g, &codes);
                        assert!(
                            (got - exact).abs() <= bound * 1.001 + 1e-4,
                            "row {h} group {g} trial {trial}: {got} vs {exact} (bound {bound})"
                        );
                    }
                    // Codes all at 7, half a step from the mean: at most half the rounding errors.
                    let flat = vec![7u8; GROUP];
                    let exact: f32 = x.iter().map(|q| q * 7.0).sum();
                    let got = qi.dot_codes(h, g, &flat);
                    assert!((got - exact).abs() <= 64.0 * sigma / 2.0 * 0.5 + 1e-4);
                }
            }
        }
    }
}
