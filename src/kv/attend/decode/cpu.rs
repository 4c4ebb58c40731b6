//! The fused CPU decode kernel.
//!
//! Work is split into tasks of (sequence, position chunk), run on the thread pool ([`pool`]); each task returns,
//! for every KV head, the softmax max, sum and weighted V of its positions for the `G` query
//! heads of that KV head ([`kernel`] says how a task reads K and V: all heads of a slot row
//! together, since they sit side by side), and the partial states of one (sequence, KV head)
//! are merged at the end, in chunk order. The chunk length adapts to each sequence's own
//! length (never to the batch: [`chunk_len`]): long enough to amortise a task, short enough
//! that a single long sequence still gives several threads work.
//!
//! Scratch buffers live per thread and are reused across calls; the only per-call allocations
//! are the query copy, the partial states and the output.
//!
//! The kernel is written once over vector operations ([`simd::Simd`]); the implementation is
//! chosen at run time: [`avx512::Avx512`] (16 lanes) where the CPU has AVX-512 F/BW and the head
//! dimension is a multiple of 16, else [`avx2::Avx2`] (8 lanes; AVX2 + FMA + F16C), else
//! [`simd::Portable`]. A head dimension that is not a multiple of 8 goes to the generic path.

mod int8;
mod int8v;
mod kernel;
mod launch;
mod rows;
mod softmax;

use super::{generic, Dims, Tables};
use crate::kv::format::{LayerKv, QuantFormat, Quantized};
use crate::ops::pool;
#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2, avx512};
use crate::simd::{Isa, Portable};
use candle_core::{DType, Device, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};
use int8::QueryI8;
use kernel::{Scratch, Shape};
use launch::{ExactOnly, Keys, Launch, WithInt};
use rows::{AffineRows, DenseRows, Rows};
use std::cell::RefCell;

/// Bounds of a task's length in positions.
const MIN_CHUNK: usize = 64;
const MAX_CHUNK: usize = 1024;
/// Chunks a sequence is split into, within those bounds.
const SPLITS: usize = 16;
/// (Sequence, KV head) pairs from which their merges run in parallel.
const MERGE_PAR: usize = 64;

/// Positions per task of a sequence with `span` visible positions. A function of the span
/// alone (not of the batch or the thread count): the chunking fixes the order in which a
/// sequence's partial softmax states are merged, so a query's result is the same whatever else
/// shares the call — batch invariance, and a prefill token attended as a decode query gives
/// what the same position gives when decoded.
fn chunk_len(span: usize) -> usize {
    span.div_ceil(SPLITS).clamp(MIN_CHUNK, MAX_CHUNK)
}

/// Row views of every vector implementation (the one used is chosen at run time).
#[cfg(target_arch = "x86_64")]
trait AnyRows: Rows<Portable> + Rows<avx2::Avx2> + Rows<avx512::Avx512> {}
#[cfg(target_arch = "x86_64")]
impl<R: Rows<Portable> + Rows<avx2::Avx2> + Rows<avx512::Avx512>> AnyRows for R {}
#[cfg(not(target_arch = "x86_64"))]
trait AnyRows: Rows<Portable> {}
#[cfg(not(target_arch = "x86_64"))]
impl<R: Rows<Portable>> AnyRows for R {}

#[derive(Clone, Copy)]
struct Task {
    b: usize,
    p0: usize,
    p1: usize,
}

/// Tasks in (sequence, chunk) order, and where each sequence's tasks begin.
struct Plan {
    tasks: Vec<Task>,
    /// Per sequence: index of its first task and its number of chunks.
    seqs: Vec<(usize, usize)>,
}

fn plan(d: &Dims, t: &Tables) -> Plan {
    let mut tasks = Vec::new();
    let mut seqs = Vec::with_capacity(d.batch);
    for b in 0..d.batch {
        let (s, l) = (t.starts[b] as usize, t.lens[b] as usize);
        let chunk = chunk_len(l - s);
        let nc = (l - s).div_ceil(chunk);
        seqs.push((tasks.len(), nc));
        for c in 0..nc {
            let p0 = s + c * chunk;
            tasks.push(Task {
                b,
                p0,
                p1: (p0 + chunk).min(l),
            });
        }
    }
    Plan { tasks, seqs }
}

