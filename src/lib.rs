//! kvq: large language models with a quantized, paged KV cache and continuous batching.
//!
//! The map (see README.md): `model` loads weights, tokenizers and chat templates and runs the
//! decoder; `kv` holds the quantization format, the paged cache and attention over it; `engine`
//! turns requests into tokens (scheduler, sampler, detokenizer); `ops` holds CPU kernels the
//! model and the cache share; `bench` measures; `cli` is the command line.

pub mod bench;
pub mod cli;
pub mod device;
pub mod engine;
pub mod kv;
pub mod model;
pub mod ops;
pub mod server;
pub mod simd;
