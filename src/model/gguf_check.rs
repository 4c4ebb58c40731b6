//! A bounds check of a GGUF file's header before candle parses it.
//!
//! candle's reader trusts the counts and lengths it reads: a string or array length, a tensor
//! or metadata count near 2^32 makes it allocate that much and abort the process. This walk
//! reads the same structure without allocating from it — every count and length is checked
//! against the bytes left in the file — so a damaged or hostile file gets a one-line refusal
//! naming what is wrong and where. (Format: github.com/ggml-org/ggml, docs/gguf.md.)

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::Read;

/// Why a header is refused: what, and the byte offset where it was read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} (at byte {offset})")]
pub struct HeaderError {
    pub what: String,
    pub offset: u64,
}

/// Dimensions a GGML tensor can have.
const MAX_DIMS: u32 = 4;
/// Array nesting that real files never exceed (bounds the recursion).
const MAX_NESTING: u32 = 8;
/// The key whose value the tensor data is aligned to (candle divides by it).
const ALIGNMENT_KEY: &[u8; 17] = b"general.alignment";

struct Walker<R> {
    r: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Walker<R> {
    fn fail<T>(&self, what: impl Into<String>) -> Result<T, HeaderError> {
        Err(HeaderError {
            what: what.into(),
            offset: self.pos,
        })
    }

    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], HeaderError> {
        let mut b = [0u8; N];
        if self.left() < N as u64 || self.r.read_exact(&mut b).is_err() {
            return self.fail("the file ends inside its header (truncated?)");
        }
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, HeaderError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, HeaderError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// Skips `n` bytes that must lie inside the file.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), HeaderError> {
        if n > self.left() {
            return self.fail(format!(
                "{what} of {n} bytes runs past the end of the file ({} bytes left)",
                self.left()
            ));
        }
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink());
        if copied.ok() != Some(n) {
            return self.fail("the file ends inside its header (truncated?)");
        }
        self.pos += n;
        Ok(())
    }

    /// A length-prefixed string; its bytes are returned only when `keep` (tensor names).
    fn string(&mut self, what: &str, keep: bool) -> Result<Option<Vec<u8>>, HeaderError> {
        let n = self.u64()?;
        if n > self.left() {
            return self.fail(format!(
                "{what} claims {n} bytes, more than the {} left in the file",
                self.left()
            ));
        }
        if !keep {
            self.skip(n, what)?;
            return Ok(None);
        }
        let mut b = vec![0u8; n as usize];
        if self.r.read_exact(&mut b).is_err() {
            return self.fail("the file ends inside its header (truncated?)");
        }
        self.pos += n;
        Ok(Some(b))
    }

    /// A metadata key, skipped; true when it is `general.alignment`.
    fn key(&mut self) -> Result<bool, HeaderError> {
        let n = self.u64()?;
        if n > self.left() {
            return self.fail(format!(
                "a metadata key claims {n} bytes, more than the {} left in the file",
                self.left()
            ));
        }
        if n != ALIGNMENT_KEY.len() as u64 {
            self.skip(n, "a metadata key")?;
            return Ok(false);
        }
        Ok(&self.bytes::<17>()? == ALIGNMENT_KEY)
    }

    /// The value of `general.alignment` (type `t`): an integer candle reads (u8..u32, i8..i32)
    /// and, as llama.cpp requires, a power of two. candle divides by it (0 would panic) and
    /// ignores other types (the data would be read at the wrong offsets).
    fn alignment(&mut self, t: u32) -> Result<(), HeaderError> {
        let v: i64 = match t {
            0 => u8::from_le_bytes(self.bytes()?).into(),
            1 => i8::from_le_bytes(self.bytes()?).into(),
            2 => u16::from_le_bytes(self.bytes()?).into(),
            3 => i16::from_le_bytes(self.bytes()?).into(),
            4 => u32::from_le_bytes(self.bytes()?).into(),
            5 => i32::from_le_bytes(self.bytes()?).into(),
            other => {
                return self.fail(format!(
                    "general.alignment has metadata type {other}: it must be an unsigned integer \
                     (u32), a power of two"
                ))
            }
        };
        if !u64::try_from(v).is_ok_and(u64::is_power_of_two) {
            return self.fail(format!(
                "general.alignment is {v}: it must be a power of two (the tensor data is aligned \
                 to it)"
            ));
        }
        Ok(())
    }

    /// One metadata value of type `t`.
    fn value(&mut self, t: u32, depth: u32) -> Result<(), HeaderError> {
        let fixed = match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                self.string("a metadata string", false)?;
                return Ok(());
            }
            9 => {
                if depth >= MAX_NESTING {
                    return self.fail("metadata arrays nested too deeply");
                }
                let et = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte (a string at least eight).
                let min = match et {
                    8 => 8,
                    9 => 12,
                    _ => 1,
                };
                if n.saturating_mul(min) > self.left() {
                    return self.fail(format!(
                        "a metadata array claims {n} elements, more than the file can hold"
                    ));
                }
                for _ in 0..n {
                    self.value(et, depth + 1)?;
                }
                return Ok(());
            }
            other => return self.fail(format!("unknown metadata value type {other}")),
        };
        self.skip(fixed, "a metadata value")
    }
}

