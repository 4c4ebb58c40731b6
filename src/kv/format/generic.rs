//! Quantize / dequantize as a composition of plain candle tensor ops, so they run on any backend
//! (Metal uses them) and serve as the reference the fused kernels are tested against.
//!
//! Bit-exactness needs care where candle's ops differ from the format's arithmetic:
//! - `Tensor / f64` multiplies by the reciprocal, so divisions use tensor ÷ tensor;
//! - `round` rounds half away from zero, so half-to-even rounding is built from `(v + 1.5·2^23) −
//!   1.5·2^23` (exact for |v| < 2^22; larger magnitudes are already integers and pass through);
//! - packing uses the bit stream itself: codes are split into bits with integer division, the
//!   stream is cut into 32-bit rows, and each word is the sum of `bit_j · 2^j` (no bits overlap,
//!   so the sum never exceeds u32).

use super::quantized::{check_input, check_quantized, with_last, Quantized};
use super::QuantFormat;
use candle_core::{DType, Device, Result, Tensor, D};

const ROUND_MAGIC: f64 = 12_582_912.0;
const ROUND_LIMIT: f64 = 4_194_304.0;

/// A scalar f32 tensor broadcast to `like`'s shape (for exact tensor-tensor arithmetic).
fn full_like(v: f64, like: &Tensor) -> Result<Tensor> {
    Tensor::new(v as f32, like.device())?.broadcast_as(like.shape())
}

/// Round half to even, elementwise, for any f32 tensor.
fn round_half_even(v: &Tensor) -> Result<Tensor> {
    let magic = full_like(ROUND_MAGIC, v)?;
    let r = ((v + &magic)? - &magic)?;
    let small = v.abs()?.lt(&full_like(ROUND_LIMIT, v)?)?;
    small.where_cond(&r, v)
}

/// Powers of two `[2^0, .., 2^(k-1)]` as u32.
fn powers(k: u32, device: &Device) -> Result<Tensor> {
    Tensor::from_vec(
        (0..k).map(|j| 1u32 << j).collect::<Vec<_>>(),
        k as usize,
        device,
    )
}

/// Splits u32 values `[.., m]` into their low `k` bits `[.., m, k]` (LSB first), each 0 or 1.
fn to_bits(v: &Tensor, k: u32) -> Result<Tensor> {
    let p = powers(k, v.device())?;
    let q = v.unsqueeze(D::Minus1)?.broadcast_div(&p)?;
    let two = Tensor::new(2u32, v.device())?.broadcast_as(q.shape())?;
    q.clone() - ((q / &two)? * &two)?
}

/// Joins bits `[.., m, k]` (LSB first) into u32 values `[.., m]`.
fn from_bits(bits: &Tensor, k: u32) -> Result<Tensor> {
    bits.broadcast_mul(&powers(k, bits.device())?)?
        .sum(D::Minus1)
}

/// Quantizes `x [..., D]` with candle ops only; same results as the fused kernels.
pub fn quantize(x: &Tensor, fmt: QuantFormat) -> Result<Quantized> {
    quantize_as(x, fmt, x.dtype())
}

/// [`quantize`] with the parameters stored as `dtype` (`super::ops::quantize_as`): computed
/// from `x`'s values in f32; rows wider than `dtype` get their codes from the rounded parameters.
pub fn quantize_as(x: &Tensor, fmt: QuantFormat, dtype: DType) -> Result<Quantized> {
    let (rows, d) = check_input(x, fmt, "quantize")?;
    let (g, b) = (fmt.group_size(), fmt.bits());
    let groups = fmt.groups_per_row(d);
    let xf = x.to_dtype(DType::F32)?.reshape((rows, groups, g))?;
    let wmax = xf.max_keepdim(2)?;
    let wmin = xf.min_keepdim(2)?;
    let n = full_like(fmt.max_code() as f64, &wmax)?;
    let side = wmin.abs()?.gt(&wmax.abs()?)?;
    let scale = (&wmax - &wmin)?
        .div(&n)?
        .maximum(&full_like(1e-7, &wmax)?)?;
    let scale = side.where_cond(&scale, &scale.neg()?)?;
    let edge = side.where_cond(&wmin, &wmax)?;
    let q0 = round_half_even(&edge.div(&scale)?)?;
    let zero = wmax.zeros_like()?;
    let nonzero = q0.ne(&zero)?;
    // Where q0 == 0 the division below is by zero; those lanes are discarded by where_cond.
    let scale = nonzero.where_cond(&edge.div(&q0)?, &scale)?;
    let bias = nonzero.where_cond(&edge, &zero)?;
    // Rows wider than the parameters (f32 into f16 / bf16): codes from the rounded parameters.
    let (scale, bias) = if x.dtype().size_in_bytes() > dtype.size_in_bytes() {
        let round = |t: &Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
        (round(&scale)?, round(&bias)?)
    } else {
        (scale, bias)
    };

    let v = xf.broadcast_sub(&bias)?.broadcast_div(&scale)?;
    let v = v
        .maximum(&v.zeros_like()?)?
        .minimum(&n.broadcast_as(v.shape())?)?;
    let codes = round_half_even(&v)?
        .to_dtype(DType::U32)?
        .reshape((rows, d))?;
    let stream = to_bits(&codes, b)?.reshape((rows, fmt.words_per_row(d), 32))?;
    let words = from_bits(&stream, 32)?;

    let out_shape = |n: usize| with_last(x, n);
    Ok(Quantized {
        codes: words.reshape(out_shape(fmt.words_per_row(d)))?,
        scales: scale.to_dtype(dtype)?.reshape(out_shape(groups))?,
        biases: bias.to_dtype(dtype)?.reshape(out_shape(groups))?,
    })
}

/// Dequantizes with candle ops only, in the scales' dtype (half types round after the product
/// and after the sum, like the fused kernels).
pub fn dequantize(q: &Quantized, fmt: QuantFormat) -> Result<Tensor> {
    dequantize_as(q, fmt, q.scales.dtype())
}

/// Dequantizes into `dtype` (`super::ops::dequantize_as`): in the scales' dtype when `dtype` is
/// that, else in f32 with the parameters widened, then cast.
pub fn dequantize_as(q: &Quantized, fmt: QuantFormat, want: DType) -> Result<Tensor> {
    let (rows, d) = check_quantized(q, fmt, "dequantize")?;
    let dtype = if want == q.scales.dtype() {
        want
    } else {
        DType::F32
    };
    let (g, b) = (fmt.group_size(), fmt.bits());
    let groups = fmt.groups_per_row(d);
    let words = q.codes.reshape((rows, fmt.words_per_row(d)))?;
    let stream = to_bits(&words, 32)?.reshape((rows, d, b as usize))?;
    let codes = from_bits(&stream, b)?;
    let codes = codes.to_dtype(dtype)?.reshape((rows, groups, g))?;
    let scales = q.scales.to_dtype(dtype)?.reshape((rows, groups, 1))?;
    let biases = q.biases.to_dtype(dtype)?.reshape((rows, groups, 1))?;
    let out = codes.broadcast_mul(&scales)?.broadcast_add(&biases)?;
    let mut shape = q.scales.dims().to_vec();
    let last = shape.len() - 1;
    shape[last] = d;
    out.reshape(shape)?.to_dtype(want)
}
