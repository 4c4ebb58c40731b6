//! CPU kernels shared by the model and the KV cache.

pub mod gguf;
pub mod pool;
pub mod row_matmul;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod tiles;
