//! The vector operations the decode kernel is written in (`LANES` f32 lanes), and their
//! portable implementation (eight-value arrays the compiler vectorizes as it can).
//!
//! Every method is `unsafe`: pointers must be valid for the values read or written, and an
//! implementation may need CPU features its caller has checked (see `avx2`, `avx512`).

/// `LANES` f32 lanes plus the row decoders of every cache format.
pub(crate) trait Simd: Copy + Send + Sync + 'static {
    const LANES: usize;
    /// Vector registers the ISA has: the kernel's register tiles (rows per K step, columns per
    /// V block) are sized so accumulators and rebuilt rows fit without spilling.
    const REGS: usize = 16;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn hsum(a: Self::V) -> f32;
    /// Four horizontal sums at once (cheaper than four [`Simd::hsum`] on wide vectors).
    #[inline(always)]
    unsafe fn hsum4(a: [Self::V; 4]) -> [f32; 4] {
        a.map(|x| Self::hsum(x))
    }
    /// Eight horizontal sums at once.
    #[inline(always)]
    unsafe fn hsum8(a: [Self::V; 8]) -> [f32; 8] {
        let (x, y) = (
            Self::hsum4([a[0], a[1], a[2], a[3]]),
            Self::hsum4([a[4], a[5], a[6], a[7]]),
        );
        [x[0], x[1], x[2], x[3], y[0], y[1], y[2], y[3]]
    }
    /// The sixteen sums of a four-row K step, `a[row][head]`, as `out[head][row]` (one row of
    /// scores per query head, four positions side by side).
    #[inline(always)]
    unsafe fn hsum16(a: [[Self::V; 4]; 4]) -> [[f32; 4]; 4] {
        let rows = a.map(|r| Self::hsum4(r));
        std::array::from_fn(|j| std::array::from_fn(|r| rows[r][j]))
    }
    /// One f16 value (as bits) as f32.
    unsafe fn half(h: u16) -> f32;
    /// `LANES` f16 values (as bits) widened to f32.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// `LANES` bf16 values (as bits) widened to f32.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// Vector `v` of the codes of the LSB-first `B`-bit stream of `words` u32 words at `row`,
    /// as f32, lane `l` holding value [`element`]`(B, LANES, v, l)`. Reads only inside the
    /// `words` words.
    unsafe fn codes<const B: u32>(row: *const u32, words: usize, v: usize) -> Self::V;
    /// Vectors `2u` and `2u + 1` of [`Simd::codes`]: the kernel walks rows in pairs of vectors,
    /// and for 4-bit codes the pair is one load (low and high nibbles of the same bytes).
    #[inline(always)]
    unsafe fn code_pair<const B: u32>(row: *const u32, words: usize, u: usize) -> [Self::V; 2] {
        [
            Self::codes::<B>(row, words, 2 * u),
            Self::codes::<B>(row, words, 2 * u + 1),
        ]
    }
    /// Whether 4-bit codes are rebuilt by a lookup in a 16-entry table ([`Simd::table4`],
    /// [`Simd::rebuild4_pair`]): one permute per vector instead of a convert and a multiply-add,
    /// where one vector holds the table (16 lanes).
    const TABLE4: bool = false;
    /// The table `scale·i + bias` for i in 0..16 (lane i). Only called where [`Simd::TABLE4`].
    #[inline(always)]
    unsafe fn table4(scale: Self::V, bias: Self::V) -> Self::V {
        Self::fma(Self::zero(), scale, bias)
    }
    /// Vectors `2u`, `2u + 1` of a `B`-bit row rebuilt as `code·scale + bias`. Safety: as
    /// [`Simd::codes`].
    #[inline(always)]
    unsafe fn rebuild_pair<const B: u32>(
        row: *const u32,
        words: usize,
        u: usize,
        scale: Self::V,
        bias: Self::V,
    ) -> [Self::V; 2] {
        // A loop, not `map`: a closure would not inherit the caller's target features.
        let mut x = Self::code_pair::<B>(row, words, u);
        for x in &mut x {
            *x = Self::fma(*x, scale, bias);
        }
        x
    }
    /// Vectors `2u`, `2u + 1` of a 4-bit row rebuilt: `table[code]` where [`Simd::TABLE4`],
    /// else [`Simd::rebuild_pair`] (the same values: the table entries are those multiply-adds).
    /// Safety: as [`Simd::codes`].
    #[inline(always)]
    unsafe fn rebuild4_pair(
        row: *const u32,
        words: usize,
        u: usize,
        table: Self::V,
        scale: Self::V,
        bias: Self::V,
    ) -> [Self::V; 2] {
        let _ = table;
        Self::rebuild_pair::<4>(row, words, u, scale, bias)
    }
    /// Asks for the cache line holding `p` (a hint: any address is fine).
    unsafe fn prefetch(p: *const u8);
}

/// Which value of a head row lane `l` of decoded vector `v` holds. 4-bit codes are decoded
/// byte-interleaved: `LANES` bytes (`2·LANES` values, inside one group since groups are
/// multiples of 32) at a time, the low nibbles (even values) into one vector and the high
/// nibbles (odd values) into the next — one widening load and one mask or shift per vector.
/// Every other width is in natural order.
#[inline(always)]
pub(crate) const fn element(bits: u32, lanes: usize, v: usize, l: usize) -> usize {
    if bits == 4 {
        (v / 2) * 2 * lanes + 2 * l + v % 2
    } else {
        v * lanes + l
    }
}

/// Any CPU: one value at a time, in loops the compiler may vectorize.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    const LANES: usize = 8;
    type V = [f32; 8];
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        p.cast::<[f32; 8]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        p.cast::<[f32; 8]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Not `mul_add`: without hardware FMA that is a slow library call.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn hsum(a: Self::V) -> f32 {
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }
    #[inline(always)]
    unsafe fn half(h: u16) -> f32 {
        super::f16_bits_to_f32(h)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self::V {
        let h = p.cast::<[u16; 8]>().read_unaligned();
        std::array::from_fn(|i| super::f16_bits_to_f32(h[i]))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self::V {
        let h = p.cast::<[u16; 8]>().read_unaligned();
        std::array::from_fn(|i| f32::from_bits((h[i] as u32) << 16))
    }
    #[inline(always)]
    unsafe fn codes<const B: u32>(row: *const u32, _words: usize, v: usize) -> Self::V {
        let mask = (1u32 << B) - 1;
        std::array::from_fn(|l| {
            let bit = element(B, 8, v, l) * B as usize;
            let (w, s) = (bit / 32, (bit % 32) as u32);
            let mut c = *row.add(w) >> s;
            if s + B > 32 {
                c |= *row.add(w + 1) << (32 - s);
            }
            (c & mask) as f32
        })
    }
    #[inline(always)]
    unsafe fn prefetch(_: *const u8) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generic four-row reduction returns row `r`, head `j`'s sum at `[j][r]` (the layout
    /// the four-row K step stores; AVX-512 overrides it and is checked against the same sums).
    #[test]
    fn hsum16_default_is_by_head_then_row() {
        let v = |i: usize| -> [f32; 8] { std::array::from_fn(|l| (i * 8 + l) as f32) };
        // SAFETY: the portable operations need no CPU features.
        let got = unsafe {
            Portable::hsum16(std::array::from_fn(|r| {
                std::array::from_fn(|j| v(4 * r + j))
            }))
        };
        for (j, row) in got.iter().enumerate() {
            for (r, &s) in row.iter().enumerate() {
                assert_eq!(s, v(4 * r + j).iter().sum::<f32>(), "head {j} row {r}");
            }
        }
    }
}
