//! The fuzz targets' bodies: each drives one of sluice's input surfaces through the real code
//! path and asserts what that surface promises on any input — no panic, no hang, no silently
//! wrong answer: a clear error (a gRPC status that says why, an HTTP 4xx, a refused rule file).
//! `fuzz_targets/*.rs` hand libFuzzer's bytes to these; `tests/fuzz_corpus.rs` runs the same
//! functions on stable over the committed corpus and every finding (`regressions/`).
//!
//! Structured inputs are read from the bytes by [`Input`] (numbers over their whole range, and
//! choices), not with the `arbitrary` crate: a reader this small serves, and the corpus stays
//! plain bytes.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use prost::Message;
use prost::bytes::Bytes;
use sluice::clock::{Clock, ManualClock};
use sluice::engine::{
    Code, Decision, Descriptor, Engine, EngineSettings, ReportedLimit, Request, Status, StatusStats,
};
use sluice::limiter::{self, Algorithm, Limit, State, Update, Verdict};
use sluice::rules::{RuleSet, Unit, load_texts};
use sluice::service::{Answer, HeaderSet, LimitHeaderNames, RateLimitGrpc, RlsServer};
use sluice::store::{DecidedBy, FailureMode, MemoryStore};
use tonic::codegen::{Service, http};

/// The sample rules the doors are fuzzed against: the shipped ones, and one of every kind of
/// limit (every algorithm, tiers, shadow, quota, a cost limit, a concurrency limit, a plan).
const RULES: &[(&str, &str)] = &[
    ("api.yaml", include_str!("../../config/api.yaml")),
    (
        "api-clients.yaml",
        include_str!("../../config/api-clients.yaml"),
    ),
    ("edge.yaml", include_str!("../../config/edge.yaml")),
    ("llm.yaml", include_str!("../../config/llm.yaml")),
    (
        "f.yaml",
        r#"
domain: f
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: s
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
  - key: l
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: sliding_log}
  - key: g
    rate_limits:
      - {unit: second, requests_per_unit: 2, algorithm: gcra, burst: 3, name: fast}
      - {unit: hour, requests_per_unit: 30, algorithm: token_bucket, name: slow}
  - key: z
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: sh
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: q
    quota_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: c
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 100, calendar: Europe/Berlin}
  - key: k
    descriptors:
      - key: r
        concurrency: {limit: 2, max_hold: 30s}
"#,
    ),
];

/// The start of every run's clock: a round hour.
const START_US: u64 = 1_800_000_000_000_000;

fn rules() -> RuleSet {
    load_texts(RULES.iter().copied()).expect("the fuzzers' sample rules load")
}

/// One runtime for every call of a process (libFuzzer calls a target millions of times).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// A memory engine on the sample rules and a manual clock.
fn engine(clock: &Arc<ManualClock>) -> Arc<Engine<MemoryStore>> {
    Arc::new(Engine::new(
        rules(),
        MemoryStore::new(clock.clone(), 100_000),
        EngineSettings::default(),
    ))
}

/// Reads structured values from the front of the fuzzer's bytes; past their end, zeros.
pub struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self(data)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.0 = rest;
        first
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// Any u64: small ones often (one byte), any other in eight.
    pub fn u64(&mut self) -> u64 {
        match self.u8() % 4 {
            0 => u64::from(self.u8()),
            1 => u64::from(self.u8()) << 8 | u64::from(self.u8()),
            2 => u64::MAX - u64::from(self.u8()),
            _ => u64::from_le_bytes(std::array::from_fn(|_| self.u8())),
        }
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.u64() % n }
    }

    pub fn pick<'t, T>(&mut self, from: &'t [T]) -> &'t T {
        &from[self.below(from.len() as u64) as usize]
    }

    /// Up to `max` bytes.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = (self.u8() as usize).min(max).min(self.0.len());
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        taken
    }

    /// A short text: one of `known`, or any bytes (lossy UTF-8).
    pub fn text(&mut self, known: &[&str]) -> String {
        if !known.is_empty() && self.bool() {
            (*self.pick(known)).to_owned()
        } else {
            String::from_utf8_lossy(self.bytes(40)).into_owned()
        }
    }

    /// What is left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

