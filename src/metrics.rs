//! Prometheus metrics (`GET /metrics`). Names are `sluice_*`, counters end in `_total`, times are
//! in seconds. Per-rule series are labelled by domain and rule path; descriptor values appear in
//! labels only for rules with `detailed_metric`/`value_to_metric`, and those series are capped
//! (`--metrics-max-series`): past the cap they are counted under `rule="_other_"`.
//!
//! With [`Metrics::with_reference_names`], the same decisions are also counted under the names
//! Envoy Gateway's dashboard reads from the Go reference service
//! (`ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,within_limit,shadow_mode}`
//! with `domain`, `key1`, `key2`), in a registry of their own served on a listener of its own
//! (`--reference-metrics-addr`, the reference's `PROMETHEUS_ADDR`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::engine::{Code, Decision, Status};
use crate::rules::{RuleSet, Tier};
use crate::store::{BackendObserver, StoreError};

/// How a call ended, for `sluice_should_rate_limit_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    Ok,
    OverLimit,
    Invalid,
    Error,
}

impl CallResult {
    pub fn label(self) -> &'static str {
        match self {
            CallResult::Ok => "ok",
            CallResult::OverLimit => "over_limit",
            CallResult::Invalid => "invalid",
            CallResult::Error => "error",
        }
    }
}

/// Gauges read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub keys_in_memory: Option<usize>,
    /// 0 closed, 1 open, 2 half-open; None without a remote backend.
    pub breaker_state: Option<i64>,
    /// Hits this node holds in quota leases (hybrid mode); None without a remote backend.
    pub lease_hits_held: Option<u64>,
    pub rules_loaded: usize,
    pub last_reload_unix: Option<u64>,
    /// The most-denied values per rule (`crate::top`), values as shown: (domain, rule, value,
    /// denials).
    pub most_limited: Vec<(String, String, String, f64)>,
}

pub struct Metrics {
    registry: Registry,
    trace_spans: IntCounterVec,
    trace_export_failures: IntCounter,
    rule_hits: IntCounterVec,
    rule_over_limit: IntCounterVec,
    rule_near_limit: IntCounterVec,
    rule_within_limit: IntCounterVec,
    rule_shadow_mode: IntCounterVec,
    rule_failure_policy: IntCounterVec,
    call_seconds: Histogram,
    backend_seconds: Histogram,
    backend_errors: IntCounterVec,
    breaker_state: IntGauge,
    reloads: IntCounterVec,
    last_reload: IntGauge,
    rules_loaded: IntGauge,
    keys: IntGauge,
    lease_hits: IntGauge,
    /// Each limit of the rules now serving, and its window: usage against limit on a dashboard.
    rule_limit: IntGaugeVec,
    rule_window: IntGaugeVec,
    /// The most-denied values per rule, set at each scrape.
    top_denials: prometheus::GaugeVec,
    /// Held from setting the limit gauges until they are encoded: a scrape never sees another's
    /// reset.
    rendering: Mutex<()>,
    near_limit_ratio: f64,
    max_series: usize,
    detailed_series: Mutex<HashSet<(String, String)>>,
    /// domain → rule → its counters.
    rule_cache: RwLock<RuleCache>,
    /// `calls` by result, in `CallResult` order.
    call_counters: [IntCounter; 4],
    /// The reference's names, when asked for.
    reference: Option<ReferenceNames>,
    quota: QuotaMetrics,
}

/// The Rate Limit Quota Service's metrics (`sluice_rlqs_*`). Domain labels only name configured
/// domains, so an Envoy cannot grow the series.
struct QuotaMetrics {
    streams: IntGauge,
    buckets: IntGauge,
    assignments: IntCounterVec,
    granted: IntCounterVec,
    returned: IntCounterVec,
    reported: IntCounterVec,
    refused: IntCounterVec,
}

