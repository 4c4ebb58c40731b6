//! Files kvq writes at the user's request (`batch-generate -o`, `--save-prompt-cache`): what it
//! refuses to overwrite, and how an output is held while a run writes it.
//!
//! Rules (README, "What kvq refuses, and what it never does"):
//! - an existing file is replaced only with `--force`; never a file the run reads (the model's
//!   files, the batch input, the `--tokenizer`), never a device, FIFO or other non-regular file
//!   (a symlink is followed to its target, which is what gets written);
//! - `batch-generate -o FILE --force` keeps the old content until the run is under way (the
//!   model loaded, every request checked): a run that fails before that changes nothing;
//! - a batch output is locked (an exclusive advisory lock) for the whole run, so two runs never
//!   interleave their lines in one file;
//! - a non-regular output (`-o /dev/stdout`, a pipe) is written as a stream: never read, never
//!   truncated, never resumed.

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::args::ModelArgs;
use crate::engine::batch_io::read_resume;
use crate::model::load::LoadedModel;

/// What a path is, in words, when it is not a regular file.
fn kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else if meta.is_symlink() {
        "a symlink"
    } else {
        "not a regular file"
    }
}

/// Whether `a` and `b` name the same file (same device and inode), following symlinks.
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        #[cfg(unix)]
        (Ok(x), Ok(y)) => {
            use std::os::unix::fs::MetadataExt;
            x.dev() == y.dev() && x.ino() == y.ino()
        }
        #[cfg(not(unix))]
        (Ok(_), Ok(_)) => match (a.canonicalize(), b.canonicalize()) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        },
        _ => false,
    }
}

/// Refuses `flag PATH` when it names a file this run reads (`read`: what it is, e.g. "the
/// model file", and its path), also through a symlink or a hard link.
pub fn check_not_read(flag: &str, path: &Path, read: &[(&str, PathBuf)]) -> Result<()> {
    if let Some((what, p)) = read.iter().find(|(_, p)| same_file(path, p)) {
        bail!(
            "{flag} {} is {what} {} this run reads: kvq never writes over its inputs",
            path.display(),
            p.display()
        );
    }
    Ok(())
}

/// The files `--model` and `--tokenizer` name that are known before the model loads: a model
/// file, every file of a model directory, the tokenizer. (What `--model` resolves to otherwise,
/// the default model or a Hub download, is known once loaded: [`model_files`].)
pub fn model_inputs(m: &ModelArgs) -> Vec<(&'static str, PathBuf)> {
    let mut read = Vec::new();
    if let Some(t) = &m.tokenizer {
        read.push(("the --tokenizer file", t.clone()));
    }
    if let Some(p) = m.model.as_deref().map(Path::new) {
        if p.is_file() {
            read.push(("the model file", p.to_path_buf()));
        } else if let Ok(f) = crate::model::hub::model_files_in_dir(p) {
            let mut files = f.weights;
            files.extend([f.config, f.tokenizer]);
            files.extend(f.tokenizer_config);
            files.extend(f.generation_config);
            read.extend(files.into_iter().map(|p| ("the model file", p)));
        }
    }
    read
}

/// The files the loaded model was read from, as [`check_not_read`] takes them.
pub fn model_files(m: &LoadedModel) -> Vec<(&'static str, PathBuf)> {
    m.source
        .files()
        .into_iter()
        .map(|f| ("the model file", f))
        .collect()
}

/// Checks that `flag PATH` may be written as a new file: it does not exist, or it is a regular
/// file (through symlinks) that is none of `read` (the files the run reads) and `force` is set.
pub fn check_new_file(
    flag: &str,
    path: &Path,
    read: &[(&str, PathBuf)],
    force: bool,
) -> Result<()> {
    check_not_read(flag, path, read)?;
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("{flag} {}", path.display())),
        Ok(m) if !m.is_file() => bail!(
            "{flag} {} is {}, not a regular file: kvq writes only regular files there",
            path.display(),
            kind(&m)
        ),
        Ok(_) if !force => bail!(
            "{flag} {} already exists: --force overwrites it",
            path.display()
        ),
        Ok(_) => Ok(()),
    }
}

/// A regular file to replace atomically: the symlink's target if `path` is one (so the link
/// keeps pointing at the new content), else `path`.
pub fn replace_target(path: &Path) -> PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_symlink() => path.canonicalize().unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// A batch output opened for a run: locked while it lives when it is a regular file.
pub struct BatchOutput {
    out: File,
    /// The file as it was before a `--resume` rewrite: its lock stays held until the run ends,
    /// so a run that opened it before the rewrite cannot take it over.
    _previous: Option<File>,
    /// With `--resume`: the keys of what the file already holds.
    pub done: Option<HashSet<String>>,
    /// With `--force` on a non-empty file: emptied by [`BatchOutput::start`], not before.
    empty_on_start: bool,
}

