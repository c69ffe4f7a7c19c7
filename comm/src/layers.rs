//! The layer rule, checked: each folder of `comm/src` is a layer, and a file may name (through
//! `crate::` paths) only its own layer and those below it:
//!
//! | layer | folder | holds |
//! |---|---|---|
//! | 5 | `api/` | `Communicator`, collectives, point-to-point, elastic, objects, topology, device calls |
//! | 4 | `engine/` | the per-communicator queue, `Work`, failure propagation, channels, execution |
//! | 3 | `algorithm/` | one file per algorithm, and the primitives they are written with |
//! | 2 | `transport/` | the transport traits, the selector, one folder per backend |
//! | 1 | `device/` | CUDA staging buffers, flags and plans (feature `cuda`) |
//! | 0 | `base/` | bootstrap, configuration, tuning, trace, errors, operation descriptions, `sys` |
//!
//! Three more rules: algorithms never name a transport backend (only the traits in
//! `transport/mod.rs`); `libc` is called only from `base/sys.rs`; and no folder names `lib.rs`'s
//! re-exports of a higher layer (`crate::Communicator` is `api`). Test modules (everything from
//! a file's first top-level `#[cfg(test)]` on) are not checked: a test may build what it needs
//! from any layer.

use std::path::{Path, PathBuf};

/// The layers in order, lowest first.
const LAYERS: [&str; 6] = ["base", "device", "transport", "algorithm", "engine", "api"];

/// Transport backends, which algorithms must not name.
const BACKENDS: [&str; 4] = ["shm", "tcp", "cuda_ipc", "rdma"];

/// The layer of each name `lib.rs` re-exports at the crate root.
const ROOT_ITEMS: [(&str, &str); 24] = [
    ("affinity", "base"),
    ("bootstrap", "base"),
    ("config", "base"),
    ("error", "base"),
    ("logging", "base"),
    ("op", "base"),
    ("trace", "base"),
    ("tuning", "base"),
    ("Config", "base"),
    ("Error", "base"),
    ("Result", "base"),
    ("Collective", "base"),
    ("TraceDump", "base"),
    ("TraceRecord", "base"),
    ("TraceState", "base"),
    ("Algorithm", "base"),
    ("DType", "base"),
    ("Element", "base"),
    ("ReduceOp", "base"),
    ("Work", "engine"),
    ("Communicator", "api"),
    ("Topology", "api"),
    ("harness", "api"),
    ("topology", "api"),
];

fn layer_of(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == name)
}

/// The layer a `crate::` path names by its first segment, if it is a layer or a root item.
fn named_layer(first: &str) -> Option<usize> {
    layer_of(first).or_else(|| {
        ROOT_ITEMS
            .iter()
            .find(|(n, _)| *n == first)
            .and_then(|(_, l)| layer_of(l))
    })
}

/// The code of a file without comments, string and char literals, cut at its first top-level
/// `#[cfg(test)]`.
fn code(src: &str) -> String {
    let cut = src
        .lines()
        .position(|l| l.starts_with("#[cfg(test)]"))
        .map_or(src.len(), |i| {
            src.lines().take(i).map(|l| l.len() + 1).sum::<usize>()
        });
    let b = &src.as_bytes()[..cut.min(src.len())];
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 3,
            b'\'' if b.get(i + 1) == Some(&b'\\') => {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// Every path a piece of code names below `crate::`, as its segments (a `use crate::{a, b::c}`
/// group gives one path per member).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `oxccl_crate::` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Members at depth 0 of the group; a nested group belongs to its member's first
            // segment, which is what the rule looks at.
            let (mut depth, mut start) = (0usize, 0usize);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        push_member(&group[start..i], &mut out);
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        push_member(&group[start..i], &mut out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(segments(rest));
        }
    }
    out
}

fn push_member(member: &str, out: &mut Vec<Vec<String>>) {
    let segs = segments(member.trim());
    if !segs.is_empty() {
        out.push(segs);
    }
}

fn segments(s: &str) -> Vec<String> {
    let mut segs = Vec::new();
    let mut s = s;
    loop {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        if end == 0 {
            break;
        }
        segs.push(s[..end].to_string());
        match s[end..].strip_prefix("::") {
            Some(r) if !r.starts_with('{') => s = r,
            _ => break,
        }
    }
    segs
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("comm/src is readable") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every breach of the rules in the file `rel` (a path below `comm/src`) with code `code`.
fn breaches(rel: &str, code: &str) -> Vec<String> {
    let top = rel.split('/').next().unwrap_or("");
    let Some(mine) = layer_of(top) else {
        return Vec::new(); // lib.rs and this file
    };
    let mut found = Vec::new();
    for path in crate_paths(code) {
        let first = path[0].as_str();
        if let Some(theirs) = named_layer(first).filter(|&l| l > mine) {
            found.push(format!(
                "{rel}: layer {} names crate::{} (layer {})",
                LAYERS[mine],
                path.join("::"),
                LAYERS[theirs]
            ));
        }
        let backend = first == "transport" && path.get(1).is_some_and(|s| BACKENDS.contains(&&**s));
        if top == "algorithm" && backend {
            found.push(format!(
                "{rel}: an algorithm names the transport backend crate::{}",
                path.join("::")
            ));
        }
    }
    if rel != "base/sys.rs" && code.contains("libc::") {
        found.push(format!("{rel}: calls libc outside base/sys.rs"));
    }
    found
}

#[test]
fn every_file_names_only_its_layer_and_those_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 40, "found only {} files", files.len());
    let mut all = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).expect("below src").to_string_lossy();
        let text = std::fs::read_to_string(f).expect("readable");
        all.extend(breaches(&rel.replace('\\', "/"), &code(&text)));
    }
    assert!(all.is_empty(), "layer rule broken:\n{}", all.join("\n"));
}

#[test]
fn the_check_finds_what_it_should() {
    let up = breaches(
        "algorithm/ring.rs",
        &code("use crate::engine::Shared;\n// crate::api::x in a comment\nlet s = \"crate::api\";"),
    );
    assert_eq!(up.len(), 1, "{up:?}");
    assert!(up[0].contains("crate::engine::Shared"), "{up:?}");
    let group = breaches(
        "base/op.rs",
        &code("use crate::{base::{error::Error, tuning}, Communicator};"),
    );
    assert_eq!(group.len(), 1, "{group:?}");
    assert!(
        group[0].contains("crate::Communicator (layer api)"),
        "{group:?}"
    );
    let backend = breaches(
        "algorithm/prims/mod.rs",
        &code("use crate::transport::shm::Segment;"),
    );
    assert_eq!(backend.len(), 1, "{backend:?}");
    let trait_ok = breaches(
        "algorithm/ring.rs",
        &code("use crate::transport::{SendConn, Tag};"),
    );
    assert!(trait_ok.is_empty(), "{trait_ok:?}");
    let libc = breaches(
        "transport/shm/mod.rs",
        &code("unsafe { libc::poll(p, 1, 0) };"),
    );
    assert_eq!(libc.len(), 1, "{libc:?}");
    let tests_skipped = breaches(
        "engine/mod.rs",
        &code("fn f() {}\n#[cfg(test)]\nmod tests { use crate::api::harness; }"),
    );
    assert!(tests_skipped.is_empty(), "{tests_skipped:?}");
    let down = breaches(
        "api/collectives.rs",
        &code("use crate::engine::Work; crate::base::op::OpDesc"),
    );
    assert!(down.is_empty(), "{down:?}");
}
