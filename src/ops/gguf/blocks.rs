//! The GGUF block layouts kvq multiplies at their stored size, split into a header (scales,
//! offsets) and codes ([`super::packed`] stores the two apart), and how each element is rebuilt.
//!
//! Every supported type stores groups of 16 or 32 integer codes that share one scale (and, for
//! the `_1` and K types, one offset), so an element is `code·scale` or `code·scale + bias`. The
//! scale and bias of a group are computed from the block's header exactly as candle's
//! `to_float` (ggml's `dequantize_row_*`) computes them ([`Block::params`]). Every `code·scale`
//! is exact in f32 (codes have at most 6 significant bits, scales at most 18: an f16 times a
//! 6- or 8-bit integer), so the one rounding dequantization does is that of the add, and
//! `fma(code, scale, bias)`, `code·scale + bias` and a table of those values all give the very
//! f32 values dequantizing the tensor gives — what makes the block kernels equal to the dense
//! f32 product of the dequantized weights.
//!
//! GGUF byte layouts (little-endian, `f16` = IEEE half) and their split (header | codes):
//! - Q4_0 (32 elements, 18 bytes): `d: f16, qs[16]`; element j < 16 is `qs[j] & 15`, j ≥ 16 is
//!   `qs[j-16] >> 4`; value `(code - 8)·d`. Split `d | qs`.
//! - Q4_1 (32, 20): `d, m: f16, qs[16]`; value `code·d + m`. Split `d, m | qs`.
//! - Q5_0 (32, 22): `d, qh: u32, qs[16]`; the 5th bit of element j is bit j of `qh`; value
//!   `(code - 16)·d`. Split `d | qs, qh`.
//! - Q5_1 (32, 24): `d, m, qh, qs[16]`; value `code·d + m`. Split `d, m | qs, qh`.
//! - Q8_0 (32, 34): `d, qs: i8[32]`; value `code·d`. Split `d | qs`.
//! - Q4_K (256, 144): `d, dmin: f16, scales[12], qs[128]`: 8 groups of 32; group g reads the
//!   low (g even) or high nibbles of `qs[32·(g/2)..][..32]`, its 6-bit scale and min from
//!   `scales` (ggml's `get_scale_min_k4`); value `code·(d·sc) - dmin·m`. Split
//!   `d, dmin, scales | qs`.
//! - Q5_K (256, 176): Q4_K's header, `qh[32]`, `qs[128]`; bit g of `qh[l]` is the 5th bit of
//!   element l of group g. Split `d, dmin, scales | qs, qh`.
//! - Q6_K (256, 210): `ql[128], qh[64], scales: i8[16], d`: 16 groups of 16; value
//!   `(code - 32)·(d·scales[g])`. Split `scales, d | ql, qh`.

use super::codes::Codes;
use crate::simd::f16_bits_to_f32;

/// One GGUF block type: its size, its split, and how a group's elements are rebuilt.
pub(crate) trait Block: Copy + Send + Sync + 'static {
    /// Elements per block.
    const ELEMS: usize;
    /// Header bytes per block (scales, offsets).
    const HEAD: usize;
    /// Code bytes per block.
    const CODES: usize;
    /// Bytes per GGUF block.
    const BYTES: usize = Self::HEAD + Self::CODES;
    /// Elements per group sharing one scale (and bias); a multiple of every `LANES`.
    const GROUP: usize;
    /// Groups per block.
    const GROUPS: usize = Self::ELEMS / Self::GROUP;
    /// Whether elements add a bias after the scaled code.
    const BIAS: bool;
    /// f32 parameters per block: each group's scale, then its bias where [`Block::BIAS`].
    const PARAMS: usize = Self::GROUPS * if Self::BIAS { 2 } else { 1 };
    /// Whether the header is exactly the parameters as f16 (so headers convert in bulk).
    const HALF_HEAD: bool;
    /// Whether codes are nibbles ([`Block::nibbles`]), rebuilt by a 16-entry table lookup where
    /// the ISA has one ([`Codes::TABLE16`]).
    const NIBBLES: bool = false;
    /// Added to a nibble before scaling (Q4_0: -8).
    const OFFSET: i32 = 0;

    /// Splits one GGUF block `blk` into its header and codes.
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]);

    /// The block's parameters from its header, as dequantization computes them: `out[g]` is
    /// group g's scale or, with a bias, `out[2g]` the scale and `out[2g + 1]` the bias.
    fn params(head: &[u8], out: &mut [f32]);

    /// Codes of elements `e0..e0 + LANES` of group `g`, offset applied.
    ///
    /// Safety: `q` is valid for [`Block::CODES`] reads; the CPU supports `S`.
    unsafe fn codes<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I;

    /// Where [`Block::NIBBLES`]: lanes whose low 4 bits are the codes of elements
    /// `e0..e0 + LANES` of group `g` (no offset; higher bits are anything). Safety: as
    /// [`Block::codes`].
    #[inline(always)]
    unsafe fn nibbles<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I {
        Self::codes::<S>(q, g, e0)
    }
}

