//! One task of the fused CPU decode kernel — a run of positions of one (sequence, KV head) for
//! all `G` query heads sharing it — written once over the vector operations of [`Simd`].
//!
//! Quantized values are rebuilt in registers, `x̂ = code·scale + bias` (one multiply-add per
//! vector of `LANES` values, shared by all `G` query heads), and never stored: that costs one
//! multiply-add per `G` of the attention itself, less than applying scales and biases to each
//! head's partial sums would cost in scalar bookkeeping.
//!
//! - K pass, row by row: the `G` dot products of the query heads with the row run side by side,
//!   each reduced to a score at the row's end.
//! - Softmax statistics in f32 over the task's scores.
//! - V pass, in tiles of [`TILE`] positions: for each vector column of the head, the tile's rows
//!   are rebuilt and accumulated for the query heads in registers (two interleaved position
//!   streams, so the multiply-add chains overlap).
//!
//! Query heads are processed in chunks of up to four (`NJ`, a compile-time size so the
//! accumulators stay in registers); a row is decoded once per chunk.

use super::simd::{element, Simd};
use super::Elem;

/// Positions per V tile: the tile's rows stay in L1 while every column of the head is summed.
pub(super) const TILE: usize = 32;

/// How many rows ahead the K pass prefetches. A head's slice of a slot is a short piece of a
/// long row, so hardware prefetchers see a strided, block-shuffled pattern; without explicit
/// prefetches the kernel waits on memory latency instead of bandwidth.
const PREFETCH: usize = 16;

/// One (KV head, K or V) view of a layer's pool: where a slot's row starts and how to decode it.
pub(super) trait Rows<S: Simd>: Sync {
    /// Whether rows carry a scale and a bias per group.
    const AFFINE: bool;
    /// Whether [`Rows::vec`] gives 4-bit codes in byte-interleaved order
    /// ([`element`](super::simd::element)); else natural order.
    const INTERLEAVED: bool;
    /// Offset of `slot`'s row of this KV head in the pool's element (or word) slice.
    fn row(&self, slot: usize) -> usize;
    /// Vector `v` of the row at `row`: values `LANES*v..LANES*(v+1)`, or for interleaved rows
    /// the values [`element`] names.
    ///
    /// Safety: `row` comes from [`Rows::row`] of a slot inside the pool,
    /// `v < head_dim / LANES`, and the CPU supports `S`.
    unsafe fn vec(&self, row: usize, v: usize) -> S::V;
    /// Scale and bias of group `g` of `slot` (dense rows: 1 and 0). Safety: the CPU supports `S`.
    unsafe fn scale_bias(&self, slot: usize, g: usize) -> (f32, f32);
    /// Starts loading `slot`'s row of this head (values, codes, scales and biases) into cache.
    fn prefetch(&self, slot: usize);
}

/// Prefetches every cache line of `len` elements from `data[at]`.
#[inline(always)]
fn prefetch_span<S: Simd, T>(data: &[T], at: usize, len: usize) {
    let first = data.as_ptr().wrapping_add(at) as usize;
    let last = (first + len * std::mem::size_of::<T>() - 1) & !63;
    let mut line = first & !63;
    // SAFETY (all prefetches): a prefetch never faults, whatever the address.
    unsafe { S::prefetch(line as *const u8) };
    while line < last {
        line += 64;
        unsafe { S::prefetch(line as *const u8) };
    }
}

/// Dense rows of element type `T`.
pub(super) struct DenseRows<'a, T> {
    pub data: &'a [T],
    /// Values per slot (all KV heads).
    pub stride: usize,
    /// Offset of this KV head inside a slot's row, and its number of values.
    pub head: usize,
    pub head_len: usize,
}

