//! The gRPC adapter: protobuf in, domain types to the engine, protobuf out. The only module
//! (with `admin::json`) that knows the wire types.

mod answer;
pub mod headers;
pub mod health;
mod metadata;
mod rls;

use std::sync::Arc;

use std::time::Instant;

use tonic::Status;

pub use answer::Answer;
pub use headers::{HeaderSet, HeaderSetError, LimitHeaderNames};
pub use rls::RlsServer;

use crate::engine::{self, Code, Decision, Engine, EngineError, LimitOverride};
use crate::metrics::{CallResult, Metrics};
use crate::proto::{self, OverrideUnit, RateLimitRequest, RateLimitResponse, ResponseUnit};
use crate::rules::Unit;
use crate::store::Store;

/// Serves `ShouldRateLimit` from an [`Engine`].
pub struct RateLimitGrpc<S> {
    engine: Arc<Engine<S>>,
    headers: HeaderSet,
    metrics: Option<Arc<Metrics>>,
    /// Answer with `dynamic_metadata` (the reference's `RESPONSE_DYNAMIC_METADATA`).
    dynamic_metadata: bool,
    /// The most-denied values per rule (`GET /top`); None records nothing.
    top: Option<Arc<crate::top::TopLimited>>,
}

impl<S: Store> RateLimitGrpc<S> {
    pub fn new(engine: Arc<Engine<S>>, headers: HeaderSet, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            engine,
            headers,
            metrics,
            dynamic_metadata: false,
            top: None,
        }
    }

    /// Records each denial's descriptor values in `top` (see [`crate::top`]).
    pub fn with_top(mut self, top: Arc<crate::top::TopLimited>) -> Self {
        self.top = Some(top);
        self
    }

    pub fn top(&self) -> Option<&Arc<crate::top::TopLimited>> {
        self.top.as_ref()
    }

    /// Adds `dynamic_metadata` to every answer (see `metadata`).
    pub fn with_dynamic_metadata(mut self, on: bool) -> Self {
        self.dynamic_metadata = on;
        self
    }

    pub fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }

    pub fn engine(&self) -> &Arc<Engine<S>> {
        &self.engine
    }

    /// One call, from wire request to wire response (HTTP `/json`).
    pub async fn handle(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let answer = self.answer(request).await?;
        Ok(answer.into_message(&self.headers))
    }

    /// One call, from wire request to its answer (gRPC: see [`RlsServer`]).
    pub async fn answer(&self, request: RateLimitRequest) -> Result<Answer, Status> {
        let started = Instant::now();
        let echo = self
            .dynamic_metadata
            .then(|| metadata::RequestEcho::of(&request));
        let (domain, result) = match to_domain(request) {
            Ok(request) => {
                let result = self.engine.decide(&request).await.map_err(to_status);
                if let (Some(top), Ok(decision)) = (&self.top, &result) {
                    record_denials(top, &request, decision);
                }
                (request.domain, result)
            }
            Err(invalid) => (String::new(), Err(invalid)),
        };
        let call = match &result {
            Ok(d) if d.code == Code::OverLimit => CallResult::OverLimit,
            Ok(_) => CallResult::Ok,
            Err(s) if s.code() == tonic::Code::InvalidArgument => CallResult::Invalid,
            Err(_) => CallResult::Error,
        };
        if crate::trace::on() {
            record_in_trace(&domain, call, result.as_ref().ok());
        }
        if let Some(m) = &self.metrics {
            m.observe_call(&domain, call, started.elapsed(), result.as_ref().ok());
        }
        result.map(|decision| match echo {
            None => Answer::Decided(decision),
            Some(echo) => Answer::Message(answer::message(
                &decision,
                &self.headers,
                Some(echo.finish(&decision)),
            )),
        })
    }
}

