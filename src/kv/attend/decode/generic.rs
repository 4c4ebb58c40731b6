//! Decode attention with candle ops only: gather each sequence's visible slots, dequantize them
//! (only those rows) and run the dense [`attend_one`]. Used on backends without a fused kernel and
//! as the reference the fused kernels are tested against.

use candle_core::{DType, Result, Tensor};

use super::{check_shapes, read_tables, Dims, Tables};
use crate::kv::attend::dense::attend_one;
use crate::kv::format::LayerKv;

/// [`super::decode_attention`] computed the reference way, on any device (same arguments and
/// checks; tables, starts and lens are read back to the host).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &Tensor,
    kv: &LayerKv,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
) -> Result<Tensor> {
    let dims = check_shapes(q, kv, block_tables, starts, lens, block_size, num_kv_heads)?;
    if dims.batch == 0 {
        return q.zeros_like();
    }
    let t = read_tables(&dims, block_tables, starts, lens, None, false)?;
    decode_checked(q, kv, &dims, &t, scale)
}

pub(super) fn decode_checked(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
) -> Result<Tensor> {
    let dev = q.device();
    let mut outs = Vec::with_capacity(dims.batch);
    for b in 0..dims.batch {
        let (s, l) = (t.starts[b] as usize, t.lens[b] as usize);
        let row = &t.tables[b * dims.max_blocks..];
        let slots: Vec<u32> = (s..l)
            .map(|p| {
                row[p / dims.block_size] * dims.block_size as u32 + (p % dims.block_size) as u32
            })
            .collect();
        let slots = Tensor::from_vec(slots, l - s, dev)?;
        let (k, v) = kv.gather(&slots, DType::F32)?;
        let shape = (l - s, dims.kv_heads, dims.head_dim);
        let qb = q.narrow(0, b, 1)?.to_dtype(DType::F32)?;
        outs.push(attend_one(
            &qb,
            &k.reshape(shape)?,
            &v.reshape(shape)?,
            l - 1,
            s,
            None,
            scale as f64,
        )?);
    }
    Tensor::cat(&outs, 0)?.to_dtype(q.dtype())
}
