//! /metrics: per-rule counters, call results and latency, capped detailed series, gauges.

mod common;

use common::*;
use sluice::engine::EngineSettings;

const RULES: &str = r#"
domain: m
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: user
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

fn value(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

#[tokio::test]
async fn counts_per_rule_per_result_and_caps_detailed_series() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    // 8 hits within (up to 80% of 10), 2 near (the 9th and 10th), then 2 over.
    for _ in 0..12 {
        let _ = client
            .should_rate_limit(request("m", vec![descriptor(&[("k", "a")])]))
            .await;
    }
    for _ in 0..3 {
        let _ = client
            .should_rate_limit(request("m", vec![descriptor(&[("shadow", "s")])]))
            .await;
    }
    for user in ["u1", "u2", "u3", "u4", "u5"] {
        let _ = client
            .should_rate_limit(request("m", vec![descriptor(&[("user", user)])]))
            .await;
    }
    let _ = client
        .should_rate_limit(request("", vec![descriptor(&[("k", "a")])]))
        .await;

    let (status, text) = http_get(server.running.http_addr, "/metrics").await;
    assert_eq!(status, 200);
    let rule = |name: &str, r: &str| {
        value(
            &text,
            &format!("sluice_rule_{name}{{domain=\"m\",rule=\"{r}\"}}"),
        )
    };
    assert_eq!(rule("hits_total", "k"), 12);
    assert_eq!(rule("within_limit_total", "k"), 8, "{text}");
    assert_eq!(rule("near_limit_total", "k"), 2);
    assert_eq!(rule("over_limit_total", "k"), 2);
    assert_eq!(rule("shadow_mode_total", "shadow"), 2);
    assert_eq!(
        rule("over_limit_total", "shadow"),
        0,
        "shadow denials are not over-limit"
    );
    // detailed_metric: the value is in the label, up to the cap (3 in tests), then _other_.
    assert_eq!(rule("hits_total", "user_u1"), 1);
    assert_eq!(rule("hits_total", "user_u3"), 1);
    assert_eq!(rule("hits_total", "user_u4"), 0);
    assert_eq!(rule("hits_total", "_other_"), 2);
    assert_eq!(
        value(&text, "sluice_should_rate_limit_total{result=\"ok\"}"),
        18
    );
    assert_eq!(
        value(
            &text,
            "sluice_should_rate_limit_total{result=\"over_limit\"}"
        ),
        2
    );
    assert_eq!(
        value(&text, "sluice_should_rate_limit_total{result=\"invalid\"}"),
        1
    );
    assert_eq!(
        value(&text, "sluice_should_rate_limit_duration_seconds_count"),
        21
    );
    assert_eq!(value(&text, "sluice_memory_keys"), 7);
    assert_eq!(value(&text, "sluice_rules_loaded"), 3);
    server.running.stop().await.unwrap();
}

/// Prometheus's own linter accepts the exposition: names, types, help, units, `_total` on
/// counters.
#[tokio::test]
async fn promtool_accepts_the_exposition() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    for entries in [[("k", "a")], [("shadow", "s")], [("user", "u1")]] {
        for _ in 0..3 {
            let _ = client
                .should_rate_limit(request("m", vec![descriptor(&entries)]))
                .await;
        }
    }
    let (status, text) = http_get(server.running.http_addr, "/metrics").await;
    assert_eq!(status, 200);
    let promtool = std::env::var("SLUICE_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut child = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{promtool}: {e} (apt-get install prometheus, or set SLUICE_PROMTOOL)")
        });
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(text.as_bytes()).await.unwrap();
    }
    let out = child.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("sluice_rule_hits_total{"), "{text}");
    server.running.stop().await.unwrap();
}

