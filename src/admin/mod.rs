//! The HTTP side: `GET /healthcheck` (the reference's probe), `/livez` and `/readyz`
//! (Kubernetes), `GET /metrics` (Prometheus), `GET /rlconfig` (the loaded rules, one line each),
//! `GET /config` (what the last reloads did), `GET /counters` (what limits have left, read
//! without spending), `GET /top` (the most-limited values), `GET /explain` (what the rules do
//! with a descriptor), `GET /status` (serving state, backend, calls) and the status page at `/`
//! that shows them all (`status.html`: one file, no external assets), and, when asked for,
//! `POST /json` (a rate-limit call as JSON). Readiness
//! is [`crate::readiness`]'s: this module only renders it.

pub mod counters;
pub mod json;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::metrics::Gauges;
use crate::proto::Code;
use crate::readiness::Gate;
use crate::rules::reload::Reloader;
use crate::service::RateLimitGrpc;
use crate::store::{Store, Upkeep};

/// What the HTTP side reads.
pub struct AdminState<S> {
    pub service: Arc<RateLimitGrpc<S>>,
    pub gate: Arc<Gate>,
    /// The store's report (gauges).
    pub upkeep: Arc<Upkeep>,
    /// Reloads the rules (for `/config`); None when the rules are fixed.
    pub reloader: Option<Arc<Reloader>>,
    /// Serve `POST /json`. Off by default: it decides on the same counters as Envoy's calls, so
    /// whoever reaches the HTTP port could spend any client's quota through it.
    pub json: bool,
    /// How descriptor values are shown (`/counters`, `/top`).
    pub reveal: counters::Reveal,
    /// The Redis key prefix, for `/explain`'s keys.
    pub key_prefix: String,
    /// The RLQS service: its streams and buckets (`/status`), and what its grants hold of a
    /// counter (`/counters`).
    pub quota: Option<Arc<crate::rlqs::QuotaService<S>>>,
}

pub fn router<S: Store>(state: AdminState<S>) -> Router {
    let json = state.json;
    let router = Router::new()
        .route("/healthcheck", get(healthcheck::<S>))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz::<S>));
    let router = if json {
        router.route("/json", post(json_call::<S>))
    } else {
        router
    };
    router
        .route("/rlconfig", get(rlconfig::<S>))
        .route("/config", get(config_status::<S>))
        .route("/counters", get(counters_answer::<S>))
        .route("/top", get(top_answer::<S>))
        .route("/status", get(status::<S>))
        .route("/explain", get(explain_answer::<S>))
        .route("/", get(status_page))
        .route("/metrics", get(metrics::<S>))
        .with_state(Arc::new(state))
}

/// The reference service's metric names (Envoy Gateway's dashboard reads them) at `path`, on a
/// listener of their own as the reference serves them (`PROMETHEUS_ADDR`).
pub fn reference_metrics(metrics: Arc<crate::metrics::Metrics>, path: &str) -> Router {
    Router::new().route(
        path,
        get(move || {
            let metrics = metrics.clone();
            async move {
                match metrics.render_reference() {
                    Some(text) => (
                        StatusCode::OK,
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    None => (StatusCode::NOT_FOUND, "reference metrics are off\n").into_response(),
                }
            }
        }),
    )
}

/// The status page: one self-contained HTML file that reads the JSON endpoints and refreshes
/// itself.
async fn status_page() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("status.html"),
    )
        .into_response()
}

