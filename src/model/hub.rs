//! Models from a local directory or the Hugging Face Hub (through hf-hub's blocking API).
//!
//! A spec is `owner/name`, optionally `@revision`, optionally `:file.gguf`
//! (`HuggingFaceTB/SmolLM2-135M-Instruct@main`, `someone/model-GGUF:model.Q4_0.gguf`).
//! A repo with config.json + safetensors weights yields [`ModelFiles`]; a repo of GGUF files yields
//! one GGUF (the one named, or the only one). Environment: `HF_HOME` (cache), `HF_ENDPOINT`
//! (server), `HF_HUB_OFFLINE=1` (read only the local cache, never the network).

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::RepoInfo;
use hf_hub::{Cache, Repo, RepoType};

/// What a Hub spec resolved to.
#[derive(Debug, Clone, PartialEq)]
pub enum HubModel {
    Gguf(PathBuf),
    Safetensors { dir_files: ModelFiles },
}

/// The files of a safetensors model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFiles {
    pub config: PathBuf,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    /// `model.safetensors`, or the shards of `model.safetensors.index.json` in sorted order.
    pub weights: Vec<PathBuf>,
}

const CONFIG: &str = "config.json";
const TOKENIZER: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const GENERATION_CONFIG: &str = "generation_config.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Finds a safetensors model's files in a local directory.
pub fn model_files_in_dir(dir: &Path) -> Result<ModelFiles> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    collect_files(&format!("directory {}", dir.display()), |name| {
        let p = dir.join(name);
        Ok(p.is_file().then_some(p))
    })
}

/// The safetensors file set, with `fetch(name)` returning a local path or None when absent.
fn collect_files(
    place: &str,
    mut fetch: impl FnMut(&str) -> Result<Option<PathBuf>>,
) -> Result<ModelFiles> {
    let config = fetch(CONFIG)?.ok_or_else(|| anyhow!("{place} has no {CONFIG}"))?;
    let tokenizer = fetch(TOKENIZER)?.ok_or_else(|| anyhow!("{place} has no {TOKENIZER}"))?;
    let tokenizer_config = fetch(TOKENIZER_CONFIG)?;
    let generation_config = fetch(GENERATION_CONFIG)?;
    let weights = if let Some(single) = fetch(SINGLE_WEIGHTS)? {
        vec![single]
    } else if let Some(index) = fetch(WEIGHTS_INDEX)? {
        let shards = shard_names(&index)?;
        let mut paths = Vec::with_capacity(shards.len());
        for shard in shards {
            paths.push(fetch(&shard)?.ok_or_else(|| {
                anyhow!("{place} has no {shard}, a shard listed in {WEIGHTS_INDEX}")
            })?);
        }
        paths
    } else {
        bail!("{place} has no weights: neither {SINGLE_WEIGHTS} nor {WEIGHTS_INDEX}");
    };
    Ok(ModelFiles {
        config,
        tokenizer,
        tokenizer_config,
        generation_config,
        weights,
    })
}

/// The distinct shard files named in a `model.safetensors.index.json` weight map.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| anyhow!("{} has no \"weight_map\" object", index.display()))?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            anyhow!(
                "{}: weight_map[{tensor:?}] is not a file name",
                index.display()
            )
        })?;
        if file.contains("..") || file.starts_with('/') {
            bail!(
                "{}: shard name {file:?} leaves the model directory",
                index.display()
            );
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        bail!("{} lists no shards", index.display());
    }
    Ok(shards.into_iter().collect())
}

/// A parsed `repo[@revision][:file.gguf]`.
#[derive(Debug, Clone, PartialEq)]
struct Spec {
    repo: String,
    revision: String,
    file: Option<String>,
}

fn parse_spec(spec: &str) -> Result<Spec> {
    let (rest, file) = match spec.split_once(':') {
        Some((r, f)) if !f.is_empty() => (r, Some(f.to_string())),
        Some(_) => bail!("model {spec:?}: nothing after ':' (expected repo:file.gguf)"),
        None => (spec, None),
    };
    let (repo, revision) = match rest.split_once('@') {
        Some((r, rev)) if !rev.is_empty() => (r, rev.to_string()),
        Some(_) => bail!("model {spec:?}: nothing after '@' (expected repo@revision)"),
        None => (rest, "main".to_string()),
    };
    let valid = !repo.is_empty()
        && repo.split('/').count() <= 2
        && repo.split('/').all(|p| {
            !p.is_empty()
                && p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        });
    if !valid {
        bail!("model {spec:?} is neither an existing path nor a Hugging Face repo id (owner/name)");
    }
    Ok(Spec {
        repo: repo.to_string(),
        revision,
        file,
    })
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// Resolves a Hub repo id to local files, downloading what the cache lacks.
pub fn resolve_repo(spec: &str) -> Result<HubModel> {
    let spec = parse_spec(spec)?;
    let repo = Repo::with_revision(spec.repo.clone(), RepoType::Model, spec.revision.clone());
    if offline() {
        resolve_offline(&spec, &Cache::from_env(), repo)
    } else {
        resolve_through_client(&spec, repo)
    }
}

/// hf-hub's blocking client (ureq, rustls).
#[cfg(not(target_os = "macos"))]
fn resolve_through_client(spec: &Spec, repo: Repo) -> Result<HubModel> {
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(std::io::stderr().is_terminal())
        .build()
        .context("setting up the Hugging Face Hub client")?
        .repo(repo);
    resolve_online(spec, api.info().map_err(|e| e.to_string()), |name| {
        api.get(name).map_err(|e| e.to_string())
    })
}

/// macOS: hf-hub's async client (reqwest with the system TLS; see Cargo.toml for why) driven on a
/// one-thread runtime, so the calls stay blocking as on the other platforms.
#[cfg(target_os = "macos")]
fn resolve_through_client(spec: &Spec, repo: Repo) -> Result<HubModel> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the Hugging Face Hub client's runtime")?;
    let api = hf_hub::api::tokio::ApiBuilder::from_env()
        .with_progress(std::io::stderr().is_terminal())
        .build()
        .context("setting up the Hugging Face Hub client")?
        .repo(repo);
    let info = runtime.block_on(api.info()).map_err(|e| e.to_string());
    resolve_online(spec, info, |name| {
        runtime.block_on(api.get(name)).map_err(|e| e.to_string())
    })
}

