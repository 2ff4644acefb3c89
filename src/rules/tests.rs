use super::*;
use crate::limiter::Algorithm;

fn set(text: &str) -> RuleSet {
    load_texts([("rules.yaml", text)]).unwrap_or_else(|e| panic!("{e}"))
}

fn errors(text: &str) -> Vec<String> {
    match load_texts([("rules.yaml", text)]) {
        Ok(_) => panic!("expected errors"),
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

/// The path of the matched rule and the counter parts, or None.
fn find(rs: &RuleSet, domain: &str, entries: &[(&str, &str)]) -> Option<(String, Vec<String>)> {
    let mut parts = Vec::new();
    let rule = rs
        .domain(domain)?
        .find(entries.iter().copied(), |k, p, _| {
            parts.push(match p {
                KeyPart::Value(v) => format!("{k}={v}"),
                KeyPart::Pattern(p) => format!("{k}~{p}"),
            })
        })?;
    Some((rule.path.clone(), parts))
}

fn path(rs: &RuleSet, entries: &[(&str, &str)]) -> Option<String> {
    find(rs, "d", entries).map(|(p, _)| p)
}

const BASIC: &str = r#"
domain: d
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key2
    value: val*
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key2
    value: v*
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: wild
    value: "foo*"
    share_threshold: true
    rate_limit: {unit: day, requests_per_unit: 3}
  - key: nested
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: inner
        value: x
        rate_limit: {unit: second, requests_per_unit: 2}
"#;

#[test]
fn exact_beats_wildcard_beats_key_only() {
    let rs = set(BASIC);
    assert_eq!(path(&rs, &[("key2", "value2")]).unwrap(), "key2_value2");
    assert_eq!(path(&rs, &[("key2", "valueX")]).unwrap(), "key2_val*");
    assert_eq!(
        path(&rs, &[("key2", "vq")]).unwrap(),
        "key2_v*",
        "first wildcard in file order that matches"
    );
    assert_eq!(path(&rs, &[("key2", "other")]).unwrap(), "key2");
}

#[test]
fn a_value_without_limit_or_children_is_whitelisted() {
    let rs = set(BASIC);
    assert_eq!(path(&rs, &[("key2", "value3")]), None);
}

#[test]
fn the_last_entry_decides_and_there_is_no_backtracking() {
    let rs = set(BASIC);
    assert_eq!(
        path(&rs, &[("key1", "value1"), ("subkey1", "a")]).unwrap(),
        "key1_value1.subkey1"
    );
    // A branch without its own limit: no limit for the shorter request.
    assert_eq!(path(&rs, &[("key1", "value1")]), None);
    // More entries than the tree is deep: no limit.
    assert_eq!(path(&rs, &[("key2", "value2"), ("more", "x")]), None);
    // Exact match at level 1 with no child for level 2: the key-only `nested` is not retried.
    assert_eq!(
        path(&rs, &[("nested", "v"), ("inner", "x")]).unwrap(),
        "nested.inner_x"
    );
    assert_eq!(path(&rs, &[("nested", "v"), ("inner", "y")]), None);
    // Fewer entries: the limit on the node matched last.
    assert_eq!(path(&rs, &[("nested", "v")]).unwrap(), "nested");
    assert_eq!(path(&rs, &[("unknown", "v")]), None);
}

#[test]
fn share_threshold_puts_the_pattern_in_the_counter() {
    let rs = set(BASIC);
    let (_, parts) = find(&rs, "d", &[("wild", "food")]).unwrap();
    assert_eq!(parts, ["wild~foo*"]);
    let (_, parts) = find(&rs, "d", &[("key2", "valueX")]).unwrap();
    assert_eq!(
        parts,
        ["key2=valueX"],
        "without share_threshold each value has its own counter"
    );
}

#[test]
fn keys_and_values_are_never_joined() {
    let rs = set(
        "domain: d\ndescriptors:\n  - key: a\n    value: b_c\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a_b\n    value: c\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
    );
    assert_eq!(path(&rs, &[("a", "b_c")]).unwrap(), "a_b_c");
    assert_eq!(find(&rs, "d", &[("a_b", "c")]).unwrap().1, ["a_b=c"]);
    // The reference's `wild_foo*` quirk does not apply: a wildcard matches values only.
    let rs = set(
        "domain: d\ndescriptors:\n  - key: wild\n    value: foo*\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    assert_eq!(path(&rs, &[("wild_food", "x")]), None);
}

#[test]
fn units_any_case_and_the_extensions() {
    let rs = set(r#"
domain: d
descriptors:
  - key: a
    rate_limit: {unit: Week, requests_per_unit: 7, name: weekly}
  - key: b
    rate_limits:
      - {unit: second, requests_per_unit: 10, name: per_second, algorithm: token_bucket, burst: 20}
      - {unit: minute, requests_per_unit: 100, unit_multiplier: 5, algorithm: sliding_window}
  - key: c
    rate_limit: {unlimited: true}
"#);
    let d = rs.domain("d").unwrap();
    let a = d.find([("a", "x")], |_, _, _| {}).unwrap();
    assert_eq!(a.tiers[0].unit, Unit::Week);
    assert_eq!(a.tiers[0].name.as_deref(), Some("weekly"));
    let b = d.find([("b", "x")], |_, _, _| {}).unwrap();
    assert_eq!(b.tiers.len(), 2);
    assert_eq!(b.tiers[0].limit.algorithm, Algorithm::TokenBucket);
    assert_eq!(b.tiers[0].limit.burst, 20);
    assert_eq!(b.tiers[1].limit.period_us, 300_000_000);
    let c = d.find([("c", "x")], |_, _, _| {}).unwrap();
    assert!(c.unlimited && c.tiers.is_empty());
    assert_eq!(rs.rule_count(), 3);
}

#[test]
fn reference_validation_messages() {
    let cases: &[(&str, &str)] = &[
        (
            "descriptors: []\n",
            "rules.yaml: domain: config file cannot have empty domain",
        ),
        (
            "domain: d\ndescriptors:\n  - value: v\n",
            "rules.yaml: descriptors[0]: descriptor has empty key",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n",
            "rules.yaml: descriptors[1]: duplicate descriptor composite key 'd.k_v'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: foo, requests_per_unit: 1}\n",
            "rules.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit 'foo'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}\n",
            "rules.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit ''",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, unlimited: true}\n",
            "rules.yaml: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, name: n, replaces: [{name: n}]}\n",
            "rules.yaml: descriptors[0].rate_limit.replaces[0]: replaces should not contain name of same descriptor",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n",
            "rules.yaml: descriptors[0].rate_limit.replaces[0]: should not have an empty replaces entry",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n",
            "rules.yaml: descriptors[0]: share_threshold can only be used with wildcard values (containing '*'), but found key 'k_v'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: magic}\n",
            "rules.yaml: descriptors[0].rate_limit.algorithm: unknown algorithm 'magic' (expected one of fixed_window, sliding_window, sliding_log, token_bucket, leaky_bucket, gcra)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}\n",
            "rules.yaml: descriptors[0].rate_limit: burst applies only to token_bucket, leaky_bucket and gcra, not to fixed_window",
        ),
    ];
    for (text, want) in cases {
        assert_eq!(errors(text), [want.to_string()], "for {text}");
    }
}

#[test]
fn parse_errors_say_where() {
    let e = errors(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        ratelimit: {unit: second}\n",
    );
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with(
            "rules.yaml: line 6 column 9: descriptors[0].descriptors[0]: unknown field `ratelimit`"
        ),
        "{}",
        e[0]
    );
    let e = errors("'''");
    assert!(
        e[0].starts_with("rules.yaml: line 1 column 4: "),
        "{}",
        e[0]
    );
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
    );
    assert!(
        e[0].contains("requests_per_unit: invalid type: integer `-1`"),
        "{}",
        e[0]
    );
}

#[test]
fn every_error_is_reported_at_once() {
    let e = errors(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: foo}\n  - key: b\n    rate_limit: {unit: bar}\n",
    );
    assert_eq!(e.len(), 2);
}

