use std::sync::Arc;

use super::*;
use crate::clock::ManualClock;
use crate::rules::{Unit, load_texts};
use crate::store::MemoryStore;

const S: u64 = 1_000_000;

const RULES: &str = r#"
domain: api
descriptors:
  - key: client
    rate_limits:
      - {unit: second, requests_per_unit: 3, name: per_second}
      - {unit: minute, requests_per_unit: 5, name: per_minute}
  - key: path
    value: /slow
    rate_limit: {unit: minute, requests_per_unit: 1, name: slow, replaces: [{name: generic}]}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 100, name: generic}
  - key: free
    rate_limit: {unlimited: true}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 2}
"#;

/// An engine on the rules `files` and a memory store, its clock at `start_s` seconds.
fn engine_on(
    files: &[(&str, &str)],
    start_s: u64,
    settings: EngineSettings,
) -> (Arc<ManualClock>, Engine<MemoryStore>) {
    let clock = Arc::new(ManualClock::new(start_s * S));
    let rules = load_texts(files.iter().copied()).unwrap();
    let store = MemoryStore::new(clock.clone(), 1_000);
    (clock, Engine::new(rules, store, settings))
}

fn engine(settings: EngineSettings) -> (Arc<ManualClock>, Engine<MemoryStore>) {
    engine_on(&[("api.yaml", RULES)], 1_000_000, settings)
}

fn desc(entries: &[(&str, &str)], hits: u64) -> Descriptor {
    Descriptor::of(entries, hits)
}

fn req(descriptors: Vec<Descriptor>) -> Request {
    Request {
        domain: "api".into(),
        descriptors,
    }
}

async fn run(e: &Engine<MemoryStore>, descriptors: Vec<Descriptor>) -> Decision {
    e.decide(&req(descriptors)).await.unwrap()
}

#[tokio::test]
async fn all_tiers_must_allow_and_the_tightest_is_reported() {
    let (clock, e) = engine(EngineSettings::default());
    let d = run(&e, vec![desc(&[("client", "a")], 1)]).await;
    assert_eq!(d.code, Code::Ok);
    let s = &d.statuses[0];
    assert_eq!(
        s.limit.as_ref().unwrap().name.as_deref(),
        Some("per_second")
    );
    assert_eq!(s.remaining, 2);
    assert_eq!(s.duration_us, Some(S));
    run(&e, vec![desc(&[("client", "a")], 2)]).await;
    let d = run(&e, vec![desc(&[("client", "a")], 1)]).await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(
        d.statuses[0].limit.as_ref().unwrap().name.as_deref(),
        Some("per_second")
    );
    assert_eq!(d.retry_after_us, Some(S));
    clock.advance(S);
    // The minute tier now has 2 left and is the tighter one.
    let d = run(&e, vec![desc(&[("client", "a")], 1)]).await;
    assert_eq!(
        d.statuses[0].limit.as_ref().unwrap().name.as_deref(),
        Some("per_minute")
    );
    assert_eq!(d.statuses[0].remaining, 1);
    run(&e, vec![desc(&[("client", "a")], 1)]).await;
    clock.advance(S);
    let d = run(&e, vec![desc(&[("client", "a")], 1)]).await;
    assert_eq!(d.code, Code::OverLimit, "the per-minute tier denies");
    assert_eq!(
        d.statuses[0].limit.as_ref().unwrap().name.as_deref(),
        Some("per_minute")
    );
}

