//! Randomized Hadamard rotation of K, V and Q per head, for the `rotated` quantization scheme.
//!
//! Keys and values of real models have a few outlier channels; an affine group stretched over
//! one outlier spends most of its codes on empty range. Rotating each head vector by an
//! orthogonal `R = diag(s)·H/√D` (H the Sylvester Hadamard matrix, s random ±1 signs from a
//! seed) spreads every channel's energy over all D coordinates, so groups become near-Gaussian
//! and quantize with much less error. Attention is unchanged in exact arithmetic:
//! `(qR)·(kR) = q·k`, and `Σ p·(vR) = (Σ p·v)R`, so the cache stores `kR`, `vR` quantized,
//! decode and prefill kernels read them as they read any quantized block, the query is rotated
//! once before attention and the output rotated back once after (`Rᵀ = R⁻¹`).
//!
//! Rows are `[.., D]` vectors; rotation is one `[N, D] × [D, D]` matmul, so every backend runs
//! it (the D² work per vector is small next to the projections that produced it); on the CPU a
//! row-invariant one, so batching never changes a rotated vector.

use candle_core::{DType, Device, Result, Tensor};

use crate::ops::row_matmul;

/// Seed of the default rotation (any fixed value works; stored with prompt caches).
pub const DEFAULT_SEED: u64 = 0x6b76_715f_726f_7431;

/// One rotation for head vectors of dimension `head_dim`.
#[derive(Debug, Clone)]
pub struct Rotation {
    head_dim: usize,
    seed: u64,
    /// `R` (f32 `[D, D]`): `x_rot = x · R`.
    fwd: Tensor,
    /// `Rᵀ`: `x = x_rot · Rᵀ`.
    inv: Tensor,
    /// s (f32 `[D]`, ±1), for kernels that rotate with a fast Walsh-Hadamard transform.
    signs: Tensor,
}

#[derive(Debug, thiserror::Error)]
pub enum RotationError {
    #[error("the rotated KV scheme needs a power-of-two head_dim (Hadamard transform); this model's head_dim is {0}")]
    NotPowerOfTwo(usize),
}

impl Rotation {
    pub fn new(head_dim: usize, seed: u64, dev: &Device) -> Result<Self> {
        Self::check(head_dim).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let s = signs(head_dim, seed);
        let fwd = Tensor::from_vec(matrix(&s), (head_dim, head_dim), dev)?;
        let inv = fwd.t()?.contiguous()?;
        Ok(Self {
            head_dim,
            seed,
            fwd,
            inv,
            signs: Tensor::from_vec(s, head_dim, dev)?,
        })
    }

    /// Checks that `head_dim` can be rotated, without building anything.
    pub fn check(head_dim: usize) -> std::result::Result<(), RotationError> {
        if head_dim.is_power_of_two() {
            Ok(())
        } else {
            Err(RotationError::NotPowerOfTwo(head_dim))
        }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The signs s of `R = diag(s)·H/√D` (f32 `[D]`, on the rotation's device).
    pub fn signs(&self) -> &Tensor {
        &self.signs
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotates every head vector of `x` (`[.., D]`, or `[N, heads·D]` rows); same shape and dtype.
    pub fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, &self.fwd, &self.inv)
    }

    /// Undoes [`Rotation::rotate`].
    pub fn unrotate(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, &self.inv, &self.fwd)
    }

    /// `x · m`, where `mt` is `mᵀ`. On the CPU through [`row_matmul`] (as `x · mtᵀ`), so a
    /// vector's rotation does not depend on how many others are rotated in the same call.
    fn apply(&self, x: &Tensor, m: &Tensor, mt: &Tensor) -> Result<Tensor> {
        let d = self.head_dim;
        let shape = x.shape().clone();
        if !shape.elem_count().is_multiple_of(d) {
            candle_core::bail!(
                "rotation: {} values are not whole head vectors of {d}",
                shape.elem_count()
            );
        }
        let dtype = x.dtype();
        // f32 matmul whatever the cache dtype: rounding a rotated vector to f16/bf16 would add
        // error of the order the scheme is meant to remove.
        let rows = x
            .to_dtype(DType::F32)?
            .reshape((shape.elem_count() / d, d))?;
        let out = if row_matmul::supports(&rows, mt) {
            row_matmul::matmul_t(&rows, mt)?
        } else {
            rows.matmul(m)?
        };
        out.to_dtype(dtype)?.reshape(shape)
    }
}

