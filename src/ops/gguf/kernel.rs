//! `y = x·Wᵀ` with `W` in GGUF blocks ([`Packed`]): tiles over the thread pool, register blocks inside a
//! tile.
//!
//! Each output element is summed exactly as [`row_matmul`](crate::ops::row_matmul) sums it
//! for the dense f32 `W`: `LANES` partial sums (lane l takes the k ≡ l (mod LANES) terms in
//! increasing k, by multiply-adds of `x` and the widened weight), then the vector's fixed
//! horizontal-sum tree (k is a whole number of blocks, a multiple of 32: no tail). Widened
//! weights are the dequantized values ([`super::blocks`]), so on one ISA the result is the
//! dense product bit for bit, and a row's result never depends on which other rows share the
//! call: blocking and the split into tiles only decide which elements are computed together.
//!
//! A tile (one task of [`pool`]) is up to [`MC`] rows of `x` × [`NC`] rows of `W`. Its first pass widens the block
//! parameters (scales, biases) of its `W` rows to f32 into a per-thread buffer, from where the
//! register blocks broadcast them (a load, no conversion). A register block is `R` rows of `x`
//! × `C` rows of `W` ([`micro`]): each widened vector of `W` feeds `R` multiply-adds (a prompt
//! chunk reuses every widened block across its rows), and while it runs it prefetches the codes
//! of the next block of `W` rows (rows of a few hundred bytes are too short for the hardware
//! prefetcher to follow). Nibble types rebuild codes by a table lookup where the ISA has a
//! one-instruction 16-entry lookup ([`Codes::TABLE16`]), else by a conversion and multiply-add.

use std::cell::RefCell;

use super::blocks::{widen, Block};
use super::codes::Codes;
use super::packed::Packed;
use crate::ops::tiles::{for_each_tile, Tile};
#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2::Avx2, avx512::Avx512};
use crate::simd::{Isa, Portable};

/// Rows of `x` per register block (prompt chunks, batches).
const MR: usize = 4;
/// Rows of `W` per register block.
const NR: usize = 4;
/// Rows of `x` per tile.
const MC: usize = 64;
/// Rows of `W` per tile (one task with at most [`MC`] rows of `x`).
const NC: usize = 32;

