//! From requests to tokens: sampling, stop conditions, incremental detokenization, the
//! scheduler that drives the model over many sequences, and run statistics.

pub mod batch;
pub mod batch_io;
pub mod chunks;
pub mod detok;
pub mod device_greedy;
#[cfg(feature = "cuda")]
pub mod graphs;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod stats;
pub mod stop;
pub mod text_stream;