impl<S: Simd, T: Elem> Rows<S> for DenseRows<'_, T> {
    const AFFINE: bool = false;
    const INTERLEAVED: bool = false;
    #[inline(always)]
    fn row(&self, slot: usize) -> usize {
        slot * self.stride + self.head
    }
    #[inline(always)]
    unsafe fn vec(&self, row: usize, v: usize) -> S::V {
        T::load::<S>(self.data.as_ptr().add(row + S::LANES * v))
    }
    #[inline(always)]
    unsafe fn scale_bias(&self, _: usize, _: usize) -> (f32, f32) {
        (1.0, 0.0)
    }
    #[inline(always)]
    fn prefetch(&self, slot: usize) {
        prefetch_span::<S, T>(self.data, <Self as Rows<S>>::row(self, slot), self.head_len);
    }
}

/// `B`-bit affine rows with scales and biases of type `T`.
pub(super) struct AffineRows<'a, T, const B: u32> {
    pub codes: &'a [u32],
    pub scales: &'a [T],
    pub biases: &'a [T],
    /// Code words per slot and this head's first word in a slot.
    pub row_words: usize,
    pub head_word: usize,
    /// Code words of one head's row.
    pub head_words: usize,
    /// Groups per slot and this head's first group in a slot.
    pub row_groups: usize,
    pub head_group: usize,
    /// Groups of one head's row.
    pub head_groups: usize,
}

impl<S: Simd, T: Elem, const B: u32> Rows<S> for AffineRows<'_, T, B> {
    const AFFINE: bool = true;
    const INTERLEAVED: bool = B == 4;
    #[inline(always)]
    fn row(&self, slot: usize) -> usize {
        slot * self.row_words + self.head_word
    }
    #[inline(always)]
    unsafe fn vec(&self, row: usize, v: usize) -> S::V {
        S::codes::<B>(self.codes.as_ptr().add(row), self.head_words, v)
    }
    #[inline(always)]
    unsafe fn scale_bias(&self, slot: usize, g: usize) -> (f32, f32) {
        let i = slot * self.row_groups + self.head_group + g;
        (self.scales[i].to_f32::<S>(), self.biases[i].to_f32::<S>())
    }
    #[inline(always)]
    fn prefetch(&self, slot: usize) {
        let row = <Self as Rows<S>>::row(self, slot);
        prefetch_span::<S, u32>(self.codes, row, self.head_words);
        let i = slot * self.row_groups + self.head_group;
        prefetch_span::<S, T>(self.scales, i, self.head_groups);
        prefetch_span::<S, T>(self.biases, i, self.head_groups);
    }
}

/// Sizes of a task.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    /// Query heads per KV head.
    pub g: usize,
    pub head_dim: usize,
    /// Values per group (dense: head_dim).
    pub group: usize,
}

