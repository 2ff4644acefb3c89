//! `GET /counters?domain=D&descriptor=k=v,k=v[&descriptor=...]`: what each limit a descriptor
//! touches has used and has left, read from wherever the counter lives (memory, Redis, Redis
//! Cluster) with zero hits, so nothing is spent and a counter that does not exist stays absent.
//! An on-call engineer's answer to "why did this client get a 429?" (`sluice inspect` prints
//! it as a table).
//!
//! Descriptor values can be secrets (API keys) or personal data (addresses): the answer shows a
//! value as its first characters and a short hash ([`Reveal`]), so a log or a screenshot of it
//! does not carry the value; `--show-descriptor-values` shows them whole.

use serde_json::{Value, json};

use crate::engine::{Descriptor, EngineError, Request};
use crate::store::Store;

/// How descriptor values are shown on the HTTP side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reveal {
    /// The first four characters and a 32-bit hash: enough to tell values apart and to match
    /// one an operator already knows, not enough to use it.
    #[default]
    Masked,
    Whole,
}

impl Reveal {
    pub fn show(self, value: &str) -> String {
        match self {
            Reveal::Whole => value.to_owned(),
            Reveal::Masked => {
                use std::hash::{Hash, Hasher};
                let prefix: String = value.chars().take(4).collect();
                // SipHash with fixed keys: the same value shows the same everywhere.
                let mut h = std::collections::hash_map::DefaultHasher::new();
                value.hash(&mut h);
                let ellipsis = if prefix.len() < value.len() {
                    "…"
                } else {
                    ""
                };
                format!("{prefix}{ellipsis}#{:08x}", h.finish() as u32)
            }
        }
    }
}

/// Why a query is refused (400, with this as the reason).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueryError {
    #[error("the query names no domain (domain=D)")]
    NoDomain,
    #[error("the query names no descriptor (descriptor=k=v,k=v)")]
    NoDescriptor,
    #[error("domain '{0}' is not configured")]
    UnknownDomain(String),
    #[error("'{0}' is not a query parameter of /counters (domain, descriptor)")]
    UnknownParameter(String),
    #[error("descriptor {index}: {reason}")]
    BadDescriptor { index: usize, reason: String },
    #[error("the query is not valid percent-encoding")]
    BadEncoding,
    #[error("{0}")]
    OutOfBounds(String),
}

/// The request a query asks about.
pub fn parse_query(query: &str) -> Result<Request, QueryError> {
    let mut domain = None;
    let mut descriptors = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or(QueryError::BadEncoding)?;
        match percent_decode(key).ok_or(QueryError::BadEncoding)?.as_str() {
            "domain" => domain = Some(value),
            "descriptor" => {
                let index = descriptors.len();
                let entries = crate::explain::parse_descriptor(&value)
                    .map_err(|reason| QueryError::BadDescriptor { index, reason })?;
                descriptors.push(Descriptor {
                    entries,
                    hits: 0,
                    ..Descriptor::default()
                });
            }
            other => return Err(QueryError::UnknownParameter(other.to_owned())),
        }
    }
    let domain = domain
        .filter(|d| !d.is_empty())
        .ok_or(QueryError::NoDomain)?;
    if descriptors.is_empty() {
        return Err(QueryError::NoDescriptor);
    }
    Ok(Request {
        domain,
        descriptors,
    })
}

