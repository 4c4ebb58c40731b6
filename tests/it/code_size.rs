//! Sizes the owners hold the code to (docs/ARCHITECTURE.md, "Sizes"): no source file over 600
//! lines and no function over 150 lines in src/ and kernels/, tests excluded (`tests.rs` files,
//! `#[cfg(test)]` modules, `#[test]` functions). Reads the files as text: comments and string
//! contents are blanked, then each function's body is found by matching its braces.

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 150;

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            source_files(&p, out);
        } else if p
            .extension()
            .is_some_and(|x| x == "rs" || x == "cu" || x == "cuh")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

/// The text with comments and the contents of string and char literals replaced by spaces
/// (newlines kept), so braces and keywords inside them do not count.
fn blank(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let keep = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            while i < b.len() && !(b[i] == '*' && b.get(i + 1) == Some(&'/')) {
                out.push(keep(b[i]));
                i += 1;
            }
            out.push_str("  ");
            i += 2;
        } else if c == 'r' && matches!(next, Some('"' | '#')) && !ident_before(&b, i) {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            out.push_str(&" ".repeat(j + 1 - i));
            i = j + 1;
            while i < b.len() {
                if b[i] == '"' && (0..hashes).all(|h| b.get(i + 1 + h) == Some(&'#')) {
                    out.push_str(&" ".repeat(hashes + 1));
                    i += hashes + 1;
                    break;
                }
                out.push(keep(b[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(keep(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && char_literal_len(&b, i) > 0 {
            let n = char_literal_len(&b, i);
            out.push_str(&" ".repeat(n));
            i += n;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// Length of a char literal starting at i ('x', '\n', '\u{..}'), 0 if it is a lifetime.
fn char_literal_len(b: &[char], i: usize) -> usize {
    match (b.get(i + 1), b.get(i + 2)) {
        (Some('\\'), _) => (i + 2..b.len().min(i + 12))
            .find(|&j| b[j] == '\'')
            .map_or(0, |j| j + 1 - i),
        (Some(_), Some('\'')) => 3,
        _ => 0,
    }
}

fn line_of(text: &str, byte: usize) -> usize {
    text[..byte].matches('\n').count() + 1
}

/// Byte index of the `}` closing the `{` at `open`.
fn closing(text: &[u8], open: usize) -> usize {
    let mut depth = 0i32;
    for (k, &c) in text.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    text.len() - 1
}

/// Byte ranges of test code: `#[cfg(test)]` items and `#[test]` functions.
fn test_ranges(code: &str) -> Vec<(usize, usize)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    for attr in ["#[cfg(test)]", "#[test]"] {
        let mut from = 0;
        while let Some(k) = code[from..].find(attr) {
            let at = from + k;
            let item_end = code[at..].find([';', '{']).map(|e| at + e);
            if let Some(e) = item_end {
                let end = if bytes[e] == b'{' {
                    closing(bytes, e)
                } else {
                    e
                };
                out.push((at, end));
            }
            from = at + attr.len();
        }
    }
    out
}

/// (name, first line, lines) of every function with a body: Rust `fn`s, and CUDA functions
/// (top-level blocks whose header has a parameter list).
fn functions(path: &Path, text: &str) -> Vec<(String, usize, usize)> {
    let code = blank(text);
    let bytes = code.as_bytes();
    let tests = test_ranges(&code);
    let in_tests = |i: usize| tests.iter().any(|&(a, b)| a <= i && i <= b);
    let mut out = Vec::new();
    let is_rust = path.extension().is_some_and(|x| x == "rs");
    if is_rust {
        let mut from = 0;
        while let Some(k) = code[from..].find("fn ") {
            let at = from + k;
            from = at + 3;
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            if in_tests(at) {
                continue;
            }
            let name: String = code[at + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                continue; // `fn(` types
            }
            // The body: the first `{` after the parameter list, unless a `;` ends a declaration.
            let Some(paren) = code[at..].find('(').map(|p| at + p) else {
                continue;
            };
            let mut depth = 0i32;
            let mut close = paren;
            for (j, &c) in bytes.iter().enumerate().skip(paren) {
                match c {
                    b'(' => depth += 1,
                    b')' => {
                        depth -= 1;
                        if depth == 0 {
                            close = j;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let Some(open) = code[close..].find(['{', ';']).map(|p| close + p) else {
                continue;
            };
            if bytes[open] == b';' {
                continue;
            }
            let end = closing(bytes, open);
            let (l0, l1) = (line_of(&code, at), line_of(&code, end));
            out.push((name, l0, l1 + 1 - l0));
        }
    } else {
        // CUDA: each top-level `{` whose header (since the last top-level `;` or `}`) has `(`;
        // a block is skipped whole once matched, so everything seen here is at the top level.
        let mut header_start = 0;
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'{' => {
                    let header = &code[header_start..i];
                    let end = closing(bytes, i);
                    if let Some(p) = header.rfind('(') {
                        let name: String = header[..p]
                            .trim_end()
                            .chars()
                            .rev()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect::<Vec<_>>()
                            .into_iter()
                            .rev()
                            .collect();
                        let l0 = line_of(
                            &code,
                            header_start + header.len() - header.trim_start().len(),
                        );
                        out.push((name, l0, line_of(&code, end) + 1 - l0));
                    }
                    i = end + 1;
                    header_start = i;
                    continue;
                }
                b';' | b'}' => header_start = i + 1,
                // A preprocessor line (continued lines end in `\`) is not a header.
                b'\n'
                    if code[header_start..i].trim_start().starts_with('#')
                        && !code[..i].ends_with('\\') =>
                {
                    header_start = i + 1
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

fn all_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    source_files(&root.join("src"), &mut files);
    source_files(&root.join("kernels"), &mut files);
    files.sort();
    files
}

#[test]
fn no_source_file_over_600_lines_and_no_function_over_150() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for f in all_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        let rel = f.strip_prefix(root).unwrap().display().to_string();
        let n = text.lines().count();
        if n > MAX_FILE_LINES {
            over.push(format!("{rel}: {n} lines (at most {MAX_FILE_LINES})"));
        }
        for (name, line, len) in functions(&f, &text) {
            if len > MAX_FN_LINES {
                over.push(format!(
                    "{rel}:{line}: fn {name} has {len} lines (at most {MAX_FN_LINES})"
                ));
            }
        }
    }
    assert!(over.is_empty(), "too long:\n{}", over.join("\n"));
}

#[test]
fn the_size_check_sees_functions_and_skips_tests() {
    let long_body = "    let x = 1;\n".repeat(200);
    let rust = format!(
        "/// fn in_doc() {{\nfn long(a: u8) -> u8 {{\n{long_body}}}\n\
         trait T {{ fn decl(&self); }}\nconst S: &str = \"fn fake() {{\";\n\
         #[cfg(test)]\nmod tests {{\n    fn helper() {{\n{long_body}    }}\n}}\n\
         #[test]\nfn a_test() {{\n{long_body}}}\n"
    );
    let got = functions(Path::new("x.rs"), &rust);
    let names: Vec<&str> = got.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["long"], "{got:?}");
    assert_eq!((got[0].1, got[0].2), (2, 202));
    let cuda = format!(
        "#define M(x) \\\n  x\ntemplate <int D>\n__device__ void f(int a) {{\n{long_body}}}\n\
         struct S {{ int a; }};\n__global__ void g() {{ f<1>(0); }}\n"
    );
    let got = functions(Path::new("x.cu"), &cuda);
    assert_eq!(
        got,
        [("f".to_string(), 3, 203), ("g".to_string(), 207, 1)],
        "{got:?}"
    );
}
