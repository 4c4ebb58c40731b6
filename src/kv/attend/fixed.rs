//! A decode step's device inputs in buffers that keep their addresses from step to step — what
//! a captured CUDA graph of the step reads (docs/ARCHITECTURE.md, "One decode step").
//!
//! One u32 buffer per (rows, table width) holds every input of a step: token ids, positions,
//! the write slot of each row (and that slot repeated along a K/V row, the index a dense
//! scatter takes), context lengths, first visible positions, and the block tables. The host builds it in one vector and copies it with one upload per step. Rows past
//! the real batch repeat row 0 (same token, position, slot and table): they write row 0's K/V
//! again, bit for bit, into row 0's slot, and their outputs are ignored — no row of the batch
//! depends on another, so padding changes nothing.
//!
//! Under `--kv-residual` the buffer also holds the window's table (what `residual::gpu`
//! uploads in an eager step) and the ring rows the new rows go to; under `--kv-center` a second
//! buffer holds each row's key means, refilled only when the batch's sequences change.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

use super::decode::HostTables;
use super::plan::{DecodeGroup, GroupTables, SeqSlice};
use crate::kv::cache::{FixedWrites, PagedKvCache, SeqId};
use crate::kv::format::SlotRows;

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("fixed decode step: {msg}"))
}

