//! The fused CPU decode kernel.
//!
//! Work is split into tasks of (sequence, position chunk), run with rayon; each task returns,
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
mod kernel;
pub(crate) mod simd;

use super::{generic, Dims, Tables};
use crate::kv::layer::LayerKv;
use candle_core::{DType, Device, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};
use kernel::{AffineRows, DenseRows, Rows, Scratch, Shape};
use rayon::prelude::*;
use simd::{Portable, Simd};
use std::cell::RefCell;

/// Bounds of a task's length in positions.
const MIN_CHUNK: usize = 64;
const MAX_CHUNK: usize = 1024;
/// Chunks a sequence is split into, within those bounds.
const SPLITS: usize = 16;

/// Positions per task of a sequence with `span` visible positions. A function of the span
/// alone (not of the batch or the thread count): the chunking fixes the order in which a
/// sequence's partial softmax states are merged, so a query's result is the same whatever else
/// shares the call — batch invariance, and a prefill token attended as a decode query gives
/// what the same position gives when decoded.
fn chunk_len(span: usize) -> usize {
    span.div_ceil(SPLITS).clamp(MIN_CHUNK, MAX_CHUNK)
}

/// A cache element type, read as f32.
pub(crate) trait Elem: WithDType + Copy + Send + Sync {
    /// One value. Safety: the CPU supports `S`.
    unsafe fn to_f32<S: Simd>(self) -> f32;
    /// `S::LANES` consecutive values widened to f32. Safety: as [`Simd`]'s loads.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn to_f32<S: Simd>(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        S::load(p)
    }
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn to_f32<S: Simd>(self) -> f32 {
        S::half(self.to_bits())
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        S::load_f16(p.cast())
    }
}

impl Elem for bf16 {
    #[inline(always)]
    unsafe fn to_f32<S: Simd>(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        S::load_bf16(p.cast())
    }
}

/// Exact f16 → f32 without branches or lookups, so conversions vectorize (half's scalar
/// conversion is a per-element call): place exponent and mantissa in an f32 and rescale by
/// 2^112 (exact for normals and subnormals); exponent 31 (inf / NaN) maps to f32 inf / NaN.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let em = (h & 0x7fff) << 13;
    let sign = (h & 0x8000) << 16;
    let scaled = (f32::from_bits(em) * f32::from_bits(0x7780_0000)).to_bits();
    let v = if h & 0x7c00 == 0x7c00 {
        em | 0x7f80_0000
    } else {
        scaled
    };
    f32::from_bits(v | sign)
}

/// Which vector implementation runs the tasks (also `ops::row_matmul`'s tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest implementation this CPU has.
    pub(crate) fn widest() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Isa::Avx512;
            }
            if avx2::available() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every implementation this CPU has, narrowest first (tests run each).
    #[cfg(test)]
    pub(crate) fn all_available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::available() {
                v.push(Isa::Avx2);
            }
            if avx512::available() {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// f32 lanes of its vectors.
    fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            _ => 8,
        }
    }

    /// The widest implementation this CPU and head dimension allow (`head_dim % 8 == 0`; 16
    /// lanes need `head_dim % 16 == 0`).
    fn best(head_dim: usize) -> Isa {
        match Isa::widest() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if !head_dim.is_multiple_of(16) => Isa::Avx2,
            isa => isa,
        }
    }
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

