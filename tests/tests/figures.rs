//! One source for each quoted figure. A figure that a command measures is written by
//! that command into a marked block of its own document (`<!-- figures: NAME -->` ...
//! `<!-- figures: end -->`); the README and the other documents quote the block whole,
//! between the same markers. This test fails when a quote differs from its source,
//! when a source lacks its block, or when a block names no known source: a figure
//! edited by hand in one place, or left behind when its run was regenerated.
//!
//! Prose that restates one figure of a block instead of linking to it is checked by
//! `shared/tests/figures.rs`, which reads the known phrasings of each figure.

use std::path::{Path, PathBuf};

/// Each block's name, the document whose generator writes it, and that generator.
const SOURCES: &[(&str, &str, &str)] = &[
    ("lab", "docs/lab.md", "bash tests/lab/run"),
    (
        "simulator",
        "docs/balance.md",
        "cargo run --release -p ballast-sim -- simulate --out docs",
    ),
    ("cycle", "docs/performance.md", "tests/ratios"),
    ("ingest", "docs/performance.md", "tests/ratios"),
    ("agent", "docs/performance.md", "tests/ratios"),
];

/// The blocks the README must quote: its headline figures come from these.
const README_QUOTES: &[&str] = &["lab", "simulator"];

const START: &str = "<!-- figures: ";
const END: &str = "<!-- figures: end -->";

/// A marked block: its name, its body (the lines between the markers), its first line.
#[derive(Debug, PartialEq)]
struct Block {
    name: String,
    body: String,
    line: usize,
}

/// The marked blocks of a document, or what is wrong with its markers.
fn blocks(text: &str) -> Result<Vec<Block>, String> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, Vec<&str>)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let marker = line.trim();
        if marker == END {
            let (name, line, body) = open
                .take()
                .ok_or_else(|| format!("line {n}: an end marker with no block open"))?;
            out.push(Block {
                name,
                body: body.join("\n"),
                line,
            });
        } else if let Some(rest) = marker.strip_prefix(START) {
            let name = rest
                .strip_suffix("-->")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| format!("line {n}: a malformed marker {marker:?}"))?;
            if let Some((open_name, at, _)) = &open {
                return Err(format!(
                    "line {n}: block {name:?} opens inside block {open_name:?} (line {at})"
                ));
            }
            open = Some((name.to_string(), n, Vec::new()));
        } else if let Some((_, _, body)) = &mut open {
            body.push(line);
        }
    }
    match open {
        Some((name, at, _)) => Err(format!("block {name:?} (line {at}) never ends")),
        None => Ok(out),
    }
}

/// The first line where two block bodies differ: its number in the body (from 1) and
/// the two lines (empty past the end of the shorter); `None` when they are the same.
fn first_difference<'a>(quoted: &'a str, source: &'a str) -> Option<(usize, &'a str, &'a str)> {
    if quoted == source {
        return None;
    }
    let (mut q, mut s) = (quoted.split('\n'), source.split('\n'));
    let mut n = 1;
    loop {
        match (q.next(), s.next()) {
            (Some(a), Some(b)) if a == b => n += 1,
            (a, b) => return Some((n, a.unwrap_or(""), b.unwrap_or(""))),
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The README and every Markdown file under docs/, relative to the repository.
fn documents() -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(Result::ok)
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let rel = format!("{rel}/{name}");
            if path.is_dir() {
                walk(&path, &rel, out);
            } else if name.ends_with(".md") {
                out.push(rel);
            }
        }
    }
    let mut out = vec!["README.md".to_string()];
    walk(&root().join("docs"), "docs", &mut out);
    out
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn every_quoted_figure_is_its_source_block() {
    let docs: Vec<(String, Vec<Block>)> = documents()
        .into_iter()
        .map(|rel| {
            let b = blocks(&read(&rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
            (rel, b)
        })
        .collect();
    let mut problems = Vec::new();
    for (name, source, command) in SOURCES {
        let own: Vec<&Block> = docs
            .iter()
            .filter(|(rel, _)| rel == source)
            .flat_map(|(_, b)| b.iter().filter(|b| b.name == *name))
            .collect();
        if own.len() != 1 {
            problems.push(format!(
                "{source} has {} blocks {name:?}, not one: `{command}` writes it",
                own.len()
            ));
            continue;
        }
        let want = &own[0].body;
        for (rel, bs) in &docs {
            for b in bs.iter().filter(|b| b.name == *name && rel != source) {
                if let Some((at, quoted, own)) = first_difference(&b.body, want) {
                    problems.push(format!(
                        "{rel}:{}: the quote of {name:?} differs from {source}'s block, \
                         which `{command}` writes; copy it over.\n  \
                         first difference, {rel}:{}:\n    quoted: {quoted}\n    source: {own}",
                        b.line,
                        b.line + at
                    ));
                }
            }
        }
    }
    for (rel, bs) in &docs {
        for b in bs {
            if !SOURCES.iter().any(|(name, _, _)| *name == b.name) {
                problems.push(format!(
                    "{rel}:{}: block {:?} has no source: known are {:?}",
                    b.line,
                    b.name,
                    SOURCES.iter().map(|s| s.0).collect::<Vec<_>>()
                ));
            }
        }
    }
    let readme = &docs[0].1;
    for name in README_QUOTES {
        if !readme.iter().any(|b| b.name == *name) {
            problems.push(format!(
                "README.md quotes no block {name:?}: its headline figures must come from it"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn blocks_are_read_with_their_names_and_broken_markers_are_refused() {
    let text = "a\n<!-- figures: lab -->\none\ntwo\n<!-- figures: end -->\nb\n";
    assert_eq!(
        blocks(text),
        Ok(vec![Block {
            name: "lab".into(),
            body: "one\ntwo".into(),
            line: 2
        }])
    );
    assert!(blocks("<!-- figures: lab -->\nx\n").is_err());
    assert!(blocks("x\n<!-- figures: end -->\n").is_err());
    assert!(blocks("<!-- figures: a -->\n<!-- figures: b -->\n<!-- figures: end -->\n").is_err());
    assert!(blocks("<!-- figures:  -->\n<!-- figures: end -->\n").is_err());
}

#[test]
fn the_first_differing_line_of_a_quote_is_named() {
    assert_eq!(first_difference("a\nb", "a\nb"), None);
    assert_eq!(first_difference("a\nb\nc", "a\nx\nc"), Some((2, "b", "x")));
    assert_eq!(first_difference("a", "a\nb"), Some((2, "", "b")));
}