/// `%XX` and `+` decoded; None for a broken escape or bytes that are not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = text.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Answers a query: the JSON document, or why it is refused. `leased`: what this node holds of a
/// counter (by key) in a hybrid lease; `grants`: what this node's RLQS Envoys hold of a
/// descriptor's counter.
pub async fn answer<S: Store>(
    engine: &crate::engine::Engine<S>,
    query: &str,
    reveal: Reveal,
    leased: impl Fn(&[u8]) -> Option<u64>,
    grants: impl Fn(&str, &[(String, String)]) -> Option<crate::rlqs::GrantsHeld>,
) -> Result<Value, Result<QueryError, EngineError>> {
    let request = parse_query(query).map_err(Ok)?;
    if engine.rules().domain(&request.domain).is_none() {
        return Err(Ok(QueryError::UnknownDomain(request.domain)));
    }
    let peek = engine.peek(&request).await.map_err(|e| match e {
        EngineError::Invalid(m) => Ok(QueryError::OutOfBounds(m)),
        e => Err(e),
    })?;
    let descriptors: Vec<Value> = request
        .descriptors
        .iter()
        .zip(&peek.descriptors)
        .map(|(d, peeked)| {
            let (rule, limits) = (&peeked.rule, &peeked.limits);
            let entries: Vec<Value> = d
                .entries
                .iter()
                .map(|(k, v)| json!({"key": k, "value": reveal.show(v)}))
                .collect();
            let limits: Vec<Value> = limits
                .iter()
                .map(|(tier, v, key)| {
                    let limit = &tier.limit;
                    // What the limit holds at most: the burst of a bucket, a window's requests.
                    let capacity = limit.burst;
                    json!({
                        "name": tier.name.as_deref(),
                        "algorithm": limit.algorithm.name(),
                        "requests_per_unit": tier.requests_per_unit,
                        "unit": tier.unit.name(),
                        "unit_multiplier": tier.unit_multiplier,
                        "calendar": limit.calendar.map(|c| c.zone_name()),
                        "capacity": capacity,
                        "used": capacity.saturating_sub(v.remaining),
                        "remaining": v.remaining,
                        "over_limit": !v.allowed,
                        "reset_seconds": v.reset_after_us as f64 / 1e6,
                        // mode: hybrid — what this node holds of the counter in a lease
                        // (charged to it already, so counted in `used`).
                        "leased_here": leased(key),
                    })
                })
                .collect();
            // RLQS buckets of these entries: what this node's Envoys hold of the window in
            // grants (charged to the counters already, so counted in `used`).
            let rlqs = grants(&request.domain, &d.entries)
                .map(|g| json!({"held_in_grants": g.tokens, "streams": g.streams}));
            json!({"entries": entries, "rule": rule, "limits": limits, "rlqs": rlqs})
        })
        .collect();
    Ok(json!({
        "domain": request.domain,
        "decided_by": if peek.decided_by.is_policy() { "failure_policy" } else { "backend" },
        "descriptors": descriptors,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_or_say_why_not() {
        let r = parse_query("domain=edge&descriptor=api_key%3Dabc,path=/v1/x+y").unwrap();
        assert_eq!(r.domain, "edge");
        assert_eq!(
            r.descriptors[0].entries,
            [
                ("api_key".to_owned(), "abc".to_owned()),
                ("path".to_owned(), "/v1/x y".to_owned())
            ]
        );
        assert_eq!(r.descriptors[0].hits, 0);
        assert_eq!(parse_query("descriptor=a=b"), Err(QueryError::NoDomain));
        assert_eq!(parse_query("domain=d"), Err(QueryError::NoDescriptor));
        assert_eq!(
            parse_query("domain=d&hits=5&descriptor=a=b"),
            Err(QueryError::UnknownParameter("hits".into()))
        );
        assert_eq!(
            parse_query("domain=d&descriptor=%zz"),
            Err(QueryError::BadEncoding)
        );
        assert_eq!(
            parse_query("domain=d&descriptor=%ff"),
            Err(QueryError::BadEncoding)
        );
        assert!(matches!(
            parse_query("domain=d&descriptor=novalue"),
            Err(QueryError::BadDescriptor { index: 0, .. })
        ));
    }

    #[test]
    fn masked_values_keep_a_prefix_and_a_stable_hash() {
        let shown = Reveal::Masked.show("sk-live-1234567890");
        assert!(shown.starts_with("sk-l…#"), "{shown}");
        assert!(!shown.contains("1234567890"));
        assert_eq!(shown, Reveal::Masked.show("sk-live-1234567890"));
        assert_ne!(shown, Reveal::Masked.show("sk-live-1234567891"));
        assert!(Reveal::Masked.show("ab").starts_with("ab#"));
        assert_eq!(Reveal::Whole.show("sk-live-1"), "sk-live-1");
    }
}
