//! KV formats: what one token's K and V rows look like in a layer's blocks, and every
//! operation that depends on it (docs/ARCHITECTURE.md, "Adding a KV format").
//!
//! - [`KvFormat`]: the per-layer format (dense, or affine groups with optional rotation) and its
//!   byte counts; the only enum the rest of kvq matches on is this one, and those matches live
//!   in this folder;
//! - [`affine`]: the MLX-exact affine group format (docs/ARCHITECTURE.md), [`pack`] its bit streams;
//! - [`ops`]: quantize / dequantize as candle ops with `cpu`, `cuda` and [`generic`] backends;
//! - [`rotation`]: the randomized Hadamard rotation of the rotated scheme;
//! - [`storage`]: one layer's slots in a format ([`LayerKv`]) and rows copied out of it
//!   ([`LayerRows`]); `side`: what a captured decode step writes in the same launch
//!   ([`SideWrites`]);
//! - [`tag`]: the names formats have in prompt-cache files and messages.

pub mod affine;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod fit;
pub mod generic;
pub mod ops;
mod pack;
mod quantized;
pub mod rotation;
pub(crate) mod scatter;
mod side;
pub mod storage;
pub mod tag;
mod widths;

pub use affine::{QuantError, QuantFormat};
pub use fit::Fit;
pub use ops::{
    dequantize, dequantize_as, fused_rotation, quantize, quantize_as, quantize_fitted,
    quantize_into, quantize_into_rows, quantize_rotated_into_rows, quantize_rows_into, Quantized,
    SlotRows,
};
pub use side::{DenseCopies, SideWrites};
pub use storage::{LayerKv, LayerRows};
pub use widths::KvWidths;

use candle_core::DType;

/// The dtype of the affine scales and biases of a cache computing in `dtype`: f16 for f32, so
/// a g64 value costs `bits + 0.5` bits as llama.cpp's q4_0 does rather than `bits + 1` (the
/// parameters are still computed in f32 and only stored rounded; the kernels widen them back),
/// and the compute dtype itself for f16 / bf16 — MLX's format, which keeps the parameters in
/// the model's dtype (docs/ARCHITECTURE.md, "Decisions").
pub fn scale_dtype_for(dtype: DType) -> DType {
    match dtype {
        DType::F32 => DType::F16,
        other => other,
    }
}

/// The element format of a layer's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// Plain values of this dtype.
    Dense(DType),
    /// Affine group quantization, K and V each in their own format (keys are the sensitive
    /// half: softmax turns key error into weight error); scales and biases in `scale_dtype`.
    /// `rotated`: head vectors are stored rotated by the cache's randomized Hadamard transform
    /// (see `kv::format::rotation`).
    Affine {
        key: QuantFormat,
        value: QuantFormat,
        scale_dtype: DType,
        rotated: bool,
    },
}

impl KvFormat {
    pub fn is_rotated(&self) -> bool {
        matches!(self, KvFormat::Affine { rotated: true, .. })
    }

    /// Bytes of one token's K row plus its V row (`width` values each: all KV heads).
    pub fn kv_row_bytes(&self, width: usize) -> usize {
        match self {
            KvFormat::Dense(dt) => 2 * width * dt.size_in_bytes(),
            KvFormat::Affine {
                key,
                value,
                scale_dtype,
                ..
            } => key.bytes_per_row(width, *scale_dtype) + value.bytes_per_row(width, *scale_dtype),
        }
    }

    /// Checks that a head of `head_dim` values splits into this format's groups.
    pub fn check_dim(&self, head_dim: usize) -> Result<(), QuantError> {
        match self {
            KvFormat::Dense(_) => Ok(()),
            KvFormat::Affine { key, value, .. } => {
                key.check_dim(head_dim)?;
                value.check_dim(head_dim)
            }
        }
    }

    /// The float dtype the format stores: dense values, or affine scales and biases (which
    /// may be narrower than the compute dtype: [`scale_dtype_for`]).
    pub fn value_dtype(&self) -> DType {
        match self {
            KvFormat::Dense(dt) => *dt,
            KvFormat::Affine { scale_dtype, .. } => *scale_dtype,
        }
    }

    /// This format with its affine scales and biases in `dtype` (a dense format unchanged).
    pub fn with_scale_dtype(self, dtype: DType) -> Self {
        match self {
            KvFormat::Affine {
                key,
                value,
                rotated,
                ..
            } => KvFormat::Affine {
                key,
                value,
                scale_dtype: dtype,
                rotated,
            },
            dense => dense,
        }
    }

    /// One format for K and V.
    pub fn affine(fmt: QuantFormat, scale_dtype: DType, rotated: bool) -> Self {
        KvFormat::Affine {
            key: fmt,
            value: fmt,
            scale_dtype,
            rotated,
        }
    }
}
