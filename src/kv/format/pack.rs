//! Scalar building blocks shared by the fused CPU kernel: the per-group parameters of the format
//! (docs/ARCHITECTURE.md, "Decisions"), code rounding, and the LSB-first bit-stream packing of 32
//! codes into `B` u32 words.
//!
//! Every allowed group size is a multiple of 32, so a group is a whole number of 32-code chunks
//! and a chunk of 32 `B`-bit codes is exactly `B` words: packing never crosses a chunk. `B` is a
//! const generic so the 32-step loops unroll into constant shifts.

/// `1.5 * 2^23`: adding and subtracting it rounds an f32 in `[-2^22, 2^22]` to the nearest
/// integer, ties to even, with two plain (vectorizable) additions — `round_ties_even` is a libm
/// call on baseline x86-64.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Scale and bias of one group, in f32, exactly as MLX computes them (docs/ARCHITECTURE.md,
/// "Decisions").
#[inline]
pub(crate) fn group_params(wmin: f32, wmax: f32, n: f32) -> (f32, f32) {
    let side = wmin.abs() > wmax.abs();
    let mut scale = ((wmax - wmin) / n).max(1e-7);
    if !side {
        scale = -scale;
    }
    let edge = if side { wmin } else { wmax };
    let q0 = (edge / scale).round_ties_even();
    if q0 != 0.0 {
        (edge / q0, edge)
    } else {
        (scale, 0.0)
    }
}

/// `clamp(round_half_even((x - bias) / scale), 0, n)`. Clamping first is equivalent (rounding is
/// monotonic and 0, n are integers) and keeps the value in the magic-number range, where
/// `v + 1.5*2^23` has ulp 1: its low mantissa bits are the rounded integer, read off as bits
/// (no float-to-int conversion, whose saturating semantics would not vectorize).
#[inline(always)]
pub(crate) fn code_of(x: f32, scale: f32, bias: f32, n: f32) -> u32 {
    let v = (x - bias) / scale;
    let v = if v > 0.0 { v } else { 0.0 };
    let v = if v < n { v } else { n };
    (v + ROUND_MAGIC).to_bits() - ROUND_MAGIC.to_bits()
}

/// Min and max of a slice, in eight independent lanes so the loop vectorizes.
#[inline]
pub(crate) fn min_max(xs: &[f32]) -> (f32, f32) {
    let mut lo = [f32::INFINITY; 8];
    let mut hi = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            lo[k] = if c[k] < lo[k] { c[k] } else { lo[k] };
            hi[k] = if c[k] > hi[k] { c[k] } else { hi[k] };
        }
    }
    let mut mn = rest.iter().fold(f32::INFINITY, |a, &b| a.min(b));
    let mut mx = rest.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for k in 0..8 {
        mn = mn.min(lo[k]);
        mx = mx.max(hi[k]);
    }
    (mn, mx)
}

/// Packs 32 codes (each < 2^B) into `B` words, element `k` at stream bits `[k*B, (k+1)*B)`.
#[inline(always)]
pub(crate) fn pack32<const B: u32>(q: &[u32; 32], out: &mut [u32]) {
    let out = &mut out[..B as usize];
    out.fill(0);
    // Every shift below is a constant once the loop is unrolled for a given B.
    for (k, &c) in q.iter().enumerate() {
        let bit = k as u32 * B;
        let (w, s) = ((bit / 32) as usize, bit % 32);
        out[w] |= c << s;
        if s + B > 32 {
            out[w + 1] |= c >> (32 - s);
        }
    }
}

/// Inverse of [`pack32`]: the 32 codes stored in `B` words.
#[inline(always)]
pub(crate) fn unpack32<const B: u32>(words: &[u32], q: &mut [u32; 32]) {
    let words = &words[..B as usize];
    let mask = (1u32 << B) - 1;
    for (k, out) in q.iter_mut().enumerate() {
        let bit = k as u32 * B;
        let (w, s) = ((bit / 32) as usize, bit % 32);
        let mut v = words[w] >> s;
        if s + B > 32 {
            v |= words[w + 1] << (32 - s);
        }
        *out = v & mask;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<const B: u32>() {
        let mut q = [0u32; 32];
        for (k, c) in q.iter_mut().enumerate() {
            *c = ((k as u32).wrapping_mul(2654435761) >> 7) & ((1 << B) - 1);
        }
        let mut words = vec![0u32; B as usize];
        pack32::<B>(&q, &mut words);
        // Element k's bits must sit at stream position k*B (LSB first).
        for (k, &c) in q.iter().enumerate() {
            for j in 0..B {
                let bit = k as u32 * B + j;
                let got = (words[(bit / 32) as usize] >> (bit % 32)) & 1;
                assert_eq!(got, (c >> j) & 1, "B={B} k={k} j={j}");
            }
        }
        let mut back = [0u32; 32];
        unpack32::<B>(&words, &mut back);
        assert_eq!(back, q);
    }

    #[test]
    fn pack_unpack_all_widths() {
        roundtrip::<2>();
        roundtrip::<3>();
        roundtrip::<4>();
        roundtrip::<5>();
        roundtrip::<6>();
        roundtrip::<8>();
    }

    #[test]
    fn code_rounding_is_half_even() {
        assert_eq!(code_of(2.5, 1.0, 0.0, 15.0), 2);
        assert_eq!(code_of(3.5, 1.0, 0.0, 15.0), 4);
        assert_eq!(code_of(-3.0, 1.0, 0.0, 15.0), 0);
        assert_eq!(code_of(99.0, 1.0, 0.0, 15.0), 15);
        assert_eq!(code_of(f32::NAN, 1.0, 0.0, 15.0), 0);
    }

    #[test]
    fn min_max_covers_remainder() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.5).collect();
        assert_eq!(min_max(&xs), (-9.0, 9.0));
    }
}
