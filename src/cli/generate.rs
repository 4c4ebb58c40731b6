//! `kvq generate` (placeholder until the engine lands).

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {}

pub fn run(_args: &GenerateArgs) -> anyhow::Result<()> {
    anyhow::bail!("generate is not built yet")
}
