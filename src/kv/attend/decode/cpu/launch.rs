//! Which implementation runs a task of the fused CPU decode kernel: the `#[target_feature]`
//! entry points of each instruction set (a function carries one set of features; the body
//! behind them, [`kernel::task`], is shared), and the launchers that pick one — [`ExactOnly`]
//! for row types the 8-bit query pass does not read (no instances of it are built for them),
//! [`WithInt`] for 4-bit keys.

#[cfg(target_arch = "x86_64")]
use super::int8::{self, Dot};
use super::int8::{Exact, QueryI8};
use super::kernel::{self, Scratch, Shape};
#[cfg(target_arch = "x86_64")]
use super::rows::Rows;
use super::AnyRows;
#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2, avx512};
use crate::simd::{Isa, Portable};

/// How a call attends: the exact float passes, or 8-bit queries ([`int8`]) and, for 4-bit
/// values, 8-bit weights (`int8v`), through `vpdpbusd` or through `vpmaddubsw`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) enum Keys {
    Exact,
    Vnni,
    Madd,
}

/// Runs one task on the chosen implementation.
pub(super) trait Launch {
    /// Safety: as [`kernel::task`]; `keys` is [`Keys::Exact`] or was chosen for this CPU.
    #[allow(clippy::too_many_arguments)]
    unsafe fn task<K: AnyRows, V: AnyRows>(
        isa: Isa,
        keys: Keys,
        heads: &[(K, V)],
        q: &[f32],
        qi: Option<(&QueryI8, usize)>,
        slots: &[u32],
        sh: Shape,
        scratch: &mut Scratch,
        out: &mut [f32],
    );
}

pub(super) struct ExactOnly;
pub(super) struct WithInt;

impl Launch for ExactOnly {
    unsafe fn task<K: AnyRows, V: AnyRows>(
        isa: Isa,
        _: Keys,
        heads: &[(K, V)],
        q: &[f32],
        _: Option<(&QueryI8, usize)>,
        slots: &[u32],
        sh: Shape,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => task_avx512::<K, V, Exact>(heads, q, None, slots, sh, scratch, out),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => task_avx2::<K, V, Exact>(heads, q, None, slots, sh, scratch, out),
            Isa::Portable => {
                kernel::task::<Portable, K, V, Exact>(heads, q, None, slots, sh, scratch, out)
            }
        }
    }
}

impl Launch for WithInt {
    unsafe fn task<K: AnyRows, V: AnyRows>(
        isa: Isa,
        keys: Keys,
        heads: &[(K, V)],
        q: &[f32],
        qi: Option<(&QueryI8, usize)>,
        slots: &[u32],
        sh: Shape,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (keys, qi);
        #[cfg(target_arch = "x86_64")]
        match (isa, keys) {
            (Isa::Avx512, Keys::Vnni) => {
                return task_avx512_vnni(heads, q, qi, slots, sh, scratch, out);
            }
            (Isa::Avx512, Keys::Madd) => {
                return task_avx512::<K, V, int8::Madd>(heads, q, qi, slots, sh, scratch, out);
            }
            (Isa::Avx2, Keys::Madd) => {
                return task_avx2::<K, V, int8::Madd>(heads, q, qi, slots, sh, scratch, out);
            }
            _ => {}
        }
        ExactOnly::task(isa, Keys::Exact, heads, q, None, slots, sh, scratch, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn task_avx512<K: Rows<avx512::Avx512>, V: Rows<avx512::Avx512>, D: Dot>(
    heads: &[(K, V)],
    q: &[f32],
    qi: Option<(&QueryI8, usize)>,
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    kernel::task::<avx512::Avx512, K, V, D>(heads, q, qi, slots, sh, scratch, out)
}

/// [`task_avx512`] with the 8-bit K pass on VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn task_avx512_vnni<K: Rows<avx512::Avx512>, V: Rows<avx512::Avx512>>(
    heads: &[(K, V)],
    q: &[f32],
    qi: Option<(&QueryI8, usize)>,
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    kernel::task::<avx512::Avx512, K, V, int8::Vnni>(heads, q, qi, slots, sh, scratch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<K: Rows<avx2::Avx2>, V: Rows<avx2::Avx2>, D: Dot>(
    heads: &[(K, V)],
    q: &[f32],
    qi: Option<(&QueryI8, usize)>,
    slots: &[u32],
    sh: Shape,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    kernel::task::<avx2::Avx2, K, V, D>(heads, q, qi, slots, sh, scratch, out)
}
