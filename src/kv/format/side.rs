//! A captured decode step's writes beside the pool's rows, made by the same launch
//! ([`quantize_rotated_into_rows`](super::ops::quantize_rotated_into_rows) on CUDA): what
//! `kv::cache::fixed` hands down so that a layer's write is one kernel.

use candle_core::{DType, Result, Tensor};

use super::QuantError;

/// What a captured decode step writes in the same launch as its rows into the pool
/// ([`quantize_rotated_into_rows`](super::ops::quantize_rotated_into_rows)), instead of a kernel of its own per layer: keys minus
/// `means` (`[n, d]`, the rows' dtype, subtracted in that dtype) before they are rotated and
/// quantized (`--kv-center`), and K and V as they then are, unrotated, into f16 dense copies
/// (`--kv-residual`).
#[derive(Clone, Copy, Default)]
pub struct SideWrites<'a> {
    pub means: Option<&'a Tensor>,
    pub copies: Option<DenseCopies<'a>>,
}

/// Input row `i` of K and V as f16 into rows `rows[i]` and `sinks[i]` (u32 `[n]`; equal for a
/// row that is no sink) of the f16 pools `k`, `v` (`[pool rows, d]`).
#[derive(Clone, Copy)]
pub struct DenseCopies<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub rows: &'a Tensor,
    pub sinks: &'a Tensor,
}

impl SideWrites<'_> {
    /// Shapes and dtypes against the rows `k` (`[n, d]`); the copies' row numbers are on the
    /// device and not checked here (the cache computes them).
    pub(super) fn check(&self, k: &Tensor, op: &'static str) -> Result<()> {
        let shape_err =
            |msg: String| -> candle_core::Error { QuantError::Shape { op, msg }.into() };
        let (n, d) = k.dims2()?;
        if let Some(m) = self.means {
            if m.dims() != k.dims() || m.dtype() != k.dtype() {
                return Err(shape_err(format!(
                    "key means {:?} {:?} for rows {:?} {:?}",
                    m.shape(),
                    m.dtype(),
                    k.shape(),
                    k.dtype()
                )));
            }
        }
        if let Some(c) = &self.copies {
            let pools_fit = [c.k, c.v].iter().all(|p| {
                p.dtype() == DType::F16
                    && p.is_contiguous()
                    && p.rank() == 2
                    && p.dim(1).ok() == Some(d)
            }) && c.k.dims() == c.v.dims();
            let rows_fit = [c.rows, c.sinks]
                .iter()
                .all(|r| r.dims() == [n] && r.dtype() == DType::U32 && r.is_contiguous());
            if !pools_fit || !rows_fit || c.k.dim(0)? == 0 {
                return Err(shape_err(format!(
                    "dense copies of {n} rows of {d} values into pools {:?} at rows {:?}",
                    c.k.shape(),
                    c.rows.shape()
                )));
            }
        }
        Ok(())
    }
}
