//! `kvq bench-kv-cache` (placeholder until the quantization work lands).

#[derive(clap::Args, Debug, Clone)]
pub struct BenchKvCacheArgs {}

pub fn run(_args: &BenchKvCacheArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench-kv-cache is not built yet")
}