#[test]
fn duplicate_domains_across_files() {
    let e = load_texts([("a.yaml", "domain: d\n"), ("b.yaml", "domain: d\n")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "b.yaml: domain: duplicate domain 'd' in config file"
    );
}

#[test]
fn directory_loading_skips_hidden_and_configmap_internals() {
    let dir = std::env::temp_dir().join(format!("sluice-rules-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("..2024_01_01_00_00_00.123")).unwrap();
    std::fs::write(dir.join("..2024_01_01_00_00_00.123/a.yaml"), "domain: a\n").unwrap();
    std::os::unix::fs::symlink("..2024_01_01_00_00_00.123", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/a.yaml", dir.join("a.yaml")).unwrap();
    std::fs::write(dir.join("b.yml"), "domain: b\n").unwrap();
    std::fs::write(dir.join(".hidden.yaml"), "not: valid: yaml").unwrap();
    std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
    let rs = load_path(&dir).unwrap();
    let mut names: Vec<_> = rs.domains().map(|d| d.name.clone()).collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_validation() {
    let base = "domain: d\ndescriptors:\n  - key: c\n    plan: {client: c, limits: search}\nplans:\n  free: [{unit: second, requests_per_unit: 1}]\n  vip: unlimited\n";
    assert_eq!(
        errors(&format!("{base}default_plan: free\n")),
        ["rules.yaml: descriptors[0].plan: plan 'free' has no limits named 'search'"]
    );
    let ok = "domain: d\ndescriptors:\n  - key: c\n    plan: {client: c}\nplans:\n  free: [{unit: second, requests_per_unit: 1}]\n  vip: unlimited\n";
    assert_eq!(
        errors(ok),
        [
            "rules.yaml: default_plan: rules take limits from plans, so default_plan must name the plan of unknown clients"
        ]
    );
    assert_eq!(
        errors(&format!("{ok}default_plan: gold\n")),
        ["rules.yaml: default_plan: no plan named 'gold' in plans"]
    );
    assert_eq!(
        errors(&format!("{ok}default_plan: free\nclients: {{k1: gold}}\n")),
        ["rules.yaml: clients.k1: no plan named 'gold' in plans"]
    );
    assert_eq!(
        errors(
            "domain: d\ndescriptors:\n  - key: c\n    plan: {client: c, entry: p}\nplans:\n  free: unlimited\ndefault_plan: free\n"
        )[0],
        "rules.yaml: descriptors[0].plan: a plan comes from either `client: <entry key>` (looked up in clients) or `entry: <entry key>` (the plan's name)"
    );
    assert_eq!(
        errors(
            "domain: d\ndescriptors:\n  - key: c\n    plan: {client: c}\n    rate_limit: {unit: second, requests_per_unit: 1}\nplans:\n  free: unlimited\ndefault_plan: free\n"
        ),
        ["rules.yaml: descriptors[0].plan: use either plan or rate_limit(s), not both"]
    );
    // A client map in its own file.
    let rules = format!("{ok}default_plan: free\n");
    let e = load_texts([
        ("a.yaml", rules.as_str()),
        ("b.yaml", "domain: d\nclients: {k1: gold}\n"),
    ])
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "b.yaml: clients.k1: no plan named 'gold' in domain 'd'"
    );
    let e = load_texts([("m.yaml", "domain: nowhere\nclients: {k1: free}\n")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "m.yaml: domain: clients for domain 'nowhere', which no rules file defines"
    );
    let set = load_texts([
        ("a.yaml", rules.as_str()),
        ("b.yaml", "domain: d\nclients: {k1: vip, k2: free}\n"),
    ])
    .unwrap();
    assert_eq!(set.domain("d").unwrap().client_count(), 2);
}

#[test]
fn mode_is_strict_or_hybrid_and_hybrid_only_where_leases_are_sound() {
    let rs = set(r#"
domain: d
descriptors:
  - key: a
    mode: hybrid
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: hour, requests_per_unit: 100, algorithm: sliding_window}
  - key: b
    mode: strict
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: gcra}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 10}
"#);
    let d = rs.domain("d").unwrap();
    let mode = |k: &str| d.find([(k, "x")], |_, _, _| {}).unwrap().mode;
    assert_eq!(mode("a"), Some(crate::store::Mode::Hybrid));
    assert_eq!(mode("b"), Some(crate::store::Mode::Strict));
    assert_eq!(mode("c"), None, "the server's --mode decides");
    let e = errors(
        "domain: d\ndescriptors:\n  - key: a\n    mode: hybrid\n    rate_limits:\n      - {unit: second, requests_per_unit: 1}\n      - {unit: second, requests_per_unit: 5, algorithm: token_bucket}\n  - key: b\n    mode: eventual\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: c\n    mode: hybrid\n",
    );
    assert_eq!(e.len(), 3, "{e:?}");
    assert!(
        e[0].contains("descriptors[0].mode")
            && e[0].contains("only to fixed_window and sliding_window limits, not to token_bucket"),
        "{e:?}"
    );
    assert!(
        e[1].contains("descriptors[1].mode") && e[1].contains("expected strict or hybrid"),
        "{e:?}"
    );
    assert!(
        e[2].contains("mode applies only to a descriptor with rate_limit"),
        "{e:?}"
    );
}

#[test]
fn periods_beyond_the_exact_range_are_located_errors() {
    // Both accepted before: the period wrapped in release builds and panicked in debug.
    for (unit, m) in [("year", "4294967295"), ("day", "213503983")] {
        let e = errors(&format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {unit}, requests_per_unit: 1, unit_multiplier: {m}}}\n"
        ));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("rules.yaml: descriptors[0].rate_limit.unit_multiplier: ")
                && e[0].contains("longest period"),
            "{e:?}"
        );
    }
}

