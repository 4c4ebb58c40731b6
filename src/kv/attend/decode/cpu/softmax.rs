//! Softmax statistics of the fused CPU decode kernel: the per-head max, `exp(score − max)` in
//! place and its sum, over one task's scores in loops the compiler vectorizes.

/// `e^x` for `x <= 0` to ~2e-7 relative, branch-free and with integer-only exponent arithmetic
/// (a float-to-int `as` cast saturates and checks NaN, which keeps the loop scalar), so the
/// softmax loop vectorizes.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: add/sub rounds to an integer
    let x = x.max(-87.0);
    let big = x * std::f32::consts::LOG2_E + MAGIC;
    let n = big - MAGIC;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `big`'s low mantissa bits hold n (in -126..=0) offset by 2^22: 2^n from them directly.
    let ni = big.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    p * f32::from_bits(((ni + 127) << 23) as u32)
}

/// Turns `scores` (`G` rows of `n` at `pitch`) into `exp(score - max)` in place, writing
/// per-head max and sum.
#[inline(always)]
pub(super) fn softmax_rows(
    scores: &mut [f32],
    n: usize,
    pitch: usize,
    m: &mut [f32],
    l: &mut [f32],
) {
    for (j, row) in scores.chunks_exact_mut(pitch).enumerate() {
        let row = &mut row[..n];
        // Sixteen partial reductions over exact chunks: one running value, or partial chunks
        // inside the loop, keep these loops scalar.
        let mut part = [f32::NEG_INFINITY; 16];
        let chunks = row.chunks_exact(16);
        for (p, &x) in part.iter_mut().zip(chunks.remainder()) {
            *p = x;
        }
        for c in chunks {
            for (p, &x) in part.iter_mut().zip(c) {
                // A compare and select (`f32::max` also orders NaN, which does not vectorize).
                *p = if x > *p { x } else { *p };
            }
        }
        let mx = part.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for x in row.iter_mut() {
            *x = exp_neg(*x - mx);
        }
        m[j] = mx;
        l[j] = sum(row);
    }
}

/// `Σ x_i` with sixteen partial sums (vectorizes; fixed order, so deterministic).
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut part = [0f32; 16];
    let chunks = x.chunks_exact(16);
    for (p, &x) in part.iter_mut().zip(chunks.remainder()) {
        *p = x;
    }
    for c in chunks {
        for (p, &x) in part.iter_mut().zip(c) {
            *p += x;
        }
    }
    part.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::exp_neg;

    /// The integer-exponent `exp` agrees with the library's to its stated accuracy over the
    /// whole clamped range, down to where results become subnormal.
    #[test]
    fn exp_neg_matches_std() {
        let mut x = 0f32;
        while x > -87.0 {
            let (got, want) = (exp_neg(x), x.exp());
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "exp({x}): {got} vs {want}"
            );
            x -= 0.0137;
        }
        assert_eq!(exp_neg(0.0), 1.0);
    }
}