impl QuotaMetrics {
    fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            registered(registry, IntCounterVec::new(Opts::new(name, help), labels))
        };
        let quota = Self {
            streams: registered(
                registry,
                IntGauge::new(
                    "sluice_rlqs_streams",
                    "RLQS streams open (one per Envoy and domain).",
                ),
            ),
            buckets: registered(
                registry,
                IntGauge::new("sluice_rlqs_buckets", "RLQS buckets the open streams hold."),
            ),
            assignments: counter(
                "sluice_rlqs_assignments_total",
                "RLQS actions sent, by kind (token_bucket: a fresh grant; renewal: a longer time to live; allow_all; deny_all; abandon).",
                &["kind"],
            ),
            granted: counter(
                "sluice_rlqs_tokens_granted_total",
                "Tokens granted to Envoys, drawn from the counters.",
                &["domain"],
            ),
            returned: counter(
                "sluice_rlqs_tokens_returned_total",
                "Tokens of ended grants the Envoys' reports proved unspent, given back to every limit whose window was still open.",
                &["domain"],
            ),
            reported: counter(
                "sluice_rlqs_requests_reported_total",
                "Requests the Envoys reported, by what they did with them (allowed, denied).",
                &["domain", "result"],
            ),
            refused: counter(
                "sluice_rlqs_refused_total",
                "RLQS reports or buckets refused, by reason.",
                &["reason"],
            ),
        };
        for kind in [
            "token_bucket",
            "renewal",
            "allow_all",
            "deny_all",
            "abandon",
        ] {
            quota.assignments.with_label_values(&[kind]);
        }
        quota
    }
}

impl Metrics {
    /// ShouldRateLimit calls so far by result: ok, over_limit, invalid, error (the status page
    /// makes rates of them).
    pub fn calls(&self) -> [u64; 4] {
        self.call_counters.each_ref().map(|c| c.get())
    }
}

impl crate::rlqs::QuotaObserver for Metrics {
    fn stream_opened(&self) {
        self.quota.streams.inc();
    }

    fn stream_closed(&self) {
        self.quota.streams.dec();
    }

    fn buckets(&self, delta: i64) {
        self.quota.buckets.add(delta);
    }

    fn assigned(&self, kind: crate::rlqs::AssignmentKind) {
        self.quota
            .assignments
            .with_label_values(&[kind.label()])
            .inc();
    }

    fn granted(&self, domain: &str, tokens: u64) {
        self.quota
            .granted
            .with_label_values(&[domain])
            .inc_by(tokens);
    }

    fn returned(&self, domain: &str, tokens: u64) {
        self.quota
            .returned
            .with_label_values(&[domain])
            .inc_by(tokens);
    }

    fn reported(&self, domain: &str, allowed: u64, denied: u64) {
        for (result, n) in [("allowed", allowed), ("denied", denied)] {
            self.quota
                .reported
                .with_label_values(&[domain, result])
                .inc_by(n);
        }
    }

    fn refused(&self, why: crate::rlqs::Refusal) {
        self.quota.refused.with_label_values(&[why.label()]).inc();
    }
}

/// The reference service's per-rule counters, as Envoy Gateway's statsd mapping names them.
struct ReferenceNames {
    registry: Registry,
    total_hits: IntCounterVec,
    over_limit: IntCounterVec,
    near_limit: IntCounterVec,
    within_limit: IntCounterVec,
    shadow_mode: IntCounterVec,
}

/// One counter, and its twin under the reference's name when those are on.
struct Tally {
    ours: IntCounter,
    reference: Option<IntCounter>,
}

impl Tally {
    fn inc_by(&self, n: u64) {
        self.ours.inc_by(n);
        if let Some(r) = &self.reference {
            r.inc_by(n);
        }
    }
}

/// `key1` and `key2` of a rule path (`key_value.key2_value2...`): its first part, and the rest
/// (the reference's statsd mapping gives one or two levels; deeper paths keep the rest in
/// `key2` rather than vanish from the dashboard).
fn reference_keys(rule: &str) -> (&str, &str) {
    rule.split_once('.').unwrap_or((rule, ""))
}

type RuleCache = HashMap<String, HashMap<Arc<str>, Arc<RuleCounters>>>;

