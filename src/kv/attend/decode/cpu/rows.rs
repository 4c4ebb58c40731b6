//! How the CPU decode kernel reads one (KV head, K or V) of a layer's pool: the row views of
//! each cache format ([`DenseRows`], [`AffineRows`]) over the vector operations of [`Simd`].
//! A new format adds its view here (docs/ARCHITECTURE.md).

use crate::kv::format::QuantFormat;
use crate::simd::{Elem, Simd};

/// One (KV head, K or V) view of a layer's pool: where a slot's row starts and how to decode it.
pub(super) trait Rows<S: Simd>: Sync {
    /// Whether rows carry a scale and a bias per group.
    const AFFINE: bool;
    /// Bits per code (dense rows: 0).
    const BITS: u32 = 0;
    /// Whether [`Rows::rebuilt_pair`] takes a 16-entry table ([`Simd::table4`]).
    const TABLE: bool = false;
    /// Offset of `slot`'s row of this KV head in the pool's element (or word) slice.
    fn row(&self, slot: usize) -> usize;
    /// Vector `v` of the row at `row`: values `LANES*v..LANES*(v+1)`, or for interleaved rows
    /// the values [`element`] names.
    ///
    /// Safety: `row` comes from [`Rows::row`] of a slot inside the pool,
    /// `v < head_dim / LANES`, and the CPU supports `S`.
    unsafe fn vec(&self, row: usize, v: usize) -> S::V;
    /// Vectors `2u` and `2u + 1` of the row ([`Simd::code_pair`]). Safety: as [`Rows::vec`].
    #[inline(always)]
    unsafe fn pair(&self, row: usize, u: usize) -> [S::V; 2] {
        [self.vec(row, 2 * u), self.vec(row, 2 * u + 1)]
    }
    /// Vectors `2u`, `2u + 1` of the row, rebuilt with the group's scale and bias (or `table`,
    /// where [`Rows::TABLE`]); dense rows are their values as stored. Safety: as [`Rows::vec`].
    #[inline(always)]
    unsafe fn rebuilt_pair(
        &self,
        row: usize,
        u: usize,
        scale: S::V,
        bias: S::V,
        table: S::V,
    ) -> [S::V; 2] {
        let _ = (scale, bias, table);
        self.pair(row, u)
    }
    /// The row at `row` as bytes (quantized rows: its codes). Safety: as [`Rows::vec`].
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    unsafe fn row_bytes(&self, row: usize) -> *const u8;
    /// Groups of a slot, all KV heads (dense rows: 0), and this head's first one.
    fn slot_groups(&self) -> usize;
    fn head_group(&self) -> usize;
    /// Writes `slot`'s scales, then its biases (all KV heads, [`Rows::slot_groups`] each) as
    /// f32 to `out` (dense rows: nothing). Safety: `slot` lies inside the pool, `out` holds
    /// twice the slot's groups, and the CPU supports `S`.
    unsafe fn widen_params(&self, slot: usize, out: *mut f32);
    /// Bytes of a slot's values or codes, all KV heads.
    fn slot_bytes(&self) -> usize;
    /// Starts loading `slot`'s values or codes, of every KV head, into cache.
    fn prefetch(&self, slot: usize);
    /// Starts loading `slot`'s scales and biases, of every KV head, into cache (dense rows:
    /// nothing).
    fn prefetch_params(&self, slot: usize);
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
    /// Offset of this KV head inside a slot's row.
    pub head: usize,
}

impl<S: Simd, T: Elem> Rows<S> for DenseRows<'_, T> {
    const AFFINE: bool = false;
    #[inline(always)]
    fn row(&self, slot: usize) -> usize {
        slot * self.stride + self.head
    }
    #[inline(always)]
    unsafe fn vec(&self, row: usize, v: usize) -> S::V {
        T::load::<S>(self.data.as_ptr().add(row + S::LANES * v))
    }
    #[inline(always)]
    unsafe fn row_bytes(&self, row: usize) -> *const u8 {
        self.data.as_ptr().add(row).cast()
    }
    fn slot_groups(&self) -> usize {
        0
    }
    fn head_group(&self) -> usize {
        0
    }
    unsafe fn widen_params(&self, _: usize, _: *mut f32) {}
    #[inline(always)]
    fn prefetch(&self, slot: usize) {
        prefetch_span::<S, T>(self.data, slot * self.stride, self.stride);
    }
    #[inline(always)]
    fn prefetch_params(&self, _: usize) {}
    fn slot_bytes(&self) -> usize {
        self.stride * std::mem::size_of::<T>()
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
}

