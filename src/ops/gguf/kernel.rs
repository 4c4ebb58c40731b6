//! `y = x·Wᵀ` with `W` in GGUF blocks: tiles over rayon, register blocks inside a tile.
//!
//! Each output element is summed exactly as [`row_matmul`](crate::ops::row_matmul) sums it
//! for the dense f32 `W`: `LANES` partial sums (lane l takes the k ≡ l (mod LANES) terms in
//! increasing k, by multiply-adds of `x` and the widened weight), then the vector's fixed
//! horizontal-sum tree (k is a whole number of blocks, a multiple of 32: no tail). Widened
//! weights are the dequantized values ([`super::blocks`]), so on one ISA the result is the
//! dense product bit for bit, and a row's result never depends on which other rows share the
//! call: blocking (up to [`MR`] rows of `x` × [`NR`] rows of `W`, each widened block reused
//! across the rows of `x` in registers) and the split into tiles only decide which elements are
//! computed together.

use super::blocks::{widen, Block};
use super::codes::Codes;
use crate::ops::tiles::{for_each_tile, Tile};
#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2::Avx2, avx512::Avx512};
use crate::simd::{Isa, Portable};

/// Rows of `x` per register block.
const MR: usize = 4;
/// Rows of `W` per register block.
const NR: usize = 4;
/// Rows of `x` per tile.
const MC: usize = 64;
/// Rows of `W` per tile (one rayon task with at most [`MC`] rows of `x`).
const NC: usize = 32;

/// `y = x·Wᵀ`: `x` `[m, k]` f32, `w` `[n, k]` in blocks of `B` (`n` rows of `k / B::ELEMS`
/// blocks), `y` `[m, n]`, row-major, with the vector implementation `isa` (which the CPU must
/// have: [`Isa::widest`] or one of [`Isa::all_available`]).
///
/// Panics when the slice lengths do not match the shape (callers check shapes first).
pub(crate) fn run<B: Block>(
    x: &[f32],
    w: &[u8],
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
    assert!(x.len() == m * k && w.len() == n * (k / B::ELEMS) * B::BYTES && y.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    for_each_tile(y, (m, n, k), (MC, NC), |y, tile| {
        // SAFETY: the slices hold m·k values, n rows of blocks and m·n values (asserted above);
        // tiles are disjoint; an ISA runs only after its detection.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => tile_avx512::<B>(x, w, y, tile),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => tile_avx2::<B>(x, w, y, tile),
                Isa::Portable => tile_run::<Portable, B>(x, w, y, tile),
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn tile_avx512<B: Block>(x: &[f32], w: &[u8], y: *mut f32, t: Tile) {
    tile_run::<Avx512, B>(x, w, y, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<B: Block>(x: &[f32], w: &[u8], y: *mut f32, t: Tile) {
    tile_run::<Avx2, B>(x, w, y, t)
}

/// Register blocks over a tile: for each block of [`NR`] rows of `W`, every block of up to
/// [`MR`] rows of `x` (row tails one row at a time). Safety: as [`micro`], for every block.
#[inline(always)]
unsafe fn tile_run<S: Codes, B: Block>(x: &[f32], w: &[u8], y: *mut f32, t: Tile) {
    let Tile { rows, cols, n, k } = t;
    let row_bytes = k / B::ELEMS * B::BYTES;
    let mut j = cols.0;
    while j < cols.1 {
        let nr = if cols.1 - j >= NR { NR } else { 1 };
        let mut i = rows.0;
        while i < rows.1 {
            let mr = if rows.1 - i >= MR { MR } else { 1 };
            let (xp, wp, yp) = (
                x.as_ptr().add(i * k),
                w.as_ptr().add(j * row_bytes),
                y.add(i * n + j),
            );
            let s = Strides { n, k, row_bytes };
            match (mr, nr) {
                (MR, NR) => micro::<S, B, MR, NR>(xp, wp, yp, s),
                (MR, _) => micro::<S, B, MR, 1>(xp, wp, yp, s),
                (_, NR) => micro::<S, B, 1, NR>(xp, wp, yp, s),
                _ => micro::<S, B, 1, 1>(xp, wp, yp, s),
            }
            i += mr;
        }
        j += nr;
    }
}

#[derive(Clone, Copy)]
struct Strides {
    /// Row length of `y`.
    n: usize,
    /// Row length of `x`.
    k: usize,
    /// Bytes per row of `W`.
    row_bytes: usize,
}

/// `R` rows of `x` (at `x`, stride `k`) times `C` rows of `W` (at `w`, stride `row_bytes`) into
/// `y[r·n + c]`, each element in the fixed order of the module docs. Each widened vector of `W`
/// is used by all `R` rows.
///
/// Safety: `x` is valid for `R·k` reads, `w` for `C` rows of blocks, `y` for the `R × C`
/// writes, and the CPU supports `S`.
#[inline(always)]
unsafe fn micro<S: Codes, B: Block, const R: usize, const C: usize>(
    x: *const f32,
    w: *const u8,
    y: *mut f32,
    s: Strides,
) {
    let Strides { n, k, row_bytes } = s;
    let mut acc = [[S::zero(); C]; R];
    let mut p = 0;
    let mut blk = 0;
    while p < k {
        let mut g = 0;
        while g < B::ELEMS / B::GROUP {
            let mut scale = [S::zero(); C];
            let mut bias = [S::zero(); C];
            for (c, (s, b)) in scale.iter_mut().zip(bias.iter_mut()).enumerate() {
                let (sc, bi) = B::affine::<S>(w.add(c * row_bytes + blk), g);
                *s = S::splat(sc);
                *b = S::splat(bi);
            }
            let mut e0 = 0;
            while e0 < B::GROUP {
                let mut wv = [S::zero(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = widen::<S, B>(w.add(c * row_bytes + blk), g, e0, scale[c], bias[c]);
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = S::load(x.add(r * k + p));
                    for (a, &wc) in row.iter_mut().zip(&wv) {
                        *a = S::fma(xv, wc, *a);
                    }
                }
                e0 += S::LANES;
                p += S::LANES;
            }
            g += 1;
        }
        blk += B::BYTES;
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            *y.add(r * n + c) = S::hsum(a);
        }
    }
}
