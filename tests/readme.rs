//! The README says what the binary does: its `$ sluice ...` examples print what the binary
//! prints today, its algorithm table names every algorithm, and its "Layout" names every module
//! under `src/` (and nothing that is gone).

use std::path::Path;
use std::process::Command;

use sluice::limiter::Algorithm;

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
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
    let examples = examples(&readme());
    assert!(!examples.is_empty(), "the README has `$ sluice` examples");
    for (command, want) in examples {
        // The examples' arguments have no quotes or spaces inside them.
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(command.split_whitespace())
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let got = String::from_utf8_lossy(&out.stdout);
        assert_eq!(got, want, "README example `sluice {command}`");
    }
}

/// Step 4 of the limiter's checklist for adding an algorithm: the README's table.
#[test]
fn readme_names_every_algorithm() {
    let text = readme();
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
        "the README's `algorithm` table must have a row per algorithm"
    );
}

#[test]
fn the_layout_names_every_module_and_nothing_else() {
    let text = readme();
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
            "README \"Layout\" does not name `{module}`"
        );
    }
    // Every `src/...` it names exists.
    for named in layout.split('`').filter(|w| w.starts_with("src/")) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(named);
        assert!(
            path.exists() || path.with_extension("rs").exists(),
            "README \"Layout\" names `{named}`, which is not in the tree"
        );
    }
}
