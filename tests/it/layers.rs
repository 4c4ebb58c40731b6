//! The map of the code holds (docs/ARCHITECTURE.md): imports only point down the layers, and no
//! two source files import each other. Reads src/ as text: every `crate::a::b` path and every
//! `super::` path in a file's code (comments and doc links excluded) is an import of the module
//! it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layer of each top-level module, lowest first; a module may import its own layer's module
/// and any lower layer. `None`: the binary's entry points, above everything.
const LAYERS: &[(&str, u32)] = &[
    ("simd", 0),
    ("device", 0),
    ("ops", 1),
    ("kv", 2),
    ("model", 3),
    ("engine", 4),
    ("bench", 5),
    ("server", 5),
    ("cli", 6),
];

/// Inside kv: format < cache < attend < preset.
const KV_LAYERS: &[(&str, u32)] = &[("format", 1), ("cache", 2), ("attend", 3), ("preset", 4)];

fn rank(table: &[(&str, u32)], name: &str) -> Option<u32> {
    table.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
}

/// `src/a/b.rs` and `src/a/b/mod.rs` -> ["a", "b"]; `src/lib.rs` -> [].
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments, string contents and `#[cfg(test)]` modules' bodies
/// (tests may reach anywhere).
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip_depth: Option<i32> = None;
    let mut depth = 0i32;
    let mut pending_test = false;
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let trimmed = code.trim();
        if trimmed.starts_with("#[cfg(test)]") || trimmed.starts_with("#[cfg(all(test") {
            pending_test = true;
        }
        let opens = code.matches('{').count() as i32;
        let closes = code.matches('}').count() as i32;
        if pending_test && trimmed.starts_with("mod ") && opens > 0 {
            skip_depth = Some(depth);
            pending_test = false;
        } else if pending_test && (trimmed.starts_with("mod ") || trimmed.starts_with("fn ")) {
            pending_test = false;
        }
        depth += opens - closes;
        if let Some(d) = skip_depth {
            if depth <= d {
                skip_depth = None;
            }
            continue;
        }
        out.push(code.to_string());
    }
    out
}

/// Module paths a file's code names: `crate::x::y` and `super::...` resolved against `me`.
fn imports(me: &[String], text: &str) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    let base: Vec<String> = me.to_vec();
    for line in code_lines(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find(['c', 's']) {
            let tail = &rest[i..];
            let prev_ok = i == 0
                || !rest[..i]
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
            let (start, path): (Vec<String>, &str) = if prev_ok && tail.starts_with("crate::") {
                (Vec::new(), &tail["crate::".len()..])
            } else if prev_ok && tail.starts_with("super::") {
                let mut p = tail;
                // `super` is the parent of the file's module path, for `a/b.rs` and
                // `a/b/mod.rs` alike.
                let mut up = base.clone();
                while let Some(r) = p.strip_prefix("super::") {
                    up.pop();
                    p = r;
                }
                (up, p)
            } else {
                rest = &rest[i + 1..];
                continue;
            };
            let mut full = start;
            for seg in path.split("::") {
                let seg: String = seg
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if seg.is_empty() || seg.chars().next().unwrap().is_uppercase() {
                    break;
                }
                full.push(seg);
            }
            out.insert(full);
            rest = &rest[i + 1..];
        }
    }
    out
}

#[test]
fn imports_point_down_and_no_two_files_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(&src, f), f.clone()))
        .collect();
    // The file a path lands in: its longest prefix that is a module with a file.
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        (1..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|p| modules.contains_key(p))
    };
    let mut edges: BTreeSet<(Vec<String>, Vec<String>)> = BTreeSet::new();
    let mut wrong = Vec::new();
    for (me, file) in &modules {
        if me.is_empty() {
            continue; // lib.rs / main.rs declare and dispatch
        }
        let text = std::fs::read_to_string(file).unwrap();
        for path in imports(me, &text) {
            let Some(target) = resolve(&path) else {
                continue;
            };
            if &target == me || target.is_empty() {
                continue;
            }
            // A parent naming its own children (declaring, re-exporting) is not an import
            // upward; a child reaching its parent is checked for cycles below.
            if target.starts_with(me) {
                continue;
            }
            edges.insert((me.clone(), target.clone()));
            let (a, b) = (&me[0], &target[0]);
            if a != b {
                let (ra, rb) = (rank(LAYERS, a), rank(LAYERS, b));
                if let (Some(ra), Some(rb)) = (ra, rb) {
                    if rb >= ra {
                        wrong.push(format!(
                            "{} imports {} (layer {a} -> {b})",
                            me.join("::"),
                            target.join("::")
                        ));
                    }
                }
            } else if a == "kv" && me.len() > 1 && target.len() > 1 && me[1] != target[1] {
                let (ra, rb) = (rank(KV_LAYERS, &me[1]), rank(KV_LAYERS, &target[1]));
                if let (Some(ra), Some(rb)) = (ra, rb) {
                    if rb > ra {
                        wrong.push(format!(
                            "{} imports {} (kv::{} is above kv::{})",
                            me.join("::"),
                            target.join("::"),
                            target[1],
                            me[1]
                        ));
                    }
                }
            }
        }
    }
    for (a, b) in &edges {
        if a < b && edges.contains(&(b.clone(), a.clone())) {
            wrong.push(format!(
                "{} and {} import each other",
                a.join("::"),
                b.join("::")
            ));
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_checker_sees_upward_and_mutual_imports() {
    // A model file naming cli is an upward import; super:: resolves to the parent module.
    let me = vec!["model".to_string(), "load".to_string()];
    let got = imports(
        &me,
        "use crate::cli::args::ModelArgs;\nuse super::config::X;",
    );
    assert!(got.contains(&vec!["cli".to_string(), "args".to_string()]));
    assert!(got.contains(&vec!["model".to_string(), "config".to_string()]));
    // Comments and test modules are not imports.
    let got = imports(
        &me,
        "// crate::cli::x\n#[cfg(test)]\nmod tests {\n    use crate::cli::y;\n}\n",
    );
    assert!(got.is_empty(), "{got:?}");
}
