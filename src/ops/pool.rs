//! Fork-join for the CPU kernels of a forward pass, on rayon's global pool.
//!
//! A decode step of a small model calls ~150 parallel kernels of a few tens of µs each. rayon,
//! called from a thread outside its pool, injects each call and puts the caller to sleep until
//! a worker wakes it: two thread wake-ups per kernel, as long as the kernel itself on a VM.
//! So a forward pass runs on a thread of the pool ([`run`]): its kernels ([`for_each`]) then
//! split from there, the caller working on its share while idle workers steal the rest.
//!
//! Why not a pool whose workers spin between calls and wait for each other (candle's barrier
//! pool, llama.cpp's): when other processes share the cores, a call then waits for a worker
//! the OS has not scheduled — on this project's shared 2-core machines that made a decode step
//! five times slower. Here a worker that runs late finds the work done.

use rayon::prelude::*;

/// Runs `f` on a thread of the pool (directly where the caller is one), so that the kernels
/// it calls do not each wake the caller.
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// Runs `f(0..n)`, spread over the pool's threads. Which thread runs which index is not fixed:
/// `f` must not depend on it.
pub(crate) fn for_each(n: usize, f: impl Fn(usize) + Sync + Send) {
    match n {
        0 => {}
        1 => f(0),
        _ => (0..n).into_par_iter().for_each(f),
    }
}

/// Threads a kernel runs on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// A mutable slice handed out in disjoint pieces to the tasks of [`for_each`].
pub(crate) struct Shared<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: tasks only touch disjoint pieces ([`Shared::piece`]'s contract) of a slice the
// creator borrows mutably for `'a`.
unsafe impl<T: Send> Send for Shared<'_, T> {}
unsafe impl<T: Send> Sync for Shared<'_, T> {}

impl<'a, T> Shared<'a, T> {
    pub(crate) fn new(s: &'a mut [T]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _slice: std::marker::PhantomData,
        }
    }

    /// Elements `at..at + len` (clamped to the slice).
    ///
    /// Safety: no two live pieces overlap.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn piece(&self, at: usize, len: usize) -> &mut [T] {
        let at = at.min(self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(at), len.min(self.len - at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_index_runs_once_and_pieces_cover_the_slice() {
        for n in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{n}");
        }
        let mut v = vec![0usize; 23];
        let s = Shared::new(&mut v);
        // SAFETY: pieces i·5..i·5+5 are disjoint.
        for_each(5, |i| unsafe { s.piece(i * 5, 5) }.fill(i + 1));
        assert_eq!(v[0], 1);
        assert_eq!(v[22], 5);
        assert!(threads() >= 1);
        assert!(run(|| rayon::current_thread_index().is_some()));
    }
}
