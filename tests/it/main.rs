//! The integration tests, one test binary (`cargo test --test it`): every binary links kvq and
//! candle, so one link instead of one per file saves minutes of CI on 2 cores.
//!
//! Where a new test goes: a new file `tests/it/NAME.rs` plus `mod NAME;` below; shared helpers
//! (reference data, running the CLI) are in `tests/common/mod.rs`, used as `crate::common::*`.
//! Run one file's tests with `cargo test --test it NAME::` (a name filter), one test with
//! `cargo test --test it NAME::TEST -- --exact`.
//!
//! Only a test that changes the process environment (`std::env::set_var`) keeps a binary of its
//! own (`tests/NAME.rs` with `mod common;`), because the tests here run as threads of one process
//! and share it: `text_fetch` (KVQ_HOME) and `text_hub` (HF_HOME, HF_ENDPOINT).

#[path = "../common/mod.rs"]
mod common;

mod attn_decode;
mod batch_generate_cli;
mod batch_generate_greedy;
mod batch_generate_quant;
mod batch_logits;
mod cli_bench_batch;
mod cli_bench_kv_cache;
mod cli_errors;
mod code_size;
#[cfg(feature = "cuda")]
mod cuda_graphs;
mod fuzz_parsers;
mod generate_reference;
mod generate_reference_blocks;
mod kv_quant_generate;
mod layers;
mod models_tiny;
mod output_safety;
mod perplexity_cli;
mod prompt_cache;
mod quant_golden;
mod quant_ops;
mod quant_side;
mod refusals;
mod serve_api;
mod serve_load;
mod serve_openai;
mod serve_prefix;
mod serve_sampling;
mod text_tokenizer;
