//! A sequence's dense copies (`--kv-residual`, `--kv-sinks`) out of the cache and into a new
//! sequence, for prompt-cache files.
//!
//! Why a file needs them: under the window every query at position `p` attends `p − N + 1 ..= p`
//! (and the sinks `0..S`) through f16 copies of the rows, not their quantized codes. A run
//! started from `T` stored positions prefills `T..`, and its first query, at `T`, must see the
//! copies of the `N − 1` positions before it exactly as a fresh run holds them — re-prefilling a
//! few positions instead would only move the problem, since their queries need the copies of the
//! positions before *them*. So a file keeps what its saving run held when the prompt was done:
//! the sinks and the last `N − 1` positions' copies; a start at `T` takes the sinks and the
//! copies of `T − N + 1 .. T` (which therefore must lie among those saved: `T` is the saved
//! length, or the whole prompt fits in the window) and carries on like the fresh run from
//! there. The rows themselves were computed through the saving run's window, so only a run
//! with the same `N` and `S` starts from them.

use candle_core::{DType, Device, Tensor};
use half::f16;

use super::residual::Tail;
use super::{CacheError, PagedKvCache, Result, SeqId};

/// The dense copies one layer of a sequence holds: its sink rows (positions `0..sink rows`)
/// and its window's rows (the positions just before the sequence's length), f16
/// `[rows, width]`.
#[derive(Debug, Clone)]
pub struct HeldLayer {
    pub sink_k: Tensor,
    pub sink_v: Tensor,
    pub window_k: Tensor,
    pub window_v: Tensor,
}

impl HeldLayer {
    /// Sink rows, window rows.
    pub fn rows(&self) -> candle_core::Result<(usize, usize)> {
        Ok((self.sink_k.dim(0)?, self.window_k.dim(0)?))
    }
}

/// What a sequence of `len` positions holds dense: per layer (`None`: a layer that keeps no
/// copies, stored dense anyway) the first `min(sinks, len)` positions' rows and the last
/// `min(residual − 1, len)` positions' rows.
#[derive(Debug, Clone)]
pub struct HeldRows {
    /// `--kv-residual` and `--kv-sinks` of the run that held them.
    pub residual: usize,
    pub sinks: usize,
    /// Positions of the sequence (the window's rows end here).
    pub len: usize,
    pub layers: Vec<Option<HeldLayer>>,
}

impl HeldRows {
    /// Window rows a sequence of `len` positions holds between steps under `--kv-residual N`.
    pub fn window_rows(residual: usize, len: usize) -> usize {
        residual.saturating_sub(1).min(len)
    }

    /// Whether a run (with the same window) can start from the first `at` positions: the
    /// copies of `at + 1 − residual .. at` are among the window's rows.
    pub fn covers(&self, at: usize) -> bool {
        let first_held = self.len - Self::window_rows(self.residual, self.len);
        at <= self.len && (at + 1).saturating_sub(self.residual) >= first_held
    }
}