thread_local! {
    static SCRATCH: RefCell<(Scratch, Vec<u32>)> = RefCell::default();
}

/// Runs every task of `plan` and merges the partial states into `[B, H, D]`, with each query
/// head's log-sum-exp of its (scaled) scores, `[B, H]` (−∞ where a sequence has no positions).
/// `views(kh)` gives the K and V rows of KV head `kh`; `qi` the 8-bit queries where `keys`
/// asks for them.
#[allow(clippy::too_many_arguments)]
fn run<K: AnyRows, V: AnyRows, L: Launch>(
    plan: &Plan,
    q: &[f32],
    (keys, qi): (Keys, Option<&QueryI8>),
    d: &Dims,
    t: &Tables,
    group: usize,
    isa: Isa,
    views: impl Fn(usize) -> (K, V),
) -> Out {
    let (g, hd) = (d.group, d.head_dim);
    let sh = Shape {
        g,
        head_dim: hd,
        group,
        groups: hd / group,
    };
    let heads: Vec<(K, V)> = (0..d.kv_heads).map(views).collect();
    // Per task and KV head: [max (G) | sum (G) | weighted V (G × head_dim)].
    let stride = 2 * g + g * hd;
    let mut parts = vec![0f32; plan.tasks.len() * d.kv_heads * stride];
    let per_task = d.kv_heads * stride;
    let shared = pool::Shared::new(&mut parts);
    pool::for_each(plan.tasks.len(), |i| {
        let task = &plan.tasks[i];
        // SAFETY: task i writes only its own piece.
        let out = unsafe { shared.piece(i * per_task, per_task) };
        SCRATCH.with_borrow_mut(|(scratch, slots)| {
            fill_slots(slots, d, t, task);
            let qb = &q[task.b * d.heads * hd..][..d.heads * hd];
            // SAFETY: `read_tables` checked every slot against the pool and `decode` that
            // the views span it; head_dim and group are multiples of the lanes (checked by
            // `Isa::best` and the format); an ISA only after its detection.
            let qi = qi.map(|x| (x, task.b * d.heads));
            unsafe { L::task(isa, keys, &heads, qb, qi, slots, sh, scratch, out) }
        })
    });
    let mut out = vec![0f32; d.batch * d.heads * hd];
    let mut lse = vec![0f32; d.batch * d.heads];
    let merge_one = |i: usize, o: &mut [f32], l: &mut [f32]| {
        merge(
            plan,
            &parts,
            d.kv_heads,
            stride,
            g,
            hd,
            i / d.kv_heads,
            i % d.kv_heads,
            o,
            l,
        )
    };
    // A merge is a few hundred operations per (sequence, KV head): in parallel only where
    // there are many.
    if d.batch * d.kv_heads < MERGE_PAR {
        for (i, (o, l)) in out
            .chunks_exact_mut(g * hd)
            .zip(lse.chunks_exact_mut(g))
            .enumerate()
        {
            merge_one(i, o, l);
        }
    } else {
        let shared = pool::Shared::new(&mut out);
        let shared_lse = pool::Shared::new(&mut lse);
        // SAFETY: merge i writes only its own pieces.
        pool::for_each(d.batch * d.kv_heads, |i| {
            merge_one(i, unsafe { shared.piece(i * g * hd, g * hd) }, unsafe {
                shared_lse.piece(i * g, g)
            })
        });
    }
    Out { out, lse }
}

/// A call's output (`[B, H, D]`) and log-sum-exp of each query head's scores (`[B, H]`).
struct Out {
    out: Vec<f32>,
    lse: Vec<f32>,
}

/// Pool slots of the task's positions, walking its block table.
fn fill_slots(slots: &mut Vec<u32>, d: &Dims, t: &Tables, task: &Task) {
    slots.clear();
    let bs = d.block_size;
    let table = &t.tables[task.b * d.max_blocks..][..d.max_blocks];
    let mut p = task.p0;
    while p < task.p1 {
        let end = ((p / bs + 1) * bs).min(task.p1);
        let base = table[p / bs] * bs as u32;
        slots.extend((p % bs..p % bs + end - p).map(|i| base + i as u32));
        p = end;
    }
}