/// Each limit of the rules now serving is a gauge with its window, a plan's limits per plan, so
/// a dashboard can plot usage against the limit; a reload takes the old limits away.
#[tokio::test]
async fn limits_are_gauges_of_the_rules_now_serving() {
    const TIERS: &str = r#"
domain: g
descriptors:
  - key: k
    rate_limits:
      - {unit: second, requests_per_unit: 10, name: burst}
      - {unit: minute, unit_multiplier: 5, requests_per_unit: 1000}
"#;
    let server = start(TIERS, "none", EngineSettings::default()).await;
    let http = server.running.http_addr;
    let (_, text) = http_get(http, "/metrics").await;
    let series = |name: &str, tier: &str| {
        format!("sluice_rule_{name}{{domain=\"g\",plan=\"\",rule=\"k\",tier=\"{tier}\"}}")
    };
    assert_eq!(value(&text, &series("limit", "burst")), 10, "{text}");
    assert_eq!(value(&text, &series("limit_window_seconds", "burst")), 1);
    assert_eq!(value(&text, &series("limit", "1")), 1000);
    assert_eq!(value(&text, &series("limit_window_seconds", "1")), 300);

    let replaced =
        "domain: h\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 7}\n";
    server
        .running
        .engine()
        .replace_rules(sluice::rules::load_texts([("h.yaml", replaced)]).unwrap());
    let (_, text) = http_get(http, "/metrics").await;
    assert!(!text.contains("domain=\"p\""), "{text}");
    assert_eq!(
        value(
            &text,
            "sluice_rule_limit{domain=\"h\",plan=\"\",rule=\"k\",tier=\"0\"}"
        ),
        7
    );
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn counters_reads_without_spending_and_refuses_hostile_queries() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    for _ in 0..3 {
        client
            .should_rate_limit(request("m", vec![descriptor(&[("k", "sk-123456")])]))
            .await
            .unwrap();
    }
    let addr = server.running.http_addr;
    let get = |q: String| async move { http_get(addr, &format!("/counters?{q}")).await };
    for _ in 0..2 {
        let (code, body) = get("domain=m&descriptor=k=sk-123456".into()).await;
        assert_eq!(code, 200, "{body}");
        let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
        let limit = &doc["descriptors"][0]["limits"][0];
        assert_eq!(
            (limit["used"].as_u64(), limit["remaining"].as_u64()),
            (Some(3), Some(7))
        );
        assert_eq!(doc["descriptors"][0]["rule"], "k");
        assert_eq!(doc["decided_by"], "backend");
        assert!(!body.contains("sk-123456"), "values are masked: {body}");
    }
    // A counter never used stays absent: a probe takes no room.
    let keys = server.running.upkeep().report().keys_in_memory;
    let (code, _) = get("domain=m&descriptor=k=never-seen".into()).await;
    assert_eq!(code, 200);
    assert_eq!(server.running.upkeep().report().keys_in_memory, keys);
    // Hostile queries: a reason, 400, nothing else.
    let many = (0..65)
        .map(|i| format!("descriptor=k={i}"))
        .collect::<Vec<_>>()
        .join("&");
    let huge = "v".repeat(2000);
    for (query, reason) in [
        ("domain=nope&descriptor=k=v".to_owned(), "not configured"),
        (format!("domain=m&{many}"), "descriptors; the limit is 64"),
        (
            format!("domain=m&descriptor=k={huge}"),
            "longer than 1024 bytes",
        ),
        ("domain=m&descriptor=%zz".to_owned(), "percent-encoding"),
        (
            "domain=m&hits=9&descriptor=k=v".to_owned(),
            "not a query parameter",
        ),
        ("domain=m".to_owned(), "no descriptor"),
    ] {
        let (code, body) = get(query.clone()).await;
        assert_eq!(code, 400, "{query}: {body}");
        assert!(body.contains(reason), "{query}: {body}");
    }
    // What was spent is still what RLS sees.
    let answer = client
        .should_rate_limit(request("m", vec![descriptor(&[("k", "sk-123456")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.statuses[0].limit_remaining, 6);
}

#[tokio::test]
async fn top_shows_the_most_denied_values_per_rule_masked() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    // k allows 10 an hour per value: "heavy" is denied 15 times, "light" 2 times.
    for (value, calls) in [("heavy-key-1", 25), ("light-key-2", 12), ("fine", 3)] {
        for _ in 0..calls {
            client
                .should_rate_limit(request("m", vec![descriptor(&[("k", value)])]))
                .await
                .unwrap();
        }
    }
    let (code, body) = http_get(server.running.http_addr, "/top?n=5").await;
    assert_eq!(code, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let rule = &doc["rules"][0];
    assert_eq!(
        (rule["domain"].as_str(), rule["rule"].as_str()),
        (Some("m"), Some("k"))
    );
    let values = rule["values"].as_array().unwrap();
    assert_eq!(values.len(), 2, "only denied values: {body}");
    assert_eq!(values[0]["denials"], 15);
    assert_eq!(values[1]["denials"], 2);
    assert!(values[0]["value"].as_str().unwrap().starts_with("k=heav…#"));
    assert!(!body.contains("heavy-key-1"), "values are masked: {body}");
    for bad in ["/top?n=0", "/top?n=1000", "/top?sort=x"] {
        assert_eq!(
            http_get(server.running.http_addr, bad).await.0,
            400,
            "{bad}"
        );
    }
}
