//! The JSON Schema of rules files (config/sluice-rules.schema.json) is generated from the Rust
//! types that parse them, stays in sync with them, and accepts every sample rules file.

mod common;

use std::path::PathBuf;

fn config_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config")
}

#[test]
fn the_shipped_schema_is_the_generated_one() {
    let shipped = std::fs::read_to_string(config_dir().join("sluice-rules.schema.json")).unwrap();
    let generated = serde_json::to_string_pretty(&sluice::rules::schema()).unwrap();
    assert!(
        shipped.trim() == generated.trim(),
        "config/sluice-rules.schema.json is stale: run `cargo run -- schema > config/sluice-rules.schema.json`"
    );
}

#[test]
fn every_sample_validates_against_the_schema() {
    let python = common::venv_tool("SLUICE_PYTHON", "python");
    let dir = common::temp_dir("schema");
    let mut samples: Vec<PathBuf> = std::fs::read_dir(config_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    samples.sort();
    assert!(samples.len() >= 3);
    let mut documents = Vec::new();
    for sample in &samples {
        let value: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(sample).unwrap()).unwrap();
        documents.push((sample.display().to_string(), value));
    }
    // And one that must fail, so a validator that accepts everything cannot pass this test.
    documents.push((
        "bad".into(),
        serde_json::json!({"domain": "d", "descriptors": [{"key": "k", "ratelimit": {}}]}),
    ));
    let mut paths = Vec::new();
    for (i, (_, doc)) in documents.iter().enumerate() {
        let p = dir.join(format!("{i}.json"));
        std::fs::write(&p, doc.to_string()).unwrap();
        paths.push(p);
    }
    let script = "import json, sys, jsonschema\n\
        schema = json.load(open(sys.argv[1]))\n\
        jsonschema.Draft202012Validator.check_schema(schema)\n\
        v = jsonschema.Draft202012Validator(schema)\n\
        for p in sys.argv[2:]:\n    \
            errors = list(v.iter_errors(json.load(open(p))))\n    \
            print(p, 'ok' if not errors else 'invalid: ' + errors[0].message)\n";
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(config_dir().join("sluice-rules.schema.json"))
        .args(&paths)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), documents.len(), "{text}");
    for ((name, _), line) in documents.iter().zip(&lines) {
        if name == "bad" {
            assert!(
                line.contains("invalid: Additional properties are not allowed ('ratelimit'"),
                "{line}"
            );
        } else {
            assert!(line.ends_with(" ok"), "{name}: {line}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
