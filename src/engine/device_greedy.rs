//! Greedy picks made where the logits are: on a GPU a decode step then sends back one token id
//! per sequence instead of a whole vocabulary row (64 sequences × 49,152 f32 = 12.6 MB a step on
//! the default model), and no host loop scans those rows.
//!
//! The pick is the sampler's greedy rule exactly: the largest logit, the lowest id among equal
//! ones (reduced on the device as max, then the smallest id holding it), and a row with a NaN
//! gets no pick (the host sampler's error for that row alone).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

use super::sampler::SamplingParams;

/// Whether a request's next token is the plain argmax of its logits (no penalty, no draw).
pub fn is_plain_greedy(p: &SamplingParams) -> bool {
    p.temperature == 0.0 && (p.repeat_penalty == 1.0 || p.repeat_last_n == 0)
}

/// Per row of f32 logits `[rows, vocab]`: the index of its largest value, lowest index on ties;
/// `None` for a row holding a NaN. One small device→host read.
pub fn greedy_picks(logits: &Tensor) -> Result<Vec<Option<u32>>> {
    let (rows, vocab) = logits.dims2()?;
    if vocab == 0 {
        bail!("sampling from an empty logits row");
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let out = Tensor::zeros(2 * rows, DType::U32, logits.device())?;
        argmax_into(logits, &out)?;
        return Ok(picks_of(&out.to_vec1()?, vocab));
    }
    let dev = logits.device();
    let max = logits.max_keepdim(1)?;
    let hit = logits.broadcast_eq(&max)?;
    let ids = Tensor::arange(0u32, vocab as u32, dev)?
        .reshape((1, vocab))?
        .broadcast_as((rows, vocab))?;
    let none = Tensor::new(&[u32::MAX], dev)?
        .reshape((1, 1))?
        .broadcast_as((rows, vocab))?;
    let first = hit.where_cond(&ids, &none)?.min(1)?; // [rows]
    let nan = logits.ne(logits)?.to_dtype(DType::U32)?.max(1)?; // [rows], 1 where a NaN is
    Ok(picks_of(
        &Tensor::cat(&[&first, &nan], 0)?.to_vec1()?,
        vocab,
    ))
}

/// The picks in `both` (the id of every row, then each row's NaN flag): `None` for a row that
/// holds a NaN (or, defensively, whose id is outside the vocabulary).
pub fn picks_of(both: &[u32], vocab: usize) -> Vec<Option<u32>> {
    let (first, nan) = both.split_at(both.len() / 2);
    first
        .iter()
        .zip(nan)
        .map(|(&i, &n)| (n == 0 && (i as usize) < vocab).then_some(i))
        .collect()
}

/// The error of a row [`greedy_picks`] could not pick from (the sampler's, on the host).
pub fn nan_error() -> anyhow::Error {
    anyhow::anyhow!("the logits contain NaN (the model produced invalid numbers)")
}

/// [`greedy_ids`]' picks into `out` (u32 `[2 * rows]`: the ids, then 1 for each row holding a
/// NaN), by one kernel launch (kernels/sample.cu) that neither allocates nor reads back: it
/// can run inside a captured CUDA graph, whose output buffer `out` outlives it.
#[cfg(feature = "cuda")]
pub fn argmax_into(logits: &Tensor, out: &Tensor) -> candle_core::Result<()> {
    use crate::device::kernels::{kernel, Module};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::Storage;

    let msg = |m: &str| candle_core::Error::Msg(format!("argmax_into: {m}"));
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok(());
    }
    if out.dtype() != DType::U32 || out.elem_count() != 2 * rows || !out.is_contiguous() {
        return Err(msg(
            "the output must be a contiguous u32 tensor of 2 x rows",
        ));
    }
    let (xs, xl) = logits.storage_and_layout();
    let (os, ol) = out.storage_and_layout();
    let (Storage::Cuda(xc), Storage::Cuda(oc)) = (&*xs, &*os) else {
        return Err(msg("expected CUDA tensors"));
    };
    let (x0, x1) = xl.contiguous_offsets().ok_or_else(|| msg("layout"))?;
    let (o0, _) = ol.contiguous_offsets().ok_or_else(|| msg("layout"))?;
    let x = xc.as_cuda_slice::<f32>()?.slice(x0..x1);
    let ids = oc.as_cuda_slice::<u32>()?.slice(o0..o0 + rows);
    let flags = oc.as_cuda_slice::<u32>()?.slice(o0 + rows..o0 + 2 * rows);
    let f = kernel(&xc.device, Module::Sample, "argmax_rows_f32")?;
    let vocab = i32::try_from(vocab).map_err(|_| msg("vocabulary too large"))?;
    let rows = u32::try_from(rows).map_err(|_| msg("too many rows"))?;
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = f.pdl_builder();
    b.arg(&x).arg(&vocab).arg(&ids).arg(&flags);
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::Sampler;
    use candle_core::Device;

    /// Random rows with planted ties at the maximum: the same ids as the host sampler's greedy
    /// rule, row by row. An odd `vocab` starts rows off the kernel's 16-byte quads (its scalar
    /// head and tail).
    fn check_on(dev: &Device, vocab: usize) {
        let rows = 7;
        let mut data: Vec<f32> = Tensor::randn(0f32, 3.0, (rows, vocab), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Row 2: a tie between ids 1 and 900 above everything; row 4: all equal.
        data[2 * vocab + 1] = 100.0;
        data[2 * vocab + 900] = 100.0;
        for x in &mut data[4 * vocab..5 * vocab] {
            *x = 1.5;
        }
        let t = Tensor::from_vec(data.clone(), (rows, vocab), dev).unwrap();
        let got: Vec<u32> = greedy_picks(&t)
            .unwrap()
            .into_iter()
            .map(|p| p.expect("no NaN yet"))
            .collect();
        let want: Vec<u32> = data
            .chunks(vocab)
            .map(|r| {
                Sampler::new(SamplingParams::greedy())
                    .sample(r, &[])
                    .unwrap()
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!(got[2], 1);
        assert_eq!(got[4], 0);
        data[3 * vocab + 17] = f32::NAN;
        let t = Tensor::from_vec(data, (rows, vocab), dev).unwrap();
        let picks = greedy_picks(&t).unwrap();
        assert_eq!(picks[3], None, "the NaN row gets no pick");
        let others: Vec<u32> = picks
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != 3)
            .map(|(_, p)| p.unwrap())
            .collect();
        let want_others: Vec<u32> = want
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != 3)
            .map(|(_, &w)| w)
            .collect();
        assert_eq!(others, want_others, "the other rows keep their picks");
    }

    #[test]
    fn device_greedy_equals_the_sampler_cpu() {
        for vocab in [1000, 1003] {
            check_on(&Device::Cpu, vocab);
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_greedy_equals_the_sampler_cuda() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for vocab in [1000, 1003, 49152] {
            check_on(&dev, vocab);
        }
    }

    #[test]
    fn plain_greedy_means_no_penalty_and_no_draw() {
        assert!(is_plain_greedy(&SamplingParams::greedy()));
        let mut p = SamplingParams::greedy();
        p.repeat_penalty = 1.1;
        assert!(!is_plain_greedy(&p));
        p.repeat_last_n = 0;
        assert!(is_plain_greedy(&p));
        assert!(!is_plain_greedy(&SamplingParams::default()));
    }
}
