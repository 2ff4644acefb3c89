use prost::Message;

use super::*;
use crate::engine::{ReportedLimit, Status as DStatus};
use crate::store::DecidedBy;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn decodes_envoys_request_bytes() {
    // Captured from Envoy 1.40 for `curl -H 'x-api-key: final' 127.0.0.1:10000/p`.
    let bytes = hex(
        "0a03653265 12120a100a076170695f6b6579120566696e616c 120c0a0a0a047061746812022f70
         123b0a1b0a0b67656e657269635f6b6579120c7065725f6b65795f706174680a100a076170695f6b6579120566696e616c0a0a0a047061746812022f70",
    );
    let r = to_domain(RateLimitRequest::decode(bytes.as_slice()).unwrap()).unwrap();
    assert_eq!(r.domain, "e2e");
    assert_eq!(r.descriptors.len(), 3);
    assert_eq!(
        r.descriptors[0].entries,
        [("api_key".to_string(), "final".to_string())]
    );
    assert_eq!(r.descriptors[2].entries.len(), 3);
    assert!(r.descriptors.iter().all(|d| d.hits == 1 && !d.refund));
}

#[test]
fn decodes_weighted_and_refund_descriptors() {
    let bytes = hex(
        "0a03653265 121d0a170a0b67656e657269635f6b6579120877656967687465641a020805
         121d0a150a0b67656e657269635f6b65791206726566756e641a0208022001
         12200a1a0a0b67656e657269635f6b6579120b66726f6d5f6865616465721a020807",
    );
    let r = to_domain(RateLimitRequest::decode(bytes.as_slice()).unwrap()).unwrap();
    let hits: Vec<(u64, bool)> = r.descriptors.iter().map(|d| (d.hits, d.refund)).collect();
    assert_eq!(hits, [(5, false), (2, true), (7, false)]);
}

#[test]
fn request_hits_zero_means_one_and_descriptor_zero_is_a_probe() {
    let d = |hits_addend| proto::RateLimitDescriptor {
        entries: vec![proto::Entry {
            key: "k".into(),
            value: "v".into(),
        }],
        hits_addend,
        ..Default::default()
    };
    let r = to_domain(RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![d(None), d(Some(0))],
        hits_addend: 0,
    })
    .unwrap();
    assert_eq!(r.descriptors[0].hits, 1);
    assert_eq!(r.descriptors[1].hits, 0);
    let r = to_domain(RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![d(None)],
        hits_addend: 4,
    })
    .unwrap();
    assert_eq!(r.descriptors[0].hits, 4);
}

#[test]
fn overrides_need_a_known_unit() {
    let o = proto::RateLimitOverride {
        requests_per_unit: 3,
        unit: OverrideUnit::Unknown as i32,
        unit_multiplier: None,
    };
    let err = limit_override(2, o).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message()
            .starts_with("descriptor 2: limit override has no valid unit")
    );
    let o = proto::RateLimitOverride {
        requests_per_unit: 3,
        unit: OverrideUnit::Hour as i32,
        unit_multiplier: Some(2),
    };
    assert_eq!(
        limit_override(0, o).unwrap(),
        LimitOverride {
            requests_per_unit: 3,
            unit: Unit::Hour,
            unit_multiplier: 2
        }
    );
}

fn limited(
    rpu: u32,
    unit: Unit,
    mult: u32,
    name: Option<&str>,
    remaining: u64,
    us: u64,
) -> DStatus {
    DStatus {
        code: Code::Ok,
        limit: Some(ReportedLimit {
            requests_per_unit: rpu,
            unit,
            unit_multiplier: mult,
            name: name.map(Into::into),
        }),
        remaining,
        duration_us: Some(us),
        stats: None,
        metadata: None,
    }
}

fn decision(code: Code, statuses: Vec<DStatus>, retry: Option<u64>) -> Decision {
    Decision {
        code,
        statuses,
        retry_after_us: retry,
        decided_by: DecidedBy::Counters,
    }
}

fn rendered(set: &str, d: &Decision) -> Vec<(String, String)> {
    HeaderSet::parse(set)
        .unwrap()
        .render(d)
        .into_iter()
        .map(|h| (h.key, h.value))
        .collect()
}

#[test]
fn draft03_headers_match_envoys_rendering() {
    let d = decision(
        Code::Ok,
        vec![
            limited(3, Unit::Minute, 1, Some("api_key"), 2, 30_000_000),
            DStatus::ok_without_limit(),
            limited(10, Unit::Week, 2, None, 1, 1_500_000),
        ],
        None,
    );
    assert_eq!(
        rendered("draft03", &d),
        [
            (
                "x-ratelimit-limit".into(),
                "10, 3;w=60;name=\"api_key\", 10;w=1209600".into()
            ),
            ("x-ratelimit-remaining".into(), "1".into()),
            ("x-ratelimit-reset".into(), "2".into()),
        ]
    );
}