#[tokio::test]
async fn a_denied_request_consumes_nothing_in_any_descriptor() {
    let (_, e) = engine(EngineSettings::default());
    run(&e, vec![desc(&[("bucket", "x")], 2)]).await;
    let d = run(
        &e,
        vec![desc(&[("client", "b")], 1), desc(&[("bucket", "x")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(d.statuses[0].code, Code::Ok);
    assert_eq!(d.statuses[1].code, Code::OverLimit);
    assert_eq!(d.statuses[0].remaining, 3, "client b was not charged");
    let d = run(&e, vec![desc(&[("client", "b")], 3)]).await;
    assert_eq!(d.code, Code::Ok);
}

#[tokio::test]
async fn statuses_follow_request_order_and_unmatched_are_ok() {
    let (_, e) = engine(EngineSettings::default());
    let d = run(
        &e,
        vec![
            desc(&[("nothing", "x")], 1),
            desc(&[("free", "x")], 1),
            desc(&[("client", "c")], 1),
        ],
    )
    .await;
    assert_eq!(d.statuses.len(), 3);
    assert_eq!(d.statuses[0], Status::ok_without_limit());
    assert_eq!(d.statuses[1], Status::unlimited());
    assert_eq!(d.statuses[1].remaining, 4_294_967_295);
    assert!(d.statuses[2].limit.is_some());
}

#[tokio::test]
async fn replaces_drops_the_named_limit_within_the_request() {
    let (_, e) = engine(EngineSettings::default());
    let d = run(
        &e,
        vec![desc(&[("path", "/slow")], 1), desc(&[("path", "/slow")], 1)],
    )
    .await;
    // Both descriptors match `slow`; generic is never involved; 1/min denies the second hit.
    assert_eq!(d.code, Code::OverLimit);
    let d = run(
        &e,
        vec![desc(&[("path", "/fast")], 1), desc(&[("path", "/slow")], 0)],
    )
    .await;
    assert_eq!(
        d.statuses[0],
        Status::ok_without_limit(),
        "generic was replaced"
    );
    assert_eq!(
        d.statuses[1].limit.as_ref().unwrap().name.as_deref(),
        Some("slow")
    );
}

#[tokio::test]
async fn a_counter_named_twice_is_charged_the_sum() {
    let (_, e) = engine(EngineSettings::default());
    let d = run(
        &e,
        vec![desc(&[("bucket", "w")], 1), desc(&[("bucket", "w")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::Ok);
    // Each occurrence as if charged in order, as the reference reports it.
    assert_eq!(d.statuses[0].remaining, 1);
    assert_eq!(d.statuses[1].remaining, 0);
    let d = run(
        &e,
        vec![desc(&[("bucket", "v")], 2), desc(&[("bucket", "v")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::OverLimit, "3 hits on a burst of 2");
    // The first would have fit; the second is the one over the limit.
    assert_eq!(d.statuses[0].code, Code::Ok);
    assert_eq!(d.statuses[0].remaining, 0);
    assert_eq!(d.statuses[1].code, Code::OverLimit);
    assert_eq!(d.statuses[1].remaining, 0);
    let probe = run(&e, vec![desc(&[("bucket", "v")], 0)]).await;
    assert_eq!(probe.statuses[0].remaining, 2, "nothing was consumed");
    // Three occurrences on a fresh counter with 3 per second: 2, 1, 0 left.
    let d = run(&e, vec![desc(&[("client", "c")], 1); 3]).await;
    let remaining: Vec<u64> = d.statuses.iter().map(|s| s.remaining).collect();
    assert_eq!(remaining, [2, 1, 0]);
}

#[tokio::test]
async fn shadow_rules_count_but_never_deny() {
    let (_, e) = engine(EngineSettings::default());
    assert_eq!(
        run(&e, vec![desc(&[("trial", "t")], 1)]).await.code,
        Code::Ok
    );
    let d = run(&e, vec![desc(&[("trial", "t")], 1)]).await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(d.statuses[0].code, Code::Ok);
    assert_eq!(d.statuses[0].remaining, 0);
}

#[tokio::test]
async fn global_shadow_forces_ok_but_statuses_tell_the_truth() {
    let (_, e) = engine(EngineSettings {
        global_shadow: true,
        ..EngineSettings::default()
    });
    let d = run(&e, vec![desc(&[("bucket", "y")], 3)]).await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(d.statuses[0].code, Code::OverLimit);
    assert_eq!(d.retry_after_us, None);
}

#[tokio::test]
async fn probes_and_refunds() {
    let (_, e) = engine(EngineSettings::default());
    run(&e, vec![desc(&[("bucket", "z")], 2)]).await;
    let probe = run(&e, vec![desc(&[("bucket", "z")], 0)]).await;
    assert_eq!(probe.code, Code::Ok);
    assert_eq!(probe.statuses[0].remaining, 0);
    let refund = Descriptor {
        refund: true,
        ..desc(&[("bucket", "z")], 1)
    };
    let d = run(&e, vec![refund]).await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(d.statuses[0].remaining, 1);
    assert_eq!(
        run(&e, vec![desc(&[("bucket", "z")], 1)]).await.code,
        Code::Ok
    );
}

#[tokio::test]
async fn a_request_override_replaces_the_configured_limit() {
    let (_, e) = engine(EngineSettings::default());
    let with_override = |hits| Descriptor {
        limit_override: Some(LimitOverride {
            requests_per_unit: 2,
            unit: Unit::Minute,
            unit_multiplier: 5,
        }),
        ..desc(&[("unconfigured", "v")], hits)
    };
    let d = run(&e, vec![with_override(2)]).await;
    assert_eq!(d.code, Code::Ok);
    let limit = d.statuses[0].limit.clone().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit, limit.unit_multiplier),
        (2, Unit::Minute, 5)
    );
    assert_eq!(run(&e, vec![with_override(1)]).await.code, Code::OverLimit);
}

#[tokio::test]
async fn an_override_period_beyond_the_exact_range_is_invalid() {
    let (_, e) = engine(EngineSettings::default());
    let request = req(vec![Descriptor {
        limit_override: Some(LimitOverride {
            requests_per_unit: 1,
            unit: Unit::Year,
            unit_multiplier: u32::MAX,
        }),
        ..desc(&[("unconfigured", "v")], 1)
    }]);
    match e.decide(&request).await {
        Err(EngineError::Invalid(m)) => {
            assert!(m.starts_with("descriptor 0: limit override: "), "{m}");
            assert!(m.contains("longest period"), "{m}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
}

#[tokio::test]
async fn unknown_domain_is_ok() {
    let (_, e) = engine(EngineSettings::default());
    let d = e
        .decide(&Request {
            domain: "other".into(),
            descriptors: vec![desc(&[("client", "a")], 1)],
        })
        .await
        .unwrap();
    assert_eq!(d, Decision::all_ok(1));
}

#[tokio::test]
async fn invalid_requests_are_rejected_with_a_reason() {
    let (_, e) = engine(EngineSettings::default());
    let e = &e;
    let msg = |r: Request| async move {
        match e.decide(&r).await {
            Err(EngineError::Invalid(m)) => m,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        msg(Request {
            domain: "".into(),
            descriptors: vec![desc(&[("a", "b")], 1)]
        })
        .await,
        "rate limit domain must not be empty"
    );
    assert_eq!(
        msg(req(vec![])).await,
        "rate limit descriptor list must not be empty"
    );
    assert_eq!(
        msg(req(vec![desc(&[], 1)])).await,
        "descriptor 0 has no entries"
    );
    assert_eq!(
        msg(req(vec![desc(&[("", "b")], 1)])).await,
        "descriptor 0 entry 0 has an empty key"
    );
    assert_eq!(
        msg(req(vec![desc(&[("a", "b")], 1); 65])).await,
        "65 descriptors; the limit is 64"
    );
    let long = "x".repeat(1025);
    assert_eq!(
        msg(req(vec![desc(&[("a", &long)], 1)])).await,
        "descriptor 0 entry 0 is longer than 1024 bytes"
    );
}

#[tokio::test]
async fn reloaded_rules_apply_to_the_next_request_and_keep_counters() {
    let (_, e) = engine(EngineSettings::default());
    run(&e, vec![desc(&[("client", "r")], 3)]).await;
    let raised = RULES.replace(
        "requests_per_unit: 3, name: per_second",
        "requests_per_unit: 4, name: per_second",
    );
    e.replace_rules(load_texts([("api.yaml", raised.as_str())]).unwrap());
    let d = run(&e, vec![desc(&[("client", "r")], 1)]).await;
    assert_eq!(
        d.code,
        Code::Ok,
        "the counter (3) continues under the new limit (4)"
    );
    assert_eq!(
        run(&e, vec![desc(&[("client", "r")], 1)]).await.code,
        Code::OverLimit
    );
}

const PLANS: &str = r#"
domain: p
descriptors:
  - key: client
    plan: {client: client}
    descriptors:
      - key: path
        value: /search*
        plan: {client: client, limits: search}
  - key: plan
    descriptors:
      - key: user
        plan: {entry: plan}
plans:
  free:
    default:
      - {unit: second, requests_per_unit: 1, name: per_second}
      - {unit: day, requests_per_unit: 3, name: per_day}
    search: [{unit: second, requests_per_unit: 2}]
  pro:
    default:
      - {unit: second, requests_per_unit: 10, name: per_second}
      - {unit: day, requests_per_unit: 5, name: per_day}
    search: [{unit: second, requests_per_unit: 20}]
  enterprise: unlimited
default_plan: free
"#;

fn plans_engine(clients: &str) -> (Arc<ManualClock>, Engine<MemoryStore>) {
    let files = [("p.yaml", PLANS), ("p-clients.yaml", clients)];
    engine_on(&files, 1_800_000_000, EngineSettings::default())
}

async fn plan_call(e: &Engine<MemoryStore>, entries: &[(&str, &str)]) -> Decision {
    e.decide(&Request {
        domain: "p".into(),
        descriptors: vec![desc(entries, 1)],
    })
    .await
    .unwrap()
}

fn limit_name(d: &Decision) -> String {
    d.statuses[0]
        .limit
        .as_ref()
        .unwrap()
        .name
        .as_deref()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn the_callers_plan_decides_and_the_status_names_plan_and_tier() {
    let (clock, e) = plans_engine("domain: p\nclients:\n  k-pro: pro\n  k-ent: enterprise\n");
    // Unknown client: the default plan.
    assert_eq!(plan_call(&e, &[("client", "nobody")]).await.code, Code::Ok);
    let d = plan_call(&e, &[("client", "nobody")]).await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(limit_name(&d), "free:per_second");
    // A pro client: 10 per second, but 5 per day.
    for _ in 0..5 {
        assert_eq!(plan_call(&e, &[("client", "k-pro")]).await.code, Code::Ok);
    }
    let d = plan_call(&e, &[("client", "k-pro")]).await;
    assert_eq!(
        (d.code, limit_name(&d)),
        (Code::OverLimit, "pro:per_day".to_owned())
    );
    // Enterprise: unlimited.
    for _ in 0..20 {
        assert_eq!(
            plan_call(&e, &[("client", "k-ent")]).await.statuses[0],
            Status::unlimited()
        );
    }
    // Per endpoint by plan: free gets 2 per second on search (an unnamed tier is named by unit).
    clock.advance(S);
    for _ in 0..2 {
        assert_eq!(
            plan_call(&e, &[("client", "x"), ("path", "/search?q=1")])
                .await
                .code,
            Code::Ok
        );
    }
    let d = plan_call(&e, &[("client", "x"), ("path", "/search?q=1")]).await;
    assert_eq!(
        (d.code, limit_name(&d)),
        (Code::OverLimit, "free:second".to_owned())
    );
}

#[tokio::test]
async fn moving_a_client_to_another_plan_keeps_its_usage() {
    let (clock, e) = plans_engine("domain: p\nclients:\n  k-x: free\n");
    assert_eq!(plan_call(&e, &[("client", "k-x")]).await.code, Code::Ok);
    clock.advance(S);
    assert_eq!(plan_call(&e, &[("client", "k-x")]).await.code, Code::Ok);
    // 2 of free's 3 per day used. Upgrade to pro (5 per day): the count carries over.
    let rules = load_texts([
        ("p.yaml", PLANS),
        ("p-clients.yaml", "domain: p\nclients:\n  k-x: pro\n"),
    ])
    .unwrap();
    e.replace_rules(rules);
    let d = plan_call(&e, &[("client", "k-x")]).await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(
        (limit_name(&d), d.statuses[0].remaining),
        ("pro:per_day".to_owned(), 2)
    );
}

#[tokio::test]
async fn a_plan_named_in_the_request() {
    let (clock, e) = plans_engine("domain: p\nclients: {}\n");
    for _ in 0..5 {
        assert_eq!(
            plan_call(&e, &[("plan", "pro"), ("user", "u")]).await.code,
            Code::Ok
        );
        clock.advance(S / 20);
    }
    assert_eq!(
        plan_call(&e, &[("plan", "pro"), ("user", "u")]).await.code,
        Code::OverLimit
    );
    // The same user on free (an unknown plan name falls back to it): the day's usage counts.
    clock.advance(S);
    let d = plan_call(&e, &[("plan", "gold"), ("user", "u")]).await;
    assert_eq!(
        (d.code, limit_name(&d)),
        (Code::OverLimit, "free:per_day".to_owned())
    );
}

const QUOTA_RULES: &str = r#"
domain: api
descriptors:
  - key: upstream
    value: a
    quota_mode: true
    metadata: {route: {pool: a}, weight: 1}
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: upstream
    value: b
    quota_mode: true
    metadata: {route: {pool: b, zone: z}, weight: 2}
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;

fn quota_engine(settings: EngineSettings) -> (Arc<ManualClock>, Engine<MemoryStore>) {
    engine_on(&[("api.yaml", QUOTA_RULES)], 1_000_000, settings)
}

fn codes(d: &Decision) -> Vec<Code> {
    d.statuses.iter().map(|s| s.code).collect()
}

#[tokio::test]
async fn quota_descriptors_deny_only_when_all_are_over() {
    let (clock, e) = quota_engine(EngineSettings::default());
    let both = || {
        vec![
            desc(&[("upstream", "a")], 1),
            desc(&[("upstream", "b")], 1),
            desc(&[("client", "c")], 1),
        ]
    };
    let d = run(&e, both()).await;
    assert_eq!(d.code, Code::Ok);
    // b (1/min) is over, a still allows: OK overall, b's status says OVER_LIMIT.
    let d = run(&e, both()).await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(codes(&d), [Code::Ok, Code::OverLimit, Code::Ok]);
    assert_eq!(d.statuses[0].remaining, 0);
    assert_eq!(d.statuses[2].remaining, 8, "the admitted request counts");
    // Both over: denied, and nothing is consumed anywhere (the client keeps 8).
    let d = run(&e, both()).await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(codes(&d), [Code::OverLimit, Code::OverLimit, Code::Ok]);
    assert_eq!(d.statuses[2].remaining, 8, "reported as not charged");
    assert!(d.retry_after_us.is_some_and(|r| r > 0 && r <= 60 * S));
    let d = run(&e, vec![desc(&[("client", "c")], 0)]).await;
    assert_eq!(
        d.statuses[0].remaining, 8,
        "the denied request was given back"
    );
    clock.advance(60 * S);
    assert_eq!(run(&e, both()).await.code, Code::Ok);
}

#[tokio::test]
async fn a_normal_descriptor_over_still_denies_a_quota_request() {
    let (_, e) = quota_engine(EngineSettings::default());
    let d = run(
        &e,
        vec![desc(&[("upstream", "a")], 1), desc(&[("client", "c")], 11)],
    )
    .await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(codes(&d), [Code::Ok, Code::OverLimit]);
    // Nothing consumed: upstream a still has both.
    let d = run(&e, vec![desc(&[("upstream", "a")], 0)]).await;
    assert_eq!(d.statuses[0].remaining, 2);
}

#[tokio::test]
async fn global_quota_mode_counts_every_descriptor_but_unlimited() {
    let (_, e) = quota_engine(EngineSettings {
        global_quota: true,
        ..EngineSettings::default()
    });
    // client over its 10, but in quota mode with a descriptor (no rule) that passes: OK.
    let d = run(
        &e,
        vec![desc(&[("client", "c")], 11), desc(&[("nothing", "x")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(codes(&d), [Code::OverLimit, Code::Ok]);
    // Alone, it is all the quota descriptors there are.
    let d = run(&e, vec![desc(&[("client", "c")], 11)]).await;
    assert_eq!(d.code, Code::OverLimit);
}

#[tokio::test]
async fn statuses_carry_the_rules_metadata() {
    let (_, e) = quota_engine(EngineSettings::default());
    let d = run(
        &e,
        vec![desc(&[("upstream", "a")], 1), desc(&[("client", "c")], 1)],
    )
    .await;
    let m = d.statuses[0]
        .metadata
        .as_ref()
        .expect("upstream a has metadata");
    assert_eq!(m["weight"], 1);
    assert!(d.statuses[1].metadata.is_none());
}

const COST_RULES: &str = r#"
domain: api
descriptors:
  - key: tokens
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: bucket_tokens
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: token_bucket, burst: 60}
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

fn cost_engine() -> (Arc<ManualClock>, Engine<MemoryStore>) {
    // On a minute's edge: the fixed window's whole minute is ahead.
    engine_on(
        &[("api.yaml", COST_RULES)],
        60_000_000,
        EngineSettings::default(),
    )
}

#[tokio::test]
async fn a_cost_limit_admits_while_under_and_records_every_debit() {
    let (clock, e) = cost_engine();
    let check = || vec![desc(&[("tokens", "u")], 0)];
    let debit = |n| vec![desc(&[("tokens", "u")], n)];
    // The request is checked with 0 hits, the response's cost debited afterwards.
    assert_eq!(run(&e, check()).await.code, Code::Ok);
    assert_eq!(run(&e, debit(80)).await.statuses[0].remaining, 20);
    assert_eq!(run(&e, check()).await.code, Code::Ok, "80 of 100: under");
    // This debit overshoots: recorded whole.
    let d = run(&e, debit(50)).await;
    assert_eq!((d.code, d.statuses[0].remaining), (Code::Ok, 0));
    // Over the limit: checks are denied until the window ends...
    let d = run(&e, check()).await;
    assert_eq!(d.code, Code::OverLimit);
    assert!(d.retry_after_us.is_some_and(|r| r > 0 && r <= 60 * S));
    // ...and a late debit of a request admitted earlier is still recorded while over.
    let d = run(&e, debit(5)).await;
    assert_eq!(d.code, Code::OverLimit);
    clock.advance(60 * S);
    assert_eq!(run(&e, check()).await.code, Code::Ok);
}

#[tokio::test]
async fn a_cost_bucket_goes_into_debt_and_drains_back() {
    let (clock, e) = cost_engine();
    let check = || vec![desc(&[("bucket_tokens", "u")], 0)];
    // 60 per minute: one token a second. A debit of 90 leaves a debt of 30.
    run(&e, vec![desc(&[("bucket_tokens", "u")], 90)]).await;
    let d = run(&e, check()).await;
    assert_eq!(d.code, Code::OverLimit);
    // Until one token of room: 31 s.
    assert_eq!(d.retry_after_us, Some(31 * S));
    clock.advance(30 * S);
    assert_eq!(run(&e, check()).await.code, Code::OverLimit);
    clock.advance(S);
    let d = run(&e, check()).await;
    assert_eq!((d.code, d.statuses[0].remaining), (Code::Ok, 1));
}

#[tokio::test]
async fn a_cost_debit_stands_when_another_limit_denies_the_request() {
    let (_, e) = cost_engine();
    let both = |n| vec![desc(&[("tokens", "u")], n), desc(&[("client", "c")], 1)];
    run(&e, both(10)).await;
    run(&e, both(10)).await;
    // The client's 2 per minute are spent: denied, but the 30 tokens are spent too.
    let d = run(&e, both(10)).await;
    assert_eq!(d.code, Code::OverLimit);
    let d = run(&e, vec![desc(&[("tokens", "u")], 0)]).await;
    assert_eq!(d.statuses[0].remaining, 70);
}

#[test]
fn overdraft_is_refused_where_it_cannot_be_exact() {
    for (alg, extra) in [("sliding_window", ""), ("sliding_log", "")] {
        let text = format!(
            "domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n    rate_limit: {{unit: minute, requests_per_unit: 5, algorithm: {alg}{extra}}}\n"
        );
        let e = load_texts([("d.yaml", text.as_str())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overdraft applies to fixed_window"), "{e}");
    }
    let hybrid = "domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n    mode: hybrid\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let e = load_texts([("d.yaml", hybrid)]).unwrap_err().to_string();
    assert!(
        e.contains("hybrid does not apply to an overdraft limit"),
        "{e}"
    );
}

const CONCURRENCY_RULES: &str = r#"
domain: api
descriptors:
  - key: key
    rate_limit: {unit: minute, requests_per_unit: 3}
    descriptors:
      - key: request
        concurrency: {limit: 2, max_hold: 30s}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

fn in_flight(key: &str, request: &str, release: bool) -> Descriptor {
    Descriptor {
        refund: release,
        ..desc(&[("key", key), ("request", request)], 1)
    }
}

#[tokio::test]
async fn a_concurrency_limit_is_all_or_nothing_with_the_request_s_rate_limits() {
    let (clock, e) = engine_on(
        &[("api.yaml", CONCURRENCY_RULES)],
        1_000_000,
        EngineSettings::default(),
    );
    // Two in flight for key k: the third request is over, and its tenant hit is not spent.
    for r in ["r1", "r2"] {
        assert_eq!(run(&e, vec![in_flight("k", r, false)]).await.code, Code::Ok);
    }
    let d = run(
        &e,
        vec![in_flight("k", "r3", false), desc(&[("tenant", "t")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(
        (
            d.statuses[0].code,
            d.statuses[0].remaining,
            d.statuses[0].duration_us
        ),
        (Code::OverLimit, 0, Some(30 * S)),
        "full: the oldest slot expires in 30 s"
    );
    assert_eq!(d.statuses[1].remaining, 1, "the tenant's hit was not spent");
    // A release frees one; a rate limit that denies then takes no slot.
    assert_eq!(
        run(&e, vec![in_flight("k", "r1", true)]).await.code,
        Code::Ok
    );
    assert_eq!(
        run(&e, vec![desc(&[("tenant", "t")], 1)]).await.code,
        Code::Ok
    );
    let d = run(
        &e,
        vec![in_flight("k", "r4", false), desc(&[("tenant", "t")], 1)],
    )
    .await;
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(d.statuses[0].remaining, 1, "r4 took no slot");
    // A retried call keeps one slot; a release of a slot not held changes nothing.
    assert_eq!(
        run(&e, vec![in_flight("k", "r2", false)]).await.statuses[0].remaining,
        1
    );
    assert_eq!(
        run(&e, vec![in_flight("k", "r9", true)]).await.statuses[0].remaining,
        1
    );
    // Slots are per key: another key has its own.
    assert_eq!(
        run(&e, vec![in_flight("j", "r1", false)]).await.statuses[0].remaining,
        1
    );
    // r2's slot is freed 30 s after it was taken.
    clock.advance(30 * S);
    assert_eq!(
        run(&e, vec![in_flight("k", "r5", false)]).await.statuses[0].remaining,
        1
    );
}

#[tokio::test]
async fn one_call_names_one_request_of_a_concurrency_counter() {
    let (_, e) = engine_on(
        &[("api.yaml", CONCURRENCY_RULES)],
        1_000_000,
        EngineSettings::default(),
    );
    let err = e
        .decide(&req(vec![
            in_flight("k", "r1", false),
            in_flight("k", "r2", false),
        ]))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "descriptors 0 and 1 name two requests under one concurrency limit; a call acquires or releases one request's slot"
    );
    // The same request twice holds one slot; two keys are two counters.
    let d = run(
        &e,
        vec![in_flight("k", "r1", false), in_flight("k", "r1", false)],
    )
    .await;
    assert_eq!(d.code, Code::Ok);
    let d = run(
        &e,
        vec![in_flight("k", "r2", false), in_flight("j", "r3", false)],
    )
    .await;
    assert_eq!(d.code, Code::Ok);
    assert_eq!(
        run(&e, vec![in_flight("k", "r3", false)]).await.code,
        Code::OverLimit
    );
}
