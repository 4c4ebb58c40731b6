//! The parallel split of `y = x·Wᵀ` shared by the CPU matmul kernels ([`super::row_matmul`],
//! [`super::gguf`]): `y` `[m, n]` in tiles of up to `mc` rows of `x` × `nc` rows of `W`, one
//! task of [`super::pool`] per tile. The split only decides which elements are computed together, never the
//! order in which one is summed.

use super::pool;

/// Rows `rows.0..rows.1` of `x` times rows `cols.0..cols.1` of `W`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub rows: (usize, usize),
    pub cols: (usize, usize),
    /// Row length of `y`.
    pub n: usize,
    /// Row length of `x` (elements) and of `W` (elements; GGUF: blocks · values per block).
    pub k: usize,
}

/// The output pointer, shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (one tile each) and `for_each_tile` outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Calls `f(y, tile)` for every tile of `y` (`[m, n]`, row-major), in parallel; `f` must write
/// only its own tile's elements through the pointer.
pub(crate) fn for_each_tile(
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    (mc, nc): (usize, usize),
    f: impl Fn(*mut f32, Tile) + Sync,
) {
    let (tm, tn) = (m.div_ceil(mc), n.div_ceil(nc));
    let out = OutPtr(y.as_mut_ptr());
    pool::for_each(tm * tn, |t| {
        let (i0, j0) = (t % tm * mc, t / tm * nc);
        let tile = Tile {
            rows: (i0, (i0 + mc).min(m)),
            cols: (j0, (j0 + nc).min(n)),
            n,
            k,
        };
        f(out.get(), tile);
    });
}