/// A body of the given DATA frames.
struct Frames(VecDeque<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// Everything a body yields, and its trailers.
async fn drain(mut body: tonic::body::Body) -> (Vec<u8>, Option<http::HeaderMap>) {
    let (mut data, mut trailers) = (Vec::new(), None);
    while let Some(frame) =
        std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await
    {
        let Ok(frame) = frame else { break };
        match frame.into_data() {
            Ok(d) => data.extend_from_slice(&d),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    (data, trailers)
}

/// A `ShouldRateLimit` call's bytes through the RLS door (`service::rls`) to its answer, on a
/// memory store: a message well framed, or any body (split over DATA frames), compressed or
/// not. Promise: an answer that decodes, or a gRPC status with a reason — never INTERNAL for
/// what the caller sent.
pub fn rls_door(data: &[u8]) {
    static DOOR: OnceLock<(Arc<ManualClock>, RlsServer<MemoryStore>)> = OnceLock::new();
    let (clock, door) = DOOR.get_or_init(|| {
        let clock = Arc::new(ManualClock::new(START_US));
        let service = RateLimitGrpc::new(
            engine(&clock),
            HeaderSet::parse("retry-after,draft03,ietf,ratelimit").unwrap(),
            None,
        );
        (clock, RlsServer::new(Arc::new(service)))
    });
    let mut input = Input::new(data);
    clock.advance(input.below(120_000_000));
    let framing = input.u8();
    let compressed = framing & 0x80 != 0;
    let message = input.rest();
    let mut body = Vec::new();
    match framing % 4 {
        // A message as Envoy frames it.
        0 | 1 => {
            body.push(0);
            body.extend_from_slice(&(message.len() as u32).to_be_bytes());
            body.extend_from_slice(message);
        }
        // Any bytes.
        _ => body.extend_from_slice(message),
    }
    let split = (framing as usize / 4 % 8) + 1;
    let frames = body
        .chunks(body.len().div_ceil(split).max(1))
        .map(Bytes::copy_from_slice)
        .collect();
    let mut request = http::Request::builder()
        .method("POST")
        .uri("http://sluice/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .header("content-type", "application/grpc");
    if compressed {
        request = request.header("grpc-encoding", "gzip");
    }
    let request = request
        .body(tonic::body::Body::new(Frames(frames)))
        .unwrap();
    let mut door = door.clone();
    runtime().block_on(async {
        let response = door.call(request).await.unwrap();
        let header_status = response
            .headers()
            .get("grpc-status")
            .map(|s| s.to_str().unwrap().to_owned());
        let (bytes, trailers) = drain(response.into_body()).await;
        let status = header_status.or_else(|| {
            trailers.and_then(|t| t.get("grpc-status").map(|s| s.to_str().unwrap().to_owned()))
        });
        let status = status.expect("every answer carries a grpc-status");
        assert_ne!(status, "13", "INTERNAL for what the caller sent");
        if status == "0" {
            assert!(bytes.len() >= 5, "an OK answer carries its message");
            let answer = sluice::proto::RateLimitResponse::decode(&bytes[5..]);
            assert!(answer.is_ok(), "the answer decodes: {answer:?}");
        }
    });
}

fn decision(input: &mut Input<'_>) -> Decision {
    let code = |input: &mut Input<'_>| {
        if input.bool() {
            Code::Ok
        } else {
            Code::OverLimit
        }
    };
    const UNITS: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];
    let n = input.below(6);
    let statuses = (0..n)
        .map(|_| Status {
            code: code(input),
            limit: input.bool().then(|| ReportedLimit {
                requests_per_unit: input.u64() as u32,
                unit: *input.pick(&UNITS),
                unit_multiplier: input.u64() as u32,
                name: input
                    .bool()
                    .then(|| Arc::from(input.text(&["", "per_second", "n\"a\\m'e é"]))),
            }),
            remaining: input.u64(),
            duration_us: input.bool().then(|| input.u64()),
            stats: Some(StatusStats {
                rule: Arc::from("r"),
                detailed: false,
                hits: 1,
                shadow_denied: false,
            }),
            metadata: None,
        })
        .collect();
    Decision {
        code: code(input),
        statuses,
        retry_after_us: input.bool().then(|| input.u64()),
        decided_by: match input.u8() % 4 {
            0 => DecidedBy::Policy(FailureMode::Allow),
            1 => DecidedBy::Policy(FailureMode::Deny),
            2 => DecidedBy::Policy(FailureMode::Local),
            _ => DecidedBy::Counters,
        },
    }
}

/// Differential: the RLS answer's protobuf, written by hand from a decision (`service::answer`),
/// is byte for byte what prost writes for the same message, for any decision (every number over
/// its whole range, any limit name) and header set.
pub fn answer_encoder(data: &[u8]) {
    let mut input = Input::new(data);
    let d = decision(&mut input);
    let headers = HeaderSet {
        retry_after: input.bool(),
        draft03: input.bool(),
        ietf: input.bool(),
        ratelimit: input.bool().then(|| {
            if input.bool() {
                LimitHeaderNames::parse("X-Limit,X-Left,X-Reset").unwrap()
            } else {
                LimitHeaderNames::default()
            }
        }),
    };
    let expected = Answer::Decided(d.clone())
        .into_message(&headers)
        .encode_to_vec();
    let mut written = Vec::new();
    Answer::Decided(d).encode(&headers, &mut written);
    assert_eq!(written, expected, "the hand-written answer is prost's");
}

/// A request of up to four descriptors of entries from `keys` (or any), for `domain`.
fn request(input: &mut Input<'_>, domain: &str, keys: &[&str]) -> Request {
    let n = 1 + input.below(4);
    let descriptors = (0..n)
        .map(|_| {
            let entries = (0..1 + input.below(3))
                .map(|_| {
                    (
                        input.text(keys),
                        input.text(&["v", "acme", "/v1/search/x", "*"]),
                    )
                })
                .collect();
            Descriptor {
                entries,
                hits: input.below(4),
                refund: input.u8().is_multiple_of(8),
                ..Descriptor::default()
            }
        })
        .collect();
    Request {
        domain: domain.to_owned(),
        descriptors,
    }
}

/// A rules file's text through the loader and validator (`rules::load_texts`): refused with
/// errors that name the file, or loaded — and then, differentially, the file as sluice read it
/// written back as YAML (`rules::rewritten`) loads too, to rules that decide a few requests
/// exactly as the text's do.
pub fn rules_yaml(data: &[u8]) {
    let mut input = Input::new(data);
    let requests_seed = input.bytes(64).to_vec();
    let text = String::from_utf8_lossy(input.rest()).into_owned();
    let loaded = load_texts([("fuzz.yaml", text.as_str())]);
    let set = match loaded {
        Err(errors) => {
            assert!(!errors.0.is_empty(), "a refusal says why");
            for e in &errors.0 {
                assert!(e.to_string().starts_with("fuzz.yaml"), "{e}");
            }
            return;
        }
        Ok(set) => set,
    };
    let written = sluice::rules::rewritten(&text).expect("a text that loaded parses");
    let again = load_texts([("fuzz.yaml", written.as_str())])
        .unwrap_or_else(|e| panic!("the file written back does not load: {e}\n{written}"));
    let domains: Vec<String> = set.domains().map(|d| d.name.clone()).collect();
    let clock = Arc::new(ManualClock::new(START_US));
    let one = Engine::new(
        set,
        MemoryStore::new(clock.clone(), 10_000),
        EngineSettings::default(),
    );
    let two = Engine::new(
        again,
        MemoryStore::new(clock.clone(), 10_000),
        EngineSettings::default(),
    );
    let mut input = Input::new(&requests_seed);
    runtime().block_on(async {
        for _ in 0..4 {
            let domain = domains.first().cloned().unwrap_or_else(|| "d".into());
            let r = request(&mut input, &domain, &["k", "key", "api_key", "path"]);
            let (a, b) = (one.decide(&r).await, two.decide(&r).await);
            assert_eq!(
                format!("{a:?}"),
                format!("{b:?}"),
                "the text and the file written back decide alike"
            );
            clock.advance(input.below(5_000_000));
        }
    });
}

/// A stream of RLQS usage reports (several messages, one session, a manual clock with ticks
/// between them): every report answered with actions or refused with a status that says why.
pub fn rlqs_stream(data: &[u8]) {
    use sluice::proto::rlqs::{BucketId, BucketQuotaUsage, RateLimitQuotaUsageReports};
    let mut input = Input::new(data);
    let clock = Arc::new(ManualClock::new(START_US));
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let service = sluice::rlqs::QuotaService::new(
        engine(&clock),
        clock.clone() as Arc<dyn Clock>,
        sluice::rlqs::QuotaOptions {
            max_buckets_per_stream: 8,
            max_buckets: 16,
            ..sluice::rlqs::QuotaOptions::default()
        },
        None,
        stopped,
    );
    runtime().block_on(async {
        let mut session = service.session();
        for _ in 0..8 {
            if input.is_empty() {
                break;
            }
            if input.u8().is_multiple_of(4) {
                clock.advance(input.below(10_000_000));
                let _ = session.tick().await;
                continue;
            }
            let domain = input.text(&["f", "api", "edge", ""]);
            let usages = (0..input.below(4))
                .map(|_| {
                    let bucket = (0..input.below(3))
                        .map(|_| {
                            (
                                input.text(&["a", "g", "k", "r", "api_key"]),
                                input.text(&["v"]),
                            )
                        })
                        .collect();
                    BucketQuotaUsage {
                        bucket_id: input.bool().then_some(BucketId { bucket }),
                        time_elapsed: input.bool().then(|| prost_types::Duration {
                            seconds: input.u64() as i64,
                            nanos: input.u64() as i32,
                        }),
                        num_requests_allowed: input.u64(),
                        num_requests_denied: input.u64(),
                    }
                })
                .collect();
            let reports = RateLimitQuotaUsageReports {
                domain,
                bucket_quota_usages: usages,
            };
            if let Err(status) = session.report(reports).await {
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted
                    ),
                    "{status:?}"
                );
                assert!(!status.message().is_empty());
                return;
            }
        }
    });
}

