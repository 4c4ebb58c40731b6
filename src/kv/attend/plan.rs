//! What a forward pass attends, decided once per step on the host: each sequence's slice of the
//! batch ([`SeqSlice`]) and the groups of queries that go through the fused decode kernel
//! together ([`DecodeGroup`], block tables uploaded once and shared by every layer).

use candle_core::{Result, Tensor};
use std::cell::{OnceCell, RefCell};

use super::decode::HostTables;
use crate::kv::cache::{PagedKvCache, SeqId};

/// One sequence's share of a forward pass: `n` new tokens at positions `start..start + n`,
/// rows `offset..offset + n` of the flattened batch.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    pub seq: SeqId,
    pub offset: usize,
    pub start: usize,
    pub n: usize,
    /// First key position any of the new tokens can see in any layer (> 0 only with a
    /// sliding window on every layer).
    pub kstart: usize,
    /// Cache slots of positions `kstart..start + n` (u32), shared by all layers: built by the
    /// first layer that gathers this sequence's rows (a prompt chunk off the decode kernel), so
    /// a decode step neither lists nor uploads any sequence's whole history.
    pub slots: OnceCell<Tensor>,
    /// A prompt chunk's causal mask per layer window (`None`: it needs none), built by the
    /// first layer of that window that attends the chunk by gathering, shared by the others.
    pub mask: RefCell<Vec<(Option<usize>, Option<Tensor>)>>,
}

/// Queries that share a pool and go through the fused decode kernel together: every decode
/// token (n = 1), and with `prefill_as_decode` every prompt token too. Built once per forward
/// pass (block tables are the same in every layer).
pub struct DecodeGroup {
    pub(super) main: bool,
    /// Per member sequence, in batch order: its index in the batch, and the range of its
    /// queries among the group's rows.
    pub(super) members: Vec<(usize, usize, usize)>,
    /// Row of each query in the flattened batch (u32 `[Q]`); `None` when they are rows 0..Q in
    /// order (a decode-only batch: no gather launch per layer).
    pub(super) rows: Option<Tensor>,
    pub(super) tables: Tensor,
    /// First visible position of each query, per distinct layer window.
    pub(super) starts: Vec<(Option<usize>, Tensor)>,
    pub(super) lens: Tensor,
    /// What `tables`, `starts` (one per window, in `starts`' order) and `lens` were made from
    /// (CPU and generic paths read these).
    pub(super) host: Vec<HostTables>,
}

/// Groups the batch's decode tokens (n = 1) by pool for [`paged_attention`](super::paged_attention). With
/// `prefill_as_decode`, each token of a prompt chunk joins too, as a decode query of its own
/// position (visible keys up to and including itself): each query then has one summation order
/// whatever chunk or batch it came in (the CPU decode kernel's order depends only on the
/// query's visible span), so prompts give the same K/V however they are chunked and batched —
/// the batch-invariant path. Without it, chunks attend with matmuls over their keys
/// ([`attend_one`](super::attend_one)), whose rounding depends on the chunk's shape.
pub fn plan_decode(
    cache: &PagedKvCache,
    batch: &[SeqSlice],
    prefill_as_decode: bool,
) -> Result<Vec<DecodeGroup>> {
    let err = |e: crate::kv::cache::CacheError| candle_core::Error::Msg(e.to_string());
    let dev = cache.device();
    let mut windows: Vec<Option<usize>> = Vec::new();
    for l in 0..cache.config().num_layers {
        let w = cache.layer_window(l);
        if !windows.contains(&w) {
            windows.push(w);
        }
    }
    let mut groups = Vec::new();
    for main in [true, false] {
        let mut members = Vec::new();
        let mut tables = Vec::new();
        let (mut rows, mut lens) = (Vec::new(), Vec::new());
        let mut starts: Vec<Vec<u32>> = vec![Vec::new(); windows.len()];
        for (i, s) in batch.iter().enumerate() {
            if (s.n == 1 || prefill_as_decode) && cache.in_main_pool(s.seq).map_err(err)? == main {
                members.push((i, rows.len(), s.n));
                let table = cache.block_table(s.seq).map_err(err)?;
                for t in 0..s.n {
                    let pos = s.start + t;
                    rows.push((s.offset + t) as u32);
                    for (st, w) in starts.iter_mut().zip(&windows) {
                        st.push(first_visible(*w, pos) as u32);
                    }
                    lens.push(pos as u32 + 1);
                    tables.push(table.clone());
                }
            }
        }
        if members.is_empty() {
            continue;
        }
        let width = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat(0)).take(width))
            .collect();
        let q = rows.len();
        let in_order = rows.iter().enumerate().all(|(i, &r)| r == i as u32);
        groups.push(DecodeGroup {
            main,
            rows: if in_order {
                None
            } else {
                Some(Tensor::from_vec(rows, q, dev)?)
            },
            starts: windows
                .iter()
                .zip(&starts)
                .map(|(w, st)| Ok((*w, Tensor::new(st.as_slice(), dev)?)))
                .collect::<Result<Vec<_>>>()?,
            lens: Tensor::new(lens.as_slice(), dev)?,
            tables: Tensor::new(flat.as_slice(), dev)?.reshape((q, width))?,
            members,
            host: starts
                .into_iter()
                .map(|starts| HostTables {
                    tables: flat.clone(),
                    starts,
                    lens: lens.clone(),
                })
                .collect(),
        });
    }
    Ok(groups)
}

/// First position a query at `pos` sees through a window of `window` positions (if any).
pub(super) fn first_visible(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}