/// Elements `e0..e0 + LANES` of group `g` as f32, `code·scale (+ bias)`: the dequantized values
/// (the product is exact, so one rounding whether fused or not). Safety: as [`Block::codes`].
#[inline(always)]
pub(crate) unsafe fn widen<S: Codes, B: Block>(
    q: *const u8,
    g: usize,
    e0: usize,
    scale: S::V,
    bias: S::V,
) -> S::V {
    let c = S::to_f32(B::codes::<S>(q, g, e0));
    if B::BIAS {
        S::fma(c, scale, bias)
    } else {
        S::mul(c, scale)
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Headers that are their parameters as f16: each half widened.
fn half_params(head: &[u8], out: &mut [f32]) {
    for (o, h) in out.iter_mut().zip(head.chunks_exact(2)) {
        *o = half(h, 0);
    }
}

/// Nibbles `e0..e0 + LANES` of a 32-element run stored as 16 bytes at `qs` (low nibbles are
/// elements 0..16, high nibbles 16..32), in the low 4 bits of each lane.
#[inline(always)]
unsafe fn nibbles32<S: Codes>(qs: *const u8, e0: usize) -> S::I {
    if e0 < 16 {
        S::u8s_kept(qs.add(e0))
    } else {
        S::srl(S::u8s_kept(qs.add(e0 - 16)), 4)
    }
}

/// Bits `e0..e0 + LANES` of the little-endian u32 at `qh`, each moved to bit 4.
#[inline(always)]
unsafe fn fifth_bits<S: Codes>(qh: *const u8, e0: usize) -> S::I {
    let bits = qh.cast::<u32>().read_unaligned() as i32;
    S::sll(S::and(S::srlv(S::splat_i(bits), S::iota(e0 as i32)), 1), 4)
}

/// ggml's `get_scale_min_k4`: 6-bit scale and min of group `j` (0..8) of a K block's 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
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

/// A GGUF block whose header is its first `HEAD` bytes and whose codes are the rest, in order.
fn split_front(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
    let (h, c) = blk.split_at(head.len());
    head.copy_from_slice(h);
    codes.copy_from_slice(c);
}

/// A 5-bit block `header, qh[4], qs[16]` (header of `head.len()` bytes) as `header | qs, qh`.
fn split_q5(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
    let h = head.len();
    head.copy_from_slice(&blk[..h]);
    codes[..16].copy_from_slice(&blk[h + 4..h + 20]);
    codes[16..20].copy_from_slice(&blk[h..h + 4]);
}

impl Block for Q4_0 {
    const ELEMS: usize = 32;
    const HEAD: usize = 2;
    const CODES: usize = 16;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    const HALF_HEAD: bool = true;
    const NIBBLES: bool = true;
    const OFFSET: i32 = -8;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_front(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        half_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        S::add_i(S::and(nibbles32::<S>(q, e0), 0xF), -8)
    }
    #[inline(always)]
    unsafe fn nibbles<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        nibbles32::<S>(q, e0)
    }
}

impl Block for Q4_1 {
    const ELEMS: usize = 32;
    const HEAD: usize = 4;
    const CODES: usize = 16;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    const HALF_HEAD: bool = true;
    const NIBBLES: bool = true;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_front(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        half_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        S::and(nibbles32::<S>(q, e0), 0xF)
    }
    #[inline(always)]
    unsafe fn nibbles<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        nibbles32::<S>(q, e0)
    }
}

impl Block for Q5_0 {
    const ELEMS: usize = 32;
    const HEAD: usize = 2;
    const CODES: usize = 20;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    const HALF_HEAD: bool = true;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_q5(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        half_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        let c = S::or(
            S::and(nibbles32::<S>(q, e0), 0xF),
            fifth_bits::<S>(q.add(16), e0),
        );
        S::add_i(c, -16)
    }
}

