//! The KV cache, in three layers that only point down (docs/ARCHITECTURE.md):
//! - [`format`]: what a token's K/V rows look like (dense, affine groups, rotation) and the
//!   quantize / dequantize ops over them;
//! - [`cache`]: the paged block pool that owns every layer's storage, block tables, staging,
//!   windows, and prompt-cache files (export / import of a sequence's rows);
//! - [`attend`]: attention over the cache — the per-step plan, prefill and decode, with cpu /
//!   cuda / generic backends (generic is the reference);
//! - [`preset`]: what a `--kv-bits` budget means for a model and device (above the others: it
//!   knows which kernels exist).

pub mod attend;
pub mod cache;
pub mod format;
pub mod preset;
