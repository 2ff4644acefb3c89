//! Rate-limit headers that sluice adds through `response_headers_to_add`.
//!
//! - `retry-after`: on OVER_LIMIT, whole seconds rounded up, at least 1 (RFC 9110).
//! - `draft03`: `x-ratelimit-limit/-remaining/-reset` of the most constrained status, in the
//!   exact form Envoy's `enable_x_ratelimit_headers: DRAFT_VERSION_03` renders. Enable one of
//!   the two, not both, or clients see every header twice.
//! - `ietf`: `ratelimit-policy` and `ratelimit` structured fields
//!   (draft-ietf-httpapi-ratelimit-headers), one item per limited status.
//! - `ratelimit`: the reference service's `LIMIT_RESPONSE_HEADERS_ENABLED` headers,
//!   `RateLimit-Limit`, `-Remaining` and `-Reset` (names configurable), plain integers of one
//!   status: the last OVER_LIMIT one, else the one with the least remaining.

use std::fmt::Write;

use super::{ceil_seconds, limit_remaining};
use crate::engine::{Code, Decision, ReportedLimit, Status};
use crate::proto::HeaderValue;
use tonic::codegen::http;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeaderSet {
    pub retry_after: bool,
    pub draft03: bool,
    pub ietf: bool,
    /// The reference service's three headers, with these names.
    pub ratelimit: Option<LimitHeaderNames>,
}

/// The names of the `ratelimit` style's headers (the reference's `LIMIT_LIMIT_HEADER`,
/// `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
}

impl Default for LimitHeaderNames {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

impl LimitHeaderNames {
    /// Parses `LIMIT,REMAINING,RESET`: three valid header names.
    pub fn parse(list: &str) -> Result<Self, HeaderSetError> {
        let names: Vec<&str> = list.split(',').map(str::trim).collect();
        let [limit, remaining, reset] = names[..] else {
            return Err(HeaderSetError::NameCount(list.to_owned()));
        };
        for name in [limit, remaining, reset] {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(HeaderSetError::BadName(name.to_owned()));
            }
        }
        Ok(Self {
            limit: limit.into(),
            remaining: remaining.into(),
            reset: reset.into(),
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeaderSetError {
    #[error(
        "unknown response header set '{0}' (expected retry-after, draft03, ietf, ratelimit or none)"
    )]
    UnknownSet(String),
    #[error(
        "--ratelimit-header-names takes three comma-separated names (limit, remaining, reset), not '{0}'"
    )]
    NameCount(String),
    #[error("--ratelimit-header-names: '{0}' is not a header name")]
    BadName(String),
}

impl HeaderSet {
    /// Parses a comma list such as `retry-after,draft03`; `none` means no headers.
    pub fn parse(list: &str) -> Result<Self, HeaderSetError> {
        let mut set = Self::default();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.to_ascii_lowercase().as_str() {
                "retry-after" => set.retry_after = true,
                "draft03" => set.draft03 = true,
                "ietf" => set.ietf = true,
                "ratelimit" => set.ratelimit = Some(LimitHeaderNames::default()),
                "none" => {}
                _ => return Err(HeaderSetError::UnknownSet(item.to_owned())),
            }
        }
        Ok(set)
    }

    /// The headers for `d`, as the wire message's list (the JSON door's answer, and a gRPC
    /// answer that carries dynamic metadata).
    pub fn render(&self, d: &Decision) -> Vec<HeaderValue> {
        let mut out = Vec::new();
        self.render_into(d, &mut out);
        out
    }

    /// The headers for `d`, each handed to `out` as it is made: every value is written into one
    /// buffer, so the gRPC answer (see `answer`) costs no allocation per header.
    pub fn render_into(&self, d: &Decision, out: &mut impl HeaderSink) {
        let limited = Limited(&d.statuses);
        let mut value = String::new();
        if self.retry_after && d.code == Code::OverLimit {
            let seconds = d.retry_after_us.map_or(1, ceil_seconds).max(1);
            push_int(&mut value, seconds);
            out.header("retry-after", &value);
        }
        if limited.is_empty() {
            return;
        }
        if self.draft03 {
            draft03(limited, &mut value, out);
        }
        if self.ietf {
            ietf(limited, &mut value, out);
        }
        if let Some(names) = &self.ratelimit {
            reference_style(limited, names, &mut value, out);
        }
    }
}

/// Where rendered headers go, one `key: value` at a time.
pub trait HeaderSink {
    fn header(&mut self, key: &str, value: &str);
}

impl HeaderSink for Vec<HeaderValue> {
    fn header(&mut self, key: &str, value: &str) {
        self.push(HeaderValue {
            key: key.to_owned(),
            value: value.to_owned(),
            raw_value: Vec::new(),
        });
    }
}

/// Hands `key` and what `write` writes to `out`, through the reused `value` buffer.
fn emit(out: &mut impl HeaderSink, value: &mut String, key: &str, write: impl FnOnce(&mut String)) {
    value.clear();
    write(value);
    out.header(key, value);
}

