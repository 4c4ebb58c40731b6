//! Batch files: prompt lines in, one JSON result line per request out.
//!
//! Input is either plain text (one prompt per non-blank line) or JSONL (one object per line with
//! `id`, `prompt` or `messages`, and optional per-request overrides). Every parsed line keeps its
//! line number so a bad one can be reported as `file:line`. Output lines are written whole and
//! flushed one by one, so a killed job leaves only complete lines behind; `--resume` reads them
//! back to know which ids are done.

// Data here comes from files and the command line: no unwrap, expect or indexing that could
// panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use serde::Deserialize;
use serde_json::Value;
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;

use crate::model::chat::Message;

/// How to read the input file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InputFormat {
    /// JSONL if the first non-blank line starts with `{`, else text.
    Auto,
    /// One prompt per line (blank lines skipped).
    Text,
    /// One JSON object per line (blank lines skipped).
    Jsonl,
}

/// What to run for one request, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSpec {
    Text(String),
    Messages(Vec<Message>),
}

/// One valid input line. `None` fields fall back to the command-line defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct InputRecord {
    /// 1-based line number in the input.
    pub line: usize,
    /// The id as given (string or integer), or the line number for text input / missing ids.
    pub id: Value,
    pub prompt: PromptSpec,
    pub raw: Option<bool>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
    /// A prompt-cache file whose saved prefix this request starts from.
    pub prompt_cache: Option<PathBuf>,
}

/// A line that could not be used, with what is known about it.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidLine {
    pub line: usize,
    pub id: Option<Value>,
    pub error: String,
}

/// The key that identifies a request across runs (`--resume`): ids compare by their JSON text,
/// so `"7"` and `7` are different ids.
pub fn id_key(id: &Value) -> String {
    id.to_string()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLine {
    id: Option<Value>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    raw: Option<bool>,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<usize>,
    seed: Option<u64>,
    stop: Option<StopField>,
    prompt_cache: Option<String>,
}

/// Parses a whole input; each non-blank line gives a record or an error. Duplicate ids are
/// errors on the later line (results are keyed by id).
pub fn parse_input(text: &str, format: InputFormat) -> Vec<Result<InputRecord, InvalidLine>> {
    let format = match format {
        InputFormat::Auto => {
            let first = text.lines().map(str::trim).find(|l| !l.is_empty());
            if first.is_some_and(|l| l.starts_with('{')) {
                InputFormat::Jsonl
            } else {
                InputFormat::Text
            }
        }
        f => f,
    };
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, raw_line) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw_line.trim_end_matches('\r');
        if trimmed.trim().is_empty() {
            continue;
        }
        let parsed = match format {
            InputFormat::Jsonl => parse_json_line(trimmed, line),
            _ => Ok(text_record(trimmed, line)),
        };
        let checked = parsed.and_then(|r| {
            if seen.insert(id_key(&r.id)) {
                Ok(r)
            } else {
                Err(InvalidLine {
                    line,
                    // The id belongs to the earlier line: the record of this one must not claim it.
                    id: None,
                    error: format!("duplicate id {} (an earlier line has it)", r.id),
                })
            }
        });
        out.push(checked);
    }
    out
}

fn text_record(prompt: &str, line: usize) -> InputRecord {
    InputRecord {
        line,
        id: Value::from(line),
        prompt: PromptSpec::Text(prompt.to_string()),
        raw: None,
        max_tokens: None,
        temperature: None,
        top_p: None,
        top_k: None,
        seed: None,
        stop: None,
        prompt_cache: None,
    }
}

