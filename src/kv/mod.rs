//! The KV cache: quantization format and ops (`quant`), the paged block pool and per-sequence
//! block tables (`cache`), attention over cached blocks (`attention`), and prompt-cache files
//! (`prompt_cache`).

pub mod attention;
pub mod cache;
pub mod decode;
#[cfg(feature = "cuda")]
pub(crate) mod kernels;
pub mod layer;
pub mod prefix;
pub mod prompt_cache;
pub mod quant;
pub mod rotation;