/// Merges the chunks of (sequence `b`, KV head `kh`) into `o` (`[G, D]`) and their
/// log-sum-exp into `lse` (`[G]`); a sequence without positions gets zeros and −∞.
#[allow(clippy::too_many_arguments)]
fn merge(
    plan: &Plan,
    parts: &[f32],
    kv_heads: usize,
    stride: usize,
    g: usize,
    hd: usize,
    b: usize,
    kh: usize,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (first, nc) = plan.seqs[b];
    if nc == 0 {
        o.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let part = |c: usize| &parts[((first + c) * kv_heads + kh) * stride..][..stride];
    for j in 0..g {
        let m = (0..nc)
            .map(|c| part(c)[j])
            .fold(f32::NEG_INFINITY, f32::max);
        let oj = &mut o[j * hd..(j + 1) * hd];
        let mut z = 0f32;
        for c in 0..nc {
            let p = part(c);
            let w = (p[j] - m).exp();
            z += w * p[g + j];
            for (x, a) in oj.iter_mut().zip(&p[2 * g + j * hd..][..hd]) {
                *x += w * a;
            }
        }
        oj.iter_mut().for_each(|x| *x /= z);
        lse[j] = m + z.ln();
    }
}

fn slice<'a, T: WithDType>(s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    let Storage::Cpu(s) = s else {
        return Err(candle_core::Error::Msg(
            "decode_attention: expected CPU storage".into(),
        ));
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("decode_attention: non-contiguous pool".into()))?;
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

fn pool_err(what: &str, len: usize, need: usize) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "decode_attention: {what} holds {len} elements, the pool needs {need}"
    ))
}

pub(super) fn decode(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
) -> Result<Tensor> {
    if !dims.head_dim.is_multiple_of(8) {
        return generic::decode_checked(q, kv, dims, t, scale);
    }
    Ok(decode_lse(q, kv, dims, t, scale)?.0)
}

/// [`decode`] with each query head's log-sum-exp of its scaled scores (`[B·H]`, −∞ for a
/// sequence whose `starts` equals its `lens`): what merging with attention over other rows
/// needs (`kv::attend::residual`). Only the fused kernel gives it: a head dimension that is not a
/// multiple of 8 is refused.
pub(super) fn decode_lse(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
) -> Result<(Tensor, Vec<f32>)> {
    if !dims.head_dim.is_multiple_of(8) {
        return Err(candle_core::Error::Msg(format!(
            "decode_attention: head_dim {} is not a multiple of 8, which the fused CPU kernel \
             needs to merge with other rows",
            dims.head_dim
        )));
    }
    let isa = Isa::best(dims.head_dim);
    let keys = if super::exact_attention() {
        Keys::Exact
    } else {
        key_pass(kv, dims.head_dim, isa)
    };
    decode_with_lse(q, kv, dims, t, scale, isa, keys)
}

/// [`decode`] on a given vector implementation (`head_dim` a multiple of its lanes), scoring
/// keys as `keys` says (its [`key_pass`], or [`Keys::Exact`]): what the tests run each ISA with.
#[cfg(test)]
fn decode_with(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
    isa: Isa,
    keys: Keys,
) -> Result<Tensor> {
    Ok(decode_with_lse(q, kv, dims, t, scale, isa, keys)?.0)
}

