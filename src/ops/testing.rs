//! Helpers of the crate's unit tests: tensor differences read as f32.

use candle_core::{DType, Tensor};

/// Largest |value| of `t`.
pub(crate) fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar())
        .expect("a tensor of numbers")
}

/// Largest |a − b| over the elements of two tensors of one size, compared in row-major order.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let f = |t: &Tensor| {
        t.flatten_all()
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("a tensor of numbers")
    };
    max_abs(&(f(a) - f(b)).expect("tensors of one size"))
}