/// One rule's counters, resolved from the vectors once.
struct RuleCounters {
    hits: Tally,
    over_limit: Tally,
    near_limit: Tally,
    within_limit: Tally,
    shadow_mode: Tally,
    failure_policy: IntCounter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// A metric made from constant names and registered once in `registry`: neither can fail at
/// run time, so a failure is a programming error caught by every test that builds `Metrics`.
fn registered<C>(registry: &Registry, made: prometheus::Result<C>) -> C
where
    C: prometheus::core::Collector + Clone + 'static,
{
    let metric = made.expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("registered once");
    metric
}

impl Metrics {
    pub fn new(near_limit_ratio: f64, max_series: usize) -> Self {
        let registry = Registry::new();
        let rule = |name: &str, help: &str| {
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), &["domain", "rule"]),
            )
        };
        let rule_hits = rule("sluice_rule_hits_total", "Hits checked against the rule.");
        let rule_over_limit = rule(
            "sluice_rule_over_limit_total",
            "Hits denied by the rule (shadow-mode rules excluded).",
        );
        let rule_near_limit = rule(
            "sluice_rule_near_limit_total",
            "Hits allowed at or above --near-limit-ratio of the limit.",
        );
        let rule_within_limit = rule(
            "sluice_rule_within_limit_total",
            "Hits allowed below --near-limit-ratio of the limit.",
        );
        let rule_shadow_mode = rule(
            "sluice_rule_shadow_mode_total",
            "Hits a shadow-mode rule would have denied.",
        );
        let rule_failure_policy = rule(
            "sluice_rule_failure_policy_total",
            "Hits decided by the failure policy because the backend could not answer.",
        );
        let calls = IntCounterVec::new(
            Opts::new(
                "sluice_should_rate_limit_total",
                "ShouldRateLimit calls by result.",
            ),
            &["result"],
        )
        .expect("valid metric");
        let latency = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
                .expect("valid metric")
        };
        let call_seconds = latency(
            "sluice_should_rate_limit_duration_seconds",
            "Time to answer a ShouldRateLimit call.",
        );
        let backend_seconds = latency(
            "sluice_backend_call_duration_seconds",
            "Time of one call to the rate limit backend (Redis).",
        );
        let backend_errors = IntCounterVec::new(
            Opts::new(
                "sluice_backend_errors_total",
                "Backend calls that failed, by kind.",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let gauge = |name: &str, help: &str| registered(&registry, IntGauge::new(name, help));
        let breaker_state = gauge(
            "sluice_circuit_breaker_state",
            "The backend circuit breaker: 0 closed, 1 open, 2 half-open.",
        );
        let last_reload = gauge(
            "sluice_rules_last_reload_timestamp_seconds",
            "When the rules now serving were loaded (Unix time).",
        );
        let rules_loaded = gauge(
            "sluice_rules_loaded",
            "Rules loaded (a rule with several limits counts once).",
        );
        let keys = gauge(
            "sluice_memory_keys",
            "Counters held in this process's memory.",
        );
        let lease_hits = gauge(
            "sluice_lease_hits_held",
            "Hits this node holds in quota leases (mode: hybrid): taken from Redis, not yet admitted.",
        );
        let limit_gauge = |name: &str, help: &str| {
            let labels = ["domain", "rule", "plan", "tier"];
            registered(&registry, IntGaugeVec::new(Opts::new(name, help), &labels))
        };
        let rule_limit = limit_gauge(
            "sluice_rule_limit",
            "Requests each limit of a rule allows per window (tier: its name, or its place in the rule; plan: the caller's plan, empty for the rule's own limits).",
        );
        let rule_window = limit_gauge(
            "sluice_rule_limit_window_seconds",
            "The window of each limit of a rule, in seconds (the rate is sluice_rule_limit / this).",
        );
        let top_denials = registered(
            &registry,
            prometheus::GaugeVec::new(
                Opts::new(
                    "sluice_top_denials",
                    "Denials of each rule's most-denied descriptor values (the five per rule GET /top shows first), counts halving every minute; values masked unless --show-descriptor-values.",
                ),
                &["domain", "rule", "value"],
            ),
        );
        let reloads = IntCounterVec::new(
            Opts::new("sluice_rules_reloads_total", "Rules reloads by result."),
            &["result"],
        )
        .expect("valid metric");
        for c in [
            Box::new(calls.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(call_seconds.clone()),
            Box::new(backend_seconds.clone()),
            Box::new(backend_errors.clone()),
            Box::new(reloads.clone()),
        ] {
            registry.register(c).expect("registered once");
        }
        // Series that exist from the start, so dashboards and alerts see zeros, not gaps.
        let call_counters = [
            CallResult::Ok,
            CallResult::OverLimit,
            CallResult::Invalid,
            CallResult::Error,
        ]
        .map(|r| calls.with_label_values(&[r.label()]));
        for result in ["success", "failure"] {
            reloads.with_label_values(&[result]);
        }
        for kind in ["timeout", "unavailable", "circuit_open"] {
            backend_errors.with_label_values(&[kind]);
        }
        let quota = QuotaMetrics::new(&registry);
        let trace_spans = registered(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "sluice_trace_spans_total",
                    "Finished spans by what became of them: exported over OTLP, or dropped (the export queue full, or the export failed). Zero while traces are off.",
                ),
                &["outcome"],
            ),
        );
        for outcome in ["exported", "dropped"] {
            trace_spans.with_label_values(&[outcome]);
        }
        let trace_export_failures = registered(
            &registry,
            IntCounter::new(
                "sluice_trace_export_failures_total",
                "Exports to the OTLP endpoint that failed or timed out.",
            ),
        );
        Self {
            quota,
            trace_spans,
            trace_export_failures,
            registry,
            rule_hits,
            rule_over_limit,
            rule_near_limit,
            rule_within_limit,
            rule_shadow_mode,
            rule_failure_policy,
            call_seconds,
            backend_seconds,
            backend_errors,
            breaker_state,
            reloads,
            last_reload,
            rules_loaded,
            keys,
            lease_hits,
            rule_limit,
            rule_window,
            top_denials,
            rendering: Mutex::new(()),
            near_limit_ratio,
            max_series,
            detailed_series: Mutex::new(HashSet::new()),
            rule_cache: RwLock::new(HashMap::new()),
            call_counters,
            reference: None,
        }
    }

    /// Also counts decisions under the reference service's names ([`Metrics::render_reference`]).
    pub fn with_reference_names(mut self) -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &["domain", "key1", "key2"])
                .expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("registered once");
            c
        };
        let name = |what: &str| format!("ratelimit_service_rate_limit_{what}");
        self.reference = Some(ReferenceNames {
            total_hits: counter(&name("total_hits"), "Hits checked against the rule."),
            over_limit: counter(&name("over_limit"), "Hits denied by the rule."),
            near_limit: counter(&name("near_limit"), "Hits allowed near the limit."),
            within_limit: counter(
                &name("within_limit"),
                "Hits allowed below the near-limit ratio.",
            ),
            shadow_mode: counter(
                &name("shadow_mode"),
                "Hits a shadow-mode rule would have denied.",
            ),
            registry,
        });
        self
    }

    /// The reference's names in the text format; None when they are off.
    pub fn render_reference(&self) -> Option<String> {
        let reference = self.reference.as_ref()?;
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&reference.registry.gather(), &mut out);
        Some(String::from_utf8(out).unwrap_or_default())
    }

    /// One ShouldRateLimit call.
    pub fn observe_call(
        &self,
        domain: &str,
        result: CallResult,
        took: Duration,
        decision: Option<&Decision>,
    ) {
        self.call_counters[result as usize].inc();
        self.call_seconds.observe(took.as_secs_f64());
        let Some(decision) = decision else { return };
        for status in &decision.statuses {
            self.observe_status(domain, status, decision.decided_by.is_policy());
        }
    }

    fn observe_status(&self, domain: &str, status: &Status, by_policy: bool) {
        let (Some(stats), Some(limit)) = (&status.stats, &status.limit) else {
            return;
        };
        let rule = if stats.detailed && !self.admit_series(domain, &stats.rule) {
            "_other_"
        } else {
            &stats.rule
        };
        let counters = self.rule_counters(domain, rule);
        let hits = stats.hits;
        counters.hits.inc_by(hits);
        if by_policy {
            counters.failure_policy.inc_by(hits);
        }
        if stats.shadow_denied {
            counters.shadow_mode.inc_by(hits);
        } else if status.code == Code::OverLimit {
            counters.over_limit.inc_by(hits);
        } else {
            // The hits that landed at or above the near-limit threshold.
            let limit = u64::from(limit.requests_per_unit);
            let threshold = (limit as f64 * self.near_limit_ratio).floor() as u64;
            let used_after = limit.saturating_sub(status.remaining);
            let near = used_after.saturating_sub(threshold).min(hits);
            if near > 0 {
                counters.near_limit.inc_by(near);
            }
            if hits > near {
                counters.within_limit.inc_by(hits - near);
            }
        }
    }

    /// A rule's counters, looked up once per status (the label lookups of the counter vectors
    /// cost several times more, per counter).
    fn rule_counters(&self, domain: &str, rule: &str) -> Arc<RuleCounters> {
        {
            let cache = self.rule_cache.read().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = cache.get(domain).and_then(|rules| rules.get(rule)) {
                return c.clone();
            }
        }
        let labels = [domain, rule];
        let (key1, key2) = reference_keys(rule);
        let reference_labels = [domain, key1, key2];
        let tally = |ours: &IntCounterVec, pick: fn(&ReferenceNames) -> &IntCounterVec| Tally {
            ours: ours.with_label_values(&labels),
            reference: self
                .reference
                .as_ref()
                .map(|r| pick(r).with_label_values(&reference_labels)),
        };
        let counters = Arc::new(RuleCounters {
            hits: tally(&self.rule_hits, |r| &r.total_hits),
            over_limit: tally(&self.rule_over_limit, |r| &r.over_limit),
            near_limit: tally(&self.rule_near_limit, |r| &r.near_limit),
            within_limit: tally(&self.rule_within_limit, |r| &r.within_limit),
            shadow_mode: tally(&self.rule_shadow_mode, |r| &r.shadow_mode),
            failure_policy: self.rule_failure_policy.with_label_values(&labels),
        });
        let mut cache = self.rule_cache.write().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(domain.to_owned())
            .or_default()
            .entry(Arc::from(rule))
            .or_insert(counters)
            .clone()
    }

    /// Whether a detailed (value-carrying) series may be created or already exists.
    fn admit_series(&self, domain: &str, rule: &str) -> bool {
        let mut series = self
            .detailed_series
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = (domain.to_owned(), rule.to_owned());
        if series.contains(&key) {
            return true;
        }
        if series.len() >= self.max_series {
            return false;
        }
        series.insert(key);
        true
    }

    /// One call to the backend; `error` names its kind when it failed.
    pub fn observe_backend(&self, took: Duration, error: Option<&StoreError>) {
        self.backend_seconds.observe(took.as_secs_f64());
        if let Some(e) = error {
            self.backend_errors.with_label_values(&[e.label()]).inc();
        }
    }

    pub fn observe_reload(&self, ok: bool) {
        self.reloads
            .with_label_values(&[if ok { "success" } else { "failure" }])
            .inc();
    }

    /// The limit gauges, for the rules now serving: a series per limit (a rule with a plan has one
    /// per plan); limits of rules that are gone go with them.
    fn set_limits(&self, rules: &RuleSet) {
        self.rule_limit.reset();
        self.rule_window.reset();
        let set = |domain: &str, rule: &str, plan: &str, tiers: &[Tier]| {
            for (i, t) in tiers.iter().enumerate() {
                let place = i.to_string();
                let tier = t.name.as_deref().unwrap_or(&place);
                let labels = [domain, rule, plan, tier];
                self.rule_limit
                    .with_label_values(&labels)
                    .set(i64::from(t.requests_per_unit));
                let window = t.limit.period_us / crate::clock::MICROS_PER_SECOND;
                self.rule_window
                    .with_label_values(&labels)
                    .set(i64::try_from(window).unwrap_or(i64::MAX));
            }
        };
        for d in rules.domains() {
            for rule in d.rules() {
                set(&d.name, &rule.label, "", &rule.tiers);
                let Some(plan_ref) = &rule.plan else { continue };
                for plan in d.plans() {
                    if let Some(tiers) = plan.groups.get(&plan_ref.group) {
                        set(&d.name, &rule.label, &plan.name, tiers);
                    }
                }
            }
        }
    }

    /// The text exposition, with gauges read now and the limits of `rules`.
    pub fn render(&self, gauges: Gauges, rules: &RuleSet) -> String {
        let _rendering = self.rendering.lock().unwrap_or_else(|e| e.into_inner());
        self.set_limits(rules);
        if let Some(k) = gauges.keys_in_memory {
            self.keys.set(k as i64);
        }
        if let Some(b) = gauges.breaker_state {
            self.breaker_state.set(b);
        }
        if let Some(h) = gauges.lease_hits_held {
            self.lease_hits.set(i64::try_from(h).unwrap_or(i64::MAX));
        }
        self.rules_loaded.set(gauges.rules_loaded as i64);
        self.top_denials.reset();
        for (domain, rule, value, denials) in &gauges.most_limited {
            self.top_denials
                .with_label_values(&[domain.as_str(), rule.as_str(), value.as_str()])
                .set(*denials);
        }
        if let Some(t) = gauges.last_reload_unix {
            self.last_reload.set(t as i64);
        }
        if let Some(counts) = crate::trace::counts() {
            use std::sync::atomic::Ordering::Relaxed;
            let catch_up = |c: &IntCounter, now: u64| c.inc_by(now.saturating_sub(c.get()));
            catch_up(
                &self.trace_spans.with_label_values(&["exported"]),
                counts.exported.load(Relaxed),
            );
            catch_up(
                &self.trace_spans.with_label_values(&["dropped"]),
                counts.dropped.load(Relaxed),
            );
            catch_up(
                &self.trace_export_failures,
                counts.failed_exports.load(Relaxed),
            );
        }
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl BackendObserver for Metrics {
    fn backend_call(&self, took: Duration, error: Option<&StoreError>) {
        self.observe_backend(took, error);
    }
}

impl crate::rules::reload::ReloadObserver for Metrics {
    fn reload(&self, ok: bool) {
        self.observe_reload(ok);
    }
}
