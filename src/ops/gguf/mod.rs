//! GGUF weights multiplied at their stored size on the CPU.
//!
//! A decode step reads every weight once; kept in their GGUF blocks (Q4_1: 5 bits a weight)
//! they cost a sixth of the bytes of dense f32 copies, and the memory those copies took. Each
//! matrix is split once at load into its block headers and codes ([`packed`]: the same bytes,
//! rearranged). The kernels ([`kernel`]) widen each block in registers to the f32 values
//! dequantization gives ([`blocks`]) and sum in the order of the dense row-invariant matmul, so
//! the result is the
//! dense f32 product of the dequantized weights (bit for bit on one ISA), and every row of the
//! output depends only on its own row of activations (batch invariance). The ISA (AVX-512,
//! AVX2, portable) is chosen once per process, as for the dense matmul.

mod blocks;
mod codes;
mod kernel;
mod packed;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};

use crate::simd::Isa;
use crate::simd::Portable;
use blocks::Block;
use packed::Packed;

/// The GGUF block types with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockType {
    /// Every supported type.
    pub const ALL: [BlockType; 8] = [
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q5_1,
        BlockType::Q8_0,
        BlockType::Q4K,
        BlockType::Q5K,
        BlockType::Q6K,
    ];

    /// The kernel type of a GGUF tensor type, if there is one.
    pub fn of(t: GgmlDType) -> Option<BlockType> {
        Some(match t {
            GgmlDType::Q4_0 => BlockType::Q4_0,
            GgmlDType::Q4_1 => BlockType::Q4_1,
            GgmlDType::Q5_0 => BlockType::Q5_0,
            GgmlDType::Q5_1 => BlockType::Q5_1,
            GgmlDType::Q8_0 => BlockType::Q8_0,
            GgmlDType::Q4K => BlockType::Q4K,
            GgmlDType::Q5K => BlockType::Q5K,
            GgmlDType::Q6K => BlockType::Q6K,
            _ => return None,
        })
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            BlockType::Q4_0 => GgmlDType::Q4_0,
            BlockType::Q4_1 => GgmlDType::Q4_1,
            BlockType::Q5_0 => GgmlDType::Q5_0,
            BlockType::Q5_1 => GgmlDType::Q5_1,
            BlockType::Q8_0 => GgmlDType::Q8_0,
            BlockType::Q4K => GgmlDType::Q4K,
            BlockType::Q5K => GgmlDType::Q5K,
            BlockType::Q6K => GgmlDType::Q6K,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        self.ggml().block_size()
    }
}

/// Runs `$body` with `$B` bound to the block type of `$ty`.
macro_rules! with_block {
    ($ty:expr, $B:ident => $body:expr) => {
        match $ty {
            BlockType::Q4_0 => {
                type $B = blocks::Q4_0;
                $body
            }
            BlockType::Q4_1 => {
                type $B = blocks::Q4_1;
                $body
            }
            BlockType::Q5_0 => {
                type $B = blocks::Q5_0;
                $body
            }
            BlockType::Q5_1 => {
                type $B = blocks::Q5_1;
                $body
            }
            BlockType::Q8_0 => {
                type $B = blocks::Q8_0;
                $body
            }
            BlockType::Q4K => {
                type $B = blocks::Q4K;
                $body
            }
            BlockType::Q5K => {
                type $B = blocks::Q5K;
                $body
            }
            BlockType::Q6K => {
                type $B = blocks::Q6K;
                $body
            }
        }
    };
}

/// `y = x·Wᵀ` on slices: `x` `[m, k]` f32, `w` the `n` rows of `[n, k]` blocks of `ty`, `y`
/// `[m, n]`, with the vector implementation `isa`.
fn matmul_slices(
    ty: BlockType,
    x: &[f32],
    w: &Packed,
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    isa: Isa,
) {
    with_block!(ty, B => kernel::run::<B>(x, w, m, n, k, y, isa))
}

/// A `[n, k]` CPU weight matrix kept in its GGUF blocks (headers and codes apart: [`packed`]).
#[derive(Debug, Clone)]
pub struct QMatrix {
    w: Packed,
    ty: BlockType,
    n: usize,
    k: usize,
}

impl QMatrix {
    /// Whether a tensor of this type and shape can be kept in blocks: a supported type, rank 2,
    /// on the CPU (rows are whole blocks by GGUF's rules).
    pub fn supports(q: &QTensor) -> bool {
        BlockType::of(q.dtype()).is_some() && q.shape().rank() == 2 && q.device().is_cpu()
    }

