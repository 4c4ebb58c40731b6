//! Dense cache rows written by one scatter launch per tensor.
//!
//! A decode step's new rows land one per sequence, each in its own block, so writing them run by
//! run costs one copy launch per sequence, K and V, every layer: launches that grow with the
//! batch (64 sequences: 3,840 per step on a 30-layer model). On a GPU such scattered writes go
//! through one index scatter per tensor instead. Long runs (prompt chunks, whole blocks at a
//! time) stay with plain slice copies, which move them at full bandwidth.

use candle_core::{Result, Tensor};

use super::ops::{slot_runs, SlotRows};

/// Whether rows bound for `slots` should go through [`scatter_rows`]: not on the CPU (its run
/// copies cost no launch), and only when they are scattered (runs averaging under 4 rows).
pub fn prefer_scatter(pool: &Tensor, slots: &[u32]) -> bool {
    if pool.device().is_cpu() || slots.len() < 2 {
        return false;
    }
    let runs = slot_runs(slots).count();
    runs > 1 && slots.len() < 4 * runs
}

/// Writes row `i` of `x` (`[n, width]`, any float dtype) into row `slots[i]` of `pool`
/// (`[rows, width]`), in one launch. Slots are checked against the pool on the host first.
pub fn scatter_rows(pool: &Tensor, slots: &SlotRows, x: &Tensor) -> Result<()> {
    let (rows, width) = pool.dims2()?;
    let (n, xw) = x.dims2()?;
    let host = slots.as_slice();
    if xw != width || n != host.len() {
        candle_core::bail!(
            "scatter_rows: {n} rows of {xw} values into slots {} of a pool {width} wide",
            host.len()
        );
    }
    if let Some(&r) = host.iter().find(|&&r| r as usize >= rows) {
        candle_core::bail!("scatter_rows: slot {r} is outside the pool of {rows} rows");
    }
    let idx = slots.wide_on(pool.device(), width)?;
    pool.scatter_set(&idx, &x.to_dtype(pool.dtype())?.contiguous()?, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Random rows scattered into a random pool: every named row replaced, every other row kept,
    /// bit for bit (a copy), against a host-side reference; on `dev`.
    fn check_on(dev: &Device, dtype: DType) {
        let (rows, width) = (40, 24);
        let pool = Tensor::randn(0f32, 1.0, (rows, width), dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let before: Vec<Vec<f32>> = pool.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
        let slots = vec![17u32, 3, 38, 4, 22, 9];
        let x = Tensor::randn(0f32, 1.0, (slots.len(), width), dev).unwrap();
        scatter_rows(&pool, &SlotRows::new(slots.clone()), &x).unwrap();
        let after: Vec<Vec<f32>> = pool.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
        let xs: Vec<Vec<f32>> = x
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2()
            .unwrap();
        for r in 0..rows {
            let want = match slots.iter().position(|&s| s as usize == r) {
                Some(i) => &xs[i],
                None => &before[r],
            };
            assert_eq!(&after[r], want, "row {r}");
        }
        let bad = SlotRows::new(vec![1, rows as u32]);
        let x2 = Tensor::zeros((2, width), DType::F32, dev).unwrap();
        let e = scatter_rows(&pool, &bad, &x2).unwrap_err().to_string();
        assert!(e.contains("outside the pool"), "{e}");
    }

    #[test]
    fn scatter_replaces_exactly_the_named_rows_cpu() {
        check_on(&Device::Cpu, DType::F32);
        check_on(&Device::Cpu, DType::F16);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn scatter_replaces_exactly_the_named_rows_cuda() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        check_on(&dev, DType::F16);
        check_on(&dev, DType::BF16);
        check_on(&dev, DType::F32);
        let pool = Tensor::zeros((8, 4), DType::F16, &dev).unwrap();
        assert!(prefer_scatter(&pool, &[5, 1, 7]));
        assert!(!prefer_scatter(&pool, &[0, 1, 2, 3, 4, 5, 6, 7]));
    }

    #[test]
    fn scatter_only_for_scattered_rows_off_the_cpu() {
        let cpu = Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(!prefer_scatter(&cpu, &[5, 1, 7]));
        // The rule itself (device aside): runs of one row scatter, a long run does not.
        assert_eq!(slot_runs(&[5, 1, 7]).count(), 3);
        assert_eq!(slot_runs(&[0, 1, 2, 3, 4, 5, 6, 7]).count(), 1);
    }
}
