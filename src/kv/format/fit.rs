//! Least-squares group parameters for kvq's own (rotated) formats.
//!
//! MLX's parameters stretch a group's codes from its minimum to its maximum, so one outlier sets
//! the step for all 64 values. Rotated head vectors are near-Gaussian: the extremes of a group
//! of 64 sit about 2.4σ out, and at 2 or 3 bits the step of least squared error spans a clearly
//! narrower range (for 4 levels about 3σ of 4.8σ). [`Fit::LeastSquares`] searches clipped ranges
//! and refits scale and bias to the codes each produces (a line through the points (code,
//! value)), keeping the pair of least squared error over the group: measured on this model's
//! rotated keys, −25% error at 3 bits and −45% at 2 bits, a few percent at 4 and none at 8.
//! The stored format and every decode kernel are unchanged — this is only a better encoder —
//! so it is applied where kvq owns the format (rotated caches) and never to MLX-exact ones.

use super::pack::{code_of, group_params, min_max};

/// How a group's scale and bias are chosen when quantizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fit {
    /// MLX's: the group's minimum and maximum are codes (bit-exact with MLX).
    #[default]
    MinMax,
    /// The scale and bias of least squared error found over clipped ranges (module doc).
    LeastSquares,
}

impl Fit {
    /// The fit of a cache's writes: least squares where kvq owns the format (rotated rows),
    /// MLX's min/max elsewhere.
    pub fn of(rotated: bool) -> Fit {
        if rotated {
            Fit::LeastSquares
        } else {
            Fit::MinMax
        }
    }
}

/// Fractions of a group's range tried as the span of its codes, centred on the range's middle.
const SPANS: [f32; 10] = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55];

/// Scale and bias (`x ≈ code·scale + bias`, codes `0..=n`) for the group `xs` under `fit`.
pub(crate) fn params(xs: &[f32], n: f32, fit: Fit) -> (f32, f32) {
    let (mn, mx) = min_max(xs);
    let minmax = group_params(mn, mx, n);
    // A flat group (or one holding a non-finite value) keeps MLX's parameters.
    let spread = (mx - mn).is_finite() && mx > mn;
    if fit == Fit::MinMax || !spread {
        return minmax;
    }
    let mut best = minmax;
    let mut best_err = squared_error(xs, minmax, n);
    let (mid, range) = (0.5 * (mn + mx), mx - mn);
    for span in SPANS {
        let lo = mid - 0.5 * span * range;
        let start = (span * range / n, lo);
        let Some(fitted) = refit(xs, start, n) else {
            continue;
        };
        let err = squared_error(xs, fitted, n);
        if err < best_err {
            (best, best_err) = (fitted, err);
        }
    }
    best
}

/// The least-squares line through (code, value) for the codes `xs` take under `(scale, bias)`;
/// `None` when every value takes one code.
fn refit(xs: &[f32], (scale, bias): (f32, f32), n: f32) -> Option<(f32, f32)> {
    let (mut sq, mut sqq, mut sx, mut sqx) = (0f64, 0f64, 0f64, 0f64);
    for &x in xs {
        let q = code_of(x, scale, bias, n) as f64;
        sq += q;
        sqq += q * q;
        sx += x as f64;
        sqx += q * x as f64;
    }
    let m = xs.len() as f64;
    let det = m * sqq - sq * sq;
    if det <= 0.0 {
        return None;
    }
    let s = (m * sqx - sq * sx) / det;
    let b = (sx - s * sq) / m;
    (s > 0.0 && s.is_finite() && b.is_finite()).then_some((s as f32, b as f32))
}

/// Σ (x − dequantized x)² over the group.
fn squared_error(xs: &[f32], (scale, bias): (f32, f32), n: f32) -> f32 {
    xs.iter()
        .map(|&x| {
            let e = x - (code_of(x, scale, bias, n) as f32 * scale + bias);
            e * e
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic near-Gaussian values (sum of uniforms).
    fn gaussianish(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut u = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n)
            .map(|_| (0..6).map(|_| u()).sum::<f32>() - 3.0)
            .collect()
    }

    #[test]
    fn least_squares_never_loses_to_min_max_and_wins_at_low_bits() {
        for bits in [2u32, 3, 4, 8] {
            let n = ((1u32 << bits) - 1) as f32;
            let (mut mm, mut ls) = (0f32, 0f32);
            for seed in 0..200 {
                let xs = gaussianish(64, seed);
                let a = squared_error(&xs, params(&xs, n, Fit::MinMax), n);
                let b = squared_error(&xs, params(&xs, n, Fit::LeastSquares), n);
                assert!(b <= a, "bits {bits} seed {seed}: {b} > {a}");
                (mm, ls) = (mm + a, ls + b);
            }
            if bits <= 3 {
                assert!(ls < 0.85 * mm, "bits {bits}: {ls} vs {mm}");
            }
        }
    }

    #[test]
    fn min_max_is_mlx_and_flat_groups_keep_it() {
        let xs = gaussianish(64, 7);
        let (mn, mx) = min_max(&xs);
        assert_eq!(params(&xs, 15.0, Fit::MinMax), group_params(mn, mx, 15.0));
        let flat = [0.25f32; 64];
        let want = group_params(0.25, 0.25, 15.0);
        assert_eq!(params(&flat, 15.0, Fit::LeastSquares), want);
    }
}