impl Block for Q5_1 {
    const ELEMS: usize = 32;
    const HEAD: usize = 4;
    const CODES: usize = 20;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    const HALF_HEAD: bool = true;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_q5(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        half_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        S::or(
            S::and(nibbles32::<S>(q, e0), 0xF),
            fifth_bits::<S>(q.add(16), e0),
        )
    }
}

impl Block for Q8_0 {
    const ELEMS: usize = 32;
    const HEAD: usize = 2;
    const CODES: usize = 32;
    const GROUP: usize = 32;
    const BIAS: bool = false;
    const HALF_HEAD: bool = true;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_front(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        half_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, _g: usize, e0: usize) -> S::I {
        S::i8s(q.add(e0))
    }
}

/// Scales and biases of the 8 groups of a Q4_K / Q5_K header `d, dmin, scales[12]`.
fn k_params(head: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half(head, 0), half(head, 2));
    for (g, o) in out.chunks_exact_mut(2).enumerate() {
        let (sc, m) = scale_min_k4(g, &head[4..16]);
        // ggml subtracts `dmin·m`; adding its negation rounds the same.
        o[0] = d * sc as f32;
        o[1] = -(dmin * m as f32);
    }
}

/// Nibbles of bytes `e0..` of the 32 bytes group `g` reads at `qs`: low (g even) or high, in the
/// low 4 bits of each lane.
#[inline(always)]
unsafe fn k_nibbles<S: Codes>(qs: *const u8, g: usize, e0: usize) -> S::I {
    let p = qs.add(32 * (g / 2) + e0);
    if g.is_multiple_of(2) {
        S::u8s_kept(p)
    } else {
        S::srl(S::u8s_kept(p), 4)
    }
}

impl Block for Q4K {
    const ELEMS: usize = 256;
    const HEAD: usize = 16;
    const CODES: usize = 128;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    const HALF_HEAD: bool = false;
    const NIBBLES: bool = true;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        split_front(blk, head, codes)
    }
    fn params(head: &[u8], out: &mut [f32]) {
        k_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I {
        S::and(k_nibbles::<S>(q, g, e0), 0xF)
    }
    #[inline(always)]
    unsafe fn nibbles<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I {
        k_nibbles::<S>(q, g, e0)
    }
}

impl Block for Q5K {
    const ELEMS: usize = 256;
    const HEAD: usize = 16;
    const CODES: usize = 160;
    const GROUP: usize = 32;
    const BIAS: bool = true;
    const HALF_HEAD: bool = false;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        head.copy_from_slice(&blk[..16]);
        codes[..128].copy_from_slice(&blk[48..176]);
        codes[128..].copy_from_slice(&blk[16..48]);
    }
    fn params(head: &[u8], out: &mut [f32]) {
        k_params(head, out)
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I {
        let high = S::sll(S::and(S::srl(S::u8s(q.add(128 + e0)), g as u32), 1), 4);
        S::or(S::and(k_nibbles::<S>(q, g, e0), 0xF), high)
    }
}

impl Block for Q6K {
    const ELEMS: usize = 256;
    const HEAD: usize = 18;
    const CODES: usize = 192;
    const GROUP: usize = 16;
    const BIAS: bool = false;
    const HALF_HEAD: bool = false;
    fn split(blk: &[u8], head: &mut [u8], codes: &mut [u8]) {
        head.copy_from_slice(&blk[192..210]);
        codes.copy_from_slice(&blk[..192]);
    }
    fn params(head: &[u8], out: &mut [f32]) {
        let d = half(head, 16);
        for (o, &s) in out.iter_mut().zip(&head[..16]) {
            *o = d * (s as i8) as f32;
        }
    }
    #[inline(always)]
    unsafe fn codes<S: Codes>(q: *const u8, g: usize, e0: usize) -> S::I {
        // Group g: half h = g/8 of the block, quarter q of that half, sixteen s.
        let (h, qq, s) = (g / 8, (g % 8) / 2, g % 2);
        let ql = S::u8s(q.add(64 * h + (qq % 2) * 32 + s * 16 + e0));
        let low = if qq < 2 {
            S::and(ql, 0xF)
        } else {
            S::srl(ql, 4)
        };
        let qh = S::u8s(q.add(128 + 32 * h + s * 16 + e0));
        let high = S::sll(S::and(S::srl(qh, 2 * qq as u32), 3), 4);
        S::add_i(S::or(low, high), -32)
    }
}
