//! `--kv-center`: keys stored minus their sequence's per-channel mean.
//!
//! Keys carry a large offset per channel that every token of a sequence shares (it barely moves
//! with the position); quantized with the rest, it takes up each group's range and leaves fewer
//! levels for what tells tokens apart. A query's scores `q·(k − μ)` differ from `q·k` by `q·μ`,
//! the same for every key it attends, which softmax removes: with one `μ` per (sequence, layer)
//! every reader (the decode kernels, the dense residual copies, the prompt-chunk path) sees
//! exactly the attention of the uncentred keys, and nothing but the write path changes.
//! Measured on the default model (short protocol, K3/V2 + 60 dense + 4 sinks): KL 0.0233 →
//! 0.0207; 4-bit: 0.0475 → 0.0398.
//!
//! `μ` is the mean of the sequence's first block of keys in the layer (or of its first write,
//! if shorter), fixed then. Rows moved to another sequence take their `μ` along (prompt-cache
//! files store it: [`PagedKvCache::export_centers`], [`PagedKvCache::import_centers`]). Prefix
//! reuse shares blocks, so a sequence attaching a cached prefix takes the means its blocks were
//! stored with: those of a sequence whose means came from a whole first block (a function of
//! that block's tokens, as a fresh run of the new prompt computes them); the blocks of a sequence
//! whose first write was shorter (a prompt split in chunks under a block, or sharing a step's
//! prompt budget) are not offered ([`PagedKvCache::register_prefix`]). What it cannot serve:
//! soft-capped scores (`tanh(s / c)·c`) are not shift-invariant; refused where they are set up.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::{CacheError, KvFormat, PagedKvCache, Result, SeqId, WriteSpan};

/// Each sequence's key means, per layer (`[1, width]`, f32; `None` until the sequence's first
/// write to the layer).
#[derive(Debug, Default)]
pub(super) struct Centers(Mutex<Means>);

/// The means by sequence.
type Means = HashMap<SeqId, SeqMeans>;

/// One sequence's means per layer (`[1, width]` f32), as a cached prefix hands them over.
pub(super) type KeyMeans = std::sync::Arc<Vec<Option<Tensor>>>;

#[derive(Debug, Clone)]
struct SeqMeans {
    layers: Vec<Option<Tensor>>,
    /// Every mean fixed so far came from a whole first block (positions `0..block_size` in one
    /// write), or from a prefix of such a sequence: a function of that block's tokens.
    whole: bool,
}

impl Centers {
    fn map(&self) -> std::sync::MutexGuard<'_, Means> {
        self.0.lock().expect("poisoned centers")
    }

    pub(super) fn remove(&self, id: SeqId) {
        self.map().remove(&id);
    }
}

impl PagedKvCache {
    /// Whether `layer`'s keys are stored centred (`--kv-center`: quantized layers only).
    pub fn centers_keys(&self, layer: usize) -> bool {
        self.cfg.center && matches!(self.cfg.formats.get(layer), Some(KvFormat::Affine { .. }))
    }

    /// `id`'s key means per layer (`[width]` values; `None` for layers that keep keys as they
    /// are), for a prompt-cache file; empty when the cache does not centre keys.
    pub fn export_centers(&self, id: SeqId) -> Result<Vec<Option<Vec<f32>>>> {
        if !self.cfg.center {
            return Ok(Vec::new());
        }
        let map = self.centers.map();
        let means = map.get(&id);
        (0..self.cfg.num_layers)
            .map(|l| {
                if !self.centers_keys(l) {
                    return Ok(None);
                }
                let mu = means
                    .and_then(|m| m.layers.get(l).cloned().flatten())
                    .ok_or_else(|| {
                        CacheError::Rows(format!("sequence {id} has no key mean in layer {l}"))
                    })?;
                Ok(Some(mu.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?))
            })
            .collect()
    }

