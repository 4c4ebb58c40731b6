//! One task of the fused CPU decode kernel — a run of positions of one (sequence, KV head) for
//! all `G` query heads sharing it — written once over the vector operations of [`Simd`].
//!
//! The kernel is bound by instructions, not bytes or multiply-adds, so each pass is shaped to
//! keep per-row scalar work and loads per multiply-add low:
//!
//! - Quantized rows are rebuilt in registers, `x̂ = code·scale + bias`, shared by all `G` query
//!   heads: one multiply-add per vector, or for 4-bit codes on 16 lanes one permute from a
//!   16-entry table `scale·i + bias` built per (row, group) ([`Simd::TABLE4`]). Scales and
//!   biases are widened to f32 once per task ([`Params`]) and broadcast from there.
//! - K pass, rows in steps of four where the ISA has 32 registers ([`Simd::REGS`]; dense and
//!   table-rebuilt rows), else two (one for affine rows with 16 registers), vectors in pairs
//!   (one load for the two nibble vectors of 4-bit codes), every KV head of a step before the
//!   next: each query vector load feeds every row of the step, and the step's sums (4 query
//!   heads per row) are reduced together.
//! - Softmax statistics in f32 over the task's scores.
//! - V pass, in tiles of positions ([`tile_len`]) and blocks of up to four vector columns (16
//!   accumulators for four query heads; two columns with 16 registers), rows rebuilt as in the
//!   K pass.
//! - Where the keys take the 8-bit query pass ([`int8`]) and the values are 4-bit or 3-bit, the
//!   V pass sums codes against 8-bit weights instead ([`int8v`]), tile by tile.
//!
//! Query heads are processed in chunks of up to four (`NJ`, a compile-time size so the
//! accumulators stay in registers); a row is decoded once per chunk.

#[cfg(target_arch = "x86_64")]
use super::int8;
use super::int8::{Dot, QueryI8};
use super::int8v;
use super::rows::{Params, Rows};
use super::softmax::softmax_rows;
use crate::simd::Simd;

/// Bytes of V rows (all KV heads) per V tile: the tile's rows stay in L1 while every column of
/// every head is summed, with room for the next tile's prefetched rows.
const TILE_BYTES: usize = 16 << 10;

/// Positions per V tile for slot rows of `row_bytes`: 32 for 4-bit rows of 8 heads × 128, 16
/// for 8-bit, 8 for f16 (measured: a fixed 32 slows the wider rows, 16 the 4-bit ones).
fn tile_len(row_bytes: usize) -> usize {
    (TILE_BYTES / row_bytes.max(1)).clamp(8, int8v::MAX_TILE)
}

/// How far ahead the K pass prefetches slot rows, in bytes of rows. Blocks are shuffled, so
/// hardware prefetchers lose the stream at every block boundary; without explicit prefetches
/// the kernel waits on memory latency instead of bandwidth (twice as slow, measured). A
/// distance in bytes, not positions, keeps as many bytes in flight for small quantized rows as
/// for wide dense ones.
const PREFETCH_BYTES: usize = 16 << 10;

/// Positions the K pass prefetches ahead for rows of `row_bytes` (all KV heads).
fn prefetch_len(row_bytes: usize) -> usize {
    (PREFETCH_BYTES / row_bytes.max(1)).clamp(8, 64)
}

/// Positions ahead the parameter widening prefetches scales and biases (a few bytes per
/// position: far ahead, or the pass waits on each line).
const PARAMS_AHEAD: usize = 64;

/// Sizes of a task.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    /// Query heads per KV head.
    pub g: usize,
    pub head_dim: usize,
    /// Values per group (dense: head_dim).
    pub group: usize,
    /// Groups per head row, `head_dim / group` (kept here: no division per row).
    pub groups: usize,
}

/// Per-thread buffers, grown as needed and reused across tasks and calls.
#[derive(Default)]
pub(super) struct Scratch {
    scores: Vec<f32>,
    rows: Vec<usize>,
    /// Widened K and V scales and biases ([`Params`]).
    k_params: Vec<f32>,
    v_params: Vec<f32>,
    /// The 8-bit-weight V pass's ([`int8v`]): its sums, a tile's row addresses and 3-bit rows
    /// widened to nibbles.
    v8: int8v::Scratch,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    at: Vec<usize>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    nibbles: Vec<u8>,
}

