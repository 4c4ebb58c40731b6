//! CPU forms of two decoder compositions (f32): RoPE on q and k straight from the rows of a
//! stacked q|k|v projection, and SwiGLU from a stacked gate|up projection.
//!
//! Why: a decode step of a small model on the CPU is ~600 candle ops of a few hundred values
//! each, and each costs an allocation, a dispatch and a pass over memory. From a stacked q|k|v
//! projection candle needs three narrow copies, two reshapes, two unsqueeze/contiguous copies and
//! two rotations; here it is one pass. The arithmetic is candle's, operation for operation
//! (`rope_thd`: `x1·cos − x2·sin`, `x1·sin + x2·cos`; `silu(g)·u` with `silu(x) = x / (1 +
//! e^(−x))`), so results are bit-identical to the compositions they replace.

use candle_core::{DType, Device, Result, Tensor};

use crate::ops::row_matmul::cpu_slice;

/// Whether [`rope_qkv`] and [`swiglu`] take tensors of this device and dtype.
pub fn applies(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// From the rows of a stacked q|k|v projection `qkv` `[T, (H + 2·KVH)·D]`: q `[T, H, D]` and k
/// `[T, KVH·D]` rotated by RoPE (rotate-half layout) with this token's `cos`, `sin` rows
/// `[T, D/2]`, and v `[T, KVH·D]`.
pub fn rope_qkv(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let (t, width) = qkv.dims2()?;
    let half = head_dim / 2;
    if width != (heads + 2 * kv_heads) * head_dim
        || cos.dims() != [t, half]
        || sin.dims() != cos.dims()
    {
        candle_core::bail!(
            "rope_qkv: qkv {:?}, cos {:?} for {heads}+2·{kv_heads} heads of {head_dim}",
            qkv.dims(),
            cos.dims()
        );
    }
    let (qkv, cos, sin) = (qkv.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let (qs, ql) = qkv.storage_and_layout();
    let (cs, cl) = cos.storage_and_layout();
    let (ss, sl) = sin.storage_and_layout();
    let (x, c, s) = (
        cpu_slice::<f32>(&qs, ql)?,
        cpu_slice::<f32>(&cs, cl)?,
        cpu_slice::<f32>(&ss, sl)?,
    );
    let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
    let mut q = vec![0f32; t * qw];
    let mut k = vec![0f32; t * kw];
    let mut v = vec![0f32; t * kw];
    for i in 0..t {
        let row = &x[i * width..][..width];
        let (c, s) = (&c[i * half..][..half], &s[i * half..][..half]);
        let rotate = |src: &[f32], dst: &mut [f32]| {
            for (src, dst) in src
                .chunks_exact(head_dim)
                .zip(dst.chunks_exact_mut(head_dim))
            {
                let (x1, x2) = src.split_at(half);
                let (d1, d2) = dst.split_at_mut(half);
                for j in 0..half {
                    d1[j] = x1[j] * c[j] - x2[j] * s[j];
                    d2[j] = x1[j] * s[j] + x2[j] * c[j];
                }
            }
        };
        rotate(&row[..qw], &mut q[i * qw..][..qw]);
        rotate(&row[qw..qw + kw], &mut k[i * kw..][..kw]);
        v[i * kw..][..kw].copy_from_slice(&row[qw + kw..]);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(q, (t, heads, head_dim), &dev)?,
        Tensor::from_vec(k, (t, kw), &dev)?,
        Tensor::from_vec(v, (t, kw), &dev)?,
    ))
}

/// SwiGLU from a stacked gate|up projection `gu` `[T, 2F]`: `silu(gate)·up`, `[T, F]`.
pub fn swiglu(gu: &Tensor, ff: usize) -> Result<Tensor> {
    let (t, width) = gu.dims2()?;
    if width != 2 * ff {
        candle_core::bail!("swiglu: gate|up rows of {width}, expected 2·{ff}");
    }
    let gu = gu.contiguous()?;
    let (gs, gl) = gu.storage_and_layout();
    let x = cpu_slice::<f32>(&gs, gl)?;
    let mut out = vec![0f32; t * ff];
    for (o, row) in out.chunks_exact_mut(ff).zip(x.chunks_exact(width)) {
        let (g, u) = row.split_at(ff);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    Tensor::from_vec(out, (t, ff), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn equal_the_candle_compositions_bit_for_bit() {
        let dev = Device::Cpu;
        let (t, h, kvh, d) = (3, 3, 1, 8);
        let w = (h + 2 * kvh) * d;
        let qkv = Tensor::randn(0f32, 1.0, (t, w), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (t, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (t, d / 2), &dev).unwrap();
        let (q, k, v) = rope_qkv(&qkv, &cos, &sin, (h, kvh, d)).unwrap();
        let rope = |x: Tensor, n: usize| {
            let x = x.reshape((t, n, d)).unwrap().unsqueeze(0).unwrap();
            candle_nn::rotary_emb::rope_thd(&x.contiguous().unwrap(), &cos, &sin)
                .unwrap()
                .squeeze(0)
                .unwrap()
        };
        let part = |a, n| qkv.narrow(1, a, n).unwrap().contiguous().unwrap();
        assert_eq!(bits(&q), bits(&rope(part(0, h * d), h)));
        assert_eq!(bits(&k), bits(&rope(part(h * d, kvh * d), kvh)));
        assert_eq!(bits(&v), bits(&part((h + kvh) * d, kvh * d)));
        assert_eq!(q.dims(), [t, h, d]);

        let gu = Tensor::randn(0f32, 2.0, (t, 2 * 5), &dev).unwrap();
        let want = (candle_nn::ops::silu(&gu.narrow(1, 0, 5).unwrap()).unwrap()
            * gu.narrow(1, 5, 5).unwrap())
        .unwrap();
        assert_eq!(bits(&swiglu(&gu, 5).unwrap()), bits(&want));
        assert!(swiglu(&gu, 4).is_err());
        assert!(rope_qkv(&qkv, &cos, &sin, (h, kvh + 1, d)).is_err());
    }
}
