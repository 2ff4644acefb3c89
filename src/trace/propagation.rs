//! The caller's span, from a call's headers: W3C Trace Context (`traceparent`, `tracestate`),
//! which Envoy's OpenTelemetry tracer sends, else B3 — one `b3` header or the `x-b3-*` set —
//! which its Zipkin tracer sends. Whichever the caller sent, its span becomes the parent, and
//! its sampling decision is followed.

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http;

/// What a call's headers say of the caller's trace.
#[derive(Debug, Clone, PartialEq)]
pub enum Caller {
    /// No trace context (or none that reads): a span here starts a trace.
    Untraced,
    /// The caller's span, and whether it sampled.
    Span(SpanContext),
    /// B3's `b3: 0` alone: the caller decided not to sample, and named no span.
    Unsampled,
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The caller's trace, from `headers`.
pub fn caller(headers: &http::HeaderMap) -> Caller {
    if headers.contains_key("traceparent") {
        let cx = TraceContextPropagator::new().extract(&Headers(headers));
        let span = cx.span().span_context().clone();
        if span.is_valid() {
            return Caller::Span(span);
        }
    }
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(b3) = text("b3") {
        return b3_single(b3.trim());
    }
    match (text("x-b3-traceid"), text("x-b3-spanid")) {
        (Some(trace), Some(span)) => {
            let debug = text("x-b3-flags") == Some("1");
            let sampled = debug || matches!(text("x-b3-sampled"), Some("1" | "true"));
            context(trace.trim(), span.trim(), sampled).map_or(Caller::Untraced, Caller::Span)
        }
        _ if text("x-b3-sampled") == Some("0") => Caller::Unsampled,
        _ => Caller::Untraced,
    }
}

/// `{trace}-{span}[-{sampling}[-{parent}]]`, or the sampling state alone.
fn b3_single(value: &str) -> Caller {
    let parts: Vec<&str> = value.split('-').collect();
    match parts.as_slice() {
        ["0"] => Caller::Unsampled,
        [_] => Caller::Untraced,
        [trace, span, rest @ ..] if rest.len() <= 2 => {
            let sampled = matches!(rest.first(), Some(&"1" | &"d"));
            context(trace, span, sampled).map_or(Caller::Untraced, Caller::Span)
        }
        _ => Caller::Untraced,
    }
}

/// A remote span context from B3's hex ids (a 64-bit trace id is the low half of 128).
fn context(trace: &str, span: &str, sampled: bool) -> Option<SpanContext> {
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(trace, 32) || hex(trace, 16)) || !hex(span, 16) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = if sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let cx = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    cx.is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, http::HeaderValue::from_static(v));
        }
        map
    }

    fn span(caller: Caller) -> SpanContext {
        match caller {
            Caller::Span(s) => s,
            other => panic!("no span: {other:?}"),
        }
    }

    #[test]
    fn w3c_as_envoys_opentelemetry_tracer_sends_it() {
        let s = span(caller(&headers(&[
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
            ("tracestate", ""),
        ])));
        assert_eq!(s.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s.span_id().to_string(), "00f067aa0ba902b7");
        assert!(s.is_sampled() && s.is_remote());
        let s = span(caller(&headers(&[(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        )])));
        assert!(!s.is_sampled());
    }

    #[test]
    fn b3_single_and_multi() {
        let s = span(caller(&headers(&[(
            "b3",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
        )])));
        assert_eq!(s.trace_id().to_string(), "80f198ee56343ba864fe8b2a57d3eff7");
        assert!(s.is_sampled());
        // A 64-bit trace id, debug sampling.
        let s = span(caller(&headers(&[(
            "b3",
            "64fe8b2a57d3eff7-e457b5a2e4d86bd1-d",
        )])));
        assert_eq!(s.trace_id().to_string(), "000000000000000064fe8b2a57d3eff7");
        assert!(s.is_sampled());
        assert_eq!(caller(&headers(&[("b3", "0")])), Caller::Unsampled);
        let s = span(caller(&headers(&[
            ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
            ("x-b3-spanid", "e457b5a2e4d86bd1"),
            ("x-b3-sampled", "0"),
        ])));
        assert!(!s.is_sampled());
        let s = span(caller(&headers(&[
            ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
            ("x-b3-spanid", "e457b5a2e4d86bd1"),
            ("x-b3-flags", "1"),
        ])));
        assert!(s.is_sampled());
    }

    #[test]
    fn what_does_not_read_starts_a_trace() {
        for bad in [
            headers(&[]),
            headers(&[("traceparent", "00-zz-00f067aa0ba902b7-01")]),
            headers(&[(
                "traceparent",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            )]),
            headers(&[("b3", "nothex-e457b5a2e4d86bd1-1")]),
            headers(&[("b3", "80f198ee56343ba864fe8b2a57d3eff7-0000000000000000-1")]),
            headers(&[("b3", "a-b-c-d-e-f")]),
            headers(&[("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7")]),
        ] {
            assert_eq!(caller(&bad), Caller::Untraced, "{bad:?}");
        }
    }
}