/// The fused kernel on a given vector implementation (`head_dim` a multiple of its lanes),
/// scoring keys as `keys` says (its [`key_pass`], or [`Keys::Exact`]), with the log-sum-exp of
/// [`decode_lse`].
fn decode_with_lse(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
    isa: Isa,
    keys: Keys,
) -> Result<(Tensor, Vec<f32>)> {
    let d = dims;
    let qv: Vec<f32> = q
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| x * scale)
        .collect();
    // 4-bit rows decode byte-interleaved (`simd::element`): the query is permuted to that
    // order once here (4-bit keys), and the output back at the end (4-bit values), so the
    // kernel never permutes.
    let (k4, v4) = match kv {
        LayerKv::Affine { kfmt, vfmt, .. } => (kfmt.bits() == 4, vfmt.bits() == 4),
        LayerKv::Dense { .. } => (false, false),
    };
    let at = |e: usize| crate::simd::element(4, isa.lanes(), e / isa.lanes(), e % isa.lanes());
    let qi = (keys != Keys::Exact).then(|| QueryI8::new(&qv, d.head_dim));
    let qv = if k4 {
        permute_rows(&qv, d.head_dim, |qd, qs| {
            for (i, x) in qd.iter_mut().enumerate() {
                *x = qs[at(i)];
            }
        })
    } else {
        qv
    };
    let plan = plan(d, t);
    let Out { out, lse } = match kv {
        LayerKv::Dense { k, v } => dense_out(k, v, &plan, &qv, d, t, isa)?,
        LayerKv::Affine {
            kfmt, vfmt, k, v, ..
        } => affine_out(
            (*kfmt, *vfmt),
            k,
            v,
            &plan,
            (&qv, keys, qi.as_ref()),
            d,
            t,
            isa,
        )?,
    };
    let out = if v4 {
        permute_rows(&out, d.head_dim, |od, os| {
            for (i, x) in os.iter().enumerate() {
                od[at(i)] = *x;
            }
        })
    } else {
        out
    };
    let o = Tensor::from_vec(out, (d.batch, d.heads, d.head_dim), &Device::Cpu)?;
    Ok((o.to_dtype(q.dtype())?, lse))
}

/// Whether [`key_pass`] takes the 8-bit passes for keys of `format` on this CPU's best ISA
/// (values: [`int8v`] where they are 4-bit too).
pub(super) fn int8_attention(format: &crate::kv::format::KvFormat, head_dim: usize) -> bool {
    let key = match format {
        crate::kv::format::KvFormat::Affine { key, .. } => Some(*key),
        crate::kv::format::KvFormat::Dense(_) => None,
    };
    key_pass_for(key, head_dim, Isa::best(head_dim)) != Keys::Exact
}

/// The K pass of a call over `kv` on `isa` ([`key_pass_for`] of its keys' format).
fn key_pass(kv: &LayerKv, head_dim: usize, isa: Isa) -> Keys {
    let key = match kv {
        LayerKv::Affine { kfmt, .. } => Some(*kfmt),
        LayerKv::Dense { .. } => None,
    };
    key_pass_for(key, head_dim, isa)
}

/// The 8-bit K pass for `isa` where [`int8::takes`] the keys (`None`: dense) and the CPU has an
/// integer dot product; else exact. The one rule for the kernel and for the labels that name it.
fn key_pass_for(key: Option<QuantFormat>, head_dim: usize, isa: Isa) -> Keys {
    match key {
        Some(k) if int8::takes(k.bits(), k.group_size(), head_dim) => {}
        _ => return Keys::Exact,
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if int8::vnni_available() => Keys::Vnni,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => Keys::Madd,
        Isa::Portable => Keys::Exact,
    }
}

/// A new vector of `x`'s length whose rows of `n` are filled by `f(new_row, old_row)`.
fn permute_rows(x: &[f32], n: usize, f: impl Fn(&mut [f32], &[f32])) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (o, i) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        f(o, i);
    }
    out
}

/// The kernel over a dense pool.
fn dense_out(
    k: &Tensor,
    v: &Tensor,
    plan: &Plan,
    qv: &[f32],
    d: &Dims,
    t: &Tables,
    isa: Isa,
) -> Result<Out> {
    let slots = d.num_blocks * d.block_size;
    let width = d.kv_heads * d.head_dim;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    macro_rules! dense {
        ($t:ty) => {{
            let (kd, vd) = (slice::<$t>(&ks, kl)?, slice::<$t>(&vs, vl)?);
            for x in [kd, vd] {
                if x.len() < slots * width {
                    return Err(pool_err("dense K/V", x.len(), slots * width));
                }
            }
            run::<_, _, ExactOnly>(plan, qv, (Keys::Exact, None), d, t, d.head_dim, isa, |kh| {
                let view = |data| DenseRows::<$t> {
                    data,
                    stride: width,
                    head: kh * d.head_dim,
                };
                (view(kd), view(vd))
            })
        }};
    }
    Ok(match k.dtype() {
        DType::F32 => dense!(f32),
        DType::F16 => dense!(f16),
        DType::BF16 => dense!(bf16),
        dt => {
            return Err(candle_core::Error::Msg(format!(
                "decode_attention: unsupported cache dtype {dt:?}"
            )))
        }
    })
}

