//! Vector arithmetic shared by every CPU kernel (KV decode attention, KV quantization, the
//! row matmuls of `ops`): ISA detection ([`Isa`]), the vector trait the kernels are written in
//! ([`Simd`], with [`Portable`], [`avx2::Avx2`] and [`avx512::Avx512`] implementations), and
//! element widening ([`Elem`], [`lanes::Lanes`]).
//!
//! Every SIMD path has an AVX2 twin chosen at run time, and a portable one: machines of the
//! same kind differ (AVX-512 Xeons, AVX2-only EPYCs), and tests run every ISA the CPU has.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod lanes;
mod vector;

pub(crate) use vector::{element, Portable, Simd};

use candle_core::WithDType;
use half::{bf16, f16};

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
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
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
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
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
    pub(crate) fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            _ => 8,
        }
    }

    /// The widest implementation this CPU and head dimension allow (`head_dim % 8 == 0`; 16
    /// lanes need `head_dim % 16 == 0`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    pub(crate) fn best(head_dim: usize) -> Isa {
        match Isa::widest() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if !head_dim.is_multiple_of(16) => Isa::Avx2,
            isa => isa,
        }
    }
}

/// Runs `f(bits, words, len)` on random packed rows — 50 rounds of every row length 32, 64, 128
/// and every width 2, 3, 4, 5, 6, 8 — each in a vector of exactly its words, so an over-read
/// leaves the allocation: the driver of every ISA's code-decoder test. Rows of 32 values are
/// shorter than one load; 64 and 128 end with vectors read from their end.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn for_random_code_rows(seed: u64, mut f: impl FnMut(usize, &[u32], usize)) {
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u32
    };
    for _ in 0..50 {
        for len in [32, 64, 128] {
            for bits in [2usize, 3, 4, 5, 6, 8] {
                let words: Vec<u32> = (0..len * bits / 32).map(|_| next()).collect();
                f(bits, &words, len);
            }
        }
    }
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