/// The files of `info` (the repo's listing), fetched through `fetch` (name -> cached path).
fn resolve_online(
    spec: &Spec,
    info: std::result::Result<RepoInfo, String>,
    fetch: impl Fn(&str) -> std::result::Result<PathBuf, String>,
) -> Result<HubModel> {
    let what = format!("{}@{}", spec.repo, spec.revision);
    let info = info.map_err(|e| anyhow!("looking up {what} on the Hugging Face Hub: {e}"))?;
    let listed: BTreeSet<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let get = |name: &str| -> Result<PathBuf> {
        fetch(name).map_err(|e| anyhow!("downloading {name} of {what}: {e}"))
    };
    let ggufs: Vec<&String> = listed.iter().filter(|f| f.ends_with(".gguf")).collect();
    let has_safetensors = listed.contains(CONFIG)
        && (listed.contains(SINGLE_WEIGHTS) || listed.contains(WEIGHTS_INDEX));
    if spec.file.is_none() && has_safetensors {
        let files = collect_files(&format!("repo {what}"), |name| {
            if listed.contains(name) {
                get(name).map(Some)
            } else {
                Ok(None)
            }
        })?;
        return Ok(HubModel::Safetensors { dir_files: files });
    }
    let file = pick_gguf(&what, spec.file.as_deref(), &ggufs)?;
    Ok(HubModel::Gguf(get(&file)?))
}

fn pick_gguf(what: &str, wanted: Option<&str>, ggufs: &[&String]) -> Result<String> {
    match (wanted, ggufs) {
        (Some(f), _) if ggufs.iter().any(|g| g.as_str() == f) => Ok(f.to_string()),
        (Some(f), _) => bail!(
            "{what} has no file {f:?}; its .gguf files: {}",
            list_or_none(ggufs)
        ),
        (None, [one]) => Ok(one.to_string()),
        (None, []) => bail!("{what} has neither config.json + safetensors weights nor .gguf files"),
        (None, many) => bail!(
            "{what} holds several .gguf files; pick one with {what}:FILE, one of: {}",
            list_or_none(many)
        ),
    }
}

fn list_or_none(files: &[&String]) -> String {
    if files.is_empty() {
        "none".to_string()
    } else {
        files
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Only the local cache: the snapshot that `refs/<revision>` points at.
fn resolve_offline(spec: &Spec, cache: &Cache, repo: Repo) -> Result<HubModel> {
    let what = format!("{}@{}", spec.repo, spec.revision);
    let repo_dir = cache.path().join(repo.folder_name());
    let not_cached = || {
        anyhow!(
            "HF_HUB_OFFLINE is set and {what} is not in the Hugging Face cache ({}); \
             run once without HF_HUB_OFFLINE to download it",
            cache.path().display()
        )
    };
    let commit = std::fs::read_to_string(repo_dir.join("refs").join(&spec.revision))
        .map_err(|_| not_cached())?;
    let snapshot = repo_dir.join("snapshots").join(commit.trim());
    if !snapshot.is_dir() {
        return Err(not_cached());
    }
    let present = |name: &str| {
        let p = snapshot.join(name);
        p.exists().then_some(p)
    };
    let has_safetensors = present(CONFIG).is_some()
        && (present(SINGLE_WEIGHTS).is_some() || present(WEIGHTS_INDEX).is_some());
    if spec.file.is_none() && has_safetensors {
        let files = collect_files(&format!("cached {what} (offline)"), |n| Ok(present(n)))?;
        return Ok(HubModel::Safetensors { dir_files: files });
    }
    let mut ggufs: Vec<String> = std::fs::read_dir(&snapshot)
        .with_context(|| format!("listing {}", snapshot.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    ggufs.sort();
    let refs: Vec<&String> = ggufs.iter().collect();
    let file = pick_gguf(
        &format!("cached {what} (offline)"),
        spec.file.as_deref(),
        &refs,
    )?;
    Ok(HubModel::Gguf(snapshot.join(file)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        let s = parse_spec("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str(), s.file),
            ("HuggingFaceTB/SmolLM2-135M-Instruct", "main", None)
        );
        let s = parse_spec("a/b@v1.0:m.Q4_0.gguf").unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str(), s.file.as_deref()),
            ("a/b", "v1.0", Some("m.Q4_0.gguf"))
        );
        for bad in ["", "a/b/c", "a/b@", "a/b:", "../x", "a b/c"] {
            assert!(parse_spec(bad).is_err(), "{bad:?}");
        }
    }
}