#[test]
fn retry_after_only_when_over_and_at_least_one_second() {
    let over = decision(
        Code::OverLimit,
        vec![limited(1, Unit::Second, 1, None, 0, 200_000)],
        Some(200_000),
    );
    assert_eq!(
        rendered("retry-after", &over),
        [("retry-after".into(), "1".into())]
    );
    let over = decision(Code::OverLimit, vec![], Some(2_000_001));
    assert_eq!(
        rendered("retry-after", &over),
        [("retry-after".into(), "3".into())]
    );
    let ok = decision(
        Code::Ok,
        vec![limited(1, Unit::Second, 1, None, 0, 1)],
        None,
    );
    assert!(rendered("retry-after", &ok).is_empty());
    assert!(rendered("none", &over).is_empty());
}

#[test]
fn ietf_structured_fields() {
    let d = decision(
        Code::Ok,
        vec![
            limited(100, Unit::Minute, 1, Some("bu\"rst"), 50, 30_000_000),
            limited(1000, Unit::Day, 1, None, 999, 86_400_000_000),
        ],
        None,
    );
    assert_eq!(
        rendered("ietf", &d),
        [
            (
                "ratelimit-policy".into(),
                "\"bu\\\"rst\";q=100;w=60, \"descriptor-1\";q=1000;w=86400".into()
            ),
            (
                "ratelimit".into(),
                "\"bu\\\"rst\";r=50;t=30, \"descriptor-1\";r=999;t=86400".into()
            ),
        ]
    );
}

#[test]
fn reference_style_headers_describe_one_status_as_the_reference_picks_it() {
    // The reference's test: 10/MINUTE, nothing left, 58 s to the window's end.
    let d = decision(
        Code::Ok,
        vec![
            limited(10, Unit::Minute, 1, None, 0, 58_000_000),
            DStatus::ok_without_limit(),
            limited(100, Unit::Hour, 1, None, 7, 3_000_000_000),
        ],
        None,
    );
    let set = HeaderSet {
        ratelimit: Some(LimitHeaderNames {
            limit: "A-Ratelimit-Limit".into(),
            remaining: "A-Ratelimit-Remaining".into(),
            reset: "A-Ratelimit-Reset".into(),
        }),
        ..HeaderSet::default()
    };
    let shown = |d: &Decision| -> Vec<(String, String)> {
        set.render(d)
            .into_iter()
            .map(|h| (h.key, h.value))
            .collect()
    };
    assert_eq!(
        shown(&d),
        [
            ("A-Ratelimit-Limit".into(), "10".into()),
            ("A-Ratelimit-Remaining".into(), "0".into()),
            ("A-Ratelimit-Reset".into(), "58".into()),
        ]
    );
    // An OVER_LIMIT status wins over a smaller remaining; of several, the last.
    let mut first = limited(5, Unit::Second, 1, None, 0, 1_000_000);
    first.code = Code::OverLimit;
    let mut last = limited(50, Unit::Minute, 1, None, 3, 2_000_000);
    last.code = Code::OverLimit;
    let over = decision(
        Code::OverLimit,
        vec![first, limited(9, Unit::Second, 1, None, 0, 1), last],
        Some(2_000_000),
    );
    assert_eq!(shown(&over)[0], ("A-Ratelimit-Limit".into(), "50".into()));
    // No limited status, no headers.
    assert!(shown(&decision(Code::Ok, vec![DStatus::ok_without_limit()], None)).is_empty());
}

#[test]
fn header_set_parsing() {
    assert_eq!(
        HeaderSet::parse("retry-after, draft03").unwrap(),
        HeaderSet {
            retry_after: true,
            draft03: true,
            ..HeaderSet::default()
        }
    );
    assert_eq!(
        HeaderSet::parse("ratelimit").unwrap().ratelimit,
        Some(LimitHeaderNames::default())
    );
    assert_eq!(HeaderSet::parse("none").unwrap(), HeaderSet::default());
    assert!(HeaderSet::parse("draft3").is_err());
}

/// Every call's future is boxed (tonic's generated server, `async_trait`) and moved on the way:
/// with the memory backend it must not carry the shared stack's nested Redis futures (it did:
/// 2.4 KB per call, copied at each box; now the shared stack's future is boxed on its own).
#[test]
fn a_memory_call_future_stays_small() {
    use crate::store::{MemoryStore, Stack, Store};
    let engine = Arc::new(Engine::new(
        crate::rules::load_texts([("b.yaml", "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n")]).unwrap(),
        Stack::Memory(Arc::new(MemoryStore::new(Arc::new(crate::clock::SystemClock), 100))),
        crate::engine::EngineSettings::default(),
    ));
    let service = RateLimitGrpc::new(engine.clone(), HeaderSet::default(), None);
    let apply = std::mem::size_of_val(&engine.store().apply(&[]));
    let call = std::mem::size_of_val(&service.handle(RateLimitRequest::default()));
    assert!(apply <= 128, "the store's apply future is {apply} bytes");
    assert!(call <= 1024, "a call's future is {call} bytes");
}
