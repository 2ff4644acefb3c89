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

use super::ceil_seconds;
use crate::engine::{Code, Decision, Status};
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

    pub fn render(&self, d: &Decision) -> Vec<HeaderValue> {
        let retry_after = self.retry_after && d.code == Code::OverLimit;
        let limited: Vec<(usize, &Status)> = d
            .statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.limit.is_some())
            .collect();
        let per_style = if limited.is_empty() {
            0
        } else {
            3 * usize::from(self.draft03)
                + 2 * usize::from(self.ietf)
                + 3 * usize::from(self.ratelimit.is_some())
        };
        let mut out = Vec::with_capacity(usize::from(retry_after) + per_style);
        if retry_after {
            let seconds = d.retry_after_us.map_or(1, ceil_seconds).max(1);
            out.push(header("retry-after", seconds.to_string()));
        }
        if limited.is_empty() {
            return out;
        }
        if self.draft03 {
            draft03(&limited, &mut out);
        }
        if self.ietf {
            ietf(&limited, &mut out);
        }
        if let Some(names) = &self.ratelimit {
            reference_style(&limited, names, &mut out);
        }
        out
    }
}

/// As the reference service picks its one status: the last OVER_LIMIT one, else the one with
/// the least remaining (the first on ties).
fn reference_style(
    limited: &[(usize, &Status)],
    names: &LimitHeaderNames,
    out: &mut Vec<HeaderValue>,
) {
    let lead = limited
        .iter()
        .rev()
        .find(|(_, s)| s.code == Code::OverLimit)
        .or_else(|| limited.iter().min_by_key(|(_, s)| s.remaining));
    let Some((_, lead)) = lead else { return };
    let limit = lead.limit.as_ref().expect("limited statuses have a limit");
    out.push(header(&names.limit, limit.requests_per_unit.to_string()));
    out.push(header(
        &names.remaining,
        lead.remaining.min(u32::MAX as u64).to_string(),
    ));
    out.push(header(&names.reset, reset_seconds(lead).to_string()));
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        value,
        raw_value: Vec::new(),
    }
}

fn reset_seconds(s: &Status) -> u64 {
    s.duration_us.map_or(0, ceil_seconds)
}

fn draft03(limited: &[(usize, &Status)], out: &mut Vec<HeaderValue>) {
    // As Envoy: the status with the smallest remaining (first on ties) leads.
    let (_, lead) = limited
        .iter()
        .min_by_key(|(_, s)| s.remaining)
        .expect("limited is not empty");
    let lead_limit = lead.limit.as_ref().expect("limited statuses have a limit");
    let mut value = lead_limit.requests_per_unit.to_string();
    for (_, s) in limited {
        let l = s.limit.as_ref().expect("limited statuses have a limit");
        let _ = write!(value, ", {};w={}", l.requests_per_unit, l.window_seconds());
        if let Some(name) = l.name.as_deref().filter(|n| !n.is_empty()) {
            let _ = write!(value, ";name=\"{}\"", sf_string(name));
        }
    }
    out.push(header("x-ratelimit-limit", value));
    out.push(header(
        "x-ratelimit-remaining",
        lead.remaining.min(u32::MAX as u64).to_string(),
    ));
    out.push(header("x-ratelimit-reset", reset_seconds(lead).to_string()));
}

fn ietf(limited: &[(usize, &Status)], out: &mut Vec<HeaderValue>) {
    let mut policy = String::new();
    let mut current = String::new();
    for (n, (i, s)) in limited.iter().enumerate() {
        let l = s.limit.as_ref().expect("limited statuses have a limit");
        let name = match l.name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => sf_string(name),
            None => format!("descriptor-{i}"),
        };
        let sep = if n == 0 { "" } else { ", " };
        let _ = write!(
            policy,
            "{sep}\"{name}\";q={};w={}",
            l.requests_per_unit,
            l.window_seconds()
        );
        let _ = write!(
            current,
            "{sep}\"{name}\";r={};t={}",
            s.remaining.min(u32::MAX as u64),
            reset_seconds(s)
        );
    }
    out.push(header("ratelimit-policy", policy));
    out.push(header("ratelimit", current));
}

/// The content of a structured-field string: printable ASCII with `"` and `\` escaped;
/// anything else becomes `_` (a header cannot carry it).
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
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
    out
}
