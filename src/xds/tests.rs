use std::time::Duration;

use prost::Message;

use super::resource::{TYPE_URL, raw_file, rules_from, unknown_field};
use super::{Backoff, parse_pairs};
use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use crate::rules::LoadOptions;

fn any(config: &RateLimitConfig) -> prost_types::Any {
    prost_types::Any {
        type_url: TYPE_URL.into(),
        value: config.encode_to_vec(),
    }
}

fn limit(unit: RateLimitUnit, n: u32) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit: n,
        ..RateLimitPolicy::default()
    })
}

fn descriptor(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..RateLimitDescriptor::default()
    }
}

/// Bytes written by hand from the reference's rls_conf.proto field numbers (not from ours), so
/// a wrong number or type in proto/ fails here.
#[test]
fn decodes_every_field_by_the_reference_numbers() {
    let struct_entry = [
        &[0x0a, 0x04][..],
        b"tier",
        &[0x12, 0x06, 0x1a, 0x04],
        b"gold",
    ]
    .concat();
    let metadata = [&[0x0a, struct_entry.len() as u8][..], &struct_entry].concat();
    let replace = [&[0x0a, 0x03][..], b"old"].concat();
    let policy = [
        &[0x08, 0x07, 0x10, 0x2a, 0x18, 0x00, 0x22, 0x03][..],
        b"new",
        &[0x2a, replace.len() as u8],
        &replace,
    ]
    .concat();
    let child = [&[0x0a, 0x01][..], b"c"].concat();
    let descriptor = [
        &[0x0a, 0x03][..],
        b"key",
        &[0x12, 0x05],
        b"value",
        &[0x1a, policy.len() as u8],
        &policy,
        &[0x22, child.len() as u8],
        &child,
        &[0x28, 0x01, 0x30, 0x01, 0x38, 0x01],
        &[0x42, metadata.len() as u8],
        &metadata,
    ]
    .concat();
    let bytes = [
        &[0x0a, 0x01][..],
        b"n",
        &[0x12, 0x03],
        b"dom",
        &[0x1a, descriptor.len() as u8],
        &descriptor,
    ]
    .concat();
    let config = RateLimitConfig::decode(bytes.as_slice()).expect("decodes");
    assert_eq!((config.name.as_str(), config.domain.as_str()), ("n", "dom"));
    let d = &config.descriptors[0];
    assert_eq!((d.key.as_str(), d.value.as_str()), ("key", "value"));
    assert!(d.shadow_mode && d.detailed_metric && d.quota_mode);
    assert_eq!(d.descriptors[0].key, "c");
    let p = d.rate_limit.as_ref().expect("policy");
    assert_eq!(p.unit, RateLimitUnit::Week as i32);
    assert_eq!((p.requests_per_unit, p.unlimited), (42, false));
    assert_eq!(
        (p.name.as_str(), p.replaces[0].name.as_str()),
        ("new", "old")
    );
    let raw = raw_file(&config);
    let limit = raw.descriptors[0].rate_limit.as_ref().expect("limit");
    assert_eq!(limit.unit.as_deref(), Some("WEEK"));
    let meta = raw.descriptors[0].metadata.as_ref().expect("metadata");
    assert_eq!(meta["tier"], "gold");
}

#[test]
fn an_empty_value_is_the_key_alone_and_unlimited_needs_no_unit() {
    let config = RateLimitConfig {
        name: "gateway".into(),
        domain: "default/eg/http".into(),
        descriptors: vec![RateLimitDescriptor {
            descriptors: vec![
                RateLimitDescriptor {
                    rate_limit: limit(RateLimitUnit::Minute, 3),
                    ..descriptor("rule-0-match-0", "")
                },
                RateLimitDescriptor {
                    rate_limit: Some(RateLimitPolicy {
                        unlimited: true,
                        ..RateLimitPolicy::default()
                    }),
                    ..descriptor("rule-0-match-1", "vip")
                },
            ],
            ..descriptor("default/route", "default/route")
        }],
    };
    let raw = raw_file(&config);
    assert_eq!(raw.descriptors[0].descriptors[0].value, None);
    let rules = rules_from(&[any(&config)], LoadOptions::default()).expect("compiles");
    assert_eq!(rules.domain_count(), 1);
    assert_eq!(rules.rule_count(), 2);
}

