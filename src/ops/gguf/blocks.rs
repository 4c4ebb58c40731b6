//! The GGUF block layouts kvq multiplies at their stored size, and how each element is rebuilt.
//!
//! Every supported type stores groups of 16 or 32 integer codes that share one scale (and, for
//! the `_1` and K types, one offset), so an element is `code·scale` or `code·scale + bias`. The
//! scale and bias of a group are computed from the block's header exactly as candle's
//! `to_float` (ggml's `dequantize_row_*`) computes them, and the element is rounded the same way
//! (the product rounded, then the sum rounded): a widened vector holds the very f32 values that
//! dequantizing the tensor gives, which is what makes the block kernels equal to the dense f32
//! product of the dequantized weights.
//!
//! Byte layouts (little-endian, `f16` = IEEE half):
//! - Q4_0 (32 elements, 18 bytes): `d: f16, qs[16]`; element j < 16 is `qs[j] & 15`, j ≥ 16 is
//!   `qs[j-16] >> 4`; value `(code - 8)·d`.
//! - Q4_1 (32, 20): `d, m: f16, qs[16]`; value `code·d + m`.
//! - Q5_0 (32, 22): `d, qh: u32, qs[16]`; the 5th bit of element j is bit j of `qh`; value
//!   `(code - 16)·d`.
//! - Q5_1 (32, 24): `d, m, qh, qs[16]`; value `code·d + m`.
//! - Q8_0 (32, 34): `d, qs: i8[32]`; value `code·d`.
//! - Q4_K (256, 144): `d, dmin: f16, scales[12], qs[128]`: 8 groups of 32; group g reads the
//!   low (g even) or high nibbles of `qs[32·(g/2)..][..32]`, its 6-bit scale and min from
//!   `scales` (ggml's `get_scale_min_k4`); value `code·(d·sc) - dmin·m`.
//! - Q5_K (256, 176): Q4_K's header, `qh[32]`, `qs[128]`; bit g of `qh[l]` is the 5th bit of
//!   element l of group g.
//! - Q6_K (256, 210): `ql[128], qh[64], scales: i8[16], d`: 16 groups of 16; value
//!   `(code - 32)·(d·scales[g])`.

use super::codes::Codes;
use crate::simd::Simd;

/// One GGUF block type: its size and how a group's elements are rebuilt.
pub(crate) trait Block: Copy + Send + Sync + 'static {
    /// Elements per block.
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Elements per group sharing one scale (and bias); a multiple of every `LANES`.
    const GROUP: usize;
    /// Whether elements add a bias after the scaled code.
    const BIAS: bool;
    /// Scale and bias (0 where not [`Block::BIAS`]) of group `g` of the block at `blk`.
    ///
    /// Safety: `blk` is valid for [`Block::BYTES`] reads; the CPU supports `S`.
    unsafe fn affine<S: Simd>(blk: *const u8, g: usize) -> (f32, f32);
    /// Codes of elements `e0..e0 + LANES` of group `g` (`e0` a multiple of `LANES`).
    ///
    /// Safety: as [`Block::affine`].
    unsafe fn codes<S: Codes>(blk: *const u8, g: usize, e0: usize) -> S::I;
}

/// Elements `e0..e0 + LANES` of group `g`, as f32: `code·scale (+ bias)`, each operation
/// rounded once (as dequantization does). Safety: as [`Block::affine`].
#[inline(always)]
pub(crate) unsafe fn widen<S: Codes, B: Block>(
    blk: *const u8,
    g: usize,
    e0: usize,
    scale: S::V,
    bias: S::V,
) -> S::V {
    let w = S::mul(S::to_f32(B::codes::<S>(blk, g, e0)), scale);
    if B::BIAS {
        S::add(w, bias)
    } else {
        w
    }
}

#[inline(always)]
unsafe fn half<S: Simd>(p: *const u8) -> f32 {
    S::half(p.cast::<u16>().read_unaligned())
}

/// Nibbles `e0..e0 + LANES` of a 32-element run stored as 16 bytes at `qs` (low nibbles are
/// elements 0..16, high nibbles 16..32).
#[inline(always)]
unsafe fn nibbles32<S: Codes>(qs: *const u8, e0: usize) -> S::I {
    if e0 < 16 {
        S::and(S::u8s(qs.add(e0)), 0xF)
    } else {
        S::srl(S::u8s(qs.add(e0 - 16)), 4)
    }
}

/// Bits `e0..e0 + LANES` of the little-endian u32 at `qh`, each moved to bit 4.
#[inline(always)]
unsafe fn fifth_bits<S: Codes>(qh: *const u8, e0: usize) -> S::I {
    let bits = qh.cast::<u32>().read_unaligned() as i32;
    S::sll(S::and(S::srlv(S::splat_i(bits), S::iota(e0 as i32)), 1), 4)
}

/// ggml's `get_scale_min_k4`: 6-bit scale and min of group `j` (0..8) of a K block's 12 bytes.
#[inline(always)]
pub(crate) unsafe fn scale_min_k4(j: usize, q: *const u8) -> (u8, u8) {
    let q = |i: usize| *q.add(i);
    if j < 4 {
        (q(j) & 63, q(j + 4) & 63)
    } else {
        (
            (q(j + 4) & 0xF) | ((q(j - 4) >> 6) << 4),
            (q(j + 4) >> 4) | ((q(j) >> 6) << 4),
        )
    }
}