/// The D signs of `seed`'s rotation, from a splitmix64 stream.
fn signs(d: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..d)
        .map(|_| {
            if splitmix64(&mut state) >> 63 == 0 {
                1.0
            } else {
                -1.0
            }
        })
        .collect()
}

/// `R = diag(s)·H/√D`, row-major: entry (i, j) = s_i·H_ij/√D, with `H_ij = (-1)^popcount(i & j)`
/// (Sylvester's construction).
fn matrix(signs: &[f32]) -> Vec<f32> {
    let d = signs.len();
    let norm = 1.0 / (d as f64).sqrt();
    (0..d)
        .flat_map(|i| {
            let s = signs[i];
            (0..d).map(move |j| {
                let h = if (i & j).count_ones() % 2 == 0 {
                    1.0
                } else {
                    -1.0
                };
                (s as f64 * h * norm) as f32
            })
        })
        .collect()
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::max_abs_diff;

    #[test]
    fn orthogonal_and_invertible() {
        let dev = Device::Cpu;
        for d in [2, 16, 64, 128] {
            let r = Rotation::new(d, 7, &dev).unwrap();
            let eye = Tensor::eye(d, DType::F32, &dev).unwrap();
            let rrt = r.fwd.matmul(&r.inv).unwrap();
            assert!(max_abs_diff(&rrt, &eye) < 1e-5, "d={d}: R·Rᵀ != I");
            let x = Tensor::randn(0f32, 1.0, (5, 3, d), &dev).unwrap();
            let back = r.unrotate(&r.rotate(&x).unwrap()).unwrap();
            assert_eq!(back.dims(), x.dims());
            assert!(max_abs_diff(&back, &x) < 1e-5);
        }
    }

    #[test]
    fn preserves_dot_products_and_spreads_outliers() {
        let dev = Device::Cpu;
        let d = 64;
        let r = Rotation::new(d, DEFAULT_SEED, &dev).unwrap();
        let q = Tensor::randn(0f32, 1.0, (1, d), &dev).unwrap();
        // One outlier channel, as in real keys.
        let mut kv = vec![0.1f32; d];
        kv[5] = 40.0;
        let k = Tensor::from_vec(kv, (1, d), &dev).unwrap();
        let dot = |a: &Tensor, b: &Tensor| -> f32 {
            (a * b).unwrap().sum_all().unwrap().to_scalar().unwrap()
        };
        let (qr, kr) = (r.rotate(&q).unwrap(), r.rotate(&k).unwrap());
        assert!((dot(&q, &k) - dot(&qr, &kr)).abs() < 1e-3);
        let peak: f32 = kr
            .abs()
            .unwrap()
            .max_keepdim(1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()[0];
        assert!(peak < 40.0 / 4.0, "outlier not spread: peak {peak}");
    }

    /// On the CPU a vector rotates to the same bits alone and among others (row-invariant
    /// matmul), both ways.
    #[test]
    fn rows_rotate_alike_alone_and_together() {
        let dev = Device::Cpu;
        let r = Rotation::new(64, DEFAULT_SEED, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (37, 3 * 64), &dev).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|f| f.to_bits()).collect()
        };
        for f in [Rotation::rotate, Rotation::unrotate] {
            let all = f(&r, &x).unwrap();
            for i in [0, 5, 36] {
                let one = f(&r, &x.narrow(0, i, 1).unwrap()).unwrap();
                assert_eq!(bits(&one), bits(&all.narrow(0, i, 1).unwrap()), "row {i}");
            }
        }
    }

    #[test]
    fn seeds_differ_and_are_reproducible() {
        let dev = Device::Cpu;
        let a = Rotation::new(32, 1, &dev).unwrap();
        let b = Rotation::new(32, 1, &dev).unwrap();
        let c = Rotation::new(32, 2, &dev).unwrap();
        assert_eq!(max_abs_diff(&a.fwd, &b.fwd), 0.0);
        assert!(max_abs_diff(&a.fwd, &c.fwd) > 0.1);
    }

    #[test]
    fn refuses_non_power_of_two() {
        let err = Rotation::new(96, 1, &Device::Cpu).unwrap_err().to_string();
        assert!(
            err.contains("power-of-two head_dim") && err.contains("96"),
            "{err}"
        );
    }
}