thread_local! {
    /// Widened parameters of a tile's `W` rows.
    static PARAMS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `y = x·Wᵀ`: `x` `[m, k]` f32, `w` `[n, k]` in blocks of `B`, `y` `[m, n]`, row-major, with
/// the vector implementation `isa` (which the CPU must have: [`Isa::widest`] or one of
/// [`Isa::all_available`]).
///
/// Panics when the slice lengths do not match the shape (callers check shapes first).
pub(crate) fn run<B: Block>(
    x: &[f32],
    w: &Packed,
    m: usize,
    n: usize,
    k: usize,
    y: &mut [f32],
    isa: Isa,
) {
    assert!(
        k.is_multiple_of(B::ELEMS),
        "k = {k} is not a whole number of blocks"
    );
    let nb = k / B::ELEMS;
    assert!(
        x.len() == m * k
            && w.codes().len() == n * nb * B::CODES
            && w.heads().len() == n * nb * B::HEAD
            && y.len() == m * n
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    for_each_tile(y, (m, n, k), (MC, NC), |out, tile| {
        PARAMS.with_borrow_mut(|params| {
            let len = (tile.cols.1 - tile.cols.0) * nb * B::PARAMS;
            if params.len() < len {
                params.resize(len, 0.0);
            }
            // SAFETY: the slices hold m·k values, n rows of blocks and m·n values (asserted
            // above); `params` holds the tile's parameters; tiles are disjoint; an ISA runs only
            // after its detection.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => tile_avx512::<B>(x, w, params, out, tile),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => tile_avx2::<B>(x, w, params, out, tile),
                    Isa::Portable => tile_run::<Portable, B>(x, w, params, out, tile),
                }
            }
        })
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn tile_avx512<B: Block>(x: &[f32], w: &Packed, p: &mut [f32], y: *mut f32, t: Tile) {
    tile_run::<Avx512, B>(x, w, p, y, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<B: Block>(x: &[f32], w: &Packed, p: &mut [f32], y: *mut f32, t: Tile) {
    tile_run::<Avx2, B>(x, w, p, y, t)
}

/// Writes the parameters of blocks `heads` (whole blocks of `B`) as f32 to `out`
/// ([`Block::PARAMS`] per block): f16 headers sixteen (or eight) at a time, others per block.
/// Safety: `out` holds them; the CPU supports `S`.
#[inline(always)]
unsafe fn widen_params<S: Codes, B: Block>(heads: &[u8], out: &mut [f32]) {
    if B::HALF_HEAD {
        debug_assert_eq!(B::HEAD, 2 * B::PARAMS);
        let n = heads.len() / 2;
        let (src, dst) = (heads.as_ptr().cast::<u16>(), out.as_mut_ptr());
        let mut i = 0;
        while i + S::LANES <= n {
            S::store(dst.add(i), S::load_f16(src.add(i)));
            i += S::LANES;
        }
        while i < n {
            *dst.add(i) = S::half(src.add(i).read_unaligned());
            i += 1;
        }
    } else {
        for (h, o) in heads
            .chunks_exact(B::HEAD)
            .zip(out.chunks_exact_mut(B::PARAMS))
        {
            B::params(h, o);
        }
    }
}

/// The parameter pass, then register blocks over a tile: for each block of [`NR`] rows of `W`
/// (column tails one at a time), every block of rows of `x` ([`rows_block`]). Safety: as
/// [`micro`], for every block; `params` holds the tile's parameters.
#[inline(always)]
unsafe fn tile_run<S: Codes, B: Block>(
    x: &[f32],
    w: &Packed,
    params: &mut [f32],
    y: *mut f32,
    t: Tile,
) {
    let Tile { rows, cols, n, k } = t;
    let nb = k / B::ELEMS;
    let (head_row, code_row, param_row) = (nb * B::HEAD, nb * B::CODES, nb * B::PARAMS);
    let params = &mut params[..(cols.1 - cols.0) * param_row];
    widen_params::<S, B>(&w.heads()[cols.0 * head_row..cols.1 * head_row], params);
    let codes = w.codes().as_ptr();
    let s = Strides { n, k, nb };
    let mut j = cols.0;
    while j < cols.1 {
        let nr = if cols.1 - j >= NR { NR } else { 1 };
        let ws = Cols {
            w: codes.add(j * code_row),
            p: params.as_ptr().add((j - cols.0) * param_row),
            // The next block of rows, or past the matrix (a prefetch never faults).
            next: codes.wrapping_add((j + nr) * code_row),
        };
        let mut i = rows.0;
        while i < rows.1 {
            let (xp, yp) = (x.as_ptr().add(i * k), y.add(i * n + j));
            i += match nr {
                NR => rows_block::<S, B, NR>(xp, ws, yp, rows.1 - i, s),
                _ => rows_block::<S, B, 1>(xp, ws, yp, rows.1 - i, s),
            };
        }
        j += nr;
    }
}

/// `C` rows of `W`: codes, parameters, and the codes to prefetch meanwhile.
#[derive(Clone, Copy)]
struct Cols {
    w: *const u8,
    p: *const f32,
    next: *const u8,
}

impl Cols {
    /// The same, from row `c` on.
    unsafe fn from<B: Block>(self, c: usize, nb: usize) -> Cols {
        Cols {
            w: self.w.add(c * nb * B::CODES),
            p: self.p.add(c * nb * B::PARAMS),
            next: self.next.wrapping_add(c * nb * B::CODES),
        }
    }
}

/// One register block of up to `rem` rows of `x` against `C` rows of `W`; returns the rows done.
/// Eight rows (two blocks of half the columns) where the ISA has 32 registers, else up to
/// [`MR`]: each widened vector of `W` feeds as many rows as registers allow. Safety: as
/// [`micro`].
#[inline(always)]
unsafe fn rows_block<S: Codes, B: Block, const C: usize>(
    x: *const f32,
    ws: Cols,
    y: *mut f32,
    rem: usize,
    s: Strides,
) -> usize {
    if S::REGS >= 64 && C == NR && rem >= 2 * MR {
        micro::<S, B, { 2 * MR }, { NR / 2 }>(x, ws, y, s);
        micro::<S, B, { 2 * MR }, { NR / 2 }>(x, ws.from::<B>(NR / 2, s.nb), y.add(NR / 2), s);
        return 2 * MR;
    }
    match rem {
        1 => micro::<S, B, 1, C>(x, ws, y, s),
        2 => micro::<S, B, 2, C>(x, ws, y, s),
        3 => micro::<S, B, 3, C>(x, ws, y, s),
        _ => micro::<S, B, MR, C>(x, ws, y, s),
    }
    rem.min(MR)
}

#[derive(Clone, Copy)]
struct Strides {
    /// Row length of `y`.
    n: usize,
    /// Row length of `x`.
    k: usize,
    /// Blocks per row of `W`.
    nb: usize,
}

/// `R` rows of `x` (at `x`, stride `k`) times `C` rows of `W` (`ws`) into `y[r·n + c]`, each
/// element in the fixed order of the module docs. Each widened vector of `W` is used by all `R`
/// rows. Prefetches the `C` rows of codes at `ws.next`, as many bytes per block as it reads.
///
/// Safety: `x` is valid for `R·k` reads, `ws` for `C` rows of codes and their parameters, `y`
/// for the `R × C` writes, and the CPU supports `S`.
#[inline(always)]
unsafe fn micro<S: Codes, B: Block, const R: usize, const C: usize>(
    x: *const f32,
    ws: Cols,
    y: *mut f32,
    s: Strides,
) {
    let Cols { w, p, next } = ws;
    let Strides { n, k, nb } = s;
    let table = B::NIBBLES && S::TABLE16;
    let (code_row, param_row) = (nb * B::CODES, nb * B::PARAMS);
    let per_group = if B::BIAS { 2 } else { 1 };
    let mut acc = [[S::zero(); C]; R];
    for b in 0..nb {
        let ahead = next.wrapping_add(b * C * B::CODES);
        let mut line = 0;
        while line < C * B::CODES {
            S::prefetch(ahead.wrapping_add(line));
            line += 64;
        }
        for g in 0..B::GROUPS {
            let mut scale = [S::zero(); C];
            let mut bias = [S::zero(); C];
            let mut tabs = [S::table16(S::zero(), S::zero(), 0, false); C];
            for c in 0..C {
                let pg = p.add(c * param_row + b * B::PARAMS + g * per_group);
                scale[c] = S::splat(*pg);
                if B::BIAS {
                    bias[c] = S::splat(*pg.add(1));
                }
                if table {
                    tabs[c] = S::table16(scale[c], bias[c], B::OFFSET, B::BIAS);
                }
            }
            let mut e0 = 0;
            while e0 < B::GROUP {
                let mut wv = [S::zero(); C];
                for c in 0..C {
                    let q = w.add(c * code_row + b * B::CODES);
                    wv[c] = if table {
                        S::lookup16(tabs[c], B::nibbles::<S>(q, g, e0))
                    } else {
                        widen::<S, B>(q, g, e0, scale[c], bias[c])
                    };
                }
                let at = b * B::ELEMS + g * B::GROUP + e0;
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = S::load(x.add(r * k + at));
                    for (a, &wc) in row.iter_mut().zip(&wv) {
                        *a = S::fma(xv, wc, *a);
                    }
                }
                e0 += S::LANES;
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            *y.add(r * n + c) = S::hsum(a);
        }
    }
}
