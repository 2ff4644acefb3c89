//! The domain types of one request and its answer.

use std::sync::Arc;

use super::EngineError;
use crate::rules::{Tier, Unit};
use crate::store::DecidedBy;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    pub limit_override: Option<LimitOverride>,
    /// Hits to consume (or give back); 0 checks without consuming.
    pub hits: u64,
    /// The hits are given back (`is_negative_hits`).
    pub refund: bool,
}

impl Descriptor {
    /// `hits` on these `(key, value)` entries, with no override and no refund.
    pub fn of(entries: &[(&str, &str)], hits: u64) -> Self {
        Self {
            entries: entries
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            hits,
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub unit_multiplier: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

/// The limit a status reports: the rule's configured numbers (for buckets the rate, not the
/// burst).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedLimit {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub unit_multiplier: u32,
    pub name: Option<std::sync::Arc<str>>,
}

impl ReportedLimit {
    pub fn of(tier: &Tier) -> Self {
        Self {
            requests_per_unit: tier.requests_per_unit,
            unit: tier.unit,
            unit_multiplier: tier.unit_multiplier,
            name: tier.name.clone(),
        }
    }

    /// The window in seconds (unit × multiplier).
    pub fn window_seconds(&self) -> u64 {
        self.unit.seconds() * u64::from(self.unit_multiplier)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub limit: Option<ReportedLimit>,
    pub remaining: u64,
    /// OK: until fully replenished; OVER_LIMIT: until this request would be allowed.
    pub duration_us: Option<u64>,
    /// For metrics: which rule decided, with how many hits.
    pub stats: Option<StatusStats>,
    /// The matched rule's `metadata:` (for the response's dynamic metadata).
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
}

/// What metrics need of a limited status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusStats {
    /// The rule's path, or with `detailed_metric`/`value_to_metric` the request's entries.
    pub rule: Arc<str>,
    /// The label carries request values (its series must be capped).
    pub detailed: bool,
    pub hits: u64,
    /// A shadow-mode rule that would have denied.
    pub shadow_denied: bool,
}

impl Status {
    pub fn ok_without_limit() -> Self {
        Self {
            code: Code::Ok,
            limit: None,
            remaining: 0,
            duration_us: None,
            stats: None,
            metadata: None,
        }
    }

    /// The reference's answer for `unlimited: true`.
    pub fn unlimited() -> Self {
        Self {
            remaining: u64::from(u32::MAX),
            ..Self::ok_without_limit()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub code: Code,
    /// One per request descriptor, in request order.
    pub statuses: Vec<Status>,
    /// When the request is OVER_LIMIT: the longest wait among the denying limits.
    pub retry_after_us: Option<u64>,
    /// The counters, or the failure policy (with its mode) when the backend could not answer.
    pub decided_by: DecidedBy,
}

impl Decision {
    pub fn all_ok(descriptors: usize) -> Self {
        Self {
            code: Code::Ok,
            statuses: vec![Status::ok_without_limit(); descriptors],
            retry_after_us: None,
            decided_by: DecidedBy::Counters,
        }
    }
}

/// Limits on what one request may carry, so a hostile request cannot cost unbounded work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub max_descriptors: usize,
    pub max_entries: usize,
    /// Per key and per value, in bytes.
    pub max_entry_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            max_descriptors: 64,
            max_entries: 32,
            max_entry_bytes: 1024,
        }
    }
}

impl Bounds {
    /// Descriptor `i`'s entries: some, not too many, no empty key, none too long.
    pub fn check_entries(&self, i: usize, entries: &[(String, String)]) -> Result<(), EngineError> {
        let invalid = |m: String| Err(EngineError::Invalid(m));
        if entries.is_empty() {
            return invalid(format!("descriptor {i} has no entries"));
        }
        if entries.len() > self.max_entries {
            return invalid(format!(
                "descriptor {i} has {} entries; the limit is {}",
                entries.len(),
                self.max_entries
            ));
        }
        for (j, (k, v)) in entries.iter().enumerate() {
            if k.is_empty() {
                return invalid(format!("descriptor {i} entry {j} has an empty key"));
            }
            if k.len() > self.max_entry_bytes || v.len() > self.max_entry_bytes {
                return invalid(format!(
                    "descriptor {i} entry {j} is longer than {} bytes",
                    self.max_entry_bytes
                ));
            }
        }
        Ok(())
    }

    pub fn check(&self, r: &Request) -> Result<(), EngineError> {
        let invalid = |m: String| Err(EngineError::Invalid(m));
        if r.domain.is_empty() {
            return invalid("rate limit domain must not be empty".into());
        }
        if r.domain.len() > self.max_entry_bytes {
            return invalid(format!(
                "domain is {} bytes; the limit is {}",
                r.domain.len(),
                self.max_entry_bytes
            ));
        }
        if r.descriptors.is_empty() {
            return invalid("rate limit descriptor list must not be empty".into());
        }
        if r.descriptors.len() > self.max_descriptors {
            return invalid(format!(
                "{} descriptors; the limit is {}",
                r.descriptors.len(),
                self.max_descriptors
            ));
        }
        for (i, d) in r.descriptors.iter().enumerate() {
            self.check_entries(i, &d.entries)?;
            if d.limit_override.is_some_and(|o| o.unit_multiplier == 0) {
                return invalid(format!(
                    "descriptor {i}: limit override unit_multiplier must be at least 1"
                ));
            }
        }
        Ok(())
    }
}
