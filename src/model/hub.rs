//! Provisional (replaced by the text branch).
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
pub struct ModelFiles {
    pub config: PathBuf,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}
pub enum HubModel {
    Gguf(PathBuf),
    Safetensors(ModelFiles),
}
pub fn model_files_in_dir(dir: &Path) -> Result<ModelFiles> {
    bail!("provisional {}", dir.display())
}
pub fn resolve_repo(spec: &str) -> Result<HubModel> {
    bail!("provisional {spec}")
}