/// The kernel over an affine pool: one format for K and V, or keys one bit wider
/// ([`QuantFormat::one_bit_wider`]).
#[allow(clippy::too_many_arguments)]
fn affine_out(
    (kfmt, vfmt): (QuantFormat, QuantFormat),
    k: &Quantized,
    v: &Quantized,
    plan: &Plan,
    (qv, keys, qi): (&[f32], Keys, Option<&QueryI8>),
    d: &Dims,
    t: &Tables,
    isa: Isa,
) -> Result<Out> {
    let slots = d.num_blocks * d.block_size;
    let width = d.kv_heads * d.head_dim;
    let ts = [
        &k.codes, &k.scales, &k.biases, &v.codes, &v.scales, &v.biases,
    ]
    .map(|t| t.contiguous());
    let [kc, ks, kb, vc, vs, vb] = ts;
    let (kc, ks, kb, vc, vs, vb) = (kc?, ks?, kb?, vc?, vs?, vb?);
    let sl = [&kc, &ks, &kb, &vc, &vs, &vb].map(|t| t.storage_and_layout());
    let group = kfmt.group_size();
    if vfmt.group_size() != group {
        return Err(candle_core::Error::Msg(format!(
            "decode_attention: K groups of {group} with V groups of {}",
            vfmt.group_size()
        )));
    }
    macro_rules! affine {
        ($t:ty, $kb:literal, $vb:literal) => {
            affine!($t, $kb, $vb, ExactOnly)
        };
        ($t:ty, $kb:literal, $vb:literal, $launch:ty) => {{
            let kc = slice::<u32>(&sl[0].0, sl[0].1)?;
            let vc = slice::<u32>(&sl[3].0, sl[3].1)?;
            let params = [1, 2, 4, 5].map(|i| slice::<$t>(&sl[i].0, sl[i].1));
            let [ks, kb, vs, vb] = params;
            let (ks, kb, vs, vb) = (ks?, kb?, vs?, vb?);
            for (x, f) in [(kc, kfmt), (vc, vfmt)] {
                let need = slots * f.words_per_row(width);
                if x.len() < need {
                    return Err(pool_err("codes", x.len(), need));
                }
            }
            for (x, f) in [(ks, kfmt), (kb, kfmt), (vs, vfmt), (vb, vfmt)] {
                let need = slots * f.groups_per_row(width);
                if x.len() < need {
                    return Err(pool_err("scales/biases", x.len(), need));
                }
            }
            run::<_, _, $launch>(plan, qv, (keys, qi), d, t, group, isa, |kh| {
                (
                    AffineRows::<$t, $kb>::new(kfmt, (kc, ks, kb), d.kv_heads, d.head_dim, kh),
                    AffineRows::<$t, $vb>::new(vfmt, (vc, vs, vb), d.kv_heads, d.head_dim, kh),
                )
            })
        }};
    }
    macro_rules! bits {
        ($t:ty) => {
            match (kfmt.bits(), vfmt.bits()) {
                (2, 2) => affine!($t, 2, 2),
                (3, 3) => affine!($t, 3, 3),
                (4, 4) => affine!($t, 4, 4, WithInt),
                (5, 5) => affine!($t, 5, 5),
                (6, 6) => affine!($t, 6, 6),
                (8, 8) => affine!($t, 8, 8),
                (3, 2) => affine!($t, 3, 2),
                (4, 3) => affine!($t, 4, 3, WithInt),
                (5, 4) => affine!($t, 5, 4),
                (6, 5) => affine!($t, 6, 5),
                (kb, vb) => {
                    return Err(candle_core::Error::Msg(format!(
                        "decode_attention: no fused CPU kernel for {kb}-bit keys with {vb}-bit \
                         values"
                    )))
                }
            }
        };
    }
    Ok(match ks.dtype() {
        DType::F32 => bits!(f32),
        DType::F16 => bits!(f16),
        DType::BF16 => bits!(bf16),
        dt => {
            return Err(candle_core::Error::Msg(format!(
                "decode_attention: unsupported scale dtype {dt:?}"
            )))
        }
    })
}

#[cfg(test)]
mod tests;