#[test]
fn one_bad_resource_rejects_the_whole_response_with_where_and_why() {
    let good = RateLimitConfig {
        name: "a".into(),
        domain: "a".into(),
        descriptors: vec![RateLimitDescriptor {
            rate_limit: limit(RateLimitUnit::Second, 1),
            ..descriptor("k", "v")
        }],
    };
    let no_unit = RateLimitConfig {
        name: "b".into(),
        domain: "b".into(),
        descriptors: vec![RateLimitDescriptor {
            rate_limit: limit(RateLimitUnit::Unknown, 1),
            ..descriptor("k", "v")
        }],
    };
    let errors = rules_from(&[any(&good), any(&no_unit)], LoadOptions::default())
        .expect_err("rejected")
        .to_string();
    assert!(
        errors.contains("xds b") && errors.contains("invalid rate limit unit 'UNKNOWN'"),
        "{errors}"
    );
    // A resource of another type, or bytes that are no RateLimitConfig.
    let wrong = prost_types::Any {
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        value: Vec::new(),
    };
    let garbage = prost_types::Any {
        type_url: TYPE_URL.into(),
        value: vec![0xff, 0xff, 0xff],
    };
    let errors = rules_from(&[wrong, garbage], LoadOptions::default())
        .expect_err("rejected")
        .to_string();
    assert!(errors.contains("resource[0]: type_url"), "{errors}");
    assert!(
        errors.contains("resource[1]: value: not a RateLimitConfig"),
        "{errors}"
    );
    // Two resources of one domain: an error unless domains merge, as for files.
    let again = RateLimitConfig {
        name: "a2".into(),
        ..good.clone()
    };
    let errors = rules_from(&[any(&good), any(&again)], LoadOptions::default())
        .expect_err("duplicate")
        .to_string();
    assert!(errors.contains("duplicate domain 'a'"), "{errors}");
    let other = RateLimitConfig {
        name: "a3".into(),
        domain: "a".into(),
        descriptors: vec![RateLimitDescriptor {
            rate_limit: limit(RateLimitUnit::Second, 1),
            ..descriptor("k", "w")
        }],
    };
    let merged = rules_from(
        &[any(&good), any(&other)],
        LoadOptions {
            merge_domains: true,
        },
    )
    .expect("merges");
    assert_eq!(merged.rule_count(), 2);
}

#[test]
fn the_pause_doubles_to_its_cap_and_spreads_by_half() {
    let b = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(30),
    };
    assert_eq!(b.pause(0, 0.5), Duration::from_secs(1));
    assert_eq!(b.pause(3, 0.5), Duration::from_secs(8));
    assert_eq!(b.pause(10, 0.5), Duration::from_secs(30));
    assert_eq!(b.pause(u32::MAX, 0.5), Duration::from_secs(30));
    assert_eq!(b.pause(0, 0.0), Duration::from_millis(500));
    assert_eq!(b.pause(0, 1.0), Duration::from_millis(1500));
}

#[test]
fn pairs_take_either_separator_and_refuse_what_is_not_a_pair() {
    assert_eq!(
        parse_pairs("a=1, b:2,,").expect("pairs"),
        vec![("a".into(), "1".into()), ("b".into(), "2".into())]
    );
    assert!(parse_pairs("novalue").is_err());
    assert!(parse_pairs("=v").is_err());
}

#[test]
fn a_field_sluice_does_not_know_rejects_the_push_by_its_place() {
    let config = RateLimitConfig {
        name: "a".into(),
        domain: "a".into(),
        descriptors: vec![RateLimitDescriptor {
            descriptors: vec![
                descriptor("x", "1"),
                RateLimitDescriptor {
                    rate_limit: limit(RateLimitUnit::Second, 1),
                    ..descriptor("y", "2")
                },
            ],
            ..descriptor("k", "v")
        }],
    };
    let mut bytes = config.encode_to_vec();
    assert_eq!(unknown_field(&bytes), None);
    // Field 9 (a bool) appended to descriptors[0].descriptors[1]: re-encode with it inside.
    let mut inner = config.descriptors[0].descriptors[1].encode_to_vec();
    inner.extend([0x48, 0x01]);
    let mut outer = Vec::new();
    let first = config.descriptors[0].descriptors[0].encode_to_vec();
    outer.extend([0x22, first.len() as u8]);
    outer.extend(first);
    outer.extend([0x22, inner.len() as u8]);
    outer.extend(inner);
    outer.extend([0x0a, 0x01, b'k', 0x12, 0x01, b'v']);
    bytes = [0x0a, 0x01, b'a', 0x12, 0x01, b'a', 0x1a, outer.len() as u8].to_vec();
    bytes.extend(outer);
    assert_eq!(
        unknown_field(&bytes).as_deref(),
        Some("RateLimitDescriptor at descriptors[0].descriptors[1]: field 9")
    );
    let resource = prost_types::Any {
        type_url: TYPE_URL.into(),
        value: bytes,
    };
    let errors = rules_from(&[resource], LoadOptions::default())
        .expect_err("rejected")
        .to_string();
    assert!(
        errors.contains("field 9") && errors.contains("does not know"),
        "{errors}"
    );
}
