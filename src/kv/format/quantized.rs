//! The quantized tensor triple (codes, scales, biases) and the shape checks and helpers every
//! backend of the quantize / dequantize ops shares.

use candle_core::op::BackpropOp;
use candle_core::{DType, Result, Storage, Tensor, D};

use super::{QuantError, QuantFormat};

/// A quantized tensor: codes plus per-group scales and biases (see the module doc).
#[derive(Debug, Clone)]
pub struct Quantized {
    /// u32 `[..., D*bits/32]`.
    pub codes: Tensor,
    /// `[..., D/g]`: the quantized input's dtype, or the one `quantize_as` was given.
    pub scales: Tensor,
    /// `[..., D/g]`, same dtype as `scales`.
    pub biases: Tensor,
}

impl Quantized {
    /// Exact bytes held by the three tensors.
    pub fn bytes(&self) -> usize {
        [&self.codes, &self.scales, &self.biases]
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

/// Checks a float input `[..., D]` against the format; returns (rows, D).
pub(super) fn check_input(
    x: &Tensor,
    fmt: QuantFormat,
    op: &'static str,
) -> Result<(usize, usize)> {
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(QuantError::DType {
            op,
            dtype: x.dtype(),
        }
        .into());
    }
    if x.rank() == 0 {
        return Err(QuantError::Shape {
            op,
            msg: "input is a scalar; expected [..., D]".into(),
        }
        .into());
    }
    let d = x.dim(D::Minus1)?;
    fmt.check_dim(d)?;
    Ok((x.elem_count() / d, d))
}

/// Checks that codes / scales / biases have matching shapes for the format; returns (rows, D).
pub(super) fn check_quantized(
    q: &Quantized,
    fmt: QuantFormat,
    op: &'static str,
) -> Result<(usize, usize)> {
    let shape_err = |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
    if q.codes.dtype() != DType::U32 {
        return Err(shape_err(format!(
            "codes must be u32, got {:?}",
            q.codes.dtype()
        )));
    }
    let dtype = q.scales.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(QuantError::DType { op, dtype }.into());
    }
    if q.biases.dtype() != dtype || q.biases.dims() != q.scales.dims() {
        return Err(shape_err(format!(
            "biases {:?} {:?} do not match scales {:?} {:?}",
            q.biases.dims(),
            q.biases.dtype(),
            q.scales.dims(),
            dtype
        )));
    }
    if q.scales.rank() == 0 || q.codes.rank() != q.scales.rank() {
        return Err(shape_err(
            "codes and scales must have the same rank ≥ 1".into(),
        ));
    }
    let d = q.scales.dim(D::Minus1)? * fmt.group_size();
    fmt.check_dim(d)?;
    let (cl, sl) = (q.codes.dims(), q.scales.dims());
    if cl[..cl.len() - 1] != sl[..sl.len() - 1] || cl[cl.len() - 1] != fmt.words_per_row(d) {
        return Err(shape_err(format!(
            "codes {cl:?} do not match scales {sl:?} for {fmt} (expected {} words per row)",
            fmt.words_per_row(d)
        )));
    }
    Ok((q.scales.elem_count() / fmt.groups_per_row(d), d))
}

/// The shape of `x` with its last dimension replaced by `n`.
pub(super) fn with_last(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    let last = dims.len() - 1;
    dims[last] = n;
    dims
}

pub(super) fn wrap(storage: Storage, shape: Vec<usize>) -> Tensor {
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}