/// `GET /status`: whether this node serves and why, the backend as the store reports it, and
/// the calls so far by result.
async fn status<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let now = state.gate.now();
    let store = state.upkeep.report();
    let calls = state.service.metrics().map(|m| m.calls());
    let body = serde_json::json!({
        "ready": now.ready(),
        "serving": now.reason(),
        "backend": {
            "reached": store.backend_reached,
            "breaker": store.breaker.map(|b| format!("{b:?}").to_lowercase()),
            "keys_in_memory": store.keys_in_memory,
            "lease_hits_held": store.lease_hits_held,
            "cached_denials": store.cached_denials,
            "policy_decisions": store.policy_decisions,
        },
        "calls": calls.map(|[ok, over_limit, invalid, error]| serde_json::json!({
            "ok": ok, "over_limit": over_limit, "invalid": invalid, "error": error,
        })),
        "rlqs": state.quota.as_ref().map(|q| serde_json::json!({
            "streams": q.streams(), "buckets": q.buckets(),
        })),
    });
    axum::Json(body).into_response()
}

/// `GET /explain?domain=D&descriptor=k=v,...`: `sluice explain`'s text for the rules now serving.
async fn explain_answer<S: Store>(
    State(state): State<Arc<AdminState<S>>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let request = match counters::parse_query(&query.unwrap_or_default()) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let engine = state.service.engine();
    if let Err(e) = engine.settings().bounds.check(&request) {
        return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response();
    }
    let descriptors: Vec<Vec<(String, String)>> =
        request.descriptors.into_iter().map(|d| d.entries).collect();
    let text = crate::explain::explain(
        &engine.rules(),
        &request.domain,
        &descriptors,
        &state.key_prefix,
    );
    (StatusCode::OK, text).into_response()
}

/// `GET /top[?n=N]`: each rule's most-denied descriptor values (see [`crate::top`]), `n` per
/// rule (20 by default, at most the sketch's size), values masked as `/counters` masks them.
async fn top_answer<S: Store>(
    State(state): State<Arc<AdminState<S>>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let mut n = 20;
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("n", v)) => match v.parse::<usize>() {
                Ok(v) if (1..=crate::top::SLOTS).contains(&v) => n = v,
                _ => {
                    return (
                        StatusCode::BAD_REQUEST,
                        format!("n must be 1 to {}\n", crate::top::SLOTS),
                    )
                        .into_response();
                }
            },
            _ => {
                return (
                    StatusCode::BAD_REQUEST,
                    format!("'{pair}' is not a query parameter of /top (n)\n"),
                )
                    .into_response();
            }
        }
    }
    let Some(top) = state.service.top() else {
        return (StatusCode::NOT_FOUND, "the most-limited view is off\n").into_response();
    };
    let rules: Vec<serde_json::Value> = top
        .snapshot(n)
        .into_iter()
        .map(|t| {
            let values: Vec<serde_json::Value> = t
                .entries
                .iter()
                .map(|e| {
                    serde_json::json!({
                        "value": shown(&e.value, state.reveal),
                        "denials": e.denials.round() as u64,
                        "hits": e.hits.round() as u64,
                        "error": e.error.round() as u64,
                    })
                })
                .collect();
            serde_json::json!({"domain": t.domain, "rule": t.rule, "values": values})
        })
        .collect();
    axum::Json(serde_json::json!({
        "half_life_seconds": top.half_life().as_secs(),
        "rules": rules,
    }))
    .into_response()
}

/// A `k=v,k=v` value of the most-limited sketch, each value shown as `reveal` says.
fn shown(entries: &str, reveal: counters::Reveal) -> String {
    let shown: Vec<String> = entries
        .split(',')
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => format!("{k}={}", reveal.show(v)),
            None => kv.to_owned(),
        })
        .collect();
    shown.join(",")
}

/// `GET /counters`: see [`counters`].
async fn counters_answer<S: Store>(
    State(state): State<Arc<AdminState<S>>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let query = query.unwrap_or_default();
    let leased = |key: &[u8]| state.upkeep.leased(key);
    let grants = |domain: &str, entries: &[(String, String)]| {
        state.quota.as_ref().and_then(|q| q.grants(domain, entries))
    };
    match counters::answer(state.service.engine(), &query, state.reveal, leased, grants).await {
        Ok(document) => axum::Json(document).into_response(),
        Err(Ok(refused)) => (StatusCode::BAD_REQUEST, format!("{refused}\n")).into_response(),
        Err(Err(failed)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{failed}\n")).into_response()
        }
    }
}

