//! Provisional (replaced by the text branch).
use anyhow::Result;
use std::path::PathBuf;
pub fn default_model() -> Result<PathBuf> {
    Ok(PathBuf::from(
        "/root/.cache/kvq/SmolLM2-135M-Instruct.Q4_1.gguf",
    ))
}
