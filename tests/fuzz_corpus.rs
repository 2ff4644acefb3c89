//! The fuzz targets on stable: every input of the committed corpus (`fuzz/corpus/<target>/`) and
//! every finding (`fuzz/regressions/<target>/`, each a crash, hang or wrong answer the fuzzers
//! found, kept once fixed) runs through the same body the target runs (`fuzz/src/lib.rs`), so a
//! regression fails `cargo test`, not only a fuzzing run. `scripts/fuzz` runs the targets
//! themselves (nightly, libFuzzer).

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod bodies;

use std::path::Path;

/// A target's body: its input's bytes in.
type Body = fn(&[u8]);

/// Each target and its body.
const TARGETS: [(&str, Body); 11] = [
    ("rls_door", bodies::rls_door),
    ("answer_encoder", bodies::answer_encoder),
    ("rules_yaml", bodies::rules_yaml),
    ("rlqs_stream", bodies::rlqs_stream),
    ("xds_resource", bodies::xds_resource),
    ("reference_env", bodies::reference_env),
    ("admin_http", bodies::admin_http),
    ("explain_bucket", bodies::explain_bucket),
    ("zones_durations", bodies::zones_durations),
    ("algorithms", bodies::algorithms),
    ("trace_context", bodies::trace_context),
];

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    out.sort();
    out
}

fn replay(kind: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(kind);
    let mut ran = 0;
    for (target, body) in TARGETS {
        for (path, data) in inputs(&root.join(target)) {
            let outcome = std::panic::catch_unwind(|| body(&data));
            assert!(outcome.is_ok(), "{target}: {path} fails again");
            ran += 1;
        }
    }
    ran
}

#[test]
fn every_finding_stays_fixed() {
    let ran = replay("regressions");
    println!("{ran} findings replayed");
}

#[test]
fn the_corpus_runs_clean() {
    let ran = replay("corpus");
    assert!(
        ran >= TARGETS.len(),
        "a corpus for every target: {ran} inputs"
    );
    println!("{ran} corpus inputs replayed");
}

/// Every target has its corpus folder, and every folder a target (a renamed target would
/// otherwise leave its corpus unread).
#[test]
fn every_target_has_a_corpus() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, _) in TARGETS {
        assert!(
            !inputs(&corpus.join(target)).is_empty(),
            "fuzz/corpus/{target} is empty"
        );
    }
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            TARGETS.iter().any(|(t, _)| *t == name),
            "fuzz/corpus/{name} has no target"
        );
    }
}

/// Writes the fuzz targets' first corpus (`cargo test --test fuzz_corpus -- --ignored`): the
/// kinds of input the tests use — Envoy's RLS requests, the shipped rules files, xDS resources,
/// bucket maps, zones and durations — laid out as each body reads its bytes ([`bodies::Input`]).
/// `cargo fuzz` grows the corpus from there, and `scripts/fuzz min` minimises it.
#[test]
#[ignore = "writes fuzz/corpus: run by hand to seed it"]
fn write_seeds() {
    use prost::Message;
    use sluice::proto::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    use sluice::proto::ratelimit::config::ratelimit::v3 as xds;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let d = dir.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), bytes).unwrap();
    };
    let descriptor =
        |entries: &[(&str, &str)], hits: Option<u64>, negative: bool| RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            hits_addend: hits,
            is_negative_hits: negative,
            ..RateLimitDescriptor::default()
        };
    let requests = [
        (
            "edge",
            vec![descriptor(&[("remote_address", "10.0.0.1")], None, false)],
        ),
        (
            "api",
            vec![
                descriptor(&[("api_key", "k1")], None, false),
                descriptor(&[("tenant", "acme")], Some(3), false),
            ],
        ),
        (
            "f",
            vec![
                descriptor(&[("g", "v")], Some(0), false),
                descriptor(&[("z", "v")], None, false),
            ],
        ),
        (
            "f",
            vec![descriptor(&[("k", "key"), ("r", "req-1")], None, false)],
        ),
        (
            "f",
            vec![descriptor(&[("k", "key"), ("r", "req-1")], Some(1), true)],
        ),
        (
            "f",
            vec![
                descriptor(&[("c", "u")], Some(40), false),
                descriptor(&[("q", "u")], None, false),
            ],
        ),
        (
            "llm",
            vec![descriptor(
                &[("api_key", "k"), ("request_id", "r")],
                None,
                false,
            )],
        ),
        ("", vec![]),
    ];
    for (i, (domain, descriptors)) in requests.into_iter().enumerate() {
        let message = sluice::proto::RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: 0,
        }
        .encode_to_vec();
        // No clock move, framed as Envoy frames it; then the same as raw bytes.
        write(
            "rls_door",
            &format!("seed-{i}"),
            &[&[0, 0, 0][..], &message].concat(),
        );
        write(
            "rls_door",
            &format!("seed-raw-{i}"),
            &[&[0, 0, 2][..], &message].concat(),
        );
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for entry in std::fs::read_dir(root.join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read(&path).unwrap();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            // No request seed, then the rules file.
            write("rules_yaml", &name, &[&[0][..], &text].concat());
        }
    }
    let config = xds::RateLimitConfig {
        name: "d".into(),
        domain: "d".into(),
        descriptors: vec![xds::RateLimitDescriptor {
            key: "k".into(),
            value: "v".into(),
            rate_limit: Some(xds::RateLimitPolicy {
                unit: xds::RateLimitUnit::Minute as i32,
                requests_per_unit: 10,
                ..xds::RateLimitPolicy::default()
            }),
            descriptors: vec![xds::RateLimitDescriptor {
                key: "sub".into(),
                ..xds::RateLimitDescriptor::default()
            }],
            ..xds::RateLimitDescriptor::default()
        }],
    }
    .encode_to_vec();
    write("xds_resource", "seed", &[&[1][..], &config].concat());
    for (i, bucket) in [
        "k=key,r=req",
        "api_key=k,request_id=r",
        "g=v",
        "a=1,a=2",
        "=",
        "",
    ]
    .iter()
    .enumerate()
    {
        // The domain: a known one (bool, then its index), then the map.
        write(
            "explain_bucket",
            &format!("seed-{i}"),
            &[&[1, 0, (i % 4) as u8][..], bucket.as_bytes()].concat(),
        );
    }
    for (i, text) in [
        "Europe/Berlin",
        "UTC",
        "Asia/Kolkata",
        "America/Santiago",
        "10ms",
        "5m",
        "x",
    ]
    .iter()
    .enumerate()
    {
        // A unit, a time near today, then the text.
        let now = 1_800_000_000_000_000u64.to_le_bytes();
        write(
            "zones_durations",
            &format!("seed-{i}"),
            &[&[0, (i % 4) as u8, 3][..], &now, text.as_bytes()].concat(),
        );
    }
    for target in [
        "answer_encoder",
        "rlqs_stream",
        "reference_env",
        "admin_http",
        "algorithms",
    ] {
        for (i, seed) in [
            &b"\x01\x02\x03\x04\x05\x06\x07\x08"[..],
            b"\xff\x00\x10\x20\x30\x40\x50\x60\x70\x80",
            b"\x00",
        ]
        .iter()
        .enumerate()
        {
            write(target, &format!("seed-{i}"), seed);
        }
    }
}