fn parse_json_line(text: &str, line: usize) -> Result<InputRecord, InvalidLine> {
    let value: Value = serde_json::from_str(text).map_err(|e| InvalidLine {
        line,
        id: None,
        error: format!("not valid JSON: {e}"),
    })?;
    let id = value.get("id").cloned();
    let fail = |error: String| InvalidLine {
        line,
        id: id
            .clone()
            .filter(|v| v.is_string() || v.is_u64() || v.is_i64()),
        error,
    };
    if !value.is_object() {
        return Err(fail("expected a JSON object".into()));
    }
    let j: JsonLine = serde_json::from_value(value).map_err(|e| fail(e.to_string()))?;
    let id = match j.id {
        None => Value::from(line),
        Some(v) if v.is_string() || v.is_u64() || v.is_i64() => v,
        Some(v) => {
            return Err(fail(format!(
                "\"id\" must be a string or an integer, not {v}"
            )))
        }
    };
    let prompt = match (j.prompt, j.messages) {
        (Some(_), Some(_)) => {
            return Err(fail(
                "give either \"prompt\" or \"messages\", not both".into(),
            ))
        }
        (None, None) => return Err(fail("missing \"prompt\" (or \"messages\")".into())),
        (Some(p), None) if p.trim().is_empty() => return Err(fail("\"prompt\" is empty".into())),
        (Some(p), None) => PromptSpec::Text(p),
        (None, Some(m)) if m.is_empty() => return Err(fail("\"messages\" is empty".into())),
        (None, Some(m)) => {
            if let Some(i) = m.iter().position(|m| m.role.trim().is_empty()) {
                return Err(fail(format!("message {i} has an empty role")));
            }
            PromptSpec::Messages(m)
        }
    };
    if j.prompt_cache.as_ref().is_some_and(|p| p.trim().is_empty()) {
        return Err(fail("\"prompt_cache\" is empty".into()));
    }
    if j.raw == Some(true) && matches!(prompt, PromptSpec::Messages(_)) {
        return Err(fail(
            "\"raw\" uses no chat template, so it cannot take \"messages\"".into(),
        ));
    }
    Ok(InputRecord {
        line,
        id,
        prompt,
        raw: j.raw,
        max_tokens: j.max_tokens,
        temperature: j.temperature,
        top_p: j.top_p,
        top_k: j.top_k,
        seed: j.seed,
        stop: j.stop.map(|s| match s {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }),
        prompt_cache: j.prompt_cache.map(PathBuf::from),
    })
}

/// What is already in an output file, for `--resume`.
#[derive(Debug, Default)]
pub struct ResumeState {
    /// Keys of what is done: ids with a final result ([`id_key`]) and the lines of the input
    /// that have an error record ([`line_key`]: number and text; error records never claim an
    /// id, so a broken line can never make `--resume` skip a valid request with the same id,
    /// and a line fixed since its error record runs).
    pub done: HashSet<String>,
    /// The lines to keep, in order: complete records other than `cancelled` ones (those requests
    /// run again), without a torn last line.
    pub keep: Vec<String>,
    /// Records of cancelled requests left out of `keep` (they run again).
    pub cancelled: usize,
    /// The number of a last line that was cut short (no newline, not a whole record): left out
    /// of `keep`, its request runs again.
    pub torn: Option<usize>,
    /// Whether the file must be rewritten as `keep` (something was left out, or the last line
    /// lacks its newline).
    pub rewrite: bool,
}

/// A line of an output file that is not a kvq record: `--resume` refuses the file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line} is not a kvq batch-generate record ({why}); --resume continues only files that batch-generate wrote, and never drops lines it does not know")]
pub struct ForeignLine {
    pub line: usize,
    pub why: String,
}

/// The `--resume` key of an input line that has an error record: its number and the digest of
/// its text ([`line_hash`]), so a line edited since (fixed, or broken another way) is read
/// again. Records written without a digest are keyed by the number alone.
pub fn line_key(line: usize, hash: Option<&str>) -> String {
    match hash {
        Some(h) => format!("line {line} {h}"),
        None => format!("line {line}"),
    }
}

/// The digest of one input line, as error records carry it (`line_hash`): the first 16 hex
/// digits of the SHA-256 of its bytes.
pub fn line_hash(line: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(line)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// [`line_hash`] of every line of an input file, line 1 first (a leading byte-order mark is
/// not part of line 1, as [`decode_input`] reads it).
pub fn line_hashes(bytes: &[u8]) -> Vec<String> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    bytes.split(|&b| b == b'\n').map(line_hash).collect()
}

/// What one output line is, if it is a kvq record: `Ok(None)` for a cancelled one.
fn record_key(line: &str) -> Result<Option<String>, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let finish = obj
        .get("finish_reason")
        .and_then(Value::as_str)
        .ok_or("no \"finish_reason\"")?;
    match finish {
        "cancelled" => Ok(None),
        // An input line that could not be used: keyed by its line and that line's text (its
        // id may not be its own).
        "error" if obj.contains_key("line") => {
            let n = obj
                .get("line")
                .and_then(Value::as_u64)
                .ok_or("an error record whose \"line\" is not a number")?;
            let hash = match obj.get("line_hash") {
                None => None,
                Some(Value::String(h)) => Some(h.as_str()),
                Some(_) => return Err("an error record whose \"line_hash\" is not a string".into()),
            };
            Ok(Some(line_key(
                usize::try_from(n).unwrap_or(usize::MAX),
                hash,
            )))
        }
        // A request that failed while running (its id is a valid one), like any result.
        _ => match obj.get("id") {
            Some(id) if id.is_string() || id.is_u64() || id.is_i64() => Ok(Some(id_key(id))),
            _ => Err("no string or integer \"id\"".into()),
        },
    }
}

