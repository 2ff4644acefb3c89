//! ShouldRateLimit over real gRPC (tonic client → server on a loopback port), plus health and
//! the HTTP endpoints.

mod common;

use common::*;
use sluice::engine::EngineSettings;
use sluice::proto::{Code, ResponseUnit};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const RULES: &str = r#"
domain: api
descriptors:
  - key: api_key
    rate_limits:
      - {unit: second, requests_per_unit: 2, name: per_second}
      - {unit: minute, requests_per_unit: 100, unit_multiplier: 5, name: per_5_minutes}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: gcra}
"#;

#[tokio::test]
async fn ok_then_over_limit_with_statuses_and_headers() {
    let server = start(RULES, "retry-after,draft03", EngineSettings::default()).await;
    let mut client = server.client().await;
    let call = || {
        request(
            "api",
            vec![
                descriptor(&[("api_key", "k")]),
                descriptor(&[("other", "x")]),
            ],
        )
    };

    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses.len(), 2);
    let s = &r.statuses[0];
    assert_eq!(s.code, Code::Ok as i32);
    assert_eq!(s.limit_remaining, 1);
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit, limit.name.as_str()),
        (2, ResponseUnit::Second as i32, "per_second")
    );
    assert_eq!(s.duration_until_reset.unwrap().seconds, 1);
    assert_eq!(r.statuses[1].code, Code::Ok as i32);
    assert!(r.statuses[1].current_limit.is_none());
    let headers: Vec<_> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect();
    assert_eq!(
        headers,
        [
            ("x-ratelimit-limit", "2, 2;w=1;name=\"per_second\""),
            ("x-ratelimit-remaining", "1"),
            ("x-ratelimit-reset", "1"),
        ]
    );

    client.should_rate_limit(call()).await.unwrap();
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert!(
        r.response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after" && h.value == "1")
    );

    // The per-5-minutes tier reports its multiplier once it is the tightest.
    server.clock.advance(S);
    let mut heavy = call();
    heavy.descriptors[0].hits_addend = Some(0);
    let r = client.should_rate_limit(heavy).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);

    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn the_denying_tier_is_reported_with_its_multiplier() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    let mut r = request("api", vec![descriptor(&[("api_key", "m")])]);
    r.descriptors[0].hits_addend = Some(2);
    // 2 per second for 50 seconds spends the 100 per 5 minutes.
    for _ in 0..50 {
        let resp = client
            .should_rate_limit(r.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.overall_code, Code::Ok as i32);
        server.clock.advance(S);
    }
    r.descriptors[0].hits_addend = Some(1);
    let resp = client.should_rate_limit(r).await.unwrap().into_inner();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    let status = &resp.statuses[0];
    let limit = status.current_limit.clone().unwrap();
    assert_eq!(limit.name, "per_5_minutes");
    assert_eq!(limit.unit_multiplier, Some(5));
    assert_eq!(
        status.duration_until_reset.unwrap().seconds,
        250,
        "until the 5-minute window ends"
    );
    assert!(
        resp.response_headers_to_add.is_empty(),
        "--response-headers none"
    );
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn invalid_requests_get_invalid_argument() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    let err = client
        .should_rate_limit(request("", vec![descriptor(&[("a", "b")])]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(err.message(), "rate limit domain must not be empty");
    let err = client
        .should_rate_limit(request("api", vec![]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let hostile = descriptor(&[("k", &"x".repeat(5000))]);
    let err = client
        .should_rate_limit(request("api", vec![hostile]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // The server still answers.
    assert!(
        client
            .should_rate_limit(request("api", vec![descriptor(&[("a", "b")])]))
            .await
            .is_ok()
    );
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_calls_never_admit_more_than_the_limit() {
    let rules = "domain: c\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 137}\n";
    let server = start(rules, "none", EngineSettings::default()).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut client = server.client().await;
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..50 {
                let r = client
                    .should_rate_limit(request("c", vec![descriptor(&[("k", "v")])]))
                    .await
                    .unwrap()
                    .into_inner();
                if r.overall_code == Code::Ok as i32 {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 137);
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn global_shadow_mode_answers_ok() {
    let settings = EngineSettings {
        global_shadow: true,
        ..EngineSettings::default()
    };
    let server = start(RULES, "none", settings).await;
    let mut client = server.client().await;
    for _ in 0..2 {
        client
            .should_rate_limit(request("api", vec![descriptor(&[("tenant", "t")])]))
            .await
            .unwrap();
    }
    let r = client
        .should_rate_limit(request("api", vec![descriptor(&[("tenant", "t")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn health_serves_every_name_and_flips_on_stop() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    // "ratelimit": the name the reference service registers.
    for service in [
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
        "ratelimit",
    ] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let http = server.running.http_addr;
    assert_eq!(http_get(http, "/healthcheck").await.0, 200);
    server.running.stop().await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(http).await.is_err(),
        "listener closed"
    );
}

#[tokio::test]
async fn rlconfig_lists_each_plans_limits() {
    let rules = "domain: p\ndescriptors:\n  - key: plan\n    descriptors:\n      - key: user\n        plan: {entry: plan}\nplans:\n  free:\n    default:\n      - {unit: second, requests_per_unit: 2, name: per_second}\n      - {unit: day, requests_per_unit: 1000, calendar: Europe/Berlin}\n  enterprise: unlimited\ndefault_plan: free\n";
    let server = start(rules, "none", EngineSettings::default()).await;
    let (status, body) = http_get(server.running.http_addr, "/rlconfig").await;
    assert_eq!(status, 200);
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(
        lines,
        // Plans by name; a plan's limits carry its name (what statuses report).
        [
            "p.plan.user: plan enterprise: unlimited, shadow_mode: false, quota_mode: false",
            "p.plan.user: plan free: unit=SECOND requests_per_unit=2, shadow_mode: false, quota_mode: false, algorithm: fixed_window, name: free:per_second",
            "p.plan.user: plan free: unit=DAY requests_per_unit=1000, shadow_mode: false, quota_mode: false, algorithm: fixed_window calendar=Europe/Berlin, name: free:day",
        ],
        "{body}"
    );
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn json_endpoint() {
    let server = start(RULES, "retry-after", EngineSettings::default()).await;
    let http = server.running.http_addr;
    let body = r#"{"domain":"api","descriptors":[{"entries":[{"key":"tenant","value":"j"}]}]}"#;
    let (status, text) = http_post(http, "/json", body).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["overallCode"], "OK");
    assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "MINUTE");
    assert_eq!(v["statuses"][0]["durationUntilReset"], "60s");
    let (status, text) = http_post(http, "/json", body).await;
    assert_eq!(status, 429);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["statuses"][0]["code"], "OVER_LIMIT");
    assert_eq!(v["responseHeadersToAdd"][0]["key"], "retry-after");
    let (status, text) = http_post(http, "/json", r#"{"domain":""}"#).await;
    assert_eq!(
        (status, text.trim()),
        (400, "rate limit domain must not be empty")
    );
    let (status, _) = http_post(http, "/json", "{").await;
    assert_eq!(status, 400);
    server.running.stop().await.unwrap();
}

const QUOTA_RULES: &str = r#"
domain: routing
descriptors:
  - key: pool
    value: primary
    quota_mode: true
    metadata: {upstream: {cluster: primary, tier: gold}}
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: pool
    value: overflow
    quota_mode: true
    metadata: {upstream: {cluster: overflow, zone: b}, note: second}
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

/// A `google.protobuf.Struct` as JSON-ish text, so the whole of it is compared at once.
fn show(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::StringValue(s)) => format!("{s:?}"),
        Some(Kind::NumberValue(n)) => n.to_string(),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::StructValue(s)) => show_struct(s),
        Some(Kind::ListValue(l)) => {
            let items: Vec<String> = l.values.iter().map(show).collect();
            format!("[{}]", items.join(","))
        }
        Some(Kind::NullValue(_)) | None => "null".into(),
    }
}

fn show_struct(s: &prost_types::Struct) -> String {
    let fields: Vec<String> = s
        .fields
        .iter()
        .map(|(k, v)| format!("{k}:{}", show(v)))
        .collect();
    format!("{{{}}}", fields.join(","))
}

#[tokio::test]
async fn quota_mode_routes_by_dynamic_metadata_until_every_pool_is_spent() {
    let server = start(QUOTA_RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    let call = || {
        let mut r = request(
            "routing",
            vec![
                descriptor(&[("pool", "primary")]),
                descriptor(&[("pool", "overflow")]),
            ],
        );
        r.hits_addend = 1;
        r
    };
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let metadata = r.dynamic_metadata.as_ref().expect("dynamic metadata is on");
    assert_eq!(
        show_struct(metadata),
        concat!(
            r#"{descriptors:[{entries:["pool=primary"]},{entries:["pool=overflow"]}],domain:"routing","#,
            r#"hitsAddend:1,metadata:{note:"second",upstream:{cluster:"primary",tier:"gold",zone:"b"}}}"#
        )
    );
    // primary is spent: still OK (overflow has quota), and only overflow's metadata remains.
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    let metadata = show_struct(r.dynamic_metadata.as_ref().unwrap());
    assert!(
        metadata.ends_with(r#"metadata:{note:"second",upstream:{cluster:"overflow",zone:"b"}}}"#),
        "{metadata}"
    );
    // Both spent: OVER_LIMIT, and no rule's metadata.
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let metadata = show_struct(r.dynamic_metadata.as_ref().unwrap());
    assert!(!metadata.contains("metadata:"), "{metadata}");
}

#[tokio::test]
async fn health_watch_follows_the_grpc_health_spec() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    let watch = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    let mut known = health.watch(watch("ratelimit")).await.unwrap().into_inner();
    let first = known.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    // An unknown name: one SERVICE_UNKNOWN, and the call is not ended.
    let mut unknown = health
        .watch(watch("no.such.Service"))
        .await
        .unwrap()
        .into_inner();
    let r = unknown.message().await.unwrap().unwrap();
    assert_eq!(r.status, ServingStatus::ServiceUnknown as i32);
    let still_open = tokio::time::timeout(std::time::Duration::from_millis(200), unknown.message());
    assert!(still_open.await.is_err(), "the unknown watch stays open");
    // Stopping: the known watch hears NOT_SERVING, then both calls end (the graceful shutdown
    // does not wait on them).
    let stopping = tokio::spawn(server.running.stop());
    let r = known.message().await.unwrap().unwrap();
    assert_eq!(r.status, ServingStatus::NotServing as i32);
    assert!(known.message().await.map_or(true, |m| m.is_none()));
    assert!(unknown.message().await.map_or(true, |m| m.is_none()));
    tokio::time::timeout(std::time::Duration::from_secs(10), stopping)
        .await
        .expect("stop does not wait on health watches")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn reflection_lists_and_describes_the_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let server = start(RULES, "none", EngineSettings::default()).await;
    let channel = server.channel().await;
    let mut client = ServerReflectionClient::new(channel);
    let ask = |m: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    };
    let requests = [
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "envoy.service.ratelimit.v3.RateLimitService".into(),
        )),
    ];
    let mut answers = client
        .server_reflection_info(futures_util::stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("a list of services")
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
            "envoy.service.ratelimit.v3.RateLimitService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
        ]
    );
    let Some(MessageResponse::FileDescriptorResponse(files)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("the file of the RLS")
    };
    assert!(!files.file_descriptor_proto.is_empty());
    server.running.stop().await.unwrap();
}

/// Issue 26 item 3 over the wire: a calendar month in Berlin. On February's last half minute
/// the reset, `duration_until_reset`, Retry-After and the draft headers all say 30 s; on March
/// 1st the month is fresh and 31 days long.
#[tokio::test]
async fn a_calendar_month_resets_on_the_first_in_its_zone() {
    let rules = "domain: plans\ndescriptors:\n  - key: user\n    rate_limit: {unit: month, requests_per_unit: 2, calendar: Europe/Berlin, name: monthly}\n";
    let server = start(rules, "retry-after,draft03", EngineSettings::default()).await;
    let berlin = |civil: &str| common::civil_us("Europe/Berlin", civil);
    server.clock.set(berlin("2026-02-28T23:59:30"));
    let mut client = server.client().await;
    let call = || request("plans", vec![descriptor(&[("user", "ann")])]);
    let headers = |r: &sluice::proto::RateLimitResponse| -> Vec<(String, String)> {
        r.response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect()
    };
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].duration_until_reset.unwrap().seconds, 30);
    assert_eq!(
        headers(&r),
        [
            pair("x-ratelimit-limit", "2, 2;w=2592000;name=\"monthly\""),
            pair("x-ratelimit-remaining", "1"),
            pair("x-ratelimit-reset", "30"),
        ]
    );
    client.should_rate_limit(call()).await.unwrap();
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].duration_until_reset.unwrap().seconds, 30);
    assert!(headers(&r).contains(&pair("retry-after", "30")), "{r:?}");
    server.clock.set(berlin("2026-03-01T00:00"));
    let r = client.should_rate_limit(call()).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 1);
    assert_eq!(
        r.statuses[0].duration_until_reset.unwrap().seconds,
        31 * 86_400 - 3_600,
        "March in Berlin: 31 days, one of them 23 hours"
    );
    server.running.stop().await.unwrap();
}
