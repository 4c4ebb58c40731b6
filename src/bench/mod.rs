//! Measurement drivers behind the `bench-*` subcommands.

pub mod kv_cache;
pub mod perplexity;