/// Reads a previous output. Every non-blank line must be a kvq record, except a last line
/// without its newline (cut by a kill), which is left out.
pub fn read_resume(text: &str) -> Result<ResumeState, ForeignLine> {
    let mut st = ResumeState::default();
    let complete = text.is_empty() || text.ends_with('\n');
    let count = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let last_cut = !complete && n == count;
        if line.trim().is_empty() {
            st.keep.push(String::new());
            continue;
        }
        match record_key(line) {
            Ok(Some(key)) => {
                st.done.insert(key);
                st.keep.push(line.to_string());
            }
            Ok(None) => {
                st.cancelled += 1;
                st.rewrite = true;
            }
            Err(_) if last_cut => {
                st.torn = Some(n);
                st.rewrite = true;
            }
            Err(why) => return Err(ForeignLine { line: n, why }),
        }
    }
    if !complete {
        // Even a whole last record needs its newline before the next one is appended.
        st.rewrite = true;
    }
    while st.keep.last().is_some_and(String::is_empty) && st.rewrite {
        st.keep.pop();
    }
    Ok(st)
}

/// Decodes an input file: a leading UTF-8 byte-order mark is dropped, and a line that is not
/// UTF-8 becomes an [`InvalidLine`] (and a blank line in the text, so line numbers hold).
pub fn decode_input(bytes: &[u8]) -> (String, Vec<InvalidLine>) {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    if let Ok(s) = std::str::from_utf8(bytes) {
        return (s.to_string(), Vec::new());
    }
    let mut text = String::with_capacity(bytes.len());
    let mut bad = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if i > 0 {
            text.push('\n');
        }
        match std::str::from_utf8(line) {
            Ok(s) => text.push_str(s),
            Err(e) => bad.push(InvalidLine {
                line: i + 1,
                id: None,
                error: format!(
                    "not UTF-8 text (byte {} of the line is invalid)",
                    e.valid_up_to() + 1
                ),
            }),
        }
    }
    (text, bad)
}

/// Where result lines go: each one written whole and flushed at once.
pub struct Sink {
    out: Box<dyn Write + Send>,
}

impl Sink {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        Self { out }
    }

    pub fn write(&mut self, record: &Value) -> std::io::Result<()> {
        let mut line = serde_json::to_string(record).map_err(std::io::Error::other)?;
        line.push('\n');
        self.out.write_all(line.as_bytes())?;
        self.out.flush()
    }
}