/// An xDS `RateLimitConfig` resource's bytes (`xds::resource`): decoded and translated to rules,
/// or refused with errors that name the resource.
pub fn xds_resource(data: &[u8]) {
    let mut input = Input::new(data);
    let type_url = if input.u8().is_multiple_of(8) {
        input.text(&[])
    } else {
        "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig".to_owned()
    };
    let resources = vec![prost_types::Any {
        type_url,
        value: input.rest().to_vec(),
    }];
    match sluice::xds::resource::rules_from(&resources, sluice::rules::LoadOptions::default()) {
        Ok(_) => {}
        Err(errors) => {
            // Named by the resource: its place, or once decoded its domain.
            assert!(!errors.0.is_empty());
            for e in &errors.0 {
                assert!(e.to_string().starts_with("xds "), "{e}");
            }
        }
    }
}

/// The reference service's environment as `sluice` reads it when run as `ratelimit`
/// (`cli::reference_env`): any values of its variables translate to settings or are refused with
/// the variable named.
pub fn reference_env(data: &[u8]) {
    const NAMES: [&str; 16] = [
        "PORT",
        "GRPC_PORT",
        "RUNTIME_ROOT",
        "RUNTIME_SUBDIRECTORY",
        "BACKEND_TYPE",
        "REDIS_URL",
        "REDIS_SOCKET_TYPE",
        "REDIS_TYPE",
        "REDIS_POOL_SIZE",
        "LOCAL_CACHE_SIZE_IN_BYTES",
        "NEAR_LIMIT_RATIO",
        "SHADOW_MODE",
        "LIMIT_RESPONSE_HEADERS_ENABLED",
        "EXPIRATION_JITTER_MAX_SECONDS",
        "REDIS_TIMEOUT",
        "CONFIG_TYPE",
    ];
    let mut input = Input::new(data);
    let mut env = std::collections::HashMap::new();
    for _ in 0..input.below(12) {
        let name = input.text(&NAMES);
        let value = input.text(&[
            "true",
            "false",
            "1",
            "redis:6379",
            "tcp",
            "cluster",
            "0.8",
            "-1",
            "10s",
        ]);
        env.insert(name, value);
    }
    if let Err(e) = sluice::cli::reference_env::translate(|k| env.get(k).cloned()) {
        assert!(!e.to_string().is_empty());
    }
}