    /// Splits a CPU tensor of a supported type (see [`QMatrix::supports`]); the tensor can be
    /// dropped after.
    pub fn new(q: &QTensor) -> Result<Self> {
        let Some(ty) = BlockType::of(q.dtype()) else {
            candle_core::bail!("no CPU block kernel for GGUF type {:?}", q.dtype());
        };
        if !q.device().is_cpu() {
            candle_core::bail!("GGUF block kernels run on the CPU only");
        }
        let (n, k) = q.shape().dims2()?;
        if !k.is_multiple_of(ty.block_elems()) {
            candle_core::bail!(
                "rows of {k} values are not whole {:?} blocks of {}",
                ty,
                ty.block_elems()
            );
        }
        let data = q.data()?;
        let nb = k / ty.block_elems();
        let w = with_block!(ty, B => Packed::split::<B>(&data, n, nb));
        Ok(Self { w, ty, n, k })
    }

    /// The matrices `parts` stacked along their rows (`[Σ n, k]`, rows in `parts`' order), so
    /// one call multiplies them all; `None` unless they share the block type and `k`. Rows are
    /// the parts' rows byte for byte, so each output is what the part alone gives.
    pub fn stack(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.ty != first.ty || p.k != first.k) {
            return None;
        }
        let w = Packed::stack(&parts.iter().map(|p| &p.w).collect::<Vec<_>>());
        Some(Self {
            w,
            ty: first.ty,
            n: parts.iter().map(|p| p.n).sum(),
            k: first.k,
        })
    }

    pub fn block_type(&self) -> BlockType {
        self.ty
    }

    /// `(n, k)`: output rows, inputs per row.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes of the blocks (the GGUF tensor's size).
    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }

    /// `x·Wᵀ`: `x` `[.., k]` (CPU, f32 / f16 / bf16) → `[.., n]` in `x`'s dtype. Activations
    /// are widened to f32, the product is summed in f32 and rounded once to `x`'s dtype; row i
    /// of the result depends only on row i of `x`.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        if !x.device().is_cpu()
            || x.rank() == 0
            || x.dims().last() != Some(&self.k)
            || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        {
            candle_core::bail!(
                "GGUF block matmul: needs a CPU float x [.., {}], got {:?} {:?}",
                self.k,
                x.dims(),
                x.dtype()
            );
        }
        let lead = &x.dims()[..x.rank() - 1];
        let m: usize = lead.iter().product();
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let mut y = vec![0f32; m * self.n];
        {
            let (xs, xl) = x.storage_and_layout();
            let xs = crate::ops::row_matmul::cpu_slice::<f32>(&xs, xl)?;
            matmul_slices(
                self.ty,
                xs,
                &self.w,
                (m, self.n, self.k),
                &mut y,
                Isa::widest(),
            );
        }
        let mut dims = lead.to_vec();
        dims.push(self.n);
        Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(dtype)
    }

    /// Rows `ids` of the matrix, dequantized (the values dequantizing the tensor gives):
    /// `[ids.len(), k]` f32. An embedding lookup that keeps the table in its blocks.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let mut out = vec![0f32; ids.len() * self.k];
        for (dst, &id) in out.chunks_exact_mut(self.k.max(1)).zip(ids) {
            let id = id as usize;
            if id >= self.n {
                candle_core::bail!("row {id} is out of range for a matrix of {} rows", self.n);
            }
            with_block!(self.ty, B => dequantize_row::<B>(&self.w, id, dst));
        }
        Tensor::from_vec(out, (ids.len(), self.k), &Device::Cpu)
    }
}

/// Row `r` of `w` to f32, with the portable decoders (the same values every ISA widens).
fn dequantize_row<B: Block>(w: &Packed, r: usize, out: &mut [f32]) {
    use crate::simd::Simd;
    let nb = out.len() / B::ELEMS;
    let heads = &w.heads()[r * nb * B::HEAD..][..nb * B::HEAD];
    let codes = &w.codes()[r * nb * B::CODES..][..nb * B::CODES];
    let mut params = vec![0f32; B::PARAMS];
    let per_group = if B::BIAS { 2 } else { 1 };
    for (b, dst) in out.chunks_exact_mut(B::ELEMS).enumerate() {
        B::params(&heads[b * B::HEAD..][..B::HEAD], &mut params);
        let q = codes[b * B::CODES..].as_ptr();
        for g in 0..B::GROUPS {
            let sc = params[g * per_group];
            let bi = if B::BIAS {
                params[g * per_group + 1]
            } else {
                0.0
            };
            // SAFETY: `q` starts a whole block of codes; the portable ops need no features.
            unsafe {
                let (sc, bi) = (Portable::splat(sc), Portable::splat(bi));
                for e0 in (0..B::GROUP).step_by(Portable::LANES) {
                    let v = blocks::widen::<Portable, B>(q, g, e0, sc, bi);
                    Portable::store(dst[g * B::GROUP + e0..].as_mut_ptr(), v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