    /// Gives the new sequence `id` the key means its imported rows were stored with (as
    /// [`Self::export_centers`] gives them); must come before the rows
    /// ([`PagedKvCache::import_rows`] refuses centred layers without).
    pub fn import_centers(&self, id: SeqId, means: &[Option<Vec<f32>>]) -> Result<()> {
        let width = self.cfg.width();
        let ok = means.len() == self.cfg.num_layers
            && means.iter().enumerate().all(|(l, m)| match m {
                Some(m) => self.centers_keys(l) && m.len() == width,
                None => !self.centers_keys(l),
            });
        if !ok {
            return Err(CacheError::Rows(format!(
                "key means for {} layers do not fit this cache ({} layers, keys centred: {}, \
                 {width} values a row)",
                means.len(),
                self.cfg.num_layers,
                self.cfg.center
            )));
        }
        let per_layer = means
            .iter()
            .map(|m| {
                m.as_ref()
                    .map(|m| Tensor::from_slice(m, (1, width), &self.device))
                    .transpose()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        // Their first write is unknown: not offered to prefix reuse.
        let means = SeqMeans {
            layers: per_layer,
            whole: false,
        };
        self.centers.map().insert(id, means);
        Ok(())
    }

    /// `id`'s means for the prefix cache: every centred layer's, fixed from a whole first block
    /// (`None` otherwise: its blocks must not be shared).
    pub(super) fn prefix_means(&self, id: SeqId) -> Option<KeyMeans> {
        let map = self.centers.map();
        let m = map.get(&id).filter(|m| m.whole)?;
        let all = (0..self.cfg.num_layers)
            .all(|l| !self.centers_keys(l) || m.layers.get(l).is_some_and(Option::is_some));
        all.then(|| std::sync::Arc::new(m.layers.clone()))
    }

    /// Gives the new sequence `id` the means of the cached prefix it starts on.
    pub(super) fn take_prefix_means(&self, id: SeqId, means: &KeyMeans) {
        let m = SeqMeans {
            layers: means.as_ref().clone(),
            whole: true,
        };
        self.centers.map().insert(id, m);
    }

    /// Whether `id` may take rows as they are: with centred keys, only once it has their means.
    pub(super) fn check_centred_import(&self, id: SeqId) -> Result<()> {
        let has = self.centers.map().contains_key(&id);
        if self.cfg.center && !has {
            return Err(CacheError::Rows(format!(
                "sequence {id}: its keys are stored centred (--kv-center), but the rows to \
                 import come without their key means"
            )));
        }
        Ok(())
    }

    /// The key means a captured decode step of the sequences `ids` (one per row) subtracts,
    /// per layer: `[layers, rows, width]` f32, zeros in layers that keep keys as they are.
    /// Errors for a sequence with no mean yet in a centred layer (it has not been written
    /// eagerly).
    pub fn fixed_means(&self, ids: &[SeqId]) -> Result<Tensor> {
        let map = self.centers.map();
        let width = self.cfg.width();
        let layers = (0..self.cfg.num_layers)
            .map(|l| {
                if !self.centers_keys(l) {
                    return Ok(Tensor::zeros((ids.len(), width), DType::F32, &self.device)?);
                }
                let rows = ids
                    .iter()
                    .map(|id| {
                        map.get(id)
                            .and_then(|m| m.layers.get(l).cloned().flatten())
                            .ok_or_else(|| {
                                CacheError::Rows(format!(
                                    "sequence {id} has no key mean in layer {l} yet"
                                ))
                            })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&rows, 0)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::stack(&layers, 0)?)
    }

    /// Whether every sequence of `ids` has its key means (in every centred layer).
    #[cfg(feature = "cuda")]
    pub(super) fn has_means(&self, ids: &[SeqId]) -> bool {
        let map = self.centers.map();
        ids.iter().all(|id| {
            map.get(id).is_some_and(|m| {
                m.layers
                    .iter()
                    .enumerate()
                    .all(|(l, mu)| mu.is_some() || !self.centers_keys(l))
            })
        })
    }

    /// `k` (`[T, width]`, spans as [`PagedKvCache::write_spans`] takes them) minus each row's
    /// sequence mean in `layer`, fixing the means of sequences writing it for the first time.
    /// Rows no span names are left as they are.
    pub(super) fn centred(&self, layer: usize, spans: &[WriteSpan], k: &Tensor) -> Result<Tensor> {
        let (rows, width) = k.dims2()?;
        let mut map = self.centers.map();
        // Row r of `k` takes mean `pick[r]` of `means` (rows no span names: a last row of zeros).
        let mut means = Vec::with_capacity(spans.len() + 1);
        let mut pick = vec![u32::MAX; rows];
        let bs = self.cfg.block_size;
        for &(id, start, offset, n) in spans {
            if n == 0 {
                continue;
            }
            let per_layer = map.entry(id).or_insert_with(|| SeqMeans {
                layers: vec![None; self.cfg.num_layers],
                whole: true,
            });
            let whole = &mut per_layer.whole;
            let mu = match per_layer.layers.get_mut(layer) {
                Some(Some(mu)) => mu.clone(),
                Some(slot) => {
                    *whole &= start == 0 && n >= bs;
                    let first = k.narrow(0, offset, n.min(bs))?;
                    let mu = first.to_dtype(DType::F32)?.mean_keepdim(0)?;
                    *slot = Some(mu.clone());
                    mu
                }
                None => return Err(candle_core::Error::Msg(format!("no layer {layer}")).into()),
            };
            let at = means.len() as u32;
            means.push(mu);
            for p in pick.iter_mut().skip(offset).take(n) {
                *p = at;
            }
        }
        if let ([mu], [(_, _, 0, n)]) = (means.as_slice(), spans) {
            if *n == rows {
                // One sequence's rows (a decode step alone, a prompt chunk): a broadcast, with
                // no index to upload.
                return Ok(k.broadcast_sub(&mu.to_dtype(k.dtype())?)?);
            }
        }
        let zeros = means.len() as u32;
        pick.iter_mut()
            .filter(|p| **p == u32::MAX)
            .for_each(|p| *p = zeros);
        means.push(Tensor::zeros((1, width), DType::F32, k.device())?);
        let means = Tensor::cat(&means, 0)?.to_dtype(k.dtype())?;
        let pick = Tensor::from_vec(pick, rows, k.device())?;
        Ok((k - means.index_select(&pick, 0)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::CacheConfig;
    use super::*;
    use crate::kv::format::QuantFormat;
    use candle_core::Device;

    fn cache() -> PagedKvCache {
        let mut cfg = CacheConfig::dense(2, 1, 64, 4, 8, DType::F32);
        let q = QuantFormat::new(4, 64).unwrap();
        cfg.formats[1] = KvFormat::Affine {
            key: q,
            value: q,
            scale_dtype: DType::F16,
            rotated: true,
        };
        cfg.center = true;
        PagedKvCache::new(cfg, &Device::Cpu).unwrap()
    }

    #[test]
    fn each_sequence_keeps_the_mean_of_its_first_block() {
        let c = cache();
        assert!(!c.centers_keys(0) && c.centers_keys(1));
        let rows: Vec<f32> = (0..6 * 64)
            .map(|i| (i % 64) as f32 + (i / 64) as f32)
            .collect();
        let k = Tensor::from_vec(rows, (6, 64), &Device::Cpu).unwrap();
        // Sequence 1 writes rows 0..5 (its first block: rows 0..4), sequence 2 row 5.
        // An empty span (sequence 3) takes no row and fixes no mean.
        let out = c
            .centred(1, &[(3, 0, 0, 0), (1, 0, 0, 5), (2, 0, 5, 1)], &k)
            .unwrap();
        let out = out.to_vec2::<f32>().unwrap();
        // Row r of sequence 1 is (channel + r); its first block's mean is channel + 1.5.
        for (r, row) in out.iter().take(5).enumerate() {
            assert!(row.iter().all(|&x| x == r as f32 - 1.5), "row {r}: {row:?}");
        }
        assert!(out[5].iter().all(|&x| x == 0.0), "{:?}", out[5]);
        assert!(c.export_centers(3).is_err(), "an empty write fixes no mean");
        // Later writes reuse the fixed mean.
        let next = Tensor::full(10f32, (1, 64), &Device::Cpu).unwrap();
        let out = c.centred(1, &[(1, 5, 0, 1)], &next).unwrap();
        let want: Vec<f32> = (0..64).map(|ch| 10.0 - (ch as f32 + 1.5)).collect();
        assert_eq!(out.to_vec2::<f32>().unwrap()[0], want);
        c.centers.remove(1);
        let out = c.centred(1, &[(1, 0, 0, 1)], &next).unwrap();
        assert!(out.to_vec2::<f32>().unwrap()[0].iter().all(|&x| x == 0.0));
    }

    /// Writes positions `0..n` of a new sequence `id` in writes of `first`, then the rest.
    fn prefill(c: &mut PagedKvCache, id: SeqId, n: usize, first: usize) {
        c.add_sequence(id).unwrap();
        c.reserve(id, n).unwrap();
        let k = Tensor::arange(0f32, (n * 64) as f32, &Device::Cpu)
            .unwrap()
            .affine(0.01, 1.0)
            .unwrap()
            .reshape((n, 64))
            .unwrap();
        for (start, len) in [(0, first), (first, n - first)] {
            for l in 0..2 {
                let x = k.narrow(0, start, len).unwrap();
                c.write(l, id, start, &x, &x).unwrap();
            }
        }
        c.advance(id, n).unwrap();
    }

    /// Prefix reuse of centred keys: a sequence whose means came from a write shorter than a
    /// block offers no blocks; one whose means came from a whole first block offers its blocks
    /// with them, and a sequence attaching them takes those means (and offers its own on).
    #[test]
    fn a_prefix_comes_with_the_means_of_its_whole_first_block() {
        let mut c = cache();
        c.enable_prefix_cache().unwrap();
        let tokens: Vec<u32> = (0..12).collect();
        prefill(&mut c, 1, 10, 3);
        assert!(c.prefix_means(1).is_none());
        c.register_prefix(1, &tokens[..10]).unwrap();
        c.remove_sequence(1);
        assert_eq!(
            c.prefix_cached_blocks(),
            0,
            "centred from 3 rows: not offered"
        );

        prefill(&mut c, 2, 10, 6);
        c.register_prefix(2, &tokens[..10]).unwrap();
        let want = c.export_centers(2).unwrap();
        c.remove_sequence(2);
        assert_eq!(c.prefix_cached_blocks(), 2);
        c.add_sequence(3).unwrap();
        assert_eq!(c.attach_prefix(3, &tokens, 10).unwrap(), 8);
        assert_eq!(c.export_centers(3).unwrap(), want);
        assert!(c.prefix_means(3).is_some());
        // Once the blocks are evicted, their means go too: nothing to attach.
        c.remove_sequence(3);
        for _ in 0..2 {
            c.groups[0].prefix.as_mut().unwrap().evict().unwrap();
        }
        assert!(c.groups[0].prefix.as_ref().unwrap().side(&tokens).is_none());
        c.add_sequence(4).unwrap();
        assert_eq!(c.attach_prefix(4, &tokens, 10).unwrap(), 0);
    }
}