impl PagedKvCache {
    /// The dense copies `id` holds now (see [`HeldRows`]); `None` without `--kv-residual`. Taken
    /// once its prompt is prefilled, for a prompt-cache file.
    pub fn export_held(&self, id: SeqId) -> Result<Option<HeldRows>> {
        if self.cfg.residual == 0 {
            return Ok(None);
        }
        let len = self.seq(id)?.len;
        let (ns, nw) = (
            self.cfg.sinks.min(len),
            HeldRows::window_rows(self.cfg.residual, len),
        );
        let layers = (0..self.cfg.num_layers)
            .map(|l| {
                if self.residual(l) == 0 {
                    return Ok(None);
                }
                #[cfg(feature = "cuda")]
                if let Some(r) = &self.tails.device {
                    return r.export(id, l, len, (ns, nw)).map(Some);
                }
                self.with_residual(id, l, |t| host_layer(t, len, (ns, nw), self.cfg.width()))
                    .map(Some)
                    .map_err(|e| CacheError::Rows(format!("sequence {id}, layer {l}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(HeldRows {
            residual: self.cfg.residual,
            sinks: self.cfg.sinks,
            len,
            layers,
        }))
    }

    /// Gives `id`, which holds the first `at` positions of `held`'s sequence (imported rows),
    /// the copies a fresh run holds at that point: the first `min(sinks, at)` positions' and
    /// those of `at + 1 − residual .. at` (this cache's settings).
    pub fn import_held(&self, id: SeqId, held: &HeldRows, at: usize) -> Result<()> {
        let (n, s) = (self.cfg.residual, self.cfg.sinks);
        if n == 0 {
            return Ok(());
        }
        let len = self.seq(id)?.len;
        // The rows were computed through the holder's window: only the same one goes on alike.
        let fits = held.layers.len() == self.cfg.num_layers
            && (held.residual, held.sinks) == (n, s)
            && held.covers(at)
            && len == at;
        if !fits {
            return Err(CacheError::Rows(format!(
                "sequence {id} at {len} positions cannot take the dense copies of {} layers of a \
                 {}-position sequence kept with --kv-residual {} --kv-sinks {} from position \
                 {at} (this cache: {} layers, --kv-residual {n} --kv-sinks {s})",
                held.layers.len(),
                held.len,
                held.residual,
                held.sinks,
                self.cfg.num_layers,
            )));
        }
        let (ns, from) = (s.min(at), (at + 1).saturating_sub(n));
        let first_held = held.len - HeldRows::window_rows(held.residual, held.len);
        for (l, h) in held.layers.iter().enumerate() {
            if self.residual(l) == 0 {
                continue;
            }
            let Some(h) = h else {
                return Err(CacheError::Rows(format!(
                    "layer {l} comes without dense copies"
                )));
            };
            let (hs, _) = h.rows()?;
            if hs < ns {
                return Err(CacheError::Rows(format!(
                    "layer {l}: {hs} sink rows, {ns} needed"
                )));
            }
            let cut = |x: &Tensor, a: usize, b: usize| x.narrow(0, a, b - a);
            let sinks = (cut(&h.sink_k, 0, ns)?, cut(&h.sink_v, 0, ns)?);
            let (a, b) = (from - first_held, at - first_held);
            let window = (cut(&h.window_k, a, b)?, cut(&h.window_v, a, b)?);
            #[cfg(feature = "cuda")]
            if let Some(r) = &self.tails.device {
                r.install(id, l, at, (&sinks.0, &sinks.1), (&window.0, &window.1))?;
                continue;
            }
            let rows = |x: &Tensor| x.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>();
            let tail = Tail {
                start: from,
                k: rows(&window.0)?,
                v: rows(&window.1)?,
                sink_k: rows(&sinks.0)?,
                sink_v: rows(&sinks.1)?,
            };
            self.tails.install(id, l, tail);
        }
        Ok(())
    }
}

/// A host tail's sinks and window rows of a sequence of `len` positions, as [`HeldLayer`].
fn host_layer(
    t: Option<&Tail>,
    len: usize,
    (ns, nw): (usize, usize),
    width: usize,
) -> std::result::Result<HeldLayer, String> {
    let t = t.ok_or("no dense copies kept")?;
    if t.sinks_held(width) < ns || t.end(width) != len || t.start + nw > len {
        return Err(format!(
            "dense copies of positions {}..{} and {} sinks kept, {}..{len} and {ns} sinks wanted",
            t.start,
            t.end(width),
            t.sinks_held(width),
            len - nw
        ));
    }
    let skip = (len - nw - t.start) * width;
    let tensor = |x: &[f16], n: usize| {
        Tensor::from_slice(x, (n, width), &Device::Cpu).map_err(|e| e.to_string())
    };
    Ok(HeldLayer {
        sink_k: tensor(&t.sink_k[..ns * width], ns)?,
        sink_v: tensor(&t.sink_v[..ns * width], ns)?,
        window_k: tensor(&t.k[skip..], nw)?,
        window_v: tensor(&t.v[skip..], nw)?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::config::CacheConfig;
    use super::*;
    use crate::kv::format::{KvFormat, QuantFormat};

    /// Layer 0 dense, layer 1 4-bit with 4 positions dense and 2 sinks; blocks of 4.
    fn cache() -> PagedKvCache {
        cache_on(&Device::Cpu)
    }

    fn cache_on(dev: &Device) -> PagedKvCache {
        let mut cfg = CacheConfig::dense(2, 1, 64, 4, 16, DType::F32);
        let q = QuantFormat::new(4, 64).unwrap();
        cfg.formats[1] = KvFormat::affine(q, DType::F32, false);
        cfg.residual = 4;
        cfg.sinks = 2;
        PagedKvCache::new(cfg, dev).unwrap()
    }

    /// Rows of positions `from..from + n`, each position's values its own.
    fn rows(from: usize, n: usize, sign: f32, dev: &Device) -> Tensor {
        let x: Vec<f32> = (from * 64..(from + n) * 64)
            .map(|i| sign * (i as f32 * 0.37).sin())
            .collect();
        Tensor::from_vec(x, (n, 64), dev).unwrap()
    }

    /// Writes positions `from..to` of `id` in chunks of `step`, as prefill steps do.
    fn fill(c: &mut PagedKvCache, id: SeqId, (from, to): (usize, usize), step: usize) {
        let mut at = from;
        while at < to {
            let n = step.min(to - at);
            c.reserve(id, n).unwrap();
            for l in 0..2 {
                let dev = c.device().clone();
                let (k, v) = (rows(at, n, 1.0, &dev), rows(at, n, -1.0, &dev));
                c.write(l, id, at, &k, &v).unwrap();
            }
            c.advance(id, n).unwrap();
            at += n;
        }
    }

    type Copies = (usize, Vec<f16>, Vec<f16>, Vec<f16>, Vec<f16>);

    fn copies(c: &PagedKvCache, id: SeqId) -> Copies {
        c.with_residual(id, 1, |t| {
            let t = t.unwrap();
            let v = |x: &Vec<f16>| x.clone();
            (t.start, v(&t.k), v(&t.v), v(&t.sink_k), v(&t.sink_v))
        })
    }

    /// A sequence started from another's rows and copies holds what the other held, and both go
    /// on alike; a start the copies cannot serve, or another window, is refused.
    #[test]
    fn imported_copies_are_those_the_holder_had() {
        let mut c = cache();
        c.add_sequence(1).unwrap();
        fill(&mut c, 1, (0, 10), 3);
        let held = c.export_held(1).unwrap().unwrap();
        assert!(held.layers[0].is_none(), "a dense layer keeps no copies");
        assert_eq!(held.layers[1].as_ref().unwrap().rows().unwrap(), (2, 3));
        assert_eq!((held.residual, held.sinks, held.len), (4, 2, 10));
        // A start at 10 needs the copies of 7..10: held. At 9 it would need 6: not held.
        assert!(held.covers(10) && !held.covers(9) && !held.covers(11));
        let stored = c.export_rows(1).unwrap();
        c.add_sequence(2).unwrap();
        c.import_rows(2, &stored, 4).unwrap();
        c.import_held(2, &held, 10).unwrap();
        assert_eq!(copies(&c, 2), copies(&c, 1));
        assert_eq!(copies(&c, 2).0, 7);
        fill(&mut c, 1, (10, 13), 2);
        fill(&mut c, 2, (10, 13), 3);
        assert_eq!(copies(&c, 2), copies(&c, 1), "after the next writes");

        let part: Vec<_> = stored.iter().map(|r| r.narrow(0, 8).unwrap()).collect();
        c.add_sequence(3).unwrap();
        c.import_rows(3, &part, 4).unwrap();
        let e = c.import_held(3, &held, 8).unwrap_err().to_string();
        assert!(e.contains("from position 8"), "{e}");
        let mut other = held.clone();
        other.sinks = 3;
        c.add_sequence(4).unwrap();
        c.import_rows(4, &stored, 4).unwrap();
        assert!(c.import_held(4, &other, 10).is_err(), "other sinks");
        c.import_held(4, &held, 10).unwrap();
    }

    /// Every layer's copies as host f32 values, for comparing.
    fn values(h: &HeldRows) -> Vec<Vec<Vec<f32>>> {
        let v = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let layers = h.layers.iter().flatten();
        layers
            .flat_map(|l| [&l.sink_k, &l.sink_v, &l.window_k, &l.window_v])
            .map(v)
            .collect()
    }

    /// What [`imported_copies_are_those_the_holder_had`] checks, through exports only (so on
    /// any device: on CUDA the copies live in the rings): a sequence given another's copies
    /// exports them back, and both export the same after the same writes.
    fn round_trip_on(dev: &Device) {
        let mut c = cache_on(dev);
        c.add_sequence(1).unwrap();
        fill(&mut c, 1, (0, 10), 3);
        let held = c.export_held(1).unwrap().unwrap();
        let stored = c.export_rows(1).unwrap();
        c.add_sequence(2).unwrap();
        c.import_rows(2, &stored, 4).unwrap();
        c.import_held(2, &held, 10).unwrap();
        let back = c.export_held(2).unwrap().unwrap();
        assert_eq!(values(&back), values(&held));
        fill(&mut c, 1, (10, 13), 2);
        fill(&mut c, 2, (10, 13), 3);
        let (a, b) = (c.export_held(1).unwrap(), c.export_held(2).unwrap());
        assert_eq!(values(&a.unwrap()), values(&b.unwrap()));
    }

    #[test]
    fn imported_copies_export_back_cpu() {
        round_trip_on(&Device::Cpu);
    }

    /// The rings' import (`Rings::install`) and export (`Rings::export`).
    #[cfg(feature = "cuda")]
    #[test]
    fn imported_copies_export_back_cuda() {
        round_trip_on(&Device::new_cuda(0).expect("a CUDA device"));
    }

    /// Prefix reuse under the window: a prefix is reused only up to a block boundary where its
    /// sequence kept its copies, and a sequence started there holds what the first one held at
    /// that point, and goes on alike.
    fn prefix_reuse_keeps_copies_on(dev: &Device) {
        let mut c = cache_on(dev);
        c.enable_prefix_cache().unwrap();
        let tokens: Vec<u32> = (100..130).collect();
        c.add_sequence(1).unwrap();
        assert_eq!(c.prefix_point(12), Some(12));
        fill(&mut c, 1, (0, 8), 3);
        c.register_prefix(1, &tokens[..8]).unwrap(); // a block boundary: copies kept
        let at8 = values(&c.export_held(1).unwrap().unwrap());
        fill(&mut c, 1, (8, 14), 3);
        c.register_prefix(1, &tokens[..14]).unwrap(); // mid-block: blocks only
        let at14 = values(&c.export_held(1).unwrap().unwrap());
        c.remove_sequence(1);
        // Three whole blocks are cached, but copies only at the end of the second.
        c.add_sequence(2).unwrap();
        assert_eq!(c.attach_prefix(2, &tokens, 28).unwrap(), 8);
        assert_eq!(values(&c.export_held(2).unwrap().unwrap()), at8);
        fill(&mut c, 2, (8, 14), 2);
        assert_eq!(values(&c.export_held(2).unwrap().unwrap()), at14);
        // Another second block: the first block alone kept no copies, nothing is reused.
        let mut other = tokens.clone();
        other[5] = 7;
        c.add_sequence(3).unwrap();
        assert_eq!(c.attach_prefix(3, &other, 28).unwrap(), 0);
    }

    #[test]
    fn prefix_reuse_keeps_copies_cpu() {
        prefix_reuse_keeps_copies_on(&Device::Cpu);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn prefix_reuse_keeps_copies_cuda() {
        prefix_reuse_keeps_copies_on(&Device::new_cuda(0).expect("a CUDA device"));
    }

    /// A sequence shorter than the window holds all its positions: any start within it works,
    /// and a start inside the sinks takes only the sinks it has reached.
    #[test]
    fn a_short_sequence_is_held_whole() {
        let mut c = cache();
        c.add_sequence(1).unwrap();
        fill(&mut c, 1, (0, 3), 3);
        let held = c.export_held(1).unwrap().unwrap();
        assert_eq!(held.layers[1].as_ref().unwrap().rows().unwrap(), (2, 3));
        assert!((0..=3).all(|at| held.covers(at)));
        let stored = c.export_rows(1).unwrap();
        c.add_sequence(2).unwrap();
        let one: Vec<_> = stored.iter().map(|r| r.narrow(0, 1).unwrap()).collect();
        c.import_rows(2, &one, 4).unwrap();
        c.import_held(2, &held, 1).unwrap();
        let (start, k, _, sink_k, _) = copies(&c, 2);
        assert_eq!((start, k.len(), sink_k.len()), (0, 64, 64));
        // Written on from 1 like sequence 1 was: the same copies.
        fill(&mut c, 2, (1, 3), 2);
        assert_eq!(copies(&c, 2), copies(&c, 1));
    }
}
