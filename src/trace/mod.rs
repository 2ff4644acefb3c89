//! Traces: each decision a span in the caller's trace, exported over OTLP (OpenTelemetry).
//!
//! **Why.** When a request gets a 429 or is slow, an operator opens its trace. Envoy traces the
//! request and its call to the rate limit service; the service's own span says what happened
//! there: which descriptor and limit decided, whether the counters or the failure policy did,
//! and how long Redis took. The reference service exports these (Envoy Gateway turns it on with
//! `TRACING_ENABLED`), so a drop-in replacement must too.
//!
//! **Shape.** The code opens `tracing` spans; the ones meant for traces declare an `otel.kind`,
//! and only those (and warnings inside them) reach OpenTelemetry, through
//! `tracing-opentelemetry`'s layer ([`Tracing::layer`]). The caller's context comes from the
//! call's headers (`propagation`: W3C or B3), and its sampling decision is followed. Finished
//! spans leave through a bounded queue (`export`) that a worker on the server's runtime empties,
//! so a collector that is down or slow costs a decision nothing; what is dropped is counted.
//!
//! **Free when off.** With no endpoint configured ([`config`]) nothing is built: [`on`] is one
//! relaxed load, and every span helper here returns `Span::none()` without reading a header.
//! When on, a call whose caller did not sample opens no span at all.

mod config;
mod export;
mod propagation;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};
use tonic::codegen::http;

use opentelemetry::trace::{
    SpanContext, SpanKind, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use config::{Protocol, Sampling, TraceConfig, TraceConfigError, from_env};
pub use export::{BATCH_DELAY, BATCH_SPANS, Counts, QUEUE_SPANS};
pub use propagation::{Caller, caller};

static ON: AtomicBool = AtomicBool::new(false);
/// The sampler follows the caller's decision.
static PARENT_BASED: AtomicBool = AtomicBool::new(true);
/// The share of traces this node starts (or, not parent-based, of every call), as a fraction
/// of `u64::MAX`: decided here before a span is opened, so a call not sampled costs nothing.
static ROOT_SHARE: AtomicU64 = AtomicU64::new(u64::MAX);
static COUNTS: OnceLock<Arc<Counts>> = OnceLock::new();
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Whether spans are exported (a configured endpoint).
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// What the export queue did; None when traces are off.
pub fn counts() -> Option<&'static Counts> {
    COUNTS.get().map(Arc::as_ref)
}

/// The exporting pipeline: the SDK's provider and the queue's worker.
pub struct Tracing {
    provider: SdkTracerProvider,
    worker: Option<export::Worker>,
}

impl Tracing {
    /// Builds the pipeline for `config` and turns [`on`] on. Nothing connects until the worker
    /// runs (see [`Tracing::worker`]). Once per process.
    pub fn new(config: &TraceConfig) -> Self {
        let counts = COUNTS.get_or_init(Arc::default).clone();
        let (protocol, endpoint, timeout) =
            (config.protocol, config.endpoint.clone(), config.timeout);
        let resource = Resource::builder_empty()
            .with_attributes(
                config
                    .resource
                    .iter()
                    .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
            )
            .build();
        let exporter_resource = resource.clone();
        let (queue, worker) = export::pair(
            move || {
                use opentelemetry_sdk::trace::SpanExporter as _;
                let built = match protocol {
                    Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                        .with_tonic()
                        .with_endpoint(endpoint.clone())
                        .with_timeout(timeout)
                        .build(),
                    Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                        .with_http()
                        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                        .with_endpoint(endpoint.clone())
                        .with_timeout(timeout)
                        .build(),
                };
                match built {
                    Ok(mut exporter) => {
                        exporter.set_resource(&exporter_resource);
                        tracing::info!(%endpoint, ?protocol, "exporting traces over OTLP");
                        Some(exporter)
                    }
                    Err(e) => {
                        tracing::error!(error = %e, %endpoint, "trace exporter not built; spans are dropped");
                        None
                    }
                }
            },
            counts,
            timeout,
        );
        let (parent_based, root) = match &config.sampling {
            Sampling::ParentBased(root) => (true, root.as_ref()),
            root => (false, root),
        };
        let share = match root {
            Sampling::AlwaysOn | Sampling::ParentBased(_) => 1.0,
            Sampling::AlwaysOff => 0.0,
            Sampling::Ratio(r) => *r,
        };
        PARENT_BASED.store(parent_based, Ordering::Relaxed);
        // `as` saturates: 1.0 is every call.
        ROOT_SHARE.store((share * u64::MAX as f64) as u64, Ordering::Relaxed);
        // The decision is made before a span opens (`parent`): every span the SDK sees is kept.
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(resource)
            .build();
        let _ = TRACER.set(provider.tracer("sluice"));
        ON.store(true, Ordering::Relaxed);
        Self {
            provider,
            worker: Some(worker),
        }
    }

