//! The README and the pages of `docs/` say what the binary does: their `$ sluice ...` examples
//! print what the binary prints today, the rules page's algorithm table names every algorithm,
//! the architecture page's "Layout" names every module under `src/` (and nothing that is gone),
//! and every link between the pages leads to a page that exists.

use std::path::Path;
use std::process::Command;

use sluice::limiter::Algorithm;

fn page(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// The README and every page under `docs/`, by path.
fn pages() -> Vec<(String, String)> {
    let mut paths = vec!["README.md".to_owned()];
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(docs).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            paths.push(format!("docs/{name}"));
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let text = page(&p);
            (p, text)
        })
        .collect()
}

/// Each example in a code block: the command after `$ `, and the lines up to the block's end
/// or the next `$ `.
fn examples(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            out.extend(current.take());
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ sluice ") {
            out.extend(current.take());
            current = Some((command.to_owned(), String::new()));
        } else if let Some((_, output)) = &mut current {
            output.push_str(line);
            output.push('\n');
        }
    }
    out
}

#[test]
fn every_example_prints_what_the_binary_prints() {
    let examples: Vec<(String, (String, String))> = pages()
        .into_iter()
        .flat_map(|(path, text)| examples(&text).into_iter().map(move |e| (path.clone(), e)))
        .collect();
    assert!(!examples.is_empty(), "the docs have `$ sluice` examples");
    for (path, (command, want)) in examples {
        // The examples' arguments have no quotes or spaces inside them.
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(command.split_whitespace())
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let got = String::from_utf8_lossy(&out.stdout);
        assert_eq!(got, want, "{path}: example `sluice {command}`");
    }
}

/// Step 4 of the limiter's checklist for adding an algorithm: the rules page's table.
#[test]
fn readme_names_every_algorithm() {
    let text = page("docs/rules.md");
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("| `algorithm` |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.split('`').nth(1))
        .collect();
    let mut want: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
    let mut got = table.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(
        got, want,
        "docs/rules.md's `algorithm` table must have a row per algorithm"
    );
}

#[test]
fn the_layout_names_every_module_and_nothing_else() {
    let text = page("docs/architecture.md");
    let layout: String = text
        .lines()
        .skip_while(|l| *l != "## Layout")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect::<Vec<_>>()
        .join("\n");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    // Every top-level module is named.
    for entry in std::fs::read_dir(&src).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let module = format!("src/{}", name.trim_end_matches(".rs"));
        assert!(
            layout.contains(&format!("`{module}`")) || layout.contains(&format!("`{module}.rs`")),
            "docs/architecture.md \"Layout\" does not name `{module}`"
        );
    }
    // Every `src/...` it names exists.
    for named in layout.split('`').filter(|w| w.starts_with("src/")) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(named);
        assert!(
            path.exists() || path.with_extension("rs").exists(),
            "docs/architecture.md \"Layout\" names `{named}`, which is not in the tree"
        );
    }
}

/// A link from one page to a file of the repository (not a web address) leads to one that
/// exists, and one to a section of a page names a heading of that page.
#[test]
fn every_link_between_pages_leads_somewhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (path, text) in pages() {
        let dir = root.join(&path).parent().unwrap().to_path_buf();
        for link in text
            .split("](")
            .skip(1)
            .filter_map(|rest| rest.split(')').next())
        {
            if link.starts_with("http") || link.contains(' ') {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((link, ""));
            let target = if file.is_empty() {
                root.join(&path)
            } else {
                dir.join(file)
            };
            assert!(target.exists(), "{path}: the link ({link}) leads nowhere");
            if !anchor.is_empty() {
                let headings = std::fs::read_to_string(&target).unwrap();
                let found = headings
                    .lines()
                    .filter(|l| l.starts_with('#'))
                    .map(|l| anchor_of(l.trim_start_matches('#').trim()))
                    .any(|a| a == anchor);
                assert!(found, "{path}: the link ({link}) names no heading");
            }
        }
    }
}

/// A heading's anchor as GitHub makes it: lower case, spaces to dashes, punctuation dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}
