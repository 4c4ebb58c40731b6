//! Greedy picks made where the logits are: on a GPU a decode step then sends back one token id
//! per sequence instead of a whole vocabulary row (64 sequences × 49,152 f32 = 12.6 MB a step on
//! the default model), and no host loop scans those rows.
//!
//! The pick is the sampler's greedy rule exactly: the largest logit, the lowest id among equal
//! ones (reduced on the device as max, then the smallest id holding it), and a row with a NaN is
//! an error, as on the host.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

use super::sampler::SamplingParams;

/// Whether a request's next token is the plain argmax of its logits (no penalty, no draw).
pub fn is_plain_greedy(p: &SamplingParams) -> bool {
    p.temperature == 0.0 && (p.repeat_penalty == 1.0 || p.repeat_last_n == 0)
}

/// Per row of f32 logits `[rows, vocab]`: the index of its largest value, lowest index on ties.
/// Errors if a row holds a NaN. One small device→host read.
pub fn greedy_ids(logits: &Tensor) -> Result<Vec<u32>> {
    let (rows, vocab) = logits.dims2()?;
    if vocab == 0 {
        bail!("sampling from an empty logits row");
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
    let both: Vec<u32> = Tensor::cat(&[&first, &nan], 0)?.to_vec1()?;
    let (first, nan) = both.split_at(rows);
    if nan.iter().any(|&n| n != 0) || first.iter().any(|&i| i as usize >= vocab) {
        bail!("the logits contain NaN (the model produced invalid numbers)");
    }
    Ok(first.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::Sampler;
    use candle_core::Device;

    /// Random rows with planted ties at the maximum: the same ids as the host sampler's greedy
    /// rule, row by row.
    fn check_on(dev: &Device) {
        let (rows, vocab) = (7, 1000);
        let mut data: Vec<f32> = Tensor::randn(0f32, 3.0, (rows, vocab), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Row 2: a tie between ids 5 and 900 above everything; row 4: all equal.
        data[2 * vocab + 5] = 100.0;
        data[2 * vocab + 900] = 100.0;
        for x in &mut data[4 * vocab..5 * vocab] {
            *x = 1.5;
        }
        let t = Tensor::from_vec(data.clone(), (rows, vocab), dev).unwrap();
        let got = greedy_ids(&t).unwrap();
        let want: Vec<u32> = data
            .chunks(vocab)
            .map(|r| {
                Sampler::new(SamplingParams::greedy())
                    .sample(r, &[])
                    .unwrap()
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!(got[2], 5);
        assert_eq!(got[4], 0);
        data[3 * vocab + 17] = f32::NAN;
        let t = Tensor::from_vec(data, (rows, vocab), dev).unwrap();
        let e = greedy_ids(&t).unwrap_err().to_string();
        assert!(e.contains("NaN"), "{e}");
    }

    #[test]
    fn device_greedy_equals_the_sampler_cpu() {
        check_on(&Device::Cpu);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_greedy_equals_the_sampler_cuda() {
        check_on(&Device::new_cuda(0).expect("a CUDA device"));
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
