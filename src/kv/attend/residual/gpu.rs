//! The residual window on a CUDA cache: the fused decode kernels attend the quantized part and
//! the dense copies kept on the device (`kv::cache::ring`) and merge the two, the warp kernels
//! in one launch (the dense rows are one more split). Per step the host builds
//! and uploads one small table (each query's parts, the same in every layer) and nothing is read
//! back; a captured step finds the table in its fixed buffer ([`fixed_table`] builds it).

use candle_core::{Result, Tensor};

use super::super::decode::{self, DenseRows, HostTables, StepTables};
use super::super::plan::{DecodeGroup, GroupTables, SeqSlice};
use super::{members, parts, Held};
use crate::kv::cache::ring::RingSeq;
use crate::kv::cache::{PagedKvCache, SeqId};

/// [`super::attend`] on the device.
pub(super) fn attend(
    q: &Tensor,
    cache: &PagedKvCache,
    layer: usize,
    g: &DecodeGroup,
    t: &GroupTables,
    batch: &[SeqSlice],
    scale: f32,
) -> Result<Tensor> {
    let cfg = cache.config();
    let n_q = q.dim(0)?;
    let keep = cache.residual(layer);
    let (seq_of, ids) = members(g, batch, n_q)?;
    // Every layer of a step writes the same spans, so its copies hold the same positions: the
    // step's first layer builds and uploads the table (each query's parts), the others reuse it
    // and ask the copies for their tensors only.
    let cached = t.residual.get().cloned();
    let asked: &[SeqId] = if cached.is_some() { &[] } else { &ids };
    let (rings, seqs) = cache.ring_view(layer, asked).ok_or_else(|| {
        candle_core::Error::Msg(format!("layer {layer}: no device copies for --kv-residual"))
    })?;
    let seg = n_q.next_multiple_of(4); // segments start 16-byte aligned
    let up = match cached {
        Some(up) => up,
        None => {
            let (qs, lo) = parts(&t.host, &seq_of, &held(&seqs), keep);
            let words = table(&t.host, &seqs, &seq_of, (&qs, &lo), seg);
            let up = Tensor::new(words.as_slice(), q.device())?;
            t.residual.get_or_init(|| up.clone());
            up
        }
    };
    let (starts_q, lens_q) = (up.narrow(0, 0, n_q)?, up.narrow(0, seg, n_q)?);
    let info = up.narrow(0, 2 * seg, 8 * n_q)?.reshape((n_q, 8))?;
    // The CUDA kernels read the device tables only.
    let step = StepTables {
        tables: &t.tables,
        starts: &starts_q,
        lens: &lens_q,
        host: None,
    };
    let dense = DenseRows {
        ring_k: &rings.k,
        ring_v: &rings.v,
        new_k: &rings.new_k,
        new_v: &rings.new_v,
        info: &info,
        sinks: rings.sinks,
        ring: rings.ring,
    };
    let out = decode::cuda_step_window(
        q,
        cache.layer_storage(layer, g.main),
        &step,
        cfg.block_size,
        cfg.num_kv_heads,
        scale,
        cache.rotation(layer, g.main),
        &dense,
    )?;
    cache
        .commit_ring(layer, &ids)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    Ok(out)
}

/// The table [`attend`] uploads, for a captured decode step (`kv::attend::FixedStep`) whose
/// rows `seqs` (one query each, at `lens − 1`, seeing from `firsts`) are already in the rings:
/// the quantized part's starts and lens, then each query's window words.
pub(crate) fn fixed_table(seqs: &[RingSeq], firsts: &[u32], lens: &[u32], keep: usize) -> Vec<u32> {
    let host = HostTables {
        starts: firsts.to_vec(),
        lens: lens.to_vec(),
        ..Default::default()
    };
    let seq_of: Vec<usize> = (0..seqs.len()).collect();
    let (qs, lo) = parts(&host, &seq_of, &held(seqs), keep);
    let seg = seqs.len().next_multiple_of(4);
    table(&host, seqs, &seq_of, (&qs, &lo), seg)
}

/// What each member sequence's copies hold, as the parts of its queries are cut.
fn held(seqs: &[RingSeq]) -> Vec<Option<Held>> {
    seqs.iter()
        .map(|s| {
            Some(Held {
                start: s.start,
                end: s.end,
                sinks: s.sinks,
            })
        })
        .collect()
}

/// The upload of one step: the quantized part's starts `qs` and lens `lo`, each in a segment
/// of `seg` words, then per query the eight words the window's kernels read (`info` in
/// kernels/decode/residual.cuh).
fn table(
    host: &HostTables,
    seqs: &[RingSeq],
    seq_of: &[usize],
    (qs, lo): (&[u32], &[u32]),
    seg: usize,
) -> Vec<u32> {
    let n_q = seq_of.len();
    let mut words = vec![0u32; 2 * seg];
    words[..n_q].copy_from_slice(qs);
    words[seg..seg + n_q].copy_from_slice(lo);
    for r in 0..n_q {
        let s = &seqs[seq_of[r]];
        let (st, len) = (host.starts[r], host.lens[r]);
        words.extend_from_slice(&[
            st,
            (s.sinks as u32).min(len),
            lo[r],
            len,
            s.base,
            s.wstart,
            s.woff,
            u32::from(qs[r] >= lo[r]),
        ]);
    }
    words
}
