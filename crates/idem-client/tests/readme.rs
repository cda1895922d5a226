//! The README and the book (`docs/`) show no Rust that the build does not
//! check: every ```rust block is either an mdBook `{{#include}}` of real
//! code (scripts/test-docs.sh fails on one that does not resolve) or made of
//! lines of a doctest, which `cargo test --doc` compiles. Also: the README
//! stays short, and its quick start is the `IdempotencyLayer` doctest.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The lines of every doc comment (`///` and `//!`) in the workspace's
/// sources, as rustdoc sees them (the marker and one space removed).
fn doc_lines() -> HashSet<String> {
    let root = root();
    let mut files = Vec::new();
    for dir in ["src", "crates", "examples"] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut lines = HashSet::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for line in text.lines() {
            let line = line.trim_start();
            if let Some(doc) = line
                .strip_prefix("///")
                .or_else(|| line.strip_prefix("//!"))
            {
                lines.insert(doc.strip_prefix(' ').unwrap_or(doc).to_string());
            }
        }
    }
    lines
}

/// The README and every Markdown file of the book.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut files);
    files
}

/// The bodies of the ```rust blocks of `markdown` (any attributes after
/// `rust`), each with the line it starts on.
fn rust_blocks(markdown: &str) -> Vec<(usize, Vec<&str>)> {
    enum State<'a> {
        Outside,
        Rust(usize, Vec<&'a str>),
        Other,
    }
    let mut blocks = Vec::new();
    let mut state = State::Outside;
    for (number, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        state = match (state, fence) {
            (State::Outside, Some(info)) if info.split(',').next() == Some("rust") => {
                State::Rust(number + 1, Vec::new())
            }
            (State::Outside, Some(_)) => State::Other,
            (State::Outside, None) => State::Outside,
            (State::Rust(start, body), Some(_)) => {
                blocks.push((start, body));
                State::Outside
            }
            (State::Rust(start, mut body), None) => {
                body.push(line);
                State::Rust(start, body)
            }
            (State::Other, Some(_)) => State::Outside,
            (State::Other, None) => State::Other,
        };
    }
    blocks
}

#[test]
fn every_rust_snippet_is_included_code_or_doctest_lines() {
    let docs = doc_lines();
    let mut checked = 0;
    let mut missing = Vec::new();
    for file in markdown_files() {
        let text = fs::read_to_string(&file).unwrap();
        for (start, body) in rust_blocks(&text) {
            checked += 1;
            if body.iter().any(|l| l.contains("{{#include")) {
                continue;
            }
            for line in body.iter().filter(|l| !l.trim().is_empty()) {
                if !docs.contains(*line) {
                    missing.push(format!("{}:{start}: {line:?}", file.display()));
                }
            }
        }
    }
    assert!(checked > 0, "no rust block found: the parser is wrong");
    assert!(
        missing.is_empty(),
        "lines of Rust snippets that are no doctest's lines (include the code, or use a doctest):\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_readme_quick_start_is_the_layers_doctest() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let layer =
        fs::read_to_string(root().join("crates/idem-client/src/middleware/layer.rs")).unwrap();
    let section = readme
        .split("\n### Rust: the tower/axum middleware")
        .nth(1)
        .expect("README has the Rust quick start");
    let (_, snippet) = rust_blocks(section)
        .into_iter()
        .next()
        .expect("the quick start has a rust snippet");
    let doc: Vec<&str> = layer
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("/// "))
        .collect();
    assert!(snippet.len() >= 4, "the quick start shrank to {snippet:?}");
    for line in snippet {
        assert!(
            doc.contains(&line),
            "README line missing from the IdempotencyLayer doctest: {line:?}"
        );
    }
}

#[test]
fn the_readme_stays_short() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: move detail into the book (docs/), keep it under 300"
    );
}

#[test]
fn the_snippet_parser_finds_blocks_and_skips_other_languages() {
    let markdown =
        "x\n```rust\nlet a = 1;\n```\n```sql\nSELECT 1;\n```\n```rust,ignore\nb\n\nc\n```\n";
    let blocks = rust_blocks(markdown);
    assert_eq!(
        blocks,
        vec![(2, vec!["let a = 1;"]), (8, vec!["b", "", "c"])]
    );
}
