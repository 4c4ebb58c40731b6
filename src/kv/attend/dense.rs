//! Dense attention with an explicit causal / window mask: how prompt chunks attend over their
//! gathered keys, and the reference every fused decode kernel is tested against.

use candle_core::{DType, Result, Tensor};

/// Causal attention of `q` (`[n, H, D]`, positions `start..start+n`) over `k`, `v`
/// (`[L, KVH, D]`, positions `kstart..start + n`); with a `window` W a query at p sees only
/// positions > p − W.
pub fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    kstart: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor> {
    let mask = chunk_mask(q.dim(0)?, k.dim(0)?, start, kstart, window, q.device())?;
    attend_masked(q, k, v, mask.as_ref(), scale, None)
}

/// The additive mask `attend_one` needs for `n` queries over `l` keys, if any (one query with
/// no window that cuts its keys sees them all): 0 where query `i` (position `start + i`) may see
/// key `j` (position `kstart + j`), else -inf. Built on `dev` from two position vectors: a long
/// prefill chunk's `[n, L]` mask would otherwise be filled on the host and copied over for every
/// layer.
pub(super) fn chunk_mask(
    n: usize,
    l: usize,
    start: usize,
    kstart: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if n <= 1 && window.is_none_or(|w| l <= w) {
        return Ok(None);
    }
    // Positions as f32 are exact far beyond any context window (2^24).
    let qpos = Tensor::arange(start as u32, (start + n) as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let kpos = Tensor::arange(kstart as u32, (kstart + l) as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((1, l))?;
    let mut visible = kpos.broadcast_le(&qpos)?; // u8 [n, L]
    if let Some(w) = window {
        // p - kp < w  <=>  kp > p - w
        let lo = (&qpos - w as f64)?;
        visible = (visible * kpos.broadcast_gt(&lo)?)?;
    }
    let zeros = Tensor::zeros((n, l), DType::F32, dev)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (n, l), dev)?;
    visible.where_cond(&zeros, &blocked).map(Some)
}

/// [`attend_one`] with its mask (`[n, L]`, or none) given, scores soft-capped by `softcap`.
pub(super) fn attend_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let (n, h, d) = q.dims3()?;
    let (l, kvh, _) = k.dims3()?;
    let g = h / kvh;
    let dtype = q.dtype();
    // [n, H, D] -> [KVH, G*n, D]: query heads of one KV head become rows of one matmul.
    let qg = q
        .reshape((n, kvh, g, d))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, g * n, d))?;
    let kt = k.transpose(0, 1)?.contiguous()?; // [KVH, L, D]
    let vt = v.transpose(0, 1)?.contiguous()?;
    let scores = qg
        .matmul(&kt.t()?)?
        .to_dtype(DType::F32)?
        .affine(scale, 0.0)?; // [KVH, G*n, L]
    let scores = match softcap {
        Some(c) => ((scores / c as f64)?.tanh()? * c as f64)?,
        None => scores,
    };
    let scores = match mask {
        Some(mask) => scores
            .reshape((kvh, g, n, l))?
            .broadcast_add(mask)?
            .reshape((kvh, g * n, l))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
    probs
        .matmul(&vt)? // [KVH, G*n, D]
        .reshape((kvh, g, n, d))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((n, h, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Straightforward per-head attention with explicit loops, the reference for `attend_one`.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        h: usize,
        kvh: usize,
        d: usize,
        start: usize,
    ) -> Vec<f32> {
        let l = start + n;
        let g = h / kvh;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; n * h * d];
        for i in 0..n {
            for hh in 0..h {
                let kh = hh / g;
                let qv = &q[(i * h + hh) * d..(i * h + hh + 1) * d];
                let vis = start + i + 1;
                let s: Vec<f32> = (0..vis)
                    .map(|j| {
                        let kv = &k[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
                        qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in 0..d {
                        out[(i * h + hh) * d + c] += ej / z * v[(j * kvh + kh) * d + c];
                    }
                }
            }
            let _ = l;
        }
        out
    }

    #[test]
    fn matches_naive_attention_gqa_and_offsets() {
        let dev = Device::Cpu;
        for &(n, h, kvh, start) in &[(1, 6, 2, 9), (5, 6, 3, 0), (4, 8, 1, 3), (3, 4, 4, 2)] {
            let d = 8;
            let l = start + n;
            let q = Tensor::randn(0f32, 1.0, (n, h, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (l, kvh, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (l, kvh, d), &dev).unwrap();
            let got = attend_one(&q, &k, &v, start, 0, None, 1.0 / (d as f64).sqrt()).unwrap();
            let want = naive(
                &q.flatten_all().unwrap().to_vec1().unwrap(),
                &k.flatten_all().unwrap().to_vec1().unwrap(),
                &v.flatten_all().unwrap().to_vec1().unwrap(),
                n,
                h,
                kvh,
                d,
                start,
            );
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err < 1e-5,
                "n={n} h={h} kvh={kvh} start={start}: max err {err}"
            );
        }
    }
}
