//! The response's `dynamic_metadata` (`--response-dynamic-metadata`), as the reference service
//! writes it: Envoy stores it under the rate limit filter's namespace, where routing (quota-based
//! choice of an upstream) and access logs can read it.
//!
//! ```text
//! domain:      the request's domain
//! descriptors: [{entries: ["key=value", ...], limit?: "requests_per_unit:N unit:U", hitsAddend?: N}]
//! hitsAddend:  the request's hits_addend, when not 0
//! metadata:    the `metadata:` of every rule whose descriptor was allowed, merged (a key already
//!              present keeps its first value; two maps under one key merge recursively)
//! ```
//!
//! The request part is copied before the request is handed to the engine (which takes its
//! strings); the `metadata` part comes from the decision.

use std::collections::BTreeMap;

use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value};

use crate::engine::{Code, Decision};
use crate::proto::{OverrideUnit, RateLimitRequest};

/// What the metadata repeats of the request.
pub struct RequestEcho {
    fields: BTreeMap<String, Value>,
}

impl RequestEcho {
    pub fn of(request: &RateLimitRequest) -> Self {
        let descriptors = request
            .descriptors
            .iter()
            .map(|d| {
                let mut fields = BTreeMap::new();
                let entries = d
                    .entries
                    .iter()
                    .map(|e| string(format!("{}={}", e.key, e.value)))
                    .collect();
                fields.insert("entries".to_owned(), list(entries));
                if let Some(limit) = &d.limit {
                    let unit = OverrideUnit::try_from(limit.unit)
                        .map_or_else(|_| limit.unit.to_string(), |u| u.as_str_name().to_owned());
                    let text = format!("requests_per_unit:{} unit:{unit}", limit.requests_per_unit);
                    fields.insert("limit".to_owned(), string(text));
                }
                if let Some(hits) = d.hits_addend {
                    fields.insert("hitsAddend".to_owned(), number(hits as f64));
                }
                structure(fields)
            })
            .collect();
        let mut fields = BTreeMap::new();
        fields.insert("domain".to_owned(), string(request.domain.clone()));
        fields.insert("descriptors".to_owned(), list(descriptors));
        if request.hits_addend != 0 {
            fields.insert(
                "hitsAddend".to_owned(),
                number(f64::from(request.hits_addend)),
            );
        }
        Self { fields }
    }

    /// The whole metadata: the echo and the merged `metadata:` of the allowed descriptors' rules.
    pub fn finish(self, decision: &Decision) -> Struct {
        let mut merged = serde_json::Map::new();
        for status in &decision.statuses {
            if let (Code::Ok, Some(m)) = (status.code, &status.metadata) {
                merge(&mut merged, m);
            }
        }
        let mut fields = self.fields;
        if !merged.is_empty() {
            fields.insert("metadata".to_owned(), json_object(&merged));
        }
        Struct { fields }
    }
}

/// The reference's merge: keys new to `into` are added, two maps merge, anything else keeps
/// what `into` had.
fn merge(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (None, _) => {
                into.insert(k.clone(), v.clone());
            }
            (Some(serde_json::Value::Object(a)), serde_json::Value::Object(b)) => merge(a, b),
            (Some(_), _) => {}
        }
    }
}

fn json_object(m: &serde_json::Map<String, serde_json::Value>) -> Value {
    structure(m.iter().map(|(k, v)| (k.clone(), json(v))).collect())
}

fn json(v: &serde_json::Value) -> Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(json).collect(),
        }),
        serde_json::Value::Object(m) => return json_object(m),
    };
    Value { kind: Some(kind) }
}

fn string(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

fn number(n: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(n)),
    }
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

fn structure(fields: BTreeMap<String, Value>) -> Value {
    Value {
        kind: Some(Kind::StructValue(Struct { fields })),
    }
}
