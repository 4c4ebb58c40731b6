//! The command line: one file per subcommand plus the shared flag groups in `args`.

pub mod args;
pub mod bench_kv_cache;
pub mod generate;