/// Distance between the per-(head, group) arrays over a task's `n` positions: a multiple of 16
/// plus 16, so the many arrays written side by side (scores of every query head, parameters of
/// every head) do not all start at the same offset modulo 4 KiB and fight over one L1 set.
fn pitch(n: usize) -> usize {
    n.next_multiple_of(16) + 16
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// The first `n` values of `v`, grown as needed but not cleared: for buffers every value of
/// which is written before it is read (zeroing them was a pass over the task's parameters).
fn reused(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Runs one task: positions `slots` (pool slots) of one sequence for every KV head. `heads[kh]`
/// views KV head `kh`'s K and V rows; `q` is `[KV heads · G, head_dim]` (scaled, in the rows'
/// decoded order). Writes, per KV head, `[max (G) | sum (G) | weighted V (G × head_dim)]` into
/// `out` (in decoded order).
///
/// All heads share a task so that each slot's row — every head's values side by side — is read
/// once, front to back, and its cache lines are prefetched once; per-position bookkeeping
/// (slot, row offsets, prefetches) is shared by all heads.
///
/// `qi`: the 8-bit queries and the task's first row among them, where the keys are scored by
/// [`int8::k_pass`] (`D` not [`int8::Exact`]).
///
/// Safety: every slot lies inside the pools of the views, `head_dim % group == 0`,
/// `group % (2 · S::LANES) == 0` for quantized rows, `head_dim % S::LANES == 0`, and the CPU
/// supports `S` (and `D`; with `qi`, the keys are what [`int8::takes`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn task<S: Simd, K: Rows<S>, V: Rows<S>, D: Dot>(
    heads: &[(K, V)],
    q: &[f32],
    qi: Option<(&QueryI8, usize)>,
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (g, hd, kvh) = (sh.g, sh.head_dim, heads.len());
    let n = slots.len();
    let np = pitch(n);
    let stride = 2 * g + g * hd;
    let scores = sized(&mut scratch.scores, kvh * g * np);
    let (k0, v0) = &heads[0];
    let (kg, vg) = (k0.slot_groups(), v0.slot_groups());
    let kp = reused(&mut scratch.k_params, 2 * kg * n);
    let vp = reused(&mut scratch.v_params, 2 * vg * n);
    if K::AFFINE || V::AFFINE {
        for (t, &s) in slots.iter().enumerate() {
            if let Some(&a) = slots.get(t + PARAMS_AHEAD) {
                k0.prefetch_params(a as usize);
                v0.prefetch_params(a as usize);
            }
            k0.widen_params(s as usize, kp.as_mut_ptr().add(2 * kg * t));
            v0.widen_params(s as usize, vp.as_mut_ptr().add(2 * vg * t));
        }
    }
    let kp = Params {
        data: kp,
        groups: kg,
    };
    let vp = Params {
        data: vp,
        groups: vg,
    };
    match qi {
        #[cfg(target_arch = "x86_64")]
        Some((qi, h0)) if D::INT => {
            let at = (g, sh.groups == 2, np, prefetch_len(k0.slot_bytes()));
            int8::k_pass::<S, D, K, V>(heads, qi, h0, slots, at, kp, scores)
        }
        _ => k_pass(heads, q, slots, sh, kp, scores),
    }
    for (o, sc) in out
        .chunks_exact_mut(stride)
        .zip(scores.chunks_exact_mut(g * np))
    {
        let (m, rest) = o.split_at_mut(g);
        let (l, acc) = rest.split_at_mut(g);
        softmax_rows(sc, n, np, m, l);
        acc.fill(0.0);
    }
    // 4-bit (or 3-bit) values where the keys took the 8-bit pass: the 8-bit-weight V pass
    // ([`int8v`]).
    let int_v = D::INT && matches!(V::BITS, 3 | 4) && qi.is_some();
    let vd = int8v::Dims {
        g,
        groups: sh.groups,
        kv_heads: kvh,
        pitch: np,
        bits: V::BITS,
    };
    if int_v {
        int8v::start(&mut scratch.v8, vd);
    }
    let rows = &mut scratch.rows;
    let tl = tile_len(v0.slot_bytes());
    for (ti, tile) in slots.chunks(tl).enumerate() {
        let t0 = ti * tl;
        let next = slots.get(t0 + tl..).unwrap_or(&[]);
        for (kh, (_, v)) in heads.iter().enumerate() {
            // The next tile's rows, a share per head so the requests spread over the tile.
            for &s in next.iter().take(tl).skip(kh).step_by(kvh) {
                v0.prefetch(s as usize);
            }
            rows.clear();
            rows.extend(tile.iter().map(|&s| v.row(s as usize)));
            #[cfg(target_arch = "x86_64")]
            if int_v {
                let p = &scores[kh * g * np..][..g * np];
                let at = &mut scratch.at;
                at.clear();
                at.extend(rows.iter().map(|&r| v.row_bytes(r) as usize));
                if V::BITS == 3 {
                    int8v::widen3(at, sh.groups, &mut scratch.nibbles);
                }
                let col = v.head_group();
                int8v::tile::<S, D>(at, p, vp, col, (t0, kh), vd, &mut scratch.v8);
                continue;
            }
            let tile = Tile {
                rows,
                params: vp,
                scores: &scores[kh * g * np..][..g * np],
                pitch: np,
                t0,
            };
            let acc = &mut out[kh * stride + 2 * g..][..g * hd];
            // Loops, not closures, around the vector code: a closure does not inherit the
            // caller's target features, so the vector operations inside would not inline.
            let mut j0 = 0;
            while j0 < g {
                match g - j0 {
                    1 => v_tile::<S, V, 1>(v, &tile, sh, j0, acc),
                    2 => v_tile::<S, V, 2>(v, &tile, sh, j0, acc),
                    3 => v_tile::<S, V, 3>(v, &tile, sh, j0, acc),
                    _ => v_tile::<S, V, 4>(v, &tile, sh, j0, acc),
                }
                j0 += 4;
            }
        }
    }
    if int_v {
        int8v::finish(&scratch.v8, vd, out, S::LANES);
    }
}

/// Scores of every query head against every row, `scores[(kh · G + j) · pitch + t]`: rows two at
/// a time, every KV head of a row pair before the next pair (so slot rows are read in order).
#[inline(always)]
unsafe fn k_pass<S: Simd, K: Rows<S>, V: Rows<S>>(
    heads: &[(K, V)],
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    kp: Params,
    scores: &mut [f32],
) {
    let n = slots.len();
    let (k0, v0) = &heads[0];
    let dist = prefetch_len(k0.slot_bytes());
    let mut t = 0;
    while t < n {
        // Four rows at a time need 16 accumulators, 8 rebuilt vectors and, for affine rows, 4
        // tables (scales and biases of rows without a table would not fit); two rows need 8
        // accumulators, 4 rebuilt vectors and, for affine rows, 4 scales and biases: more than
        // 16 registers hold.
        let rw = if S::REGS >= 32 && t + 3 < n && (!K::AFFINE || K::TABLE) {
            4
        } else if t + 1 < n && (S::REGS >= 32 || !K::AFFINE) {
            2
        } else {
            1
        };
        // Rows `dist` positions on; past the end, the first V rows.
        for ahead in t + dist..(t + dist + rw).min(2 * n) {
            if ahead < n {
                k0.prefetch(slots[ahead] as usize);
            } else {
                v0.prefetch(slots[ahead - n] as usize);
            }
        }
        match rw {
            4 => k_heads::<S, K, V, 4>(heads, q, slots, sh, kp, t, scores),
            2 => k_heads::<S, K, V, 2>(heads, q, slots, sh, kp, t, scores),
            _ => k_heads::<S, K, V, 1>(heads, q, slots, sh, kp, t, scores),
        }
        t += rw;
    }
}

/// [`k_rows`] of rows `t..t+RW` for every KV head and query head.
#[inline(always)]
unsafe fn k_heads<S: Simd, K: Rows<S>, V: Rows<S>, const RW: usize>(
    heads: &[(K, V)],
    q: &[f32],
    slots: &[u32],
    sh: Shape,
    kp: Params,
    t: usize,
    scores: &mut [f32],
) {
    let (g, np, hd) = (sh.g, pitch(slots.len()), sh.head_dim);
    for (kh, (k, _)) in heads.iter().enumerate() {
        let sc = scores.get_unchecked_mut(kh * g * np..(kh + 1) * g * np);
        let mut j0 = 0;
        while j0 < g {
            let qp = q.as_ptr().add((kh * g + j0) * hd);
            match g - j0 {
                1 => k_rows::<S, K, 1, RW>(k, qp, slots, sh, kp, t, j0, sc),
                2 => k_rows::<S, K, 2, RW>(k, qp, slots, sh, kp, t, j0, sc),
                3 => k_rows::<S, K, 3, RW>(k, qp, slots, sh, kp, t, j0, sc),
                _ => k_rows::<S, K, 4, RW>(k, qp, slots, sh, kp, t, j0, sc),
            }
            j0 += 4;
        }
    }
}

/// Scores of rows `t..t+RW` for query heads `j0..j0+NJ` (`qp` points at head `j0`).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k_rows<S: Simd, R: Rows<S>, const NJ: usize, const RW: usize>(
    k: &R,
    qp: *const f32,
    slots: &[u32],
    sh: Shape,
    kp: Params,
    t: usize,
    j0: usize,
    scores: &mut [f32],
) {
    let (hd, np) = (sh.head_dim, pitch(slots.len()));
    let (gv, ng) = (sh.group / S::LANES, sh.groups);
    let rows: [usize; RW] = std::array::from_fn(|r| k.row(*slots.get_unchecked(t + r) as usize));
    let mut a = [[S::zero(); NJ]; RW];
    for gi in 0..ng {
        let (mut sc, mut bi, mut tb) = ([S::zero(); RW], [S::zero(); RW], [S::zero(); RW]);
        if R::AFFINE {
            for r in 0..RW {
                (sc[r], bi[r]) = kp.splat::<S>(t + r, k.head_group() + gi);
                if R::TABLE {
                    tb[r] = S::table4(sc[r], bi[r]);
                }
            }
        }
        let v0 = gi * gv;
        for u in v0 / 2..(v0 + gv) / 2 {
            let mut x = [[S::zero(); 2]; RW];
            for r in 0..RW {
                x[r] = k.rebuilt_pair(rows[r], u, sc[r], bi[r], tb[r]);
            }
            for j in 0..NJ {
                for h in 0..2 {
                    let qj = S::load(qp.add(j * hd + S::LANES * (2 * u + h)));
                    for r in 0..RW {
                        a[r][j] = S::fma(qj, x[r][h], a[r][j]);
                    }
                }
            }
        }
        if gv % 2 == 1 {
            // Dense rows with an odd number of vectors: the last one alone.
            let vi = v0 + gv - 1;
            for r in 0..RW {
                let x = k.vec(rows[r], vi);
                for j in 0..NJ {
                    a[r][j] = S::fma(S::load(qp.add(j * hd + S::LANES * vi)), x, a[r][j]);
                }
            }
        }
    }
    if NJ == 4 && RW == 4 {
        // All four rows' sums at once.
        let a =
            std::array::from_fn(|r| std::array::from_fn(|j| *a.get_unchecked(r).get_unchecked(j)));
        let s = S::hsum16(a);
        for (j, s) in s.iter().enumerate() {
            let o = scores.as_mut_ptr().add((j0 + j) * np + t);
            std::ptr::copy_nonoverlapping(s.as_ptr(), o, 4);
        }
        return;
    }
    if NJ == 4 && RW == 2 {
        // Both rows' sums at once (cheaper than two four-way reductions).
        let v = |r: usize, j: usize| *a.get_unchecked(r).get_unchecked(j);
        let s = S::hsum8([
            v(0, 0),
            v(0, 1),
            v(0, 2),
            v(0, 3),
            v(1, 0),
            v(1, 1),
            v(1, 2),
            v(1, 3),
        ]);
        for j in 0..4 {
            *scores.get_unchecked_mut((j0 + j) * np + t) = s[j];
            *scores.get_unchecked_mut((j0 + j) * np + t + 1) = s[4 + j];
        }
        return;
    }
    for r in 0..RW {
        let sums = hsums::<S, NJ>(&a[r]);
        for j in 0..NJ {
            *scores.get_unchecked_mut((j0 + j) * np + t + r) = sums[j];
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

/// One V tile: its row offsets, and the task's V scales and biases and softmax weights.
struct Tile<'a> {
    rows: &'a [usize],
    /// The task's V scales and biases.
    params: Params<'a>,
    /// `G` rows (at `pitch`) of softmax numerators of the task; the tile starts at position
    /// `t0`.
    scores: &'a [f32],
    pitch: usize,
    t0: usize,
}

/// Adds `Σ_t p_jt · row_t` of one tile to the accumulators of query heads `j0..j0+NJ`: vector
/// columns in blocks of four (quantized rows always have an even count), then pairs, then one.
#[inline(always)]
unsafe fn v_tile<S: Simd, R: Rows<S>, const NJ: usize>(
    v: &R,
    tile: &Tile,
    sh: Shape,
    j0: usize,
    acc: &mut [f32],
) {
    let nv = sh.head_dim / S::LANES;
    let mut c = 0;
    // Blocks of four columns keep 16 accumulators: only where there are 32 registers.
    while S::REGS >= 32 && c + 4 <= nv {
        v_cols::<S, R, NJ, 2>(v, tile, sh, j0, c, acc);
        c += 4;
    }
    while c + 2 <= nv {
        v_cols::<S, R, NJ, 1>(v, tile, sh, j0, c, acc);
        c += 2;
    }
    if c < nv {
        v_col::<S, R, NJ>(v, tile, sh, j0, c, acc);
    }
}

/// [`v_tile`] for the `2·P` vector columns from `c0` (even), rebuilt in pairs as in the K pass.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn v_cols<S: Simd, R: Rows<S>, const NJ: usize, const P: usize>(
    v: &R,
    tile: &Tile,
    sh: Shape,
    j0: usize,
    c0: usize,
    acc: &mut [f32],
) {
    let gv = sh.group / S::LANES;
    // Whether the block lies in one group (one scale, bias and table per row), else one each
    // pair.
    let one_group = c0 / gv == (c0 + 2 * P - 1) / gv;
    let mut a = [[[S::zero(); 2]; P]; NJ];
    let w: [*const f32; NJ] =
        std::array::from_fn(|j| tile.scores.as_ptr().add((j0 + j) * tile.pitch + tile.t0));
    for (t, &row) in tile.rows.iter().enumerate() {
        let (mut sc, mut bi, mut tb) = (S::zero(), S::zero(), S::zero());
        let mut x = [[S::zero(); 2]; P];
        for p in 0..P {
            if R::AFFINE && (p == 0 || !one_group) {
                let i = v.head_group() + (c0 + 2 * p) / gv;
                (sc, bi) = tile.params.splat::<S>(tile.t0 + t, i);
                if R::TABLE {
                    tb = S::table4(sc, bi);
                }
            }
            x[p] = v.rebuilt_pair(row, c0 / 2 + p, sc, bi, tb);
        }
        for j in 0..NJ {
            let wj = S::splat(*w[j].add(t));
            for p in 0..P {
                a[j][p][0] = S::fma(wj, x[p][0], a[j][p][0]);
                a[j][p][1] = S::fma(wj, x[p][1], a[j][p][1]);
            }
        }
    }
    for j in 0..NJ {
        for p in 0..P {
            for h in 0..2 {
                let o = acc
                    .as_mut_ptr()
                    .add((j0 + j) * sh.head_dim + S::LANES * (c0 + 2 * p + h));
                S::store(o, S::add(S::load(o), a[j][p][h]));
            }
        }
    }
}

/// [`v_tile`] for the single vector column `c` (dense rows with an odd number of vectors).
#[inline(always)]
unsafe fn v_col<S: Simd, R: Rows<S>, const NJ: usize>(
    v: &R,
    tile: &Tile,
    sh: Shape,
    j0: usize,
    c: usize,
    acc: &mut [f32],
) {
    let gv = sh.group / S::LANES;
    let mut a = [S::zero(); NJ];
    let w: [*const f32; NJ] =
        std::array::from_fn(|j| tile.scores.as_ptr().add((j0 + j) * tile.pitch + tile.t0));
    for (t, &row) in tile.rows.iter().enumerate() {
        let mut x = v.vec(row, c);
        if R::AFFINE {
            let (sc, bi) = tile.params.splat::<S>(tile.t0 + t, v.head_group() + c / gv);
            x = S::fma(x, sc, bi);
        }
        for j in 0..NJ {
            a[j] = S::fma(S::splat(*w[j].add(t)), x, a[j]);
        }
    }
    for (j, a) in a.iter().enumerate() {
        let o = acc.as_mut_ptr().add((j0 + j) * sh.head_dim + S::LANES * c);
        S::store(o, S::add(S::load(o), *a));
    }
}
