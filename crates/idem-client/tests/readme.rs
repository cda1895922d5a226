//! The README's middleware snippet is the `IdempotencyLayer` doctest (which
//! compiles it): every line of the one must be a line of the other.

#[test]
fn the_readme_snippet_is_the_layers_doctest() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let layer = std::fs::read_to_string(format!(
        "{}/src/middleware/layer.rs",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let section = readme
        .split("\n## Client and middleware")
        .nth(1)
        .expect("README has the section");
    let snippet = section
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the section has a rust snippet");
    let doc: Vec<&str> = layer
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("/// "))
        .collect();
    for line in snippet.lines() {
        assert!(
            doc.contains(&line),
            "README line missing from the IdempotencyLayer doctest: {line:?}"
        );
    }
}
