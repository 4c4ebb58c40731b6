//! The fused CPU decode kernel.
//!
//! Work is split into tasks of (sequence, KV head, chunk of up to `CHUNK` positions), run with
//! rayon; each task makes two passes over its rows — K rows to scores, then V rows weighted by
//! `exp(score - max)` — and returns its softmax max, sum and weighted V, which are merged per
//! (sequence, KV head) at the end. Every K/V row is read once for all `G` query heads that share
//! it.
//!
//! Quantized rows with 2, 4 or 8 bits are unpacked word-parallel: code `k` of every word of a
//! group first, then code `k + 1`, ... — a permutation of the group's values that turns the unpack
//! into contiguous shift/mask loops the compiler vectorizes. Dot products do not care about the
//! order, so the query is permuted the same way once per task, and the V accumulator is permuted
//! back at the end. 3, 5 and 6 bits (codes straddle words) are unpacked in natural order.
//!
//! f16 and bf16 are widened with branch-free bit arithmetic that vectorizes.
//!
//! On x86-64 with AVX2 + FMA the task body is compiled a second time with those features and
//! chosen at run time.

use super::{Dims, Tables};
use crate::kv::layer::LayerKv;
use candle_core::{DType, Device, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

/// Positions per task: enough work to amortise a task, few enough that long contexts of a small
/// batch still give every core several tasks.
const CHUNK: usize = 512;

/// A cache element type, read as f32.
pub(crate) trait Elem: WithDType + Copy + Send + Sync {
    fn load(src: &[Self], dst: &mut [f32]);
    fn get(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f16_bits_to_f32(s.to_bits());
        }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// Exact f16 → f32 without branches or lookups, so row conversions vectorize (half's scalar
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

/// One layer's pool as plain slices.
enum Pool<'a, T> {
    Dense {
        k: &'a [T],
        v: &'a [T],
    },
    Affine {
        bits: u32,
        group: usize,
        k: QSlices<'a, T>,
        v: QSlices<'a, T>,
    },
}

struct QSlices<'a, T> {
    codes: &'a [u32],
    scales: &'a [T],
    biases: &'a [T],
}

struct Ctx<'a, T> {
    pool: Pool<'a, T>,
    /// `[B, H, D]`, already multiplied by the softmax scale.
    q: &'a [f32],
    dims: Dims,
    t: &'a Tables,
}

#[derive(Clone, Copy)]
struct Task {
    b: usize,
    kh: usize,
    p0: usize,
    p1: usize,
}

/// Softmax state of one task: per query head max and sum, and the weighted V (`[G, D]`).
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
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

