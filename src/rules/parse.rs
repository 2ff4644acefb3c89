//! The rules file as written: the Go reference service's YAML plus sluice's extensions.
//! Unknown fields are rejected at the place they appear (the reference accepts a known name in
//! the wrong place and then ignores it; here that is an error too).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawFile {
    pub domain: Option<String>,
    #[serde(default)]
    pub descriptors: Vec<RawDescriptor>,
    /// Extension: named plans (free, pro, ...), each `unlimited`, a list of limits, or named
    /// groups of limits (`default`, `search`, ...).
    pub plans: Option<BTreeMap<String, RawPlan>>,
    /// Extension: the plan of a client missing from `clients`, or of an unknown plan name.
    pub default_plan: Option<String>,
    /// Extension: client (e.g. API key) → plan name. May stand in a file of its own with just
    /// `domain` and `clients`.
    pub clients: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum RawPlan {
    /// `unlimited`.
    Word(String),
    /// The limits of the `default` group.
    Limits(Vec<RawLimit>),
    /// Named groups of limits.
    Groups(BTreeMap<String, Vec<RawLimit>>),
}

/// Where a rule takes the caller's plan from.
#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawPlanRef {
    /// The value of this entry is looked up in `clients`.
    pub client: Option<String>,
    /// The value of this entry names the plan (Envoy fills it from an auth header).
    pub entry: Option<String>,
    /// The plans' group of limits to apply (default: `default`).
    pub limits: Option<String>,
}

#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawDescriptor {
    pub key: Option<String>,
    pub value: Option<String>,
    pub rate_limit: Option<RawLimit>,
    /// Extension: the limits come from the caller's plan.
    pub plan: Option<RawPlanRef>,
    /// Extension: several limits on one descriptor, all of which must allow.
    pub rate_limits: Option<Vec<RawLimit>>,
    /// Extension: at most `limit` requests in flight. This descriptor's entry names one
    /// request (its slot, e.g. `x-request-id`); the counter is the path above it. A call with
    /// hits acquires the request's slot, one with `is_negative_hits` releases it.
    pub concurrency: Option<RawConcurrency>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub detailed_metric: bool,
    #[serde(default)]
    pub value_to_metric: bool,
    #[serde(default)]
    pub share_threshold: bool,
    /// An over-limit answer of this rule alone does not make the request OVER_LIMIT: only when
    /// every quota-mode descriptor of the request is over (as the reference's `quota_mode`).
    #[serde(default)]
    pub quota_mode: bool,
    /// Returned to Envoy in the response's dynamic metadata while this rule allows
    /// (`--response-dynamic-metadata`); its contents are not checked, as in the reference.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Extension: a cost limit (tokens, bytes) whose cost is known only afterwards: a request is
    /// allowed while usage is under the limit, and every hit is recorded, past the limit too.
    #[serde(default)]
    pub overdraft: bool,
    /// Extension: what to answer when the shared backend (Redis) cannot: allow, deny, local or
    /// error.
    pub failure_mode: Option<String>,
    /// Extension: `strict` (one backend call per request) or `hybrid` (nodes decide from
    /// leases of the shared quota; fixed_window and sliding_window only).
    pub mode: Option<String>,
    /// Extension: put this descriptor's counters in the Redis Cluster slot of the entry with
    /// this key (e.g. `tenant`), so descriptors sharing that entry are decided in one script.
    pub hash_tag: Option<String>,
    #[serde(default)]
    pub descriptors: Vec<RawDescriptor>,
}

#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub unit: Option<String>,
    pub requests_per_unit: Option<u32>,
    #[serde(default)]
    pub unlimited: bool,
    pub name: Option<String>,
    pub replaces: Option<Vec<RawReplace>>,
    /// Extension: fixed_window (default), sliding_window, sliding_log, token_bucket,
    /// leaky_bucket, gcra.
    pub algorithm: Option<String>,
    /// Extension: the capacity of token_bucket, leaky_bucket and gcra.
    pub burst: Option<u32>,
    /// Extension: the window is `unit_multiplier` units (e.g. 5 minutes).
    pub unit_multiplier: Option<u32>,
    /// Extension: calendar windows in this IANA time zone (`Europe/Berlin`, or `UTC`): a day
    /// from local midnight, a week from Monday, a month from the 1st, a year from January 1st.
    /// Units day, week, month and year; fixed_window only; no unit_multiplier.
    pub calendar: Option<String>,
}

/// A concurrency limit: how many requests may be in flight at once, and how long a slot that
/// is never released (a crashed proxy, a lost call) is held.
#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConcurrency {
    /// Requests in flight at most.
    pub limit: Option<u32>,
    /// A slot not released by then is freed: `30s`, `2m`. Set it above the route's timeout.
    pub max_hold: Option<String>,
}

#[derive(Debug, Deserialize, Serialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawReplace {
    pub name: Option<String>,
}

/// The JSON Schema of a rules file (draft 2020-12), for editors and CI checks.
pub fn schema() -> serde_json::Value {
    let mut schema = schemars::schema_for!(RawFile);
    schema.insert("title".into(), "sluice rules file".into());
    serde_json::to_value(schema).unwrap_or_default()
}

/// Parses one file's text. The error keeps serde_yaml's path and position.
pub fn parse(text: &str) -> Result<RawFile, serde_yaml::Error> {
    // An empty file is a YAML null, which would not deserialize as a struct.
    if text.trim().is_empty() {
        return Ok(RawFile::default());
    }
    serde_yaml::from_str(text)
}

/// One file's text as sluice read it, written back as YAML: what it means, nothing of how it
/// was spelled. It loads to the same rules as the text (the rules fuzzer checks it).
pub fn rewritten(text: &str) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&parse(text)?)
}