/// Sections are 16-byte aligned (the kernels use vector loads).
fn align(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// The inputs of decode steps of `rows` sequences with block tables of `width` columns, on a
/// cache of one layer group (models with windowed layers beside global ones run eagerly).
pub struct FixedStep {
    rows: usize,
    width: usize,
    /// Values in one K (or V) row: the width of the scatter index.
    kv_width: usize,
    block_size: usize,
    buf: Tensor,
    host: Vec<u32>,
    pub ids: Tensor,
    pub pos: Tensor,
    slots: Tensor,
    wide: Tensor,
    lens: Tensor,
    starts: Tensor,
    tables: Tensor,
    /// `--kv-residual`: the window's table, then each row's ring row and sink row.
    window: Option<[Tensor; 3]>,
    /// `--kv-center`: each row's key means per layer (in the model's dtype), and the sequences
    /// they are of.
    means: Option<(Tensor, Vec<SeqId>)>,
    /// The batch of the last [`FixedStep::fill`], padded to `rows` with copies of its first.
    batch: Vec<SeqSlice>,
    /// Sequences in that batch before padding.
    real: usize,
}

impl FixedStep {
    /// Buffers for `rows` decode tokens whose block tables have at most `width` blocks, of a
    /// model computing in `dtype` (the key means' dtype, as the eager write casts them).
    pub fn new(cache: &PagedKvCache, rows: usize, width: usize, dtype: DType) -> Result<Self> {
        if cache.groups().len() != 1 {
            return Err(err(format!(
                "a cache of {} layer groups (one is supported)",
                cache.groups().len()
            )));
        }
        let cfg = cache.config();
        let kv_width = cfg.width();
        let mut sizes = vec![rows, rows, rows, rows * kv_width, rows, rows, rows * width];
        let windowed = cfg.residual > 0;
        if windowed {
            let table = 2 * align(rows) + 8 * rows;
            sizes.extend([table, rows, rows]);
        }
        let total: usize = sizes.iter().map(|&n| align(n)).sum();
        let buf = Tensor::zeros(total, DType::U32, cache.device())?;
        let mut at = 0;
        let mut parts = Vec::new();
        for n in sizes {
            parts.push(buf.narrow(0, at, n)?);
            at += align(n);
        }
        let window = match windowed {
            true => {
                let w: Vec<Tensor> = parts.drain(7..).collect();
                Some(<[Tensor; 3]>::try_from(w).map_err(|_| err("window sections".into()))?)
            }
            false => None,
        };
        let [ids, pos, slots, wide, lens, starts, tables] =
            <[Tensor; 7]>::try_from(parts).map_err(|_| err("sections".into()))?;
        let means = match cfg.center {
            true => Some((
                Tensor::zeros((cfg.num_layers, rows, kv_width), dtype, cache.device())?,
                Vec::new(),
            )),
            false => None,
        };
        Ok(FixedStep {
            rows,
            width,
            kv_width,
            block_size: cfg.block_size,
            host: vec![0; total],
            buf,
            ids,
            pos,
            wide: wide.reshape((rows, kv_width))?,
            slots,
            lens,
            starts,
            tables: tables.reshape((rows, width))?,
            window,
            means,
            batch: Vec::new(),
            real: 0,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Writes the step of `batch` (every slice one decode token; at most [`FixedStep::rows`]
    /// of them, tables of at most `width` blocks) with its `tokens` into the buffers: one
    /// upload. Slots and block ids are checked against the pool here, on the host.
    pub fn fill(&mut self, cache: &PagedKvCache, batch: &[SeqSlice], tokens: &[u32]) -> Result<()> {
        let (rows, width) = (self.rows, self.width);
        if batch.is_empty() || batch.len() > rows || tokens.len() != batch.len() {
            return Err(err(format!(
                "{} sequences and {} tokens for {rows} rows",
                batch.len(),
                tokens.len()
            )));
        }
        let bs = self.block_size;
        let pool_rows = cache.config().pool_blocks.first().copied().unwrap_or(0) * bs;
        let cache_err = |e: crate::kv::cache::CacheError| err(e.to_string());
        let mut ids = Vec::with_capacity(rows);
        let mut pos = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut tables = Vec::with_capacity(rows * width);
        for (s, &tok) in batch.iter().zip(tokens) {
            if s.n != 1 || !cache.in_main_pool(s.seq).map_err(cache_err)? {
                return Err(err(format!("sequence {} is not a main-pool decode", s.seq)));
            }
            let table = cache.block_table(s.seq, 0).map_err(cache_err)?;
            if table.len() > width {
                return Err(err(format!(
                    "sequence {} holds {} blocks, more than the {width} planned",
                    s.seq,
                    table.len()
                )));
            }
            let slot = table
                .get(s.start / bs)
                .map(|&b| b as usize * bs + s.start % bs)
                .filter(|&slot| slot < pool_rows)
                .ok_or_else(|| err(format!("sequence {}: no slot for its new token", s.seq)))?;
            ids.push(tok);
            pos.push(s.start as u32);
            slots.push(slot as u32);
            tables.extend(
                table
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(0))
                    .take(width),
            );
        }
        for _ in batch.len()..rows {
            ids.push(ids[0]);
            pos.push(pos[0]);
            slots.push(slots[0]);
            tables.extend_from_within(0..width);
        }
        let kvw = self.kv_width;
        let firsts: Vec<u32> = pos
            .iter()
            .map(|&p| cache.first_visible(0, p as usize) as u32)
            .collect();
        let mut padded: Vec<SeqId> = batch.iter().map(|s| s.seq).collect();
        padded.resize(rows, batch[0].seq);
        let window = match self.window {
            Some(_) => window_words(cache, &padded, &pos, &firsts)?,
            None => Default::default(),
        };
        let host = &mut self.host;
        let mut at = 0;
        let mut put = |vals: &mut dyn Iterator<Item = u32>, n: usize| {
            for (d, v) in host[at..at + n].iter_mut().zip(vals) {
                *d = v;
            }
            at += align(n);
        };
        put(&mut ids.iter().copied(), rows);
        put(&mut pos.iter().copied(), rows);
        put(&mut slots.iter().copied(), rows);
        put(
            &mut slots.iter().flat_map(|&s| std::iter::repeat_n(s, kvw)),
            rows * kvw,
        );
        put(&mut pos.iter().map(|&p| p + 1), rows);
        put(&mut firsts.iter().copied(), rows);
        put(&mut tables.into_iter(), rows * width);
        for w in &window {
            put(&mut w.iter().copied(), w.len());
        }
        crate::device::graph::write_u32(&self.buf, host)?;
        if let Some((means, of)) = self.means.as_mut() {
            if *of != padded {
                let m = cache.fixed_means(&padded).map_err(cache_err)?;
                means.slice_set(&m.to_dtype(means.dtype())?, 0, 0)?;
                *of = padded;
            }
        }
        self.real = batch.len();
        self.batch = batch.to_vec();
        self.batch.resize(rows, batch[0].clone());
        Ok(())
    }

    /// The step as [`super::paged_attention`] takes it: `rows` slices (padding included) and
    /// one decode group over all of them, reading this step's buffers.
    pub fn plan(&self) -> (&[SeqSlice], Vec<DecodeGroup>) {
        // The window's table, as the eager step's first layer uploads it.
        let residual = std::sync::OnceLock::new();
        if let Some([table, ..]) = &self.window {
            let _ = residual.set(table.clone());
        }
        let group = DecodeGroup {
            main: true,
            members: (0..self.rows).map(|i| (i, i, 1)).collect(),
            rows: None,
            lens: self.lens.clone(),
            tables: vec![GroupTables {
                tables: self.tables.clone(),
                starts: self.starts.clone(),
                // The CUDA kernel reads the device tables only.
                host: HostTables::default(),
                residual,
            }],
        };
        (&self.batch, vec![group])
    }

    /// Where the step's rows go: their slots, and their ring rows and key means where the
    /// cache keeps those — device copies preset (no upload when written).
    pub fn writes(&self) -> FixedWrites {
        FixedWrites {
            slots: Arc::new(SlotRows::preset(
                self.slot_host(),
                self.slots.clone(),
                self.wide.clone(),
            )),
            rings: self.window.as_ref().map(|[_, r, s]| (r.clone(), s.clone())),
            means: self.means.as_ref().map(|(m, _)| m.clone()),
        }
    }

    fn slot_host(&self) -> Vec<u32> {
        let at = 2 * align(self.rows);
        self.host[at..at + self.rows].to_vec()
    }

    /// Sequences of the last fill, in row order (padding excluded).
    pub fn seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.batch.iter().take(self.real).map(|s| s.seq)
    }

    pub fn device(&self) -> &Device {
        self.buf.device()
    }
}

/// The window's sections of a step's buffer (`--kv-residual`): its table as `residual::gpu`
/// builds it for an eager step, then the rows' ring rows and sink rows. `ids`, `pos`,
/// `firsts`: each row's sequence, position and first visible position.
#[cfg(feature = "cuda")]
fn window_words(
    cache: &PagedKvCache,
    ids: &[SeqId],
    pos: &[u32],
    firsts: &[u32],
) -> Result<[Vec<u32>; 3]> {
    let at: Vec<(SeqId, usize)> = ids
        .iter()
        .zip(pos)
        .map(|(&id, &p)| (id, p as usize))
        .collect();
    let rows = cache
        .fixed_rows(&at)
        .map_err(|e| err(e.to_string()))?
        .ok_or_else(|| err("no device copies for --kv-residual".into()))?;
    let lens: Vec<u32> = pos.iter().map(|&p| p + 1).collect();
    let seqs: Vec<_> = rows.iter().map(|r| r.seq).collect();
    let table = super::residual::gpu::fixed_table(&seqs, firsts, &lens, cache.config().residual);
    let ring: Vec<u32> = rows.iter().map(|r| r.ring_row).collect();
    let sink: Vec<u32> = rows.iter().map(|r| r.sink_row).collect();
    Ok([table, ring, sink])
}

#[cfg(not(feature = "cuda"))]
fn window_words(_: &PagedKvCache, _: &[SeqId], _: &[u32], _: &[u32]) -> Result<[Vec<u32>; 3]> {
    Err(err(
        "--kv-residual decode steps are captured on CUDA devices only".into(),
    ))
}