/// The admin HTTP router (`admin`): `/json` bodies, `/counters` and `/top` queries, the other
/// routes, any method. Promise: an answer below 500 for anything a client sends.
pub fn admin_http(data: &[u8]) {
    static ROUTER: OnceLock<(Arc<ManualClock>, axum::Router)> = OnceLock::new();
    let (clock, router) = ROUTER.get_or_init(|| {
        let clock = Arc::new(ManualClock::new(START_US));
        let config = sluice::store::StoreConfig {
            clocks: sluice::store::Clocks::pinned(clock.clone()),
            ..sluice::store::StoreConfig::new(sluice::store::BackendConfig::Memory)
        };
        let (stack, upkeep) = sluice::store::build(&config).unwrap();
        let engine = Arc::new(Engine::new(rules(), stack, EngineSettings::default()));
        let upkeep = Arc::new(upkeep);
        let service = Arc::new(
            RateLimitGrpc::new(
                engine,
                HeaderSet::parse("retry-after,draft03,ietf,ratelimit").unwrap(),
                None,
            )
            .with_top(Arc::new(sluice::top::TopLimited::new(
                clock.clone() as Arc<dyn Clock>,
                std::time::Duration::from_secs(60),
            ))),
        );
        let state = sluice::admin::AdminState {
            service,
            gate: Arc::new(sluice::readiness::Gate::new(upkeep.clone())),
            upkeep,
            reloader: None,
            json: true,
            reveal: sluice::admin::counters::Reveal::Masked,
            key_prefix: "sluice:".into(),
            quota: None,
        };
        (clock, sluice::admin::router(state))
    });
    let mut input = Input::new(data);
    clock.advance(input.below(60_000_000));
    let method = *input.pick(&["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]);
    let path = input.text(&[
        "/json",
        "/counters",
        "/top",
        "/rlconfig",
        "/healthcheck",
        "/readyz",
        "/livez",
        "/metrics",
        "/",
        "/config",
    ]);
    let query = input.text(&[
        "",
        "domain=f&descriptor=a=1",
        "domain=api&descriptor=api_key=x,path=/v1",
        "domain=f&descriptor=k=1,r=2&descriptor=a=2",
        "n=3",
        "domain=",
        "descriptor=%zz",
    ]);
    let uri = if query.is_empty() {
        path
    } else {
        format!("{path}?{query}")
    };
    let Ok(uri) = uri.parse::<http::Uri>() else {
        return;
    };
    let body = input.rest().to_vec();
    let Ok(request) = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
    else {
        return;
    };
    let mut router = router.clone();
    runtime().block_on(async {
        let response = Service::call(&mut router, request).await.unwrap();
        assert!(
            response.status().as_u16() < 500,
            "{} for a client's request",
            response.status()
        );
    });
}

/// `sluice explain --bucket k=v,...` (`explain`): any map of entries, parsed and explained
/// against the sample rules for any domain.
pub fn explain_bucket(data: &[u8]) {
    static RULES_SET: OnceLock<RuleSet> = OnceLock::new();
    let rules = RULES_SET.get_or_init(rules);
    let mut input = Input::new(data);
    let domain = input.text(&["f", "api", "edge", "llm"]);
    let text = String::from_utf8_lossy(input.rest()).into_owned();
    if let Ok(entries) = sluice::explain::parse_descriptor(&text) {
        let out = sluice::explain::explain_buckets(rules, &domain, &[entries], "sluice:");
        assert!(out.starts_with("bucket 0:"), "{out}");
    }
}

/// Calendar zone names and durations (`calendar`, `clock::parse_duration`): any text is a
/// duration or refused, any zone a calendar or refused, and a calendar's window holds the time
/// it was asked about, over the whole range of times sluice takes.
pub fn zones_durations(data: &[u8]) {
    use sluice::calendar::{Calendar, CalendarUnit};
    let mut input = Input::new(data);
    let unit = *input.pick(&[
        CalendarUnit::Day,
        CalendarUnit::Week,
        CalendarUnit::Month,
        CalendarUnit::Year,
    ]);
    let now = input.below(limiter::TIME_MAX);
    let text = String::from_utf8_lossy(input.rest()).into_owned();
    let _ = sluice::clock::parse_duration(&text);
    if let Ok(calendar) = Calendar::new(&text, unit)
        && let Ok((start, end)) = calendar.window_at(now)
    {
        assert!(
            start <= now && now < end,
            "{text}: [{start}, {end}) misses {now}"
        );
    }
}

/// The algorithms (`limiter`): any limit the rules take, any stored state a store holds, and any
/// run of decisions, refunds, releases and clock moves over the whole u64 range of hits and
/// slots — no panic, no overflow, and the invariants each algorithm promises: a denial consumes
/// nothing, an allowed verdict waits for nothing, a fixed window never admits more than its
/// limit in a window, a concurrency limit never holds more slots than its limit.
pub fn algorithms(data: &[u8]) {
    let mut input = Input::new(data);
    let algorithm = *input.pick(&Algorithm::ALL);
    let period_s = 1 + input.below(limiter::TIME_MAX / 1_000_000 / 2);
    let burst =
        (algorithm.has_burst() && input.bool()).then(|| 1 + input.below(u64::from(u32::MAX)));
    let Ok(mut limit) = Limit::new(
        algorithm,
        input.below(u64::from(u32::MAX) + 1),
        period_s * 1_000_000,
        burst,
    ) else {
        return;
    };
    if algorithm.counts_past_limit() && input.u8().is_multiple_of(4) {
        limit = limit.with_overdraft().unwrap();
    }
    let mut now = START_US;
    let mut state = State::Empty;
    for _ in 0..32 {
        if input.is_empty() {
            break;
        }
        now = now
            .saturating_add(input.below(3 * limit.period_us))
            .min(limiter::TIME_MAX - 1);
        let hits = input.u64();
        let slot = input.u64() % (1 << 53);
        let window = limit.window_at(now);
        if input.u8().is_multiple_of(4) {
            let until = if input.bool() {
                now + input.below(limit.period_us)
            } else {
                0
            };
            let (v, next) = limiter::refund(&limit, &state, now, hits, slot, until);
            assert_eq!(
                v,
                limiter::decide(&limit, &next, now, 0, slot).0,
                "a refund reports the state a look sees after it"
            );
            state = next;
            continue;
        }
        let (v, update): (Verdict, Update) = limiter::decide(&limit, &state, now, hits, slot);
        if v.allowed {
            assert_eq!(v.retry_after_us, 0);
        }
        if v.allowed || limiter::charges_always(&limit, hits) {
            state.apply(update);
        }
        // What a fixed window holds of the current window — admitted hits less those given back —
        // never passes its limit (a cost limit's does: every debit is recorded).
        if let State::Window { start_us, count } = state
            && start_us == window.0
            && !limit.overdraft
        {
            assert!(
                count <= limit.requests,
                "a window holds {count} of {}",
                limit.requests
            );
        }
        if let State::Slots { held } = &state {
            let live = held.iter().filter(|s| s.until_us > now).count() as u64;
            assert!(
                live <= limit.requests,
                "{live} slots held of {}",
                limit.requests
            );
        }
    }
}

/// A caller's trace headers and the tracing environment: the caller's context
/// (`trace::caller`) from any values of `traceparent`, `tracestate`, `b3` and `x-b3-*` (a valid
/// remote span, or none: the call starts a trace), and `trace::from_env` from any values of its
/// variables (a configuration that can be used, or an error that names the variable).
pub fn trace_context(data: &[u8]) {
    const HEADERS: [&str; 7] = [
        "traceparent",
        "tracestate",
        "b3",
        "x-b3-traceid",
        "x-b3-spanid",
        "x-b3-sampled",
        "x-b3-flags",
    ];
    const VARS: [&str; 16] = [
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "TRACING_ENABLED",
        "TRACING_EXPORTER_PROTOCOL",
        "TRACING_SERVICE_NAME",
        "TRACING_SERVICE_NAMESPACE",
        "TRACING_SERVICE_INSTANCE_ID",
        "TRACING_SAMPLING_RATE",
    ];
    let mut input = Input::new(data);
    let mut headers = http::HeaderMap::new();
    for _ in 0..input.below(8) {
        let name = *input.pick(&HEADERS);
        let value = input.text(&[
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
            "80f198ee56343ba864fe8b2a57d3eff7",
            "e457b5a2e4d86bd1",
            "0",
            "1",
            "d",
        ]);
        if let Ok(value) = http::HeaderValue::from_str(&value) {
            headers.append(name, value);
        }
    }
    if let sluice::trace::Caller::Span(span) = sluice::trace::caller(&headers) {
        assert!(span.is_valid() && span.is_remote(), "{span:?}");
    }
    let mut env = std::collections::HashMap::new();
    for _ in 0..input.below(10) {
        let name = *input.pick(&VARS);
        let value = input.text(&[
            "true",
            "false",
            "grpc",
            "http",
            "http/protobuf",
            "http://127.0.0.1:4317",
            "127.0.0.1:4318",
            "parentbased_traceidratio",
            "0.25",
            "service.name=a,k=v%2C",
            "500",
        ]);
        env.insert(name, value);
    }
    match sluice::trace::from_env(|k| env.get(k).cloned(), input.bool()) {
        Ok(Some(config)) => {
            assert!(config.endpoint.starts_with("http"), "{config:?}");
            assert_eq!(config.resource[0].0, "service.name");
            assert!(!config.timeout.is_zero());
            fn ratios_in_range(s: &sluice::trace::Sampling) -> bool {
                match s {
                    sluice::trace::Sampling::Ratio(r) => (0.0..=1.0).contains(r),
                    sluice::trace::Sampling::ParentBased(inner) => ratios_in_range(inner),
                    _ => true,
                }
            }
            assert!(ratios_in_range(&config.sampling), "{config:?}");
        }
        Ok(None) => {}
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
