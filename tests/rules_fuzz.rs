//! The rules loader against hostile input: random text, and random mutations of the sample
//! files. Nothing panics or hangs, and every rejection says where the problem is.

use proptest::prelude::*;
use sluice::rules::load_texts;

const SAMPLES: [&str; 3] = [
    include_str!("../config/edge.yaml"),
    include_str!("../config/api.yaml"),
    include_str!("../config/api-clients.yaml"),
];

fn check(texts: &[(&str, &str)]) -> Result<(), TestCaseError> {
    match load_texts(texts.iter().copied()) {
        Ok(_) => Ok(()),
        Err(errors) => {
            prop_assert!(!errors.0.is_empty());
            for e in &errors.0 {
                prop_assert!(
                    !e.file.is_empty() && !e.location.is_empty() && !e.message.is_empty(),
                    "{e:?}"
                );
            }
            Ok(())
        }
    }
}

/// One edit of a text: delete a span, insert a YAML-significant fragment, or repeat a line.
fn mutate(text: &str, kind: u8, at: usize, len: usize, fragment: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let at = at % (chars.len() + 1);
    let end = (at + len).min(chars.len());
    let mut out: String = chars[..at].iter().collect();
    match kind % 3 {
        0 => out.extend(&chars[end..]),
        1 => {
            out.push_str(fragment);
            out.extend(&chars[at..]);
        }
        _ => {
            let line_start = out.rfind('\n').map_or(0, |i| i + 1);
            let line: String = out[line_start..].to_owned();
            out.push_str(&chars[at..].iter().collect::<String>());
            out.push('\n');
            out.push_str(&line);
        }
    }
    out
}

const FRAGMENTS: &[&str] = &[
    ":",
    "- ",
    "{",
    "}",
    "[",
    "]",
    "*",
    "&a ",
    "*a",
    "!!str ",
    "\n  ",
    "\n- key: x\n",
    "'",
    "\"",
    "#",
    "unit: week",
    "requests_per_unit: -1",
    "algorithm: gcra",
    "burst: 0",
    "plan: {client: c}",
    "rate_limits: []",
    "value: \"*\"",
    "\t",
    "~",
    "null",
    "4294967296",
    "unlimited: true",
    "replaces: [{name: x}]",
    "share_threshold: true",
    "descriptors:",
    "%YAML 1.2\n---\n",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_text_never_panics(text in "[ -~\n\t]{0,400}") {
        check(&[("random.yaml", &text)])?;
    }

    #[test]
    fn mutated_samples_never_panic(
        sample in 0usize..3,
        edits in prop::collection::vec((any::<u8>(), any::<usize>(), 0usize..40, prop::sample::select(FRAGMENTS)), 1..6),
    ) {
        let mut text = SAMPLES[sample].to_owned();
        for (kind, at, len, fragment) in edits {
            text = mutate(&text, kind, at, len, fragment);
        }
        // With the other samples, so cross-file checks (duplicate domains, client maps) run too.
        let mut files: Vec<(&str, &str)> = SAMPLES.iter().enumerate()
            .filter(|(i, _)| *i != sample)
            .map(|(i, t)| (["edge.yaml", "api.yaml", "api-clients.yaml"][i], *t))
            .collect();
        files.push(("mutated.yaml", &text));
        check(&files)?;
    }
}

#[test]
fn deep_nesting_is_an_error_with_a_position() {
    let mut text = String::from("domain: d\ndescriptors:\n");
    let mut indent = String::new();
    for _ in 0..200 {
        text.push_str(&format!("{indent}  - key: k\n{indent}    descriptors:\n"));
        indent.push_str("    ");
    }
    let e = load_texts([("deep.yaml", text.as_str())]).unwrap_err();
    assert_eq!(e.0.len(), 1);
    assert!(e.0[0].location.starts_with("line "), "{e}");
    assert!(e.0[0].message.contains("recursion limit exceeded"), "{e}");
}

#[test]
fn alias_bombs_do_not_expand() {
    let mut text = String::from(
        "domain: d\ndescriptors:\n  - key: k\n    metadata:\n      a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n",
    );
    for i in 1..12 {
        let refs: Vec<String> = (0..10).map(|_| format!("*a{}", i - 1)).collect();
        text.push_str(&format!("      a{i}: &a{i} [{}]\n", refs.join(",")));
    }
    let started = std::time::Instant::now();
    let _ = load_texts([("bomb.yaml", text.as_str())]);
    // Not a timing test of speed: 10^12 expanded nodes would take hours, so finishing at all
    // proves no expansion. The bound only turns a hang into a failure.
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
}

#[test]
fn nesting_beyond_32_levels_is_an_error_at_its_place() {
    let mut text = String::from("domain: d\ndescriptors:\n");
    let mut indent = String::new();
    for i in 0..34 {
        text.push_str(&format!(
            "{indent}  - key: k{i}\n{indent}    descriptors:\n"
        ));
        indent.push_str("    ");
    }
    text.push_str(&format!("{indent}  - key: last\n"));
    let e = load_texts([("deep.yaml", text.as_str())]).unwrap_err();
    assert_eq!(e.0.len(), 1, "{e}");
    assert!(
        e.0[0]
            .message
            .starts_with("descriptors nest deeper than 32 levels"),
        "{e}"
    );
    assert!(e.0[0].location.ends_with(".descriptors"), "{e}");
}

#[test]
fn too_many_rules_is_an_error() {
    let mut text = String::from("domain: d\ndescriptors:\n");
    for i in 0..100_001 {
        text.push_str(&format!(
            "  - {{key: k, value: v{i}, rate_limit: {{unit: second, requests_per_unit: 1}}}}\n"
        ));
    }
    let e = load_texts([("many.yaml", text.as_str())]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "many.yaml: descriptors: 100001 rules in one domain; the limit is 100000"
    );
}
