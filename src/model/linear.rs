//! The decoder's projections and token embeddings as loaded ([`super::weights`] builds them):
//! what each multiplies with — candle's matmul on dense or GGUF-quantized weights, or kvq's
//! row-invariant CPU kernels ([`crate::ops::row_matmul`], [`crate::ops::gguf`]).

// Weights come from model files: no unwrap, expect or indexing that could panic on them (issue 21;
// clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::Result;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Module, Tensor};
use std::sync::Arc;

use crate::ops::gguf::QMatrix;
use crate::ops::row_matmul;

/// What a projection's matmul computes (its K/V differ from the others').
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMath {
    /// Dense weights (safetensors, dummy, `--dequantize`).
    Dense,
    /// GGUF blocks through kvq's kernels.
    Blocks,
    /// GGUF blocks through candle's QMatMul.
    Quantized,
}

/// A projection's weight: for candle's matmul (dense or QMatMul) or in GGUF blocks for kvq's
/// CPU kernels.
#[derive(Debug, Clone)]
pub(super) enum Weight {
    Candle(QMatMul),
    Blocks(Arc<QMatrix>),
}

/// A projection `y = x Wᵀ (+ b)`; W quantized (GGUF) or dense.
#[derive(Debug, Clone)]
pub struct Linear {
    w: Weight,
    b: Option<Tensor>,
}

impl Linear {
    pub(super) fn new(w: Weight, b: Option<Tensor>) -> Self {
        Self { w, b }
    }

    fn candle(w: QMatMul, b: Option<Tensor>) -> Self {
        Self {
            w: Weight::Candle(w),
            b,
        }
    }

    /// How the weight is multiplied.
    pub fn math(&self) -> WeightMath {
        match &self.w {
            Weight::Candle(QMatMul::QTensor(_)) => WeightMath::Quantized,
            Weight::Candle(_) => WeightMath::Dense,
            Weight::Blocks(_) => WeightMath::Blocks,
        }
    }

    /// The weight `[out, in]` where it is a dense tensor (not GGUF blocks).
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match &self.w {
            Weight::Candle(QMatMul::Tensor(w)) => Some(w),
            _ => None,
        }
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.b.as_ref()
    }

    /// The projections `parts` stacked along their outputs (`[Σ out, in]`, outputs in `parts`'
    /// order), so one matmul launch computes them all; `None` where they cannot be stacked
    /// (mixed GGUF types or input widths, some with a bias and some without). GGUF weights
    /// stack as their raw blocks: each output row is a whole run of blocks, so the stacked
    /// rows are the parts' rows, bit for bit (and each output element is computed alone, so
    /// the outputs are the parts' outputs).
    pub fn stacked(parts: &[&Linear]) -> Result<Option<Linear>> {
        let biases: Vec<&Tensor> = parts.iter().filter_map(|l| l.b.as_ref()).collect();
        if parts.is_empty() || !(biases.is_empty() || biases.len() == parts.len()) {
            return Ok(None);
        }
        let b = match biases.is_empty() {
            true => None,
            false => Some(Tensor::cat(&biases, 0)?),
        };
        let blocks: Vec<&QMatrix> = parts
            .iter()
            .filter_map(|l| match &l.w {
                Weight::Blocks(m) => Some(m.as_ref()),
                _ => None,
            })
            .collect();
        if blocks.len() == parts.len() {
            return Ok(QMatrix::stack(&blocks).map(|m| Linear {
                w: Weight::Blocks(Arc::new(m)),
                b,
            }));
        }
        let qs: Vec<&QTensor> = parts
            .iter()
            .filter_map(|l| match &l.w {
                Weight::Candle(QMatMul::QTensor(q)) => Some(q.as_ref()),
                _ => None,
            })
            .collect();
        if let (true, Some(first)) = (qs.len() == parts.len(), qs.first()) {
            let (dtype, dims) = (first.dtype(), first.shape().dims2()?);
            let mut rows = 0;
            let mut data = Vec::new();
            for q in &qs {
                let (r, c) = q.shape().dims2()?;
                if q.dtype() != dtype || c != dims.1 {
                    return Ok(None);
                }
                rows += r;
                data.extend_from_slice(&q.data()?);
            }
            let dev = first.device();
            let storage = QStorage::from_data(std::borrow::Cow::Owned(data), &dev, dtype)?;
            let q = QTensor::new(storage, (rows, dims.1))?;
            return Ok(Some(Linear::candle(QMatMul::from_qtensor(q)?, b)));
        }
        let ws: Vec<&Tensor> = parts
            .iter()
            .filter_map(|l| match &l.w {
                Weight::Candle(QMatMul::Tensor(w)) => Some(w),
                _ => None,
            })
            .collect();
        let width = ws.first().and_then(|w| w.dim(1).ok());
        if ws.len() == parts.len() && ws.iter().all(|w| w.dim(1).ok() == width) {
            return Ok(Some(Linear::candle(
                QMatMul::Tensor(Tensor::cat(&ws, 0)?),
                b,
            )));
        }
        Ok(None)
    }

    /// `x`: [T, in] → [T, out]. Dense weights on the CPU (f32, f16, bf16) go through
    /// [`row_matmul`](crate::ops::row_matmul), GGUF blocks through [`crate::ops::gguf`] (same
    /// summation order), so each output row depends only on its own input row, however many rows
    /// share the call (batch invariance; it is also faster than candle's gemm at these shapes).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            Weight::Blocks(m) => m.matmul_t(x)?,
            Weight::Candle(QMatMul::Tensor(w)) if row_matmul::supports(x, w) => {
                row_matmul::matmul_t(x, w)?
            }
            Weight::Candle(w) => w.forward(x)?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// The token-embedding table.
#[derive(Debug, Clone)]
pub enum Embedding {
    Dense(Tensor),
    /// GGUF blocks (CPU), looked-up rows widened to f32 then cast to this dtype.
    Blocks(Arc<QMatrix>, DType),
}

impl Embedding {
    /// Rows `ids` (`[T]` u32) → `[T, hidden]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Dense(t) => t.index_select(ids, 0)?,
            Embedding::Blocks(m, dtype) => {
                let ids: Vec<u32> = ids.to_vec1()?;
                m.rows(&ids)?.to_dtype(*dtype)?
            }
        })
    }
}