/// Appends `n` in decimal, as `write!(out, "{n}")` does, without the formatting machinery: a
/// header value is rendered on every answer, and `core::fmt` was a sixth of the cost.
fn push_int(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20]; // u64::MAX has 20 digits
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend(digits[start..].iter().map(|&d| char::from(d)));
}

/// The statuses that carry a limit (the ones headers describe), read in place: a header set
/// is rendered on every answer, and collecting them cost an allocation each time.
#[derive(Clone, Copy)]
struct Limited<'a>(&'a [Status]);

impl<'a> Limited<'a> {
    /// Each limited status with its index in the answer and its limit.
    fn iter(self) -> impl Iterator<Item = (usize, &'a Status, &'a ReportedLimit)> {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s, s.limit.as_ref()?)))
    }

    fn is_empty(self) -> bool {
        self.iter().next().is_none()
    }

    /// The status with the least remaining, the first on ties (as Envoy picks it).
    fn least_remaining(self) -> Option<(&'a Status, &'a ReportedLimit)> {
        self.iter()
            .min_by_key(|(_, s, _)| s.remaining)
            .map(|(_, s, l)| (s, l))
    }
}

/// As the reference service picks its one status: the last OVER_LIMIT one, else the one with
/// the least remaining (the first on ties).
fn reference_style(
    limited: Limited<'_>,
    names: &LimitHeaderNames,
    value: &mut String,
    out: &mut impl HeaderSink,
) {
    let lead = limited
        .iter()
        .filter(|(_, s, _)| s.code == Code::OverLimit)
        .last()
        .map(|(_, s, l)| (s, l))
        .or_else(|| limited.least_remaining());
    let Some((lead, limit)) = lead else { return };
    emit(out, value, &names.limit, |v| {
        push_int(v, limit.requests_per_unit.into())
    });
    emit(out, value, &names.remaining, |v| {
        push_int(v, limit_remaining(lead).into())
    });
    emit(out, value, &names.reset, |v| {
        push_int(v, reset_seconds(lead))
    });
}

fn reset_seconds(s: &Status) -> u64 {
    s.duration_us.map_or(0, ceil_seconds)
}

fn draft03(limited: Limited<'_>, value: &mut String, out: &mut impl HeaderSink) {
    let Some((lead, lead_limit)) = limited.least_remaining() else {
        return;
    };
    emit(out, value, "x-ratelimit-limit", |v| {
        // `L, L;w=W` per limit.
        push_int(v, lead_limit.requests_per_unit.into());
        for (_, _, l) in limited.iter() {
            v.push_str(", ");
            push_int(v, l.requests_per_unit.into());
            v.push_str(";w=");
            push_int(v, l.window_seconds());
            if let Some(name) = l.name.as_deref().filter(|n| !n.is_empty()) {
                v.push_str(";name=\"");
                push_sf_string(v, name);
                v.push('"');
            }
        }
    });
    emit(out, value, "x-ratelimit-remaining", |v| {
        push_int(v, limit_remaining(lead).into())
    });
    emit(out, value, "x-ratelimit-reset", |v| {
        push_int(v, reset_seconds(lead))
    });
}

fn ietf(limited: Limited<'_>, policy: &mut String, out: &mut impl HeaderSink) {
    policy.clear();
    let mut current = String::new();
    for (n, (i, s, l)) in limited.iter().enumerate() {
        if n > 0 {
            policy.push_str(", ");
            current.push_str(", ");
        }
        // The quoted name goes into the policy, then the same bytes into the current state.
        let name_start = policy.len();
        policy.push('"');
        match l.name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => push_sf_string(policy, name),
            None => {
                let _ = write!(policy, "descriptor-{i}");
            }
        }
        policy.push('"');
        current.push_str(&policy[name_start..]);
        let _ = write!(
            policy,
            ";q={};w={}",
            l.requests_per_unit,
            l.window_seconds()
        );
        let _ = write!(current, ";r={};t={}", limit_remaining(s), reset_seconds(s));
    }
    out.header("ratelimit-policy", policy);
    out.header("ratelimit", &current);
}

/// Appends the content of a structured-field string: printable ASCII with `"` and `\` escaped;
/// anything else becomes `_` (a header cannot carry it).
fn push_sf_string(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::push_int;
    use proptest::prelude::*;

    fn pushed(n: u64) -> String {
        let mut s = String::from("x");
        push_int(&mut s, n);
        s
    }

    #[test]
    fn integers_are_written_as_display_writes_them_at_the_edges() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            assert_eq!(pushed(n), format!("x{n}"));
        }
    }

    proptest! {
        #[test]
        fn integers_are_written_as_display_writes_them(n in any::<u64>()) {
            prop_assert_eq!(pushed(n), format!("x{n}"));
        }
    }
}