/// One line per limit, like the reference service's `/rlconfig`, plus the algorithm. A rule
/// whose limits come from the caller's plan has a line per plan and limit, `plan <name>` first.
async fn rlconfig<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let rules = state.service.engine().rules();
    let mut out = String::new();
    for (domain, rules) in limit_lines(&rules) {
        for (rule, lines) in rules {
            for line in lines {
                out.push_str(&format!("{domain}.{rule}: {line}\n"));
            }
        }
    }
    (StatusCode::OK, out).into_response()
}

/// A domain's rules, each with its limits worded as `/rlconfig` words them.
type DomainLimits = (String, Vec<(String, Vec<String>)>);

/// Every limit of the rules serving, by domain (sorted) and rule: what `/rlconfig` prints after
/// `domain.rule:`, and what `/config` lists for the status page.
fn limit_lines(rules: &crate::rules::RuleSet) -> Vec<DomainLimits> {
    let mut domains: Vec<_> = rules.domains().collect();
    domains.sort_by(|a, b| a.name.cmp(&b.name));
    let mut listed = Vec::new();
    for d in domains {
        let mut rules = Vec::new();
        for rule in d.rules() {
            let flags = format!(
                "shadow_mode: {}, quota_mode: {}",
                rule.shadow_mode, rule.quota_mode
            );
            let mut lines = Vec::new();
            if rule.unlimited {
                lines.push(format!("unlimited, {flags}"));
            }
            for t in &rule.tiers {
                lines.push(format!("{}, {flags}{}", tier_line(t), tier_extras(t)));
            }
            if let Some(plan_ref) = &rule.plan {
                for plan in d.plans() {
                    if plan.unlimited {
                        lines.push(format!("plan {}: unlimited, {flags}", plan.name));
                        continue;
                    }
                    for t in plan.groups.get(&plan_ref.group).into_iter().flatten() {
                        lines.push(format!(
                            "plan {}: {}, {flags}{}",
                            plan.name,
                            tier_line(t),
                            tier_extras(t)
                        ));
                    }
                }
            }
            if !lines.is_empty() {
                rules.push((rule.path.clone(), lines));
            }
        }
        if !rules.is_empty() {
            listed.push((d.name.clone(), rules));
        }
    }
    listed
}

/// `unit=MINUTE requests_per_unit=20`, as the reference prints a limit; a concurrency limit as
/// `concurrency limit=3 max_hold=120s`.
fn tier_line(t: &crate::rules::Tier) -> String {
    if t.limit.algorithm.holds_slots() {
        return format!(
            "concurrency limit={} max_hold={:?}",
            t.requests_per_unit,
            std::time::Duration::from_micros(t.limit.period_us)
        );
    }
    let multiplier = if t.unit_multiplier == 1 {
        String::new()
    } else {
        format!(" unit_multiplier={}", t.unit_multiplier)
    };
    format!(
        "unit={}{multiplier} requests_per_unit={}",
        t.unit, t.requests_per_unit
    )
}

/// What sluice adds after the reference's fields: the algorithm, a burst, a calendar, the name.
fn tier_extras(t: &crate::rules::Tier) -> String {
    let burst = if t.limit.algorithm.has_burst() {
        format!(" burst={}", t.limit.burst)
    } else {
        String::new()
    };
    let name = t
        .name
        .as_deref()
        .map(|n| format!(", name: {n}"))
        .unwrap_or_default();
    let calendar = t
        .limit
        .calendar
        .map(|c| format!(" calendar={}", c.zone_name()))
        .unwrap_or_default();
    format!(", algorithm: {}{burst}{calendar}{name}", t.limit.algorithm)
}