macro_rules! block_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name;
    };
}

block_type!(
    /// GGUF Q4_0.
    Q4_0
);
block_type!(
    /// GGUF Q4_1.
    Q4_1
);
block_type!(
    /// GGUF Q5_0.
    Q5_0
);
block_type!(
    /// GGUF Q5_1.
    Q5_1
);
block_type!(
    /// GGUF Q8_0.
    Q8_0
);
block_type!(
    /// GGUF Q4_K.
    Q4K
);
block_type!(
    /// GGUF Q5_K.
    Q5K
);
block_type!(
    /// GGUF Q6_K.
    Q6K
);

impl Block for Q4_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, _g: usize) -> (f32, f32) {
        (half::<S>(blk), 0.0)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, _g: usize, e0: usize) -> S::I {
        S::add_i(nibbles32::<S>(blk.add(2), e0), -8)
    }
}

impl Block for Q4_1 {
    const ELEMS: usize = 32;
    const BYTES: usize = 20;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, _g: usize) -> (f32, f32) {
        (half::<S>(blk), half::<S>(blk.add(2)))
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, _g: usize, e0: usize) -> S::I {
        nibbles32::<S>(blk.add(4), e0)
    }
}

impl Block for Q5_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 22;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, _g: usize) -> (f32, f32) {
        (half::<S>(blk), 0.0)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, _g: usize, e0: usize) -> S::I {
        let c = S::or(
            nibbles32::<S>(blk.add(6), e0),
            fifth_bits::<S>(blk.add(2), e0),
        );
        S::add_i(c, -16)
    }
}

impl Block for Q5_1 {
    const ELEMS: usize = 32;
    const BYTES: usize = 24;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, _g: usize) -> (f32, f32) {
        (half::<S>(blk), half::<S>(blk.add(2)))
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, _g: usize, e0: usize) -> S::I {
        S::or(
            nibbles32::<S>(blk.add(8), e0),
            fifth_bits::<S>(blk.add(4), e0),
        )
    }
}

impl Block for Q8_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 34;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, _g: usize) -> (f32, f32) {
        (half::<S>(blk), 0.0)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, _g: usize, e0: usize) -> S::I {
        S::i8s(blk.add(2 + e0))
    }
}

/// Scale and bias of group `g` of a Q4_K / Q5_K block (header `d, dmin, scales[12]`).
#[inline(always)]
unsafe fn k_affine<S: Simd>(blk: *const u8, g: usize) -> (f32, f32) {
    let (d, dmin) = (half::<S>(blk), half::<S>(blk.add(2)));
    let (sc, m) = scale_min_k4(g, blk.add(4));
    // ggml subtracts `dmin·m`; adding its negation rounds the same.
    (d * sc as f32, -(dmin * m as f32))
}

/// Low (g even) or high nibbles of bytes `e0..` of the 32 bytes group `g` reads at `qs`.
#[inline(always)]
unsafe fn k_nibbles<S: Codes>(qs: *const u8, g: usize, e0: usize) -> S::I {
    let p = qs.add(32 * (g / 2) + e0);
    if g.is_multiple_of(2) {
        S::and(S::u8s(p), 0xF)
    } else {
        S::srl(S::u8s(p), 4)
    }
}

impl Block for Q4K {
    const ELEMS: usize = 256;
    const BYTES: usize = 144;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, g: usize) -> (f32, f32) {
        k_affine::<S>(blk, g)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, g: usize, e0: usize) -> S::I {
        k_nibbles::<S>(blk.add(16), g, e0)
    }
}

impl Block for Q5K {
    const ELEMS: usize = 256;
    const BYTES: usize = 176;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, g: usize) -> (f32, f32) {
        k_affine::<S>(blk, g)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, g: usize, e0: usize) -> S::I {
        let high = S::sll(S::and(S::srl(S::u8s(blk.add(16 + e0)), g as u32), 1), 4);
        S::or(k_nibbles::<S>(blk.add(48), g, e0), high)
    }
}

impl Block for Q6K {
    const ELEMS: usize = 256;
    const BYTES: usize = 210;
    const GROUP: usize = 16;
    const BIAS: bool = false;
    #[inline(always)]
    unsafe fn affine<S: Simd>(blk: *const u8, g: usize) -> (f32, f32) {
        let d = half::<S>(blk.add(208));
        (d * (*blk.add(192 + g) as i8) as f32, 0.0)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(blk: *const u8, g: usize, e0: usize) -> S::I {
        // Group g: half h = g/8 of the block, quarter q of that half, sixteen s.
        let (h, q, s) = (g / 8, (g % 8) / 2, g % 2);
        let ql = S::u8s(blk.add(64 * h + (q % 2) * 32 + s * 16 + e0));
        let low = if q < 2 {
            S::and(ql, 0xF)
        } else {
            S::srl(ql, 4)
        };
        let qh = S::u8s(blk.add(128 + 32 * h + s * 16 + e0));
        let high = S::sll(S::and(S::srl(qh, 2 * q as u32), 3), 4);
        S::add_i(S::or(low, high), -32)
    }
}