impl BatchOutput {
    /// Called once the run is under way (the model loaded, every request checked), before the
    /// first record: only now does `--force` empty the old file, so a run that fails before
    /// it starts leaves the old content as it was.
    pub fn start(&mut self, path: &Path) -> Result<()> {
        if std::mem::take(&mut self.empty_on_start) {
            self.out
                .set_len(0)
                .with_context(|| format!("cannot empty {}", path.display()))?;
        }
        Ok(())
    }
}

impl Write for BatchOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

fn lock(file: &File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "{} is being written by another kvq run (it holds the file's lock): wait for it to \
             end, or choose another --output",
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("cannot lock {}", path.display()))
        }
    }
}

/// Opens `-o PATH` for a batch run. Without `resume`, an existing non-empty file needs `force`
/// (and is emptied only by [`BatchOutput::start`], once the run is under way). With `resume`, the file is read and checked line by line
/// (see [`read_resume`]); if anything must go (cancelled records, a torn last line), the kept
/// lines are written to a new file, locked, and renamed over the old one.
pub fn open_batch_output(path: &Path, resume: bool, force: bool) -> Result<BatchOutput> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("--output {}", path.display())),
    };
    if let Some(m) = meta.as_ref().filter(|m| !m.is_file()) {
        if m.is_dir() || resume {
            bail!(
                "--output {} is {}: {}",
                path.display(),
                kind(m),
                if resume {
                    "--resume needs a regular file it can read back"
                } else {
                    "give a file path"
                }
            );
        }
        // A pipe or device: a stream, written as it is.
        let out = OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open {} for writing", path.display()))?;
        return Ok(BatchOutput {
            out,
            _previous: None,
            done: None,
            empty_on_start: false,
        });
    }
    let target = replace_target(path);
    let mut file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(&target)
        .with_context(|| format!("cannot open {} for writing", path.display()))?;
    lock(&file, path)?;
    if !resume {
        let len = file.metadata()?.len();
        if len > 0 && !force {
            bail!(
                "{} already exists: --resume continues it, --force overwrites it",
                path.display()
            );
        }
        return Ok(BatchOutput {
            out: file,
            _previous: None,
            done: None,
            empty_on_start: len > 0,
        });
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let line = e
            .as_bytes()
            .iter()
            .take(e.utf8_error().valid_up_to())
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        anyhow::anyhow!(
            "--resume {}:{line}: not UTF-8 text, so not a kvq batch-generate output; \
             nothing was changed",
            path.display()
        )
    })?;
    let st = read_resume(&text).map_err(|e| {
        anyhow::anyhow!(
            "--resume {}:{}: {e}; nothing was changed",
            path.display(),
            e.line
        )
    })?;
    if st.cancelled > 0 {
        eprintln!(
            "--resume: {} cancelled record(s) removed from {}; those requests run again",
            st.cancelled,
            path.display()
        );
    }
    if let Some(n) = st.torn {
        eprintln!(
            "--resume: the last line ({}:{n}) was cut short by a kill; it is removed and its \
             request runs again",
            path.display()
        );
    }
    if !st.rewrite {
        return Ok(BatchOutput {
            out: file,
            _previous: None,
            done: Some(st.done),
            empty_on_start: false,
        });
    }
    let new = rewrite_locked(&target, &st.keep)?;
    Ok(BatchOutput {
        out: new,
        _previous: Some(file),
        done: Some(st.done),
        empty_on_start: false,
    })
}

/// Writes `lines` to a fresh file beside `target`, locks it, and renames it over `target`, so a
/// kill leaves the old file or the new one. Returns the new file, open for appending.
fn rewrite_locked(target: &Path, lines: &[String]) -> Result<File> {
    let mut tmp = target.as_os_str().to_owned();
    tmp.push(format!(".kvq-resume-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let mut f = OpenOptions::new()
        .read(true)
        .append(true)
        .create_new(true)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    let done = (|| -> Result<()> {
        lock(&f, &tmp)?;
        let mut body = lines.join("\n");
        if !body.is_empty() {
            body.push('\n');
        }
        f.write_all(body.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, target)?;
        Ok(())
    })();
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot rewrite {}", target.display()));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_output_is_refused_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        let first = open_batch_output(&p, false, false).unwrap();
        let e = open_batch_output(&p, true, false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("another kvq run"), "{e}");
        drop(first);
        assert!(open_batch_output(&p, true, false).is_ok());
    }

    #[test]
    fn new_file_checks() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let read = [("the model file", model.clone())];
        for p in [&model, &link] {
            let e = check_new_file("--x", p, &read, true).unwrap_err();
            assert!(e.to_string().contains("model"), "{e}");
        }
        let other = dir.path().join("o");
        std::fs::write(&other, b"x").unwrap();
        assert!(check_new_file("--x", &other, &[], false).is_err());
        assert!(check_new_file("--x", &other, &[], true).is_ok());
        assert!(check_new_file("--x", Path::new("/dev/null"), &[], true).is_err());
        assert!(check_new_file("--x", &dir.path().join("new"), &[], false).is_ok());
    }
}