/// What the rules reloads did: when the serving rules were loaded, counts, and the last
/// rejected reload's errors.
async fn config_status<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let rules = state.service.engine().rules();
    let seconds = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    };
    // The loaded rules, by domain then rule, each with its limits as /rlconfig words them.
    let loaded: Vec<serde_json::Value> = limit_lines(&rules)
        .into_iter()
        .map(|(domain, rules)| {
            let rules: Vec<serde_json::Value> = rules
                .into_iter()
                .map(|(rule, limits)| serde_json::json!({"rule": rule, "limits": limits}))
                .collect();
            serde_json::json!({"domain": domain, "rules": rules})
        })
        .collect();
    let mut body = match &state.reloader {
        Some(r) => {
            let s = r.status();
            serde_json::json!({
                "path": r.path().map(|p| p.display().to_string()),
                "source": r.source(),
                "domains": rules.domain_count(),
                "rules": rules.rule_count(),
                "loaded_at": s.loaded_at.map(seconds),
                "reloads_ok": s.reloads_ok,
                "reloads_failed": s.reloads_failed,
                "last_error": s.last_error.as_ref().map(|(_, e)| e),
                "last_error_at": s.last_error.as_ref().map(|(t, _)| seconds(*t)),
            })
        }
        None => serde_json::json!({
            "domains": rules.domain_count(),
            "rules": rules.rule_count(),
        }),
    };
    body["loaded"] = serde_json::Value::Array(loaded);
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// Liveness for Kubernetes: the process answers. It asks nothing of the backend or the drain, so
/// a node that starts while Redis is down (serving by its failure policy) or that is draining is
/// never restarted for it; readiness (`/readyz`) is what takes such a node out of rotation.
async fn livez() -> &'static str {
    "OK\n"
}

/// The reference service's health check (Envoy Gateway's every probe): see
/// [`Readiness::healthy`](crate::readiness::Readiness::healthy).
async fn healthcheck<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let now = state.gate.now();
    if now.healthy() {
        (StatusCode::OK, "OK\n").into_response()
    } else if now == crate::readiness::Readiness::Draining {
        (StatusCode::SERVICE_UNAVAILABLE, "NOT SERVING\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT SERVING: the rate limit backend has not been reached yet\n",
        )
            .into_response()
    }
}

/// Prometheus text format; 404 when metrics are off.
async fn metrics<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let Some(metrics) = state.service.metrics() else {
        return (StatusCode::NOT_FOUND, "metrics are off\n").into_response();
    };
    let engine = state.service.engine();
    let status = state.upkeep.report();
    let gauges = Gauges {
        keys_in_memory: status.keys_in_memory,
        breaker_state: status.breaker.map(|b| b.gauge()),
        lease_hits_held: status.lease_hits_held,
        rules_loaded: engine.rules().rule_count(),
        last_reload_unix: state
            .reloader
            .as_ref()
            .and_then(|r| r.status().loaded_at)
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs()),
        most_limited: state
            .service
            .top()
            .map(|top| {
                top.snapshot(5)
                    .into_iter()
                    .flat_map(|t| {
                        t.entries
                            .into_iter()
                            .map(|e| {
                                let value = shown(&e.value, state.reveal);
                                (t.domain.clone(), t.rule.clone(), value, e.denials.round())
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect()
            })
            .unwrap_or_default(),
    };
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render(gauges, &engine.rules()),
    )
        .into_response()
}

/// Readiness (see [`crate::readiness`]), with the reason in the body.
async fn readyz<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let now = state.gate.now();
    let code = if now.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, format!("{}\n", now.reason())).into_response()
}

/// 200 for OK, 429 for OVER_LIMIT, 400 for a bad request, 503 when the store cannot answer.
async fn json_call<S: Store>(State(state): State<Arc<AdminState<S>>>, body: Bytes) -> Response {
    let request = match json::parse_request(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    match state.service.handle(request).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (status, axum::Json(json::render_response(&response))).into_response()
        }
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response()
        }
        Err(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", s.message()),
        )
            .into_response(),
    }
}