/// The decision on the call's span (`trace::rls_call`): the domain, the decision, who decided
/// (the counters, or the failure policy and its mode), and the descriptor and limit that
/// decided it — the first that denied, else the one with the least left.
fn record_in_trace(domain: &str, call: CallResult, decision: Option<&Decision>) {
    let span = tracing::Span::current();
    if span.is_none() {
        return;
    }
    span.record("ratelimit.domain", domain);
    span.record("ratelimit.decision", call.label());
    let Some(decision) = decision else {
        return;
    };
    span.record("ratelimit.descriptors", decision.statuses.len());
    let decided_by = match decision.decided_by {
        crate::store::DecidedBy::Counters => "counters".to_owned(),
        crate::store::DecidedBy::Policy(mode) => format!("failure_policy:{mode}"),
    };
    span.record("ratelimit.decided_by", decided_by.as_str());
    let limited = decision
        .statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.limit.is_some());
    let decisive = match decision.code {
        Code::OverLimit => limited.clone().find(|(_, s)| s.code == Code::OverLimit),
        Code::Ok => None,
    }
    .or_else(|| limited.min_by_key(|(_, s)| s.remaining));
    if let Some((i, s)) = decisive {
        span.record("ratelimit.descriptor", i);
        span.record("ratelimit.remaining", s.remaining);
        if let Some(stats) = &s.stats {
            span.record("ratelimit.rule", &*stats.rule);
        }
        if let Some(limit) = &s.limit {
            let unit = limit.unit.name().to_ascii_lowercase();
            let per = match limit.unit_multiplier {
                0 | 1 => unit,
                n => format!("{n} {unit}s"),
            };
            span.record(
                "ratelimit.limit",
                format!("{} per {per}", limit.requests_per_unit).as_str(),
            );
        }
    }
}

/// Each descriptor a rule denied, with its values, into the most-limited sketch.
fn record_denials(top: &crate::top::TopLimited, request: &engine::Request, decision: &Decision) {
    for (status, d) in decision.statuses.iter().zip(&request.descriptors) {
        if status.code != Code::OverLimit {
            continue;
        }
        if let Some(stats) = &status.stats {
            let value: Vec<String> = d.entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
            top.record(&request.domain, &stats.rule, &value.join(","), stats.hits);
        }
    }
}

fn to_status(e: EngineError) -> Status {
    match e {
        EngineError::Invalid(m) => Status::invalid_argument(m),
        // Envoy treats a non-OK status as an error and applies its failure_mode_deny.
        EngineError::Store(e) => Status::unavailable(e.to_string()),
    }
}

/// Moves the strings out of the wire request (no copies).
fn to_domain(r: RateLimitRequest) -> Result<engine::Request, Status> {
    // Request-level hits: 0 (unset) means 1; a descriptor's own hits_addend, when present,
    // wins, including 0 (check only).
    let request_hits = if r.hits_addend == 0 {
        1
    } else {
        u64::from(r.hits_addend)
    };
    let descriptors = r
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            Ok(engine::Descriptor {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                limit_override: d.limit.map(|o| limit_override(i, o)).transpose()?,
                hits: d.hits_addend.unwrap_or(request_hits),
                refund: d.is_negative_hits,
            })
        })
        .collect::<Result<_, Status>>()?;
    Ok(engine::Request {
        domain: r.domain,
        descriptors,
    })
}

fn limit_override(i: usize, o: proto::RateLimitOverride) -> Result<LimitOverride, Status> {
    let unit = match OverrideUnit::try_from(o.unit) {
        Ok(OverrideUnit::Second) => Unit::Second,
        Ok(OverrideUnit::Minute) => Unit::Minute,
        Ok(OverrideUnit::Hour) => Unit::Hour,
        Ok(OverrideUnit::Day) => Unit::Day,
        Ok(OverrideUnit::Month) => Unit::Month,
        Ok(OverrideUnit::Year) => Unit::Year,
        Ok(OverrideUnit::Unknown) | Err(_) => {
            return Err(Status::invalid_argument(format!(
                "descriptor {i}: limit override has no valid unit ({})",
                o.unit
            )));
        }
    };
    Ok(LimitOverride {
        requests_per_unit: o.requests_per_unit,
        unit,
        unit_multiplier: o.unit_multiplier.unwrap_or(1),
    })
}

fn code(c: Code) -> proto::Code {
    match c {
        Code::Ok => proto::Code::Ok,
        Code::OverLimit => proto::Code::OverLimit,
    }
}

pub fn response_unit(u: Unit) -> ResponseUnit {
    match u {
        Unit::Second => ResponseUnit::Second,
        Unit::Minute => ResponseUnit::Minute,
        Unit::Hour => ResponseUnit::Hour,
        Unit::Day => ResponseUnit::Day,
        Unit::Week => ResponseUnit::Week,
        Unit::Month => ResponseUnit::Month,
        Unit::Year => ResponseUnit::Year,
    }
}

/// Whole seconds, rounded up: Envoy shows only the seconds, and rounding down would tell a
/// client to come back before it can succeed.
pub fn ceil_seconds(micros: u64) -> u64 {
    micros.div_ceil(crate::clock::MICROS_PER_SECOND)
}

/// What is left, as the wire's `limit_remaining` and the headers say it: at most `u32::MAX`.
fn limit_remaining(s: &engine::Status) -> u32 {
    u32::try_from(s.remaining).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
