//! Traces from the `sluice` binary to an OTLP receiver the tests run (there is no collector
//! package here): the reference's variables as Envoy Gateway sets them, the caller's context
//! in W3C or B3 and its sampling decision, a batched Redis call linking the requests it
//! carried, and a collector that hangs costing the decisions nothing.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use common::otlp::{CLIENT, Receiver, SERVER};
use sluice::proto::RateLimitServiceClient;
use tonic::transport::Channel;

const RULES: &str =
    "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

/// A call of domain `t` with the trace headers `headers`.
fn call(headers: &[(&'static str, String)]) -> tonic::Request<sluice::proto::RateLimitRequest> {
    let mut request = tonic::Request::new(common::request(
        "t",
        vec![common::descriptor(&[("k", "v")])],
    ));
    for (k, v) in headers {
        request.metadata_mut().insert(*k, v.parse().unwrap());
    }
    request
}

fn traceparent(trace: &str, span: &str, sampled: bool) -> (&'static str, String) {
    (
        "traceparent",
        format!("00-{trace}-{span}-{}", if sampled { "01" } else { "00" }),
    )
}

async fn client(http: SocketAddr, grpc: SocketAddr) -> RateLimitServiceClient<Channel> {
    common::wait_healthy(http).await;
    RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap()
}

/// As Envoy Gateway runs the reference with `rateLimit.telemetry.tracing` set: a `ratelimit`
/// binary, `TRACING_*` and `OTEL_EXPORTER_OTLP_ENDPOINT` (the reference's default protocol:
/// OTLP/HTTP). The spans carry the service's name, namespace and instance, and join the
/// caller's trace whether it came as W3C or B3; a call the caller did not sample opens none.
#[tokio::test]
async fn as_ratelimit_the_references_tracing_variables_export_over_http() {
    let receiver = Receiver::start().await;
    let dir = common::temp_dir("traced-reference");
    let rules = dir.join("runtime/ratelimit/config");
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(rules.join("t.yaml"), RULES).unwrap();
    let (http, grpc) = (common::free_port(), common::free_port());
    let mut child = common::as_reference_on(&dir, http, grpc)
        .env("TRACING_ENABLED", "true")
        .env("TRACING_SERVICE_NAME", "envoy-ratelimit")
        .env("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system")
        .env("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-0")
        .env("TRACING_SAMPLING_RATE", "1")
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://{}", receiver.http),
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut client = client(
        format!("127.0.0.1:{http}").parse().unwrap(),
        format!("127.0.0.1:{grpc}").parse().unwrap(),
    )
    .await;
    let (w3c, b3, unsampled) = (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "80f198ee56343ba864fe8b2a57d3eff7",
        "0af7651916cd43dd8448eb211c80319c",
    );
    // The unsampled call first: were it exported, it would be by the time the others are.
    let calls = [
        vec![traceparent(unsampled, "b7ad6b7169203331", false)],
        vec![traceparent(w3c, "00f067aa0ba902b7", true)],
        vec![("b3", format!("{b3}-e457b5a2e4d86bd1-1"))],
    ];
    for headers in calls {
        client.should_rate_limit(call(&headers)).await.unwrap();
    }
    for (trace, parent) in [(w3c, "00f067aa0ba902b7"), (b3, "e457b5a2e4d86bd1")] {
        let span = receiver
            .until(Duration::from_secs(20), |spans| {
                spans.iter().find(|s| s.trace_id == trace).cloned()
            })
            .await;
        assert_eq!(span.parent_span_id, parent);
        assert_eq!(span.kind, SERVER);
        assert_eq!(span.attr("ratelimit.domain"), Some("t"));
        assert_eq!(span.attr("ratelimit.decision"), Some("ok"));
        assert_eq!(span.service(), "envoy-ratelimit");
        assert_eq!(
            span.resource_attr("service.namespace"),
            Some("envoy-gateway-system")
        );
        assert_eq!(
            span.resource_attr("service.instance.id"),
            Some("envoy-ratelimit-0")
        );
    }
    assert!(
        receiver.spans().iter().all(|s| s.trace_id != unsampled),
        "a call its caller did not sample opened a span"
    );
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Calls that queue while Redis is held (SIGSTOP) leave together in one call when it is back:
/// that call's span links each request's span, each in its own trace.
#[tokio::test]
async fn a_batched_redis_call_links_every_request_it_carried() {
    let receiver = Receiver::start().await;
    let redis = common::redis::RedisServer::start();
    let dir = common::temp_dir("traced-batch");
    std::fs::write(dir.join("t.yaml"), RULES).unwrap();
    let args = [
        "--backend",
        "redis",
        "--redis-timeout",
        "60s",
        "--redis-url",
        &redis.url(),
    ];
    let (mut child, http, grpc) = common::serve_binary(&dir, &args, &receiver.grpc_env()).await;
    let client = client(http, grpc).await;
    // A first call, so the connection is up before Redis is held.
    client.clone().should_rate_limit(call(&[])).await.unwrap();
    redis.pause();
    let traces: Vec<String> = (0..6).map(|i| format!("{:032x}", 0xabc0 + i)).collect();
    let mut calls = Vec::new();
    for (i, trace) in traces.iter().enumerate() {
        let mut c = client.clone();
        let headers = vec![traceparent(trace, &format!("{:016x}", 0x10 + i), true)];
        calls.push(tokio::spawn(async move {
            c.should_rate_limit(call(&headers)).await.map(|_| ())
        }));
    }
    // Redis holds whichever call left first; the rest queue behind it. (No clock of ours can
    // say when six loopback calls have reached the server: this wait only lets them arrive,
    // and the assertions below hold for any split of them into calls but one each.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    // The calls that queued left together: that call's span links each request's span.
    let (batch, groups) = receiver
        .until(Duration::from_secs(20), |spans| {
            let batch = spans
                .iter()
                .filter(|s| s.kind == CLIENT && traces.contains(&s.trace_id))
                .max_by_key(|s| s.links.len())
                .filter(|s| s.links.len() >= 2)?;
            let groups: Vec<_> = batch
                .links
                .iter()
                .map(|(t, id)| {
                    spans
                        .iter()
                        .find(|s| &s.trace_id == t && &s.span_id == id)
                        .cloned()
                })
                .collect::<Option<_>>()?;
            Some((batch.clone(), groups))
        })
        .await;
    let carried = groups.len();
    eprintln!("one Redis call carried {carried} of the six requests, and links their spans");
    assert_eq!(
        batch.attr("redis.groups"),
        Some(carried.to_string().as_str())
    );
    let linked: std::collections::HashSet<&str> =
        groups.iter().map(|g| g.trace_id.as_str()).collect();
    assert_eq!(linked.len(), carried, "a request per trace");
    assert!(linked.iter().all(|t| traces.iter().any(|x| x == t)));
    for g in &groups {
        assert_eq!(g.name, "redis group");
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A collector that accepts connections and never answers: every call is answered at once, and
/// the spans it could not take are counted as dropped in the metrics.
#[tokio::test]
async fn a_collector_that_hangs_costs_a_decision_nothing() {
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_addr = hung.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = hung.accept().await {
            open.push(s);
        }
    });
    let dir = common::temp_dir("traced-hung");
    std::fs::write(dir.join("t.yaml"), RULES).unwrap();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{hung_addr}")),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "500".to_owned()),
    ];
    let (mut child, http, grpc) = common::serve_binary(&dir, &[], &env).await;
    let mut client = client(http, grpc).await;
    for i in 0..20 {
        let headers = vec![traceparent(
            &format!("{:032x}", 0x100 + i),
            "00f067aa0ba902b7",
            true,
        )];
        let answer = client.should_rate_limit(call(&headers)).await.unwrap();
        assert_eq!(
            answer.into_inner().overall_code,
            sluice::proto::Code::Ok as i32
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, metrics) = common::http_get(http, "/metrics").await;
        let value = |name: &str| common::metric(&metrics, name).unwrap_or(0);
        let dropped = value("sluice_trace_spans_total{outcome=\"dropped\"}");
        if dropped >= 20 && value("sluice_trace_export_failures_total") >= 1 {
            assert_eq!(value("sluice_trace_spans_total{outcome=\"exported\"}"), 0);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "dropped {dropped}: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    held.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

/// An RLQS report that changed an Envoy's assignments is a span: its domain, the buckets it
/// reported and the actions it got.
#[tokio::test]
async fn an_rlqs_report_that_changed_assignments_is_a_span() {
    use sluice::proto::rlqs::{BucketId, BucketQuotaUsage, RateLimitQuotaUsageReports};
    let receiver = Receiver::start().await;
    let dir = common::temp_dir("traced-rlqs");
    std::fs::write(dir.join("t.yaml"), RULES).unwrap();
    let (mut child, http, grpc) = common::serve_binary(&dir, &[], &receiver.grpc_env()).await;
    common::wait_healthy(http).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let first = RateLimitQuotaUsageReports {
        domain: "t".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("k".to_owned(), "v".to_owned())].into(),
            }),
            time_elapsed: Some(prost_types::Duration::default()),
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    };
    let (tx, mut inbound) = common::rlqs_envoy::open_stream(channel, first).await;
    let first = inbound.message().await.unwrap().unwrap();
    assert!(!first.bucket_action.is_empty());
    let span = receiver
        .until(Duration::from_secs(20), |spans| {
            spans
                .iter()
                .find(|s| s.name.contains("StreamRateLimitQuotas"))
                .cloned()
        })
        .await;
    assert_eq!(span.kind, SERVER);
    assert_eq!(span.attr("ratelimit.domain"), Some("t"));
    assert_eq!(span.attr("rlqs.buckets_reported"), Some("1"));
    assert_eq!(
        span.attr("rlqs.actions"),
        Some(first.bucket_action.len().to_string().as_str())
    );
    drop(tx);
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}