    /// The layer that makes `tracing` spans declaring an `otel.kind` OpenTelemetry spans.
    pub fn layer(
        &self,
    ) -> Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync> {
        use tracing_subscriber::Layer as _;
        let layer = tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("sluice"))
            .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                m.target().starts_with("sluice")
                    && if m.is_span() {
                        m.fields().field("otel.kind").is_some()
                    } else {
                        *m.level() <= tracing::Level::WARN
                    }
            }));
        Box::new(layer)
    }

    /// The queue's worker, to run on the server's runtime (taken once).
    pub fn worker(&mut self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        self.worker.take()
    }

    /// Ends the pipeline: the queue closes, and the worker sends what is left, for at most
    /// `bound` (the worker's task is given by whoever ran it).
    pub async fn stop(self, worker: Option<tokio::task::JoinHandle<()>>, bound: Duration) {
        ON.store(false, Ordering::Relaxed);
        let _ = self.provider.shutdown_with_timeout(bound);
        if let Some(worker) = worker
            && tokio::time::timeout(bound, worker).await.is_err()
        {
            tracing::warn!("spans not yet exported at the stop were dropped");
        }
    }
}

/// The caller's span to be the parent of ours, or None when ours is not to be opened: the
/// sampling decision, made here so that a call not sampled opens nothing (the SDK's samplers
/// decide once a span is built, after the work). Parent-based: the caller's decision, else this
/// node's share; otherwise this node's share of every call. The share is drawn at random, not
/// from the trace id: a trace this node starts is decided nowhere else.
fn parent(headers: &http::HeaderMap) -> Option<Option<SpanContext>> {
    let parent_based = PARENT_BASED.load(Ordering::Relaxed);
    let (decided, parent) = match caller(headers) {
        Caller::Span(s) if parent_based => (Some(s.is_sampled()), Some(s)),
        Caller::Span(s) => (None, Some(s)),
        Caller::Unsampled if parent_based => (Some(false), None),
        Caller::Unsampled | Caller::Untraced => (None, None),
    };
    let sampled = decided.unwrap_or_else(|| {
        let share = ROOT_SHARE.load(Ordering::Relaxed);
        share == u64::MAX || (share != 0 && draw() < share)
    });
    sampled.then_some(parent)
}

/// A random u64 (xorshift, per thread, seeded from the clock and the thread): for sampling
/// only.
fn draw() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let t = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let here = &t as *const u64 as u64;
            (t ^ here.rotate_left(32)) | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

/// The context a span of ours starts in: the caller's span, or none (a trace of its own).
fn context_of(parent: Option<SpanContext>) -> Context {
    parent.map_or_else(Context::new, |p| Context::new().with_remote_span_context(p))
}

fn with_parent(span: tracing::Span, parent: Option<SpanContext>) -> tracing::Span {
    if parent.is_some() {
        let _ = span.set_parent(context_of(parent));
    }
    span
}

/// The SERVER span of one `ShouldRateLimit` call, child of the caller's span; its decision's
/// fields are recorded by the service as it answers. `Span::none()` when traces are off or the
/// caller did not sample.
pub fn rls_call(headers: &http::HeaderMap) -> tracing::Span {
    if !on() {
        return tracing::Span::none();
    }
    let Some(parent) = parent(headers) else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(
        "ShouldRateLimit",
        otel.name = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "envoy.service.ratelimit.v3.RateLimitService",
        rpc.method = "ShouldRateLimit",
        ratelimit.domain = tracing::field::Empty,
        ratelimit.descriptors = tracing::field::Empty,
        ratelimit.decision = tracing::field::Empty,
        ratelimit.decided_by = tracing::field::Empty,
        ratelimit.descriptor = tracing::field::Empty,
        ratelimit.rule = tracing::field::Empty,
        ratelimit.limit = tracing::field::Empty,
        ratelimit.remaining = tracing::field::Empty,
    );
    with_parent(span, parent)
}