/// Parses a byte count: `1073741824`, `512M`, `2G`, `1.5GiB`, `300MB` (K, M, G, T are powers of
/// 1024; a trailing `B` or `iB` is optional).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 512M, 2G, 1073741824)"))?;
    let unit = unit.trim().to_ascii_uppercase();
    let unit = unit
        .strip_suffix("IB")
        .or_else(|| unit.strip_suffix('B'))
        .unwrap_or(&unit);
    let mult: f64 = match unit {
        "" => 1.0,
        "K" => 1024.0,
        "M" => 1024f64.powi(2),
        "G" => 1024f64.powi(3),
        "T" => 1024f64.powi(4),
        u => {
            return Err(format!(
                "unknown size unit '{u}' in '{s}' (use K, M, G or T)"
            ))
        }
    };
    let bytes = n * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(format!("'{s}' is not a usable size"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_are_prompts_with_line_ids() {
        let r = parse_input("hello\n\n  \nworld\r\n", InputFormat::Auto);
        assert_eq!(r.len(), 2);
        let b = r[1].as_ref().unwrap();
        assert_eq!(b.line, 4);
        assert_eq!(b.id, Value::from(4));
        assert_eq!(b.prompt, PromptSpec::Text("world".into()));
    }

    #[test]
    fn jsonl_fields_and_errors_keep_line_numbers() {
        let input = concat!(
            "{\"id\": \"a\", \"prompt\": \"hi\", \"max_tokens\": 3, \"stop\": \"x\", \"raw\": true, \"prompt_cache\": \"p.st\"}\n",
            "{\"id\": \"b\", \"messages\": [{\"role\": \"user\", \"content\": \"yo\"}], \"stop\": [\"1\", \"2\"]}\n",
            "{\"id\": \"c\", \"promt\": \"typo\"}\n",
            "not json\n",
            "{\"id\": \"a\", \"prompt\": \"again\"}\n",
            "{\"id\": 5, \"prompt\": \"p\", \"max_tokens\": -1}\n",
        );
        let r = parse_input(input, InputFormat::Auto);
        assert_eq!(r.len(), 6);
        let a = r[0].as_ref().unwrap();
        assert_eq!((a.max_tokens, a.raw), (Some(3), Some(true)));
        assert_eq!(a.stop, Some(vec!["x".to_string()]));
        assert_eq!(a.prompt_cache, Some(PathBuf::from("p.st")));
        let b = r[1].as_ref().unwrap();
        assert!(matches!(&b.prompt, PromptSpec::Messages(m) if m.len() == 1));
        assert_eq!(b.stop.as_ref().unwrap().len(), 2);
        let c = r[2].as_ref().unwrap_err();
        assert_eq!((c.line, c.id.clone()), (3, Some(Value::from("c"))));
        assert!(c.error.contains("promt"), "{}", c.error);
        assert_eq!(r[3].as_ref().unwrap_err().line, 4);
        assert!(r[4].as_ref().unwrap_err().error.contains("duplicate"));
        assert_eq!(r[5].as_ref().unwrap_err().id, Some(Value::from(5)));
    }

    #[test]
    fn resume_keeps_complete_records_and_drops_cancelled_and_torn() {
        let text = concat!(
            "{\"id\":\"a\",\"finish_reason\":\"stop\"}\n",
            "{\"id\":\"b\",\"finish_reason\":\"cancelled\"}\n",
            "{\"id\":3,\"line\":4,\"finish_reason\":\"error\"}\n",
            "{\"id\":null,\"line\":5,\"line_hash\":\"ab\",\"finish_reason\":\"error\"}\n",
            "{\"id\":\"d\",\"fini",
        );
        let st = read_resume(text).unwrap();
        assert_eq!(st.keep.len(), 3);
        assert!(st.done.contains("\"a\"") && st.done.contains(&line_key(4, None)));
        assert!(st.done.contains(&line_key(5, Some("ab"))));
        assert!(!st.done.contains(&line_key(5, None)));
        assert!(
            !st.done.contains("3"),
            "an error record claims its line, not its id"
        );
        assert!(!st.done.contains("\"b\""));
        assert_eq!((st.cancelled, st.torn, st.rewrite), (1, Some(5), true));
        assert!(
            !read_resume("{\"id\":1,\"finish_reason\":\"stop\"}\n")
                .unwrap()
                .rewrite
        );
    }

    #[test]
    fn resume_refuses_foreign_lines_with_their_number() {
        let e = read_resume("{\"id\":1,\"finish_reason\":\"stop\"}\ngarbage\n{\"id\":2,\"finish_reason\":\"stop\"}\n")
            .unwrap_err();
        assert_eq!(e.line, 2);
        assert_eq!(read_resume("# notes\n").unwrap_err().line, 1);
        assert_eq!(read_resume("{\"a\": 1}\n").unwrap_err().line, 1);
    }

    #[test]
    fn input_bom_is_dropped_and_bad_utf8_names_its_line() {
        let (t, bad) = decode_input(b"\xEF\xBB\xBF{\"prompt\":\"x\"}\n");
        assert!(t.starts_with('{') && bad.is_empty());
        let (t, bad) = decode_input(b"ok\nbad \xFF here\nfine\n");
        assert_eq!(t.lines().collect::<Vec<_>>(), ["ok", "", "fine"]);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 2);
    }

    #[test]
    fn line_hashes_follow_the_lines_of_the_file() {
        let h = line_hashes(b"\xEF\xBB\xBFone\ntwo\n");
        assert_eq!(h.len(), 3);
        assert_eq!(h[0], line_hash(b"one"));
        assert_eq!(h[1], line_hash(b"two"));
        assert_eq!(h[0].len(), 16);
        assert_ne!(h[0], h[1]);
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("512M").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5k").unwrap(), 1536);
        assert_eq!(parse_bytes("3 MB").unwrap(), 3 << 20);
        assert!(parse_bytes("12X").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