/// Per-thread buffers, grown as needed and reused across tasks and calls.
#[derive(Default)]
pub(super) struct Scratch {
    scores: Vec<f32>,
    /// (scale, bias) of each (position, group) of a V tile.
    params: Vec<f32>,
    /// The query, and then the accumulators, in decoded order (interleaved rows only).
    perm: Vec<f32>,
    rows: Vec<usize>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// Runs one task: `q` is `[G, head_dim]` (scaled), `slots` the pool slots of the task's
/// positions. Writes `out = [max (G) | sum (G) | weighted V (G × head_dim)]`.
///
/// Safety: every slot lies inside the pools of `k` and `v`, `head_dim % group == 0`,
/// `group % S::LANES == 0`, and the CPU supports `S`.
#[inline(always)]
pub(super) unsafe fn task<S: Simd, R: Rows<S>>(
    k: &R,
    v: &R,
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (g, hd) = (sh.g, sh.head_dim);
    let ng = hd / sh.group;
    let n = slots.len();
    let at = |e: usize| element(4, S::LANES, e / S::LANES, e % S::LANES);
    let q = if R::INTERLEAVED {
        let qp = sized(&mut scratch.perm, g * hd);
        for (qd, qs) in qp.chunks_exact_mut(hd).zip(q.chunks_exact(hd)) {
            for (i, x) in qd.iter_mut().enumerate() {
                *x = qs[at(i)];
            }
        }
        &*qp
    } else {
        q
    };
    let scores = sized(&mut scratch.scores, g * n);
    chunks(g, |j0, nj| match nj {
        4 => k_pass::<S, R, 4>(k, v, q, slots, sh, j0, scores),
        3 => k_pass::<S, R, 3>(k, v, q, slots, sh, j0, scores),
        2 => k_pass::<S, R, 2>(k, v, q, slots, sh, j0, scores),
        _ => k_pass::<S, R, 1>(k, v, q, slots, sh, j0, scores),
    });
    let (m, rest) = out.split_at_mut(g);
    let (l, acc) = rest.split_at_mut(g);
    softmax_rows(scores, n, m, l);
    acc.fill(0.0);
    let params = sized(&mut scratch.params, 2 * TILE * ng);
    let rows = &mut scratch.rows;
    for (ti, tile) in slots.chunks(TILE).enumerate() {
        let t0 = ti * TILE;
        rows.clear();
        for (t, &s) in tile.iter().enumerate() {
            if let Some(&next) = slots.get(t0 + TILE + t) {
                v.prefetch(next as usize);
            }
            let s = s as usize;
            rows.push(v.row(s));
            if R::AFFINE {
                for (gi, p) in params[2 * t * ng..][..2 * ng]
                    .chunks_exact_mut(2)
                    .enumerate()
                {
                    (p[0], p[1]) = v.scale_bias(s, gi);
                }
            }
        }
        let tile = Tile {
            rows,
            params,
            scores,
            n,
            t0,
        };
        chunks(g, |j0, nj| match nj {
            4 => v_tile::<S, R, 4>(v, &tile, sh, j0, acc),
            3 => v_tile::<S, R, 3>(v, &tile, sh, j0, acc),
            2 => v_tile::<S, R, 2>(v, &tile, sh, j0, acc),
            _ => v_tile::<S, R, 1>(v, &tile, sh, j0, acc),
        });
    }
    if R::INTERLEAVED {
        let tmp = sized(&mut scratch.perm, g * hd);
        tmp.copy_from_slice(acc);
        for (a, t) in acc.chunks_exact_mut(hd).zip(tmp.chunks_exact(hd)) {
            for (i, x) in t.iter().enumerate() {
                a[at(i)] = *x;
            }
        }
    }
}

/// Calls `f(first, count)` for chunks of at most four of the `g` query heads.
#[inline(always)]
fn chunks(g: usize, mut f: impl FnMut(usize, usize)) {
    let mut j0 = 0;
    while j0 < g {
        let nj = (g - j0).min(4);
        f(j0, nj);
        j0 += nj;
    }
}

/// Scores of query heads `j0..j0+NJ` against every row: `scores[j * n + t]`.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k_pass<S: Simd, R: Rows<S>, const NJ: usize>(
    k: &R,
    v: &R,
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    j0: usize,
    scores: &mut [f32],
) {
    let (hd, n) = (sh.head_dim, slots.len());
    let (gv, ng) = (sh.group / S::LANES, hd / sh.group);
    let qp = q.as_ptr().add(j0 * hd);
    for (t, &s) in slots.iter().enumerate() {
        if j0 == 0 {
            // The row PREFETCH ahead; past the end, the first V rows.
            let ahead = t + PREFETCH;
            if ahead < n {
                k.prefetch(slots[ahead] as usize);
            } else if ahead - n < n {
                v.prefetch(slots[ahead - n] as usize);
            }
        }
        let s = s as usize;
        let row = k.row(s);
        let mut a = [S::zero(); NJ];
        for gi in 0..ng {
            let (sc, bi) = k.scale_bias(s, gi);
            let (sc, bi) = (S::splat(sc), S::splat(bi));
            for vi in gi * gv..(gi + 1) * gv {
                let mut x = k.vec(row, vi);
                if R::AFFINE {
                    x = S::fma(x, sc, bi);
                }
                for j in 0..NJ {
                    a[j] = S::fma(S::load(qp.add(j * hd + S::LANES * vi)), x, a[j]);
                }
            }
        }
        let sums = hsums::<S, NJ>(&a);
        for j in 0..NJ {
            *scores.get_unchecked_mut((j0 + j) * n + t) = sums[j];
        }
    }
}