/// The span of one request's checks in a call of the limiter on Redis (child of the current
/// span), and its context for the call's span to link; `Span::none()` when off.
pub fn redis_group(checks: usize) -> (tracing::Span, Option<SpanContext>) {
    if !on() {
        return (tracing::Span::none(), None);
    }
    // Only under a call's span that is being traced: any other current span (a log's) would
    // make this one a trace of its own.
    let current = tracing::Span::current();
    if current.is_none() || !current.context().span().span_context().is_sampled() {
        return (tracing::Span::none(), None);
    }
    let span = tracing::debug_span!(
        "redis group",
        otel.kind = "internal",
        db.system = "redis",
        redis.checks = checks,
    );
    let cx = span.context().span().span_context().clone();
    let cx = cx.is_valid().then_some(cx);
    (span, cx)
}

/// The CLIENT span of one call of the limiter on Redis carrying several requests' groups: child
/// of the first group's span, linked to every group's. `Span::none()` when off or no group was
/// traced.
pub fn redis_call(
    groups: impl IntoIterator<Item = Option<SpanContext>>,
    count: usize,
) -> tracing::Span {
    if !on() {
        return tracing::Span::none();
    }
    let mut traced = groups.into_iter().flatten();
    let Some(first) = traced.next() else {
        return tracing::Span::none();
    };
    let span = tracing::debug_span!(
        "FCALL",
        otel.name = "FCALL sluice batch",
        otel.kind = "client",
        db.system = "redis",
        db.operation.name = "FCALL",
        redis.groups = count,
    );
    let span = with_parent(span, Some(first.clone()));
    span.add_link(first);
    for cx in traced {
        span.add_link(cx);
    }
    span
}

/// A span for an RLQS report that changed assignments: from `started` to now, child of the
/// stream's caller when its headers named one.
pub fn rlqs_report(
    started: SystemTime,
    headers: &http::HeaderMap,
    domain: &str,
    buckets: usize,
    actions: usize,
) {
    let Some(tracer) = TRACER.get().filter(|_| on()) else {
        return;
    };
    let Some(parent) = parent(headers) else {
        return;
    };
    let cx = context_of(parent);
    let mut span = tracer
        .span_builder(
            "envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas report",
        )
        .with_kind(SpanKind::Server)
        .with_start_time(started)
        .with_attributes([
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("ratelimit.domain", domain.to_owned()),
            KeyValue::new("rlqs.buckets_reported", buckets as i64),
            KeyValue::new("rlqs.actions", actions as i64),
        ])
        .start_with_context(tracer, &cx);
    opentelemetry::trace::Span::end(&mut span);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one test that sets the sampling statics (no other reads them).
    #[test]
    fn the_decision_follows_the_caller_and_else_draws_the_share() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = http::HeaderMap::new();
            for (k, v) in pairs {
                map.insert(*k, http::HeaderValue::from_static(v));
            }
            map
        };
        let sampled = headers(&[(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )]);
        let unsampled = headers(&[(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        )]);
        let none = headers(&[]);
        let share = |s: f64| ROOT_SHARE.store((s * u64::MAX as f64) as u64, Ordering::Relaxed);
        PARENT_BASED.store(true, Ordering::Relaxed);
        share(0.0);
        assert!(
            matches!(parent(&sampled), Some(Some(_))),
            "the caller sampled"
        );
        assert_eq!(parent(&unsampled), None, "the caller did not");
        assert_eq!(parent(&headers(&[("b3", "0")])), None);
        assert_eq!(parent(&none), None, "a trace started here: none at 0");
        share(1.0);
        assert_eq!(parent(&none), Some(None), "every one at 1");
        share(0.25);
        let n = 100_000;
        let kept = (0..n).filter(|_| parent(&none).is_some()).count();
        assert!(
            (n * 24 / 100..=n * 26 / 100).contains(&kept),
            "{kept} of {n} at a quarter"
        );
        // Not parent-based: the share of every call, the caller's span still the parent.
        PARENT_BASED.store(false, Ordering::Relaxed);
        share(1.0);
        assert!(matches!(parent(&unsampled), Some(Some(_))));
        share(0.0);
        assert_eq!(parent(&sampled), None);
        PARENT_BASED.store(true, Ordering::Relaxed);
        share(1.0);
    }
}