pub(super) fn decode(
    q: &Tensor,
    kv: &LayerKv,
    dims: &Dims,
    t: &Tables,
    scale: f32,
) -> Result<Tensor> {
    let qv: Vec<f32> = q
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| x * scale)
        .collect();
    let out = match kv {
        LayerKv::Dense { k, v } => {
            let (k, v) = (k.contiguous()?, v.contiguous()?);
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            macro_rules! dense {
                ($t:ty) => {
                    run::<$t>(&Ctx {
                        pool: Pool::Dense {
                            k: slice(&ks, kl)?,
                            v: slice(&vs, vl)?,
                        },
                        q: &qv,
                        dims: *dims,
                        t,
                    })
                };
            }
            match k.dtype() {
                DType::F32 => dense!(f32),
                DType::F16 => dense!(f16),
                DType::BF16 => dense!(bf16),
                d => {
                    return Err(candle_core::Error::Msg(format!(
                        "decode_attention: unsupported cache dtype {d:?}"
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
            macro_rules! affine {
                ($t:ty) => {
                    run::<$t>(&Ctx {
                        pool: Pool::Affine {
                            bits: fmt.bits(),
                            group: fmt.group_size(),
                            k: QSlices {
                                codes: slice(&sl[0].0, sl[0].1)?,
                                scales: slice(&sl[1].0, sl[1].1)?,
                                biases: slice(&sl[2].0, sl[2].1)?,
                            },
                            v: QSlices {
                                codes: slice(&sl[3].0, sl[3].1)?,
                                scales: slice(&sl[4].0, sl[4].1)?,
                                biases: slice(&sl[5].0, sl[5].1)?,
                            },
                        },
                        q: &qv,
                        dims: *dims,
                        t,
                    })
                };
            }
            match ks.dtype() {
                DType::F32 => affine!(f32),
                DType::F16 => affine!(f16),
                DType::BF16 => affine!(bf16),
                d => {
                    return Err(candle_core::Error::Msg(format!(
                        "decode_attention: unsupported scale dtype {d:?}"
                    )))
                }
            }
        }
    };
    Tensor::from_vec(out, (dims.batch, dims.heads, dims.head_dim), &Device::Cpu)?
        .to_dtype(q.dtype())
}

/// Splits the batch into tasks, runs them in parallel and merges their partial softmax states.
fn run<T: Elem>(ctx: &Ctx<T>) -> Vec<f32> {
    let d = ctx.dims;
    let mut tasks = Vec::new();
    for b in 0..d.batch {
        let (s, l) = (ctx.t.starts[b] as usize, ctx.t.lens[b] as usize);
        for kh in 0..d.kv_heads {
            let mut p0 = s;
            while p0 < l {
                let p1 = (p0 + CHUNK).min(l);
                tasks.push(Task { b, kh, p0, p1 });
                p0 = p1;
            }
        }
    }
    let parts: Vec<Partial> = tasks.par_iter().map(|&task| run_task(ctx, task)).collect();
    let (g, hd) = (d.group, d.head_dim);
    let mut out = vec![0f32; d.batch * d.heads * hd];
    let mut i = 0;
    while i < tasks.len() {
        let (b, kh) = (tasks[i].b, tasks[i].kh);
        let mut e = i;
        while e < tasks.len() && tasks[e].b == b && tasks[e].kh == kh {
            e += 1;
        }
        let o = &mut out[(b * d.heads + kh * g) * hd..][..g * hd];
        for j in 0..g {
            let m = parts[i..e]
                .iter()
                .map(|p| p.m[j])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f32;
            let oj = &mut o[j * hd..(j + 1) * hd];
            for p in &parts[i..e] {
                let w = (p.m[j] - m).exp();
                z += w * p.l[j];
                for (x, a) in oj.iter_mut().zip(&p.acc[j * hd..(j + 1) * hd]) {
                    *x += w * a;
                }
            }
            for x in oj.iter_mut() {
                *x /= z;
            }
        }
        i = e;
    }
    out
}

fn run_task<T: Elem>(ctx: &Ctx<T>, task: Task) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { run_task_avx2(ctx, task) };
        }
    }
    task_body(ctx, task)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_task_avx2<T: Elem>(ctx: &Ctx<T>, task: Task) -> Partial {
    task_body(ctx, task)
}

#[inline(always)]
fn task_body<T: Elem>(ctx: &Ctx<T>, task: Task) -> Partial {
    match &ctx.pool {
        Pool::Dense { k, v } => dense_task(ctx, task, k, v),
        Pool::Affine { bits, group, k, v } => match bits {
            2 => affine_task::<T, 2>(ctx, task, *group, k, v),
            3 => affine_task::<T, 3>(ctx, task, *group, k, v),
            4 => affine_task::<T, 4>(ctx, task, *group, k, v),
            5 => affine_task::<T, 5>(ctx, task, *group, k, v),
            6 => affine_task::<T, 6>(ctx, task, *group, k, v),
            _ => affine_task::<T, 8>(ctx, task, *group, k, v),
        },
    }
}

/// Slot of position `p` of sequence `b`.
#[inline(always)]
fn slot(ctx_t: &Tables, d: &Dims, b: usize, p: usize) -> usize {
    ctx_t.tables[b * d.max_blocks + p / d.block_size] as usize * d.block_size + p % d.block_size
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().unwrap(), y.try_into().unwrap());
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = ar.iter().zip(br).map(|(x, y)| x * y).sum::<f32>();
    for v in acc {
        s += v;
    }
    s
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `e^x` for `x <= 0` to ~2e-7 relative, branch-free so the softmax loop vectorizes.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: add/sub rounds to an integer
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// Turns `scores` (`[G, n]`) into `exp(score - max)` in place; returns per-head max and sum.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], g: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut ms = vec![0f32; g];
    let mut ls = vec![0f32; g];
    for j in 0..g {
        let row = &mut scores[j * n..(j + 1) * n];
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut l = 0f32;
        for x in row.iter_mut() {
            *x = exp_neg(*x - m);
            l += *x;
        }
        ms[j] = m;
        ls[j] = l;
    }
    (ms, ls)
}

#[inline(always)]
fn dense_task<T: Elem>(ctx: &Ctx<T>, task: Task, k: &[T], v: &[T]) -> Partial {
    let d = &ctx.dims;
    let (g, hd) = (d.group, d.head_dim);
    let width = d.kv_heads * hd;
    let n = task.p1 - task.p0;
    let qh = &ctx.q[(task.b * d.heads + task.kh * g) * hd..][..g * hd];
    let mut scores = vec![0f32; g * n];
    let mut buf = vec![0f32; hd];
    for (t, p) in (task.p0..task.p1).enumerate() {
        let s = slot(ctx.t, d, task.b, p);
        T::load(&k[s * width + task.kh * hd..][..hd], &mut buf);
        for j in 0..g {
            scores[j * n + t] = dot(&qh[j * hd..(j + 1) * hd], &buf);
        }
    }
    let (m, l) = softmax_rows(&mut scores, g, n);
    let mut acc = vec![0f32; g * hd];
    for (t, p) in (task.p0..task.p1).enumerate() {
        let s = slot(ctx.t, d, task.b, p);
        T::load(&v[s * width + task.kh * hd..][..hd], &mut buf);
        for j in 0..g {
            axpy(scores[j * n + t], &buf, &mut acc[j * hd..(j + 1) * hd]);
        }
    }
    Partial { m, l, acc }
}

/// Where value `i` of a group of `gsz` values lands after [`unpack`].
#[inline(always)]
fn perm<const B: u32>(i: usize, gsz: usize) -> usize {
    if 32 % B == 0 {
        let cpw = (32 / B) as usize;
        let gw = gsz * B as usize / 32;
        (i % cpw) * gw + i / cpw
    } else {
        i
    }
}

/// Unpacks one head's codes (`words`: `D*B/32` words, groups of `gsz`) into `out` as f32, in
/// the order of [`perm`].
#[inline(always)]
fn unpack<const B: u32>(words: &[u32], gsz: usize, out: &mut [f32]) {
    let mask = (1u32 << B) - 1;
    if 32 % B == 0 {
        let cpw = (32 / B) as usize;
        let gw = gsz * B as usize / 32;
        for (gwords, o) in words.chunks_exact(gw).zip(out.chunks_exact_mut(gsz)) {
            for k in 0..cpw {
                let sh = k as u32 * B;
                for (w, x) in gwords.iter().zip(&mut o[k * gw..(k + 1) * gw]) {
                    *x = ((w >> sh) & mask) as i32 as f32;
                }
            }
        }
    } else {
        for (cw, o) in words.chunks_exact(B as usize).zip(out.chunks_exact_mut(32)) {
            for (k, x) in o.iter_mut().enumerate() {
                let bit = k as u32 * B;
                let (w, s) = ((bit / 32) as usize, bit % 32);
                let mut c = cw[w] >> s;
                if s + B > 32 {
                    c |= cw[w + 1] << (32 - s);
                }
                *x = (c & mask) as i32 as f32;
            }
        }
    }
}

#[inline(always)]
fn affine_task<T: Elem, const B: u32>(
    ctx: &Ctx<T>,
    task: Task,
    gsz: usize,
    k: &QSlices<T>,
    v: &QSlices<T>,
) -> Partial {
    let d = &ctx.dims;
    let (g, hd) = (d.group, d.head_dim);
    let ng = hd / gsz;
    let head_words = hd * B as usize / 32;
    let row_words = d.kv_heads * head_words;
    let row_groups = d.kv_heads * ng;
    let n = task.p1 - task.p0;
    let qh = &ctx.q[(task.b * d.heads + task.kh * g) * hd..][..g * hd];
    // The query in unpack order, and its sum per group (the bias term).
    let mut qp = vec![0f32; g * hd];
    let mut qsum = vec![0f32; g * ng];
    for j in 0..g {
        for gi in 0..ng {
            let base = j * hd + gi * gsz;
            for i in 0..gsz {
                qp[base + perm::<B>(i, gsz)] = qh[base + i];
            }
            qsum[j * ng + gi] = qh[base..base + gsz].iter().sum();
        }
    }
    let mut scores = vec![0f32; g * n];
    let mut buf = vec![0f32; hd];
    for (t, p) in (task.p0..task.p1).enumerate() {
        let s = slot(ctx.t, d, task.b, p);
        unpack::<B>(
            &k.codes[s * row_words + task.kh * head_words..][..head_words],
            gsz,
            &mut buf,
        );
        let pg = s * row_groups + task.kh * ng;
        let (sc, bi) = (&k.scales[pg..pg + ng], &k.biases[pg..pg + ng]);
        for j in 0..g {
            let mut acc = 0f32;
            for gi in 0..ng {
                let o = gi * gsz;
                acc += sc[gi].get() * dot(&qp[j * hd + o..j * hd + o + gsz], &buf[o..o + gsz])
                    + bi[gi].get() * qsum[j * ng + gi];
            }
            scores[j * n + t] = acc;
        }
    }
    let (m, l) = softmax_rows(&mut scores, g, n);
    let mut accp = vec![0f32; g * hd];
    let mut accb = vec![0f32; g * ng];
    for (t, p) in (task.p0..task.p1).enumerate() {
        let s = slot(ctx.t, d, task.b, p);
        unpack::<B>(
            &v.codes[s * row_words + task.kh * head_words..][..head_words],
            gsz,
            &mut buf,
        );
        let pg = s * row_groups + task.kh * ng;
        let (sc, bi) = (&v.scales[pg..pg + ng], &v.biases[pg..pg + ng]);
        for gi in 0..ng {
            let (s, b) = (sc[gi].get(), bi[gi].get());
            let o = gi * gsz;
            for j in 0..g {
                let pj = scores[j * n + t];
                axpy(
                    pj * s,
                    &buf[o..o + gsz],
                    &mut accp[j * hd + o..j * hd + o + gsz],
                );
                accb[j * ng + gi] += pj * b;
            }
        }
    }
    let mut acc = vec![0f32; g * hd];
    for j in 0..g {
        for gi in 0..ng {
            let base = j * hd + gi * gsz;
            for i in 0..gsz {
                acc[base + i] = accp[base + perm::<B>(i, gsz)] + accb[j * ng + gi];
            }
        }
    }
    Partial { m, l, acc }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