/// Runs every task of `plan` and merges the partial states into `[B, H, D]`.
/// `views(kh)` gives the K and V rows of KV head `kh`.
fn run<R: AnyRows>(
    plan: &Plan,
    q: &[f32],
    d: &Dims,
    t: &Tables,
    group: usize,
    isa: Isa,
    views: impl Fn(usize) -> (R, R),
) -> Vec<f32> {
    let (g, hd) = (d.group, d.head_dim);
    let sh = Shape {
        g,
        head_dim: hd,
        group,
        groups: hd / group,
    };
    let heads: Vec<(R, R)> = (0..d.kv_heads).map(views).collect();
    // Per task and KV head: [max (G) | sum (G) | weighted V (G × head_dim)].
    let stride = 2 * g + g * hd;
    let mut parts = vec![0f32; plan.tasks.len() * d.kv_heads * stride];
    parts
        .par_chunks_mut(d.kv_heads * stride)
        .zip(plan.tasks.par_iter())
        .for_each(|(out, task)| {
            SCRATCH.with_borrow_mut(|(scratch, slots)| {
                fill_slots(slots, d, t, task);
                let qb = &q[task.b * d.heads * hd..][..d.heads * hd];
                // SAFETY: `read_tables` checked every slot against the pool and `decode` that
                // the views span it; head_dim and group are multiples of the lanes (checked by
                // `Isa::best` and the format); an ISA only after its detection.
                unsafe {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 => task_avx512(&heads, qb, slots, sh, scratch, out),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => task_avx2(&heads, qb, slots, sh, scratch, out),
                        Isa::Portable => {
                            kernel::task::<Portable, R>(&heads, qb, slots, sh, scratch, out)
                        }
                    }
                }
            })
        });
    let mut out = vec![0f32; d.batch * d.heads * hd];
    out.par_chunks_mut(g * hd).enumerate().for_each(|(i, o)| {
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
        )
    });
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn task_avx512<R: Rows<avx512::Avx512>>(
    heads: &[(R, R)],
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    kernel::task::<avx512::Avx512, R>(heads, q, slots, sh, scratch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<R: Rows<avx2::Avx2>>(
    heads: &[(R, R)],
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    kernel::task::<avx2::Avx2, R>(heads, q, slots, sh, scratch, out)
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

/// Merges the chunks of (sequence `b`, KV head `kh`) into `o` (`[G, D]`).
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
) {
    let (first, nc) = plan.seqs[b];
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
    decode_with(q, kv, dims, t, scale, Isa::best(dims.head_dim))
}

/// [`decode`] on a given vector implementation (`head_dim` a multiple of its lanes).
fn decode_with(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
    isa: Isa,
) -> Result<Tensor> {
    let d = dims;
    let qv: Vec<f32> = q
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| x * scale)
        .collect();
    // 4-bit rows decode byte-interleaved (`simd::element`): the query is permuted to that
    // order once here, and the output back at the end, so the kernel never permutes.
    let interleaved = matches!(kv, LayerKv::Affine { kfmt, .. } if kfmt.bits() == 4);
    let at = |e: usize| simd::element(4, isa.lanes(), e / isa.lanes(), e % isa.lanes());
    let qv = if interleaved {
        let mut qp = vec![0f32; qv.len()];
        for (qd, qs) in qp
            .chunks_exact_mut(d.head_dim)
            .zip(qv.chunks_exact(d.head_dim))
        {
            for (i, x) in qd.iter_mut().enumerate() {
                *x = qs[at(i)];
            }
        }
        qp
    } else {
        qv
    };
    let plan = plan(d, t);
    let slots = d.num_blocks * d.block_size;
    let width = d.kv_heads * d.head_dim;
    let out = match kv {
        LayerKv::Dense { k, v } => {
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
                    run(&plan, &qv, d, t, d.head_dim, isa, |kh| {
                        let view = |data| DenseRows::<$t> {
                            data,
                            stride: width,
                            head: kh * d.head_dim,
                        };
                        (view(kd), view(vd))
                    })
                }};
            }
            match k.dtype() {
                DType::F32 => dense!(f32),
                DType::F16 => dense!(f16),
                DType::BF16 => dense!(bf16),
                dt => {
                    return Err(candle_core::Error::Msg(format!(
                        "decode_attention: unsupported cache dtype {dt:?}"
                    )))
                }
            }
        }
        LayerKv::Affine {
            kfmt: fmt, k, v, ..
        } => {
            let ts = [
                &k.codes, &k.scales, &k.biases, &v.codes, &v.scales, &v.biases,
            ]
            .map(|t| t.contiguous());
            let [kc, ks, kb, vc, vs, vb] = ts;
            let (kc, ks, kb, vc, vs, vb) = (kc?, ks?, kb?, vc?, vs?, vb?);
            let sl = [&kc, &ks, &kb, &vc, &vs, &vb].map(|t| t.storage_and_layout());
            let group = fmt.group_size();
            let (row_words, row_groups) = (fmt.words_per_row(width), fmt.groups_per_row(width));
            let (head_words, ng) = (fmt.words_per_row(d.head_dim), d.head_dim / group);
            macro_rules! affine {
                ($t:ty, $b:literal) => {{
                    let kc = slice::<u32>(&sl[0].0, sl[0].1)?;
                    let vc = slice::<u32>(&sl[3].0, sl[3].1)?;
                    let params = [1, 2, 4, 5].map(|i| slice::<$t>(&sl[i].0, sl[i].1));
                    let [ks, kb, vs, vb] = params;
                    let (ks, kb, vs, vb) = (ks?, kb?, vs?, vb?);
                    for x in [kc, vc] {
                        if x.len() < slots * row_words {
                            return Err(pool_err("codes", x.len(), slots * row_words));
                        }
                    }
                    for x in [ks, kb, vs, vb] {
                        if x.len() < slots * row_groups {
                            return Err(pool_err("scales/biases", x.len(), slots * row_groups));
                        }
                    }
                    run(&plan, &qv, d, t, group, isa, |kh| {
                        let view = |codes, scales, biases| AffineRows::<$t, $b> {
                            codes,
                            scales,
                            biases,
                            row_words,
                            head_word: kh * head_words,
                            head_words,
                            row_groups,
                            head_group: kh * ng,
                        };
                        (view(kc, ks, kb), view(vc, vs, vb))
                    })
                }};
            }
            macro_rules! bits {
                ($t:ty) => {
                    match fmt.bits() {
                        2 => affine!($t, 2),
                        3 => affine!($t, 3),
                        4 => affine!($t, 4),
                        5 => affine!($t, 5),
                        6 => affine!($t, 6),
                        _ => affine!($t, 8),
                    }
                };
            }
            match ks.dtype() {
                DType::F32 => bits!(f32),
                DType::F16 => bits!(f16),
                DType::BF16 => bits!(bf16),
                dt => {
                    return Err(candle_core::Error::Msg(format!(
                        "decode_attention: unsupported scale dtype {dt:?}"
                    )))
                }
            }
        }
    };
    let out = if interleaved {
        let mut o = vec![0f32; out.len()];
        for (od, os) in o
            .chunks_exact_mut(d.head_dim)
            .zip(out.chunks_exact(d.head_dim))
        {
            for (i, x) in os.iter().enumerate() {
                od[at(i)] = *x;
            }
        }
        o
    } else {
        out
    };
    Tensor::from_vec(out, (d.batch, d.heads, d.head_dim), &Device::Cpu)?.to_dtype(q.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::{check_shapes, read_tables};
    use super::*;
    use crate::kv::layer::KvFormat;
    use crate::kv::quant::QuantFormat;

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_bits_to_f32(bits);
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{bits:#x}");
            }
        }
    }

    /// Deterministic values in [-2, 2).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 8) as f32 / (1u32 << 22) as f32 - 2.0
            })
            .collect()
    }

    /// K/V values of a pool of `per_seq` blocks per sequence, and the tables, starts and lens
    /// of `seqs` (start, len) over it; block ids reversed so tables are not the identity.
    struct Fixture {
        bs: usize,
        kvh: usize,
        k: Tensor,
        v: Tensor,
        table: Vec<u32>,
        per_seq: usize,
        seqs: Vec<(usize, usize)>,
    }

    impl Fixture {
        fn new(seqs: &[(usize, usize)], per_seq: usize, kvh: usize, hd: usize, seed: u32) -> Self {
            let bs = 16;
            let num_blocks = seqs.len() * per_seq;
            let (slots, width) = (num_blocks * bs, kvh * hd);
            let dev = Device::Cpu;
            let k = Tensor::from_vec(values(slots * width, seed), (slots, width), &dev).unwrap();
            let v = Tensor::from_vec(values(slots * width, seed + 1), (slots, width), &dev);
            Fixture {
                bs,
                kvh,
                k,
                v: v.unwrap(),
                table: (0..num_blocks as u32).rev().collect(),
                per_seq,
                seqs: seqs.to_vec(),
            }
        }

        /// The fixture's K/V stored in `format`.
        fn pool(&self, format: KvFormat) -> LayerKv {
            let (slots, width) = self.k.dims2().unwrap();
            let kv = LayerKv::zeros(format, slots, width, &Device::Cpu).unwrap();
            kv.write_run(0, &self.k, &self.v).unwrap();
            kv
        }

        /// Shapes and host tables of a call for sequences `which` with queries `q`.
        fn call(&self, q: &Tensor, kv: &LayerKv, which: &[usize]) -> (Dims, Tables) {
            let (b, dev) = (which.len(), Device::Cpu);
            let u32s = |v: Vec<u32>| Tensor::from_vec(v, b, &dev).unwrap();
            let tables: Vec<u32> = which
                .iter()
                .flat_map(|&i| self.table[i * self.per_seq..(i + 1) * self.per_seq].to_vec())
                .collect();
            let tables = Tensor::from_vec(tables, (b, self.per_seq), &dev).unwrap();
            let starts = u32s(which.iter().map(|&i| self.seqs[i].0 as u32).collect());
            let lens = u32s(which.iter().map(|&i| self.seqs[i].1 as u32).collect());
            let dims = check_shapes(q, kv, &tables, &starts, &lens, self.bs, self.kvh).unwrap();
            let t = read_tables(&dims, &tables, &starts, &lens).unwrap();
            (dims, t)
        }

        /// The generic reference and every vector implementation's output for all sequences.
        fn outputs(
            &self,
            q: &Tensor,
            kv: &LayerKv,
            scale: f32,
        ) -> (Vec<f32>, Vec<(Isa, Vec<f32>)>) {
            let all: Vec<usize> = (0..self.seqs.len()).collect();
            let (dims, t) = self.call(q, kv, &all);
            let flat = |x: Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
            let want = flat(generic::decode_checked(q, kv, &dims, &t, scale).unwrap());
            let got = Isa::all_available()
                .into_iter()
                .map(|isa| {
                    (
                        isa,
                        flat(decode_with(q, kv, &dims, &t, scale, isa).unwrap()),
                    )
                })
                .collect();
            (want, got)
        }
    }

    /// Every vector implementation this CPU has matches the generic reference, at head_dim 64
    /// with GQA 3 (the default model's shape), for dense and odd/even bit widths.
    #[test]
    fn every_vector_code_matches_reference() {
        let (kvh, g, hd) = (2usize, 3usize, 64usize);
        let f = Fixture::new(&[(0, 37), (20, 150), (0, 1)], 10, kvh, hd, 1);
        let q = values(3 * kvh * g * hd, 3);
        let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
        // f32 scales: with f16 ones the reference rounds dequantized values to f16.
        let affine = |bits, group| {
            KvFormat::affine(QuantFormat::new(bits, group).unwrap(), DType::F32, false)
        };
        for format in [
            KvFormat::Dense(DType::F16),
            KvFormat::Dense(DType::F32),
            affine(4, 64),
            affine(4, 32),
            affine(3, 32),
            affine(2, 32),
            affine(8, 32),
        ] {
            let (want, got) = f.outputs(&q, &f.pool(format), 0.125);
            for (isa, got) in got {
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1e-2))
                    .fold(0f32, f32::max);
                assert!(err < 1e-4, "{format:?} {isa:?}: rel err {err}");
            }
        }
    }

    /// Every vector implementation matches the generic reference at head_dim 128 for every bit
    /// width × group size × GQA ratio {1, 3, 8} (query-head chunks of 1, 3 and 4+4; 4-bit
    /// tables; column blocks spanning one group, two groups, or half a group), with ragged
    /// lengths, an odd final row pair and V tiles cut short.
    #[test]
    fn every_isa_matches_reference_all_formats() {
        let (kvh, hd) = (2usize, 128usize);
        let f = Fixture::new(&[(0, 45), (3, 77), (0, 1)], 5, kvh, hd, 7);
        for g in [1usize, 3, 8] {
            let q = values(3 * kvh * g * hd, 9 + g as u32);
            let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
            for bits in [2u32, 3, 4, 5, 6, 8] {
                for group in [32usize, 64, 128] {
                    let fmt = QuantFormat::new(bits, group).unwrap();
                    let kv = f.pool(KvFormat::affine(fmt, DType::F32, false));
                    let (want, got) = f.outputs(&q, &kv, 0.1);
                    // The contract's measure: max |error| / max |reference|.
                    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (isa, got) in got {
                        let err = got
                            .iter()
                            .zip(&want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max)
                            / scale;
                        assert!(err < 1e-4, "{bits}-bit g{group} GQA {g} {isa:?}: {err}");
                    }
                }
            }
        }
    }

    /// A sequence decoded among others of other lengths (one of them long enough to be split
    /// into many chunks) gives the same bits as decoded alone, on every vector implementation.
    #[test]
    fn a_sequence_does_not_depend_on_the_batch() {
        let (kvh, g, hd) = (3usize, 3usize, 64usize);
        let seqs = [(0usize, 37usize), (0, 700), (20, 150), (0, 1), (300, 1500)];
        let nb = seqs.len();
        let f = Fixture::new(&seqs, 1500usize.div_ceil(16), kvh, hd, 1);
        let q = values(nb * kvh * g * hd, 3);
        let q = Tensor::from_vec(q, (nb, kvh * g, hd), &Device::Cpu).unwrap();
        let call = |kv: &LayerKv, isa: Isa, which: &[usize]| -> Vec<u32> {
            let ids: Vec<u32> = which.iter().map(|&i| i as u32).collect();
            let ids = Tensor::from_vec(ids, which.len(), &Device::Cpu).unwrap();
            let qb = q.index_select(&ids, 0).unwrap();
            let (dims, t) = f.call(&qb, kv, which);
            let out = decode_with(&qb, kv, &dims, &t, 0.125, isa).unwrap();
            let out: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
            out.iter().map(|x| x.to_bits()).collect()
        };
        let affine =
            |bits| KvFormat::affine(QuantFormat::new(bits, 64).unwrap(), DType::F32, false);
        for format in [KvFormat::Dense(DType::F32), affine(4), affine(8)] {
            let kv = f.pool(format);
            for isa in Isa::all_available() {
                let all: Vec<usize> = (0..nb).collect();
                let together = call(&kv, isa, &all);
                let row = kvh * g * hd;
                for i in 0..nb {
                    let alone = call(&kv, isa, &[i]);
                    assert_eq!(
                        alone,
                        together[i * row..(i + 1) * row],
                        "{format:?} {isa:?}: sequence {i}"
                    );
                }
            }
        }
    }
}
