//! Measurement drivers behind the `bench-*` subcommands.

pub mod batch;
pub mod kv_cache;
pub mod perplexity;
