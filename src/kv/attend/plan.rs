//! What a forward pass attends, decided once per step on the host: each sequence's slice of the
//! batch ([`SeqSlice`]) and the groups of queries that go through the fused decode kernel
//! together ([`DecodeGroup`], block tables uploaded once per layer group of the cache and shared
//! by every layer of the group).

use candle_core::{Result, Tensor};
use std::cell::OnceCell;

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
    /// Per layer group of the cache (in its order): what a prompt chunk attending by gathering
    /// needs in that group's layers.
    pub groups: Vec<SliceGroup>,
}

/// A sequence slice's keys in one layer group.
#[derive(Debug, Clone, Default)]
pub struct SliceGroup {
    /// First key position any of the new tokens can see in the group's layers (> 0 only
    /// through a window).
    pub kstart: usize,
    /// Cache slots of positions `kstart..start + n` in the group's pool (u32): built by the
    /// first layer of the group that gathers this sequence's rows (a prompt chunk off the
    /// decode kernel), so a decode step neither lists nor uploads any sequence's history.
    pub slots: OnceCell<Tensor>,
    /// The chunk's causal mask in the group's layers (`None`: it needs none), built by the
    /// group's first layer that attends the chunk by gathering, shared by the others.
    pub mask: OnceCell<Option<Tensor>>,
}

impl SeqSlice {
    /// The slice of `n` new tokens of `seq` at rows `offset..`, starting after what the cache
    /// holds (`start`), with each group's first visible key.
    pub fn new(cache: &PagedKvCache, seq: SeqId, offset: usize, start: usize, n: usize) -> Self {
        let groups = (0..cache.groups().len())
            .map(|g| SliceGroup {
                kstart: cache.first_visible(g, start),
                ..SliceGroup::default()
            })
            .collect();
        Self {
            seq,
            offset,
            start,
            n,
            groups,
        }
    }
}

/// Queries that share a pool and go through the fused decode kernel together: every decode
/// token (n = 1), and with `prefill_as_decode` every prompt token too. Built once per forward
/// pass (block tables are the same in every layer of a group).
pub struct DecodeGroup {
    pub(super) main: bool,
    /// Per member sequence, in batch order: its index in the batch, and the range of its
    /// queries among the group's rows.
    pub(super) members: Vec<(usize, usize, usize)>,
    /// Row of each query in the flattened batch (u32 `[Q]`); `None` when they are rows 0..Q in
    /// order (a decode-only batch: no gather launch per layer).
    pub(super) rows: Option<Tensor>,
    pub(super) lens: Tensor,
    /// Per layer group of the cache, in its order: each query's block table in that group's
    /// pool and first visible position through the group's window.
    pub(super) tables: Vec<GroupTables>,
}

/// A decode group's block tables and starts in one layer group.
pub(super) struct GroupTables {
    pub tables: Tensor,
    pub starts: Tensor,
    /// What `tables`, `starts` and the group's `lens` were made from (CPU and generic paths
    /// read these).
    pub host: HostTables,
    /// The residual window's per-query table on the device (`residual::gpu`): the same in
    /// every layer of a step, so the step's first such layer uploads it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub residual: std::sync::OnceLock<Tensor>,
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
    let ngroups = cache.groups().len();
    let mut out = Vec::new();
    for main in [true, false] {
        let mut members = Vec::new();
        let (mut rows, mut lens) = (Vec::new(), Vec::new());
        // Per layer group: each query's table and first visible position.
        let mut tables: Vec<Vec<Vec<u32>>> = vec![Vec::new(); ngroups];
        let mut starts: Vec<Vec<u32>> = vec![Vec::new(); ngroups];
        for (i, s) in batch.iter().enumerate() {
            if (s.n == 1 || prefill_as_decode) && cache.in_main_pool(s.seq).map_err(err)? == main {
                members.push((i, rows.len(), s.n));
                for g in 0..ngroups {
                    let table = cache.block_table(s.seq, g).map_err(err)?;
                    for t in 0..s.n {
                        starts[g].push(cache.first_visible(g, s.start + t) as u32);
                        tables[g].push(table.clone());
                    }
                }
                for t in 0..s.n {
                    let pos = s.start + t;
                    rows.push((s.offset + t) as u32);
                    lens.push(pos as u32 + 1);
                }
            }
        }
        if members.is_empty() {
            continue;
        }
        let q = rows.len();
        let in_order = rows.iter().enumerate().all(|(i, &r)| r == i as u32);
        let per_group = tables
            .into_iter()
            .zip(starts)
            .map(|(tables, starts)| -> Result<GroupTables> {
                let width = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
                let flat: Vec<u32> = tables
                    .iter()
                    .flat_map(|t| t.iter().copied().chain(std::iter::repeat(0)).take(width))
                    .collect();
                Ok(GroupTables {
                    tables: Tensor::new(flat.as_slice(), dev)?.reshape((q, width))?,
                    starts: Tensor::new(starts.as_slice(), dev)?,
                    host: HostTables {
                        tables: flat,
                        starts,
                        lens: lens.clone(),
                    },
                    residual: Default::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.push(DecodeGroup {
            main,
            rows: if in_order {
                None
            } else {
                Some(Tensor::from_vec(rows, q, dev)?)
            },
            lens: Tensor::new(lens.as_slice(), dev)?,
            tables: per_group,
            members,
        });
    }
    Ok(out)
}