impl<'a, T, const B: u32> AffineRows<'a, T, B> {
    /// KV head `kh`'s view of a pool in `fmt` holding `kv_heads` head rows of `head_dim` values
    /// per slot: its codes, scales and biases.
    pub(super) fn new(
        fmt: QuantFormat,
        (codes, scales, biases): (&'a [u32], &'a [T], &'a [T]),
        kv_heads: usize,
        head_dim: usize,
        kh: usize,
    ) -> Self {
        let head_words = fmt.words_per_row(head_dim);
        AffineRows {
            codes,
            scales,
            biases,
            row_words: fmt.words_per_row(kv_heads * head_dim),
            head_word: kh * head_words,
            head_words,
            row_groups: fmt.groups_per_row(kv_heads * head_dim),
            head_group: kh * (head_dim / fmt.group_size()),
        }
    }
}

impl<S: Simd, T: Elem, const B: u32> Rows<S> for AffineRows<'_, T, B> {
    const AFFINE: bool = true;
    const BITS: u32 = B;
    const TABLE: bool = B == 4 && S::TABLE4;
    #[inline(always)]
    fn row(&self, slot: usize) -> usize {
        slot * self.row_words + self.head_word
    }
    #[inline(always)]
    unsafe fn vec(&self, row: usize, v: usize) -> S::V {
        S::codes::<B>(self.codes.as_ptr().add(row), self.head_words, v)
    }
    #[inline(always)]
    unsafe fn pair(&self, row: usize, u: usize) -> [S::V; 2] {
        S::code_pair::<B>(self.codes.as_ptr().add(row), self.head_words, u)
    }
    #[inline(always)]
    unsafe fn rebuilt_pair(
        &self,
        row: usize,
        u: usize,
        scale: S::V,
        bias: S::V,
        table: S::V,
    ) -> [S::V; 2] {
        let p = self.codes.as_ptr().add(row);
        if B == 4 {
            S::rebuild4_pair(p, self.head_words, u, table, scale, bias)
        } else {
            S::rebuild_pair::<B>(p, self.head_words, u, scale, bias)
        }
    }
    #[inline(always)]
    unsafe fn row_bytes(&self, row: usize) -> *const u8 {
        self.codes.as_ptr().add(row).cast()
    }
    fn slot_groups(&self) -> usize {
        self.row_groups
    }
    fn head_group(&self) -> usize {
        self.head_group
    }
    #[inline(always)]
    unsafe fn widen_params(&self, slot: usize, out: *mut f32) {
        let (n, at) = (self.row_groups, slot * self.row_groups);
        for (src, out) in [(self.scales, out), (self.biases, out.add(n))] {
            let src = src.as_ptr().add(at);
            let mut i = 0;
            while i + S::LANES <= n {
                S::store(out.add(i), T::load::<S>(src.add(i)));
                i += S::LANES;
            }
            while i < n {
                *out.add(i) = (*src.add(i)).to_f32::<S>();
                i += 1;
            }
        }
    }
    #[inline(always)]
    fn prefetch(&self, slot: usize) {
        prefetch_span::<S, u32>(self.codes, slot * self.row_words, self.row_words);
    }
    fn slot_bytes(&self) -> usize {
        self.row_words * 4
    }
    #[inline(always)]
    fn prefetch_params(&self, slot: usize) {
        let i = slot * self.row_groups;
        prefetch_span::<S, T>(self.scales, i, self.row_groups);
        prefetch_span::<S, T>(self.biases, i, self.row_groups);
    }
}

/// The scales and biases of a task's positions, widened to f32 once per task
/// ([`Rows::widen_params`]): `2 · groups` values per position, so the K and V passes broadcast
/// them from memory instead of widening a 16-bit value per row, group and column block (a
/// conversion as costly as a multiply-add on some cores).
#[derive(Clone, Copy)]
pub(super) struct Params<'a> {
    pub(super) data: &'a [f32],
    /// Groups per slot, all KV heads.
    pub(super) groups: usize,
}

impl Params<'_> {
    /// Scale and bias of slot-group `i` (head's first group + group) of position `t`, in every
    /// lane. Safety: `t` < the task's positions, `i` < `groups`, and the CPU supports `S`.
    #[inline(always)]
    pub(super) unsafe fn splat<S: Simd>(&self, t: usize, i: usize) -> (S::V, S::V) {
        let p = self.data.as_ptr().add(2 * self.groups * t + i);
        (S::splat(*p), S::splat(*p.add(self.groups)))
    }
}