/// Horizontal sums of `NJ` vectors, four at a time where possible.
#[inline(always)]
unsafe fn hsums<S: Simd, const NJ: usize>(a: &[S::V; NJ]) -> [f32; NJ] {
    let mut out = [0f32; NJ];
    for (o, c) in out.chunks_mut(4).zip(a.chunks(4)) {
        if let [a0, a1, a2, a3] = *c {
            o.copy_from_slice(&S::hsum4([a0, a1, a2, a3]));
        } else {
            for (o, &x) in o.iter_mut().zip(c) {
                *o = S::hsum(x);
            }
        }
    }
    out
}

/// One V tile: row offsets, (scale, bias) per (position, group), and the task's weights.
struct Tile<'a> {
    rows: &'a [usize],
    params: &'a [f32],
    /// `[G, n]` softmax numerators of the task; the tile starts at position `t0`.
    scores: &'a [f32],
    n: usize,
    t0: usize,
}

/// Adds `Σ_t p_jt · row_t` of one tile to the accumulators of query heads `j0..j0+NJ`.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn v_tile<S: Simd, R: Rows<S>, const NJ: usize>(
    v: &R,
    tile: &Tile,
    sh: Shape,
    j0: usize,
    acc: &mut [f32],
) {
    let (hd, tn) = (sh.head_dim, tile.rows.len());
    let (gv, ng) = (sh.group / S::LANES, hd / sh.group);
    let p: [*const f32; NJ] =
        std::array::from_fn(|j| tile.scores.as_ptr().add((j0 + j) * tile.n + tile.t0));
    let rebuilt = |t: usize, vi: usize| -> S::V {
        let x = v.vec(*tile.rows.get_unchecked(t), vi);
        if R::AFFINE {
            let sb = tile.params.as_ptr().add(2 * (t * ng + vi / gv));
            S::fma(x, S::splat(*sb), S::splat(*sb.add(1)))
        } else {
            x
        }
    };
    for vi in 0..hd / S::LANES {
        let (mut a, mut b) = ([S::zero(); NJ], [S::zero(); NJ]);
        let mut t = 0;
        while t + 1 < tn {
            let (x0, x1) = (rebuilt(t, vi), rebuilt(t + 1, vi));
            for j in 0..NJ {
                a[j] = S::fma(S::splat(*p[j].add(t)), x0, a[j]);
                b[j] = S::fma(S::splat(*p[j].add(t + 1)), x1, b[j]);
            }
            t += 2;
        }
        if t < tn {
            let x0 = rebuilt(t, vi);
            for j in 0..NJ {
                a[j] = S::fma(S::splat(*p[j].add(t)), x0, a[j]);
            }
        }
        for j in 0..NJ {
            let o = acc.as_mut_ptr().add((j0 + j) * hd + S::LANES * vi);
            S::store(o, S::add(S::load(o), S::add(a[j], b[j])));
        }
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

/// Turns `scores` (`[G, n]`) into `exp(score - max)` in place, writing per-head max and sum.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], n: usize, m: &mut [f32], l: &mut [f32]) {
    for (j, row) in scores.chunks_exact_mut(n).enumerate() {
        // Eight partial reductions: one running value would keep these loops scalar.
        let mut part = [f32::NEG_INFINITY; 8];
        let mut mx = f32::NEG_INFINITY;
        for c in row.chunks(8) {
            for (p, &x) in part.iter_mut().zip(c) {
                *p = p.max(x);
            }
        }
        for p in part {
            mx = mx.max(p);
        }
        for x in row.iter_mut() {
            *x = exp_neg(*x - mx);
        }
        let mut part = [0f32; 8];
        for c in row.chunks(8) {
            for (p, x) in part.iter_mut().zip(c) {
                *p += x;
            }
        }
        m[j] = mx;
        l[j] = part.iter().sum();
    }
}