/// Walks the header of the GGUF bytes `r` (of `len` bytes in all): magic, version, counts,
/// metadata and tensor infos. Returns the number of tensors.
pub fn check_header(r: impl Read, len: u64) -> Result<u64, HeaderError> {
    let mut w = Walker { r, pos: 0, len };
    if &w.bytes::<4>()? != b"GGUF" {
        return w.fail("no GGUF magic");
    }
    let version = w.u32()?;
    if !(2..=3).contains(&version) {
        return w.fail(format!("GGUF version {version} (kvq reads 2 and 3)"));
    }
    let tensors = w.u64()?;
    let kvs = w.u64()?;
    // A metadata entry takes at least 12 bytes (key length + type), a tensor info 28.
    if kvs.saturating_mul(12) > w.left() {
        return w.fail(format!(
            "{kvs} metadata entries claimed, more than the file can hold"
        ));
    }
    for _ in 0..kvs {
        let alignment = w.key()?;
        let t = w.u32()?;
        if alignment {
            w.alignment(t)?;
        } else {
            w.value(t, 0)?;
        }
    }
    if tensors.saturating_mul(28) > w.left() {
        return w.fail(format!(
            "{tensors} tensors claimed, more than the file can hold"
        ));
    }
    for _ in 0..tensors {
        let name = w.string("a tensor name", true)?.unwrap_or_default();
        let name = String::from_utf8_lossy(&name).into_owned();
        let dims = w.u32()?;
        if dims == 0 || dims > MAX_DIMS {
            return w.fail(format!(
                "tensor {name} has {dims} dimensions (1 to 4 allowed)"
            ));
        }
        let mut elems: u64 = 1;
        let mut empty = false;
        for _ in 0..dims {
            let d = w.u64()?;
            empty |= d == 0;
            elems = elems.saturating_mul(d);
        }
        // candle cannot read a tensor without values (it aborts on the empty slice).
        if empty {
            return w.fail(format!("tensor {name} has a dimension of 0 (no values)"));
        }
        // No GGML type stores a value in less than one bit... or 1.5 bits: at most 8 per byte.
        if elems > len.saturating_mul(8) {
            return w.fail(format!(
                "tensor {name} claims {elems} values, more than a {len}-byte file holds"
            ));
        }
        w.u32()?; // type: candle names an unknown one
        let offset = w.u64()?;
        if offset > len {
            return w.fail(format!(
                "tensor {name} starts at offset {offset}, past the end of the file"
            ));
        }
    }
    Ok(tensors)
}

/// Checks the header of the GGUF file at `path`.
pub fn check_file(path: &std::path::Path) -> std::io::Result<Result<u64, HeaderError>> {
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    Ok(check_header(std::io::BufReader::new(f), len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(out: &mut Vec<u8>, x: &str) {
        out.extend((x.len() as u64).to_le_bytes());
        out.extend(x.as_bytes());
    }

    fn header(tensors: u64, kvs: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(tensors.to_le_bytes());
        b.extend(kvs.to_le_bytes());
        b
    }

    fn check(b: &[u8]) -> Result<u64, HeaderError> {
        check_header(b, b.len() as u64)
    }

    #[test]
    fn a_small_valid_header_passes() {
        let mut b = header(1, 2);
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "list");
        b.extend(9u32.to_le_bytes());
        b.extend(4u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend([0u8; 8]);
        s(&mut b, "t");
        b.extend(2u32.to_le_bytes());
        b.extend(4u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend([0u8; 32]);
        assert_eq!(check(&b), Ok(1));
    }

    #[test]
    fn huge_counts_and_lengths_are_refused_without_allocating() {
        let e = check(&header(1 << 32, 0)).unwrap_err();
        assert!(e.what.contains("4294967296 tensors"), "{e}");
        let e = check(&header(0, u64::MAX)).unwrap_err();
        assert!(e.what.contains("metadata entries"), "{e}");
        let mut b = header(0, 1);
        b.extend((u32::MAX as u64).to_le_bytes());
        b.extend([0u8; 4]); // room for the entry's type: the key length is what is wrong
        let e = check(&b).unwrap_err();
        assert!(
            e.what.contains("metadata key claims 4294967295 bytes"),
            "{e}"
        );
        let mut b = header(0, 1);
        s(&mut b, "k");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend((1u64 << 32).to_le_bytes());
        let e = check(&b).unwrap_err();
        assert!(e.what.contains("array claims 4294967296"), "{e}");
        assert!(check(b"GGUF").is_err());
        assert!(check(b"").is_err());
    }

    #[test]
    fn alignment_must_be_a_power_of_two_of_a_type_candle_reads() {
        let with = |t: u32, v: &[u8]| {
            let mut b = header(0, 1);
            s(&mut b, "general.alignment");
            b.extend(t.to_le_bytes());
            b.extend(v);
            check(&b)
        };
        assert_eq!(with(4, &64u32.to_le_bytes()), Ok(0));
        assert_eq!(with(0, &[8]), Ok(0));
        for (t, v) in [
            (4, 0u32.to_le_bytes().to_vec()),
            (4, 24u32.to_le_bytes().to_vec()),
            (5, (-32i32).to_le_bytes().to_vec()),
        ] {
            let e = with(t, &v).unwrap_err();
            assert!(e.what.contains("power of two"), "{e}");
        }
        let e = with(10, &32u64.to_le_bytes()).unwrap_err();
        assert!(e.what.contains("metadata type 10"), "{e}");
    }
}
