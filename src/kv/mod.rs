//! The KV cache: quantization format and ops (`quant`), the paged block pool and per-sequence
//! block tables (`cache`), and attention over cached blocks (`attention`).

pub mod attention;
pub mod cache;
pub mod decode;
pub mod layer;
pub mod quant;
pub mod rotation;