/// The metrics label a request gets: the reference's stats key without the domain.
fn metric_label(rs: &RuleSet, entries: &[(&str, &str)]) -> String {
    let rule = rs
        .domain("d")
        .and_then(|d| d.find(entries.iter().copied(), |_, _, _| {}))
        .expect("a rule matches");
    let owned: Vec<(String, String)> = entries
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    rule.metric_label(&owned)
        .unwrap_or_else(|| rule.label.to_string())
}

#[test]
fn metric_labels_follow_the_reference_stats_keys() {
    // The cases of the reference's config tests (TestValueToMetric_*, share_threshold.yaml).
    let rs = set(r#"
domain: d
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 60}
  - key: k1
    descriptors:
      - key: k2
        value_to_metric: true
        descriptors:
          - key: k3
            rate_limit: {unit: minute, requests_per_unit: 60}
  - key: plain
    descriptors:
      - key: k2
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: detailed
    value_to_metric: true
    descriptors:
      - key: subject_id
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: user
    value_to_metric: true
    descriptors:
      - key: action
        value: read*
        value_to_metric: true
        descriptors:
          - key: resource
            rate_limit: {unit: minute, requests_per_unit: 60}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: sroute
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: service
    value: svc/*
    share_threshold: true
    descriptors:
      - key: endpoint
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 80}
  - key: midroute
    value: /api*v2
    share_threshold: true
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 80}
  - key: wild
    value: foo*
    descriptors:
      - key: other
        value: bar
        value_to_metric: true
        descriptors:
          - key: limit
            rate_limit: {unit: minute, requests_per_unit: 80}
"#);
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[
                ("route", "draw"),
                ("http_method", "GET"),
                ("subject_id", "123"),
            ],
            "route_draw.http_method_GET.subject_id",
        ),
        (
            &[("route", ""), ("http_method", "GET"), ("subject_id", "123")],
            "route.http_method_GET.subject_id",
        ),
        (&[("k1", "X"), ("k2", "Y"), ("k3", "Z")], "k1.k2_Y.k3"),
        (&[("plain", "X"), ("k2", "Y")], "plain.k2"),
        (
            &[("detailed", "draw"), ("subject_id", "123")],
            "detailed_draw.subject_id_123",
        ),
        (
            &[
                ("user", "alice"),
                ("action", "readfile"),
                ("resource", "documents"),
            ],
            "user_alice.action_readfile.resource",
        ),
        (&[("files", "files/a.txt")], "files_files/*"),
        (
            &[("sroute", "api/v1"), ("method", "GET")],
            "sroute_api/*.method",
        ),
        (
            &[("service", "svc/a"), ("endpoint", "get")],
            "service_svc/*.endpoint_get",
        ),
        (&[("midroute", "/api/x/v2")], "midroute_/api*v2"),
        (
            &[("wild", "foo1"), ("other", "bar"), ("limit", "x")],
            "wild_foo*.other_bar.limit",
        ),
    ];
    for (entries, want) in cases {
        assert_eq!(metric_label(&rs, entries), *want, "{entries:?}");
    }
}

const MERGE_A: &str =
    "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
const MERGE_B: &str = "domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n  - key: a\n    value: x\n    rate_limit: {unit: second, requests_per_unit: 3}\n";

#[test]
fn merged_domains_join_their_descriptors() {
    let merge = LoadOptions {
        merge_domains: true,
    };
    let rs = load_texts_with([("a.yaml", MERGE_A), ("b.yaml", MERGE_B)], merge).unwrap();
    assert_eq!(rs.domain_count(), 1);
    assert_eq!(rs.rule_count(), 3);
    assert_eq!(path(&rs, &[("a", "y")]).as_deref(), Some("a"));
    assert_eq!(path(&rs, &[("a", "x")]).as_deref(), Some("a_x"));
    assert_eq!(path(&rs, &[("b", "y")]).as_deref(), Some("b"));
    // Without the option, the reference's error.
    let e = load_texts([("a.yaml", MERGE_A), ("b.yaml", MERGE_B)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "b.yaml: domain: duplicate domain 'd' in config file"
    );
}

#[test]
fn merged_domains_still_refuse_a_descriptor_defined_twice() {
    let merge = LoadOptions {
        merge_domains: true,
    };
    // The same file twice: the reference's duplicate composite key error.
    let e = load_texts_with([("a.yaml", MERGE_A), ("a2.yaml", MERGE_A)], merge).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a2.yaml: descriptors: duplicate descriptor composite key 'd.a'"
    );
    let e = load_texts_with([("b.yaml", MERGE_B), ("b2.yaml", MERGE_B)], merge).unwrap_err();
    assert_eq!(e.0.len(), 2, "{e}");
    assert!(e.to_string().contains("'d.a_x'"), "{e}");
}

#[test]
fn metadata_is_kept_as_written() {
    let rs = set(
        "domain: d\ndescriptors:\n  - key: a\n    metadata: {pool: {name: x}, n: 1}\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    let rule = rs
        .domain("d")
        .unwrap()
        .find([("a", "1")], |_, _, _| {})
        .unwrap();
    let m = rule.metadata.as_ref().unwrap();
    assert_eq!(m["pool"]["name"], "x");
    assert_eq!(m["n"], 1);
}

#[test]
fn a_map_of_entries_is_ordered_as_the_rules_nest_them() {
    let rs = set(r#"
domain: d
descriptors:
  - key: route
    value: api
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: a
    descriptors:
      - key: b
        descriptors:
          - key: c
            rate_limit: {unit: hour, requests_per_unit: 1}
"#);
    let d = rs.domain("d").unwrap();
    let order = |entries: &[(&'static str, &'static str)]| d.order_entries(entries);
    assert_eq!(
        order(&[("user", "u1"), ("route", "api")]),
        Some(vec![("route", "api"), ("user", "u1")])
    );
    // Alphabetical keys first, backtracking until the whole map matches a rule.
    assert_eq!(
        order(&[("c", "3"), ("b", "2"), ("a", "1")]),
        Some(vec![("a", "1"), ("b", "2"), ("c", "3")])
    );
    assert_eq!(order(&[("user", "u1")]), Some(vec![("user", "u1")]));
    // An entry no rule names, or a path that ends without a rule: no order, no rule.
    assert_eq!(order(&[("user", "u1"), ("other", "x")]), None);
    assert_eq!(order(&[("a", "1"), ("b", "2")]), None);
    assert_eq!(order(&[("route", "web"), ("user", "u1")]), None);
    assert_eq!(order(&[]), None);
    // Whatever order it finds, `find` agrees that it names a rule.
    let ordered = order(&[("user", "u1"), ("route", "api")]).unwrap();
    assert_eq!(path(&rs, &ordered).as_deref(), Some("route_api.user"));
}

#[test]
fn ordering_a_map_with_entries_no_path_holds_gives_none() {
    // Every top-level key matches, none nests: 40 entries never form one path.
    let mut text = String::from("domain: d\ndescriptors:\n");
    for i in 0..40 {
        text.push_str(&format!(
            "  - key: k{i}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        ));
    }
    let rs = set(&text);
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let entries: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "v")).collect();
    assert_eq!(rs.domain("d").unwrap().order_entries(&entries), None);
    assert_eq!(
        rs.domain("d").unwrap().order_entries(&entries[..1]),
        Some(vec![("k0", "v")])
    );
}

#[test]
fn calendar_windows_are_checked_where_they_are_written() {
    let limit = |fields: &str| {
        format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{requests_per_unit: 10, {fields}}}\n"
        )
    };
    let cases = [
        (
            "unit: hour, calendar: UTC",
            "rules.yaml: descriptors[0].rate_limit.calendar: calendar applies to the units day, week, month and year, not HOUR",
        ),
        (
            "unit: month, calendar: Mars/Olympus",
            "rules.yaml: descriptors[0].rate_limit.calendar: unknown time zone 'Mars/Olympus' (an IANA name such as Europe/Berlin, or UTC)",
        ),
        (
            "unit: month, unit_multiplier: 3, calendar: UTC",
            "rules.yaml: descriptors[0].rate_limit.unit_multiplier: a calendar window is one day, week, month or year: unit_multiplier is not allowed with calendar",
        ),
        (
            "unit: month, calendar: UTC, algorithm: token_bucket",
            "rules.yaml: descriptors[0].rate_limit: calendar windows apply to fixed_window, not to token_bucket",
        ),
        (
            "unit: month, calendar: UTC, algorithm: sliding_window",
            "rules.yaml: descriptors[0].rate_limit: calendar windows apply to fixed_window, not to sliding_window",
        ),
    ];
    for (fields, want) in cases {
        assert_eq!(errors(&limit(fields)), [want.to_string()], "for {fields}");
    }
    // In a plan: the free plan's month is Berlin's calendar month.
    let rs = set(
        "domain: d\ndescriptors:\n  - key: c\n    plan: {client: c}\nplans:\n  free: [{unit: month, requests_per_unit: 1000, calendar: Europe/Berlin}]\n  pro: [{unit: month, requests_per_unit: 9000}]\ndefault_plan: free\n",
    );
    let d = rs.domain("d").unwrap();
    let tier = |plan: &str| {
        let p = d.plans().iter().find(|p| p.name == plan).unwrap();
        p.groups["default"][0].limit
    };
    let free = tier("free").calendar.expect("a calendar month");
    assert_eq!(free.zone_name(), "Europe/Berlin");
    assert_eq!(free.unit(), crate::calendar::CalendarUnit::Month);
    assert_eq!(tier("pro").calendar, None);
}

/// A concurrency limit's refusals, each named by its file and field.
#[test]
fn a_bad_concurrency_limit_is_refused_where_it_is_written() {
    let one = |body: &str| {
        format!("domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: id\n{body}")
    };
    let cases = [
        (
            one("        concurrency: {limit: 3}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency.max_hold: a concurrency limit needs `max_hold`: how long a slot that is never released (a crashed proxy, a lost call) is held; set it above the route's timeout",
        ),
        (
            one("        concurrency: {max_hold: 30s}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency.limit: a concurrency limit needs `limit`: how many requests may be in flight at once",
        ),
        (
            one("        concurrency: {limit: 3, max_hold: 500ms}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency.max_hold: max_hold must be between 1s and 24h, not 500ms",
        ),
        (
            one("        concurrency: {limit: 3, max_hold: 25h}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency.max_hold: max_hold must be between 1s and 24h, not 25h",
        ),
        (
            one("        concurrency: {limit: 3, max_hold: soon}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency.max_hold: 'soon' is not a duration like 10ms, 2s or 5m",
        ),
        (
            one("        concurrency: {limit: 3, max_hold: 30s}\n        rate_limit: {unit: second, requests_per_unit: 1}\n"),
            "rules.yaml: descriptors[0].descriptors[0].concurrency: use either concurrency or rate_limit(s)/plan on one descriptor, not both",
        ),
        (
            one("        concurrency: {limit: 3, max_hold: 30s}\n        descriptors:\n          - key: x\n            rate_limit: {unit: second, requests_per_unit: 1}\n"),
            "rules.yaml: descriptors[0].descriptors[0].descriptors: a concurrency limit's entry names one request (its slot): it has no child descriptors; put the limit on the request id's level",
        ),
        (
            one("        overdraft: true\n        concurrency: {limit: 3, max_hold: 30s}\n"),
            "rules.yaml: descriptors[0].descriptors[0].overdraft: overdraft does not apply to a concurrency limit",
        ),
        (
            one("        mode: hybrid\n        concurrency: {limit: 3, max_hold: 30s}\n"),
            "rules.yaml: descriptors[0].descriptors[0].mode: mode: hybrid applies only to fixed_window and sliding_window limits, not to concurrency (a lease held unused would let it admit more than its limit)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: concurrency}\n".to_owned(),
            "rules.yaml: descriptors[0].rate_limit.algorithm: concurrency is not a rate: write `concurrency: {limit, max_hold}` on the descriptor whose entry names the request",
        ),
    ];
    for (text, want) in cases {
        assert_eq!(errors(&text), [want.to_string()], "for {text}");
    }
    let negative = errors(&one("        concurrency: {limit: -1, max_hold: 30s}\n"));
    assert!(
        negative[0].contains("concurrency.limit: invalid type: integer `-1`, expected u32"),
        "{}",
        negative[0]
    );
}
