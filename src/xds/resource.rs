//! The reference service's `RateLimitConfig` resource, turned into the rules a file would
//! hold: one resource is one domain's file, and the whole state of the world compiles into one
//! rule set exactly as a directory of files does (same validation, same errors, same merging).

use prost::Message;
use prost_types::value::Kind;

use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use crate::rules::{
    LoadOptions, RawDescriptor, RawFile, RawLimit, RawReplace, RuleError, RuleErrors, RuleSet,
    load_parsed_with,
};

/// The type of every resource sluice subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Decodes every resource of one response and compiles them all into one rule set; any error
/// in any of them rejects the whole response (the old rules keep serving).
pub fn rules_from(
    resources: &[prost_types::Any],
    options: LoadOptions,
) -> Result<RuleSet, RuleErrors> {
    let mut files = Vec::with_capacity(resources.len());
    let mut errors = Vec::new();
    for (i, any) in resources.iter().enumerate() {
        let at = format!("xds resource[{i}]");
        if any.type_url != TYPE_URL {
            errors.push(RuleError {
                file: at,
                location: "type_url".into(),
                message: format!("'{}' is not {TYPE_URL}", any.type_url),
            });
            continue;
        }
        // prost skips fields it does not know; a newer control plane's field (a counter-sharing
        // switch, say) dropped silently would decide wrongly, so it rejects the push instead.
        if let Some(unknown) = unknown_field(&any.value) {
            errors.push(RuleError {
                file: at,
                location: unknown,
                message: "a field sluice does not know (a newer RateLimitConfig?); the push is rejected rather than read in part".into(),
            });
            continue;
        }
        match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(config) => {
                let name = if config.name.is_empty() {
                    at
                } else {
                    format!("xds {}", config.name)
                };
                files.push((name, raw_file(&config)));
            }
            Err(e) => errors.push(RuleError {
                file: at,
                location: "value".into(),
                message: format!("not a RateLimitConfig: {e}"),
            }),
        }
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    load_parsed_with(files.iter().map(|(n, f)| (n.as_str(), f)), options)
}

/// The file that says what `config` says.
pub fn raw_file(config: &RateLimitConfig) -> RawFile {
    RawFile {
        domain: Some(config.domain.clone()),
        descriptors: config.descriptors.iter().map(raw_descriptor).collect(),
        ..RawFile::default()
    }
}

fn raw_descriptor(d: &RateLimitDescriptor) -> RawDescriptor {
    RawDescriptor {
        key: Some(d.key.clone()),
        // An empty value is the key alone: one counter per value (as the reference reads it).
        value: Some(d.value.clone()).filter(|v| !v.is_empty()),
        rate_limit: d.rate_limit.as_ref().map(raw_limit),
        shadow_mode: d.shadow_mode,
        detailed_metric: d.detailed_metric,
        quota_mode: d.quota_mode,
        metadata: d.metadata.as_ref().map(json_object),
        descriptors: d.descriptors.iter().map(raw_descriptor).collect(),
        ..RawDescriptor::default()
    }
}

fn raw_limit(p: &RateLimitPolicy) -> RawLimit {
    let unit = match RateLimitUnit::try_from(p.unit) {
        // An unlimited policy has no unit; a limited one without a unit is an error, which
        // compiling reports as for a file.
        Ok(RateLimitUnit::Unknown) if p.unlimited => None,
        Ok(unit) => Some(unit.as_str_name().to_owned()),
        Err(_) => Some(format!("unit number {}", p.unit)),
    };
    RawLimit {
        unit,
        requests_per_unit: Some(p.requests_per_unit),
        unlimited: p.unlimited,
        name: Some(p.name.clone()).filter(|n| !n.is_empty()),
        replaces: (!p.replaces.is_empty()).then(|| {
            p.replaces
                .iter()
                .map(|r| RawReplace {
                    name: Some(r.name.clone()),
                })
                .collect()
        }),
        ..RawLimit::default()
    }
}

fn json_object(s: &prost_types::Struct) -> serde_json::Map<String, serde_json::Value> {
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), json_value(v)))
        .collect()
}

fn json_value(v: &prost_types::Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map_or(serde_json::Value::Null, serde_json::Value::Number),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::StructValue(s)) => serde_json::Value::Object(json_object(s)),
        Some(Kind::ListValue(l)) => {
            serde_json::Value::Array(l.values.iter().map(json_value).collect())
        }
    }
}

/// The messages of the resource, by the fields sluice reads: for each known field number,
/// the message it holds, if it is one to look into.
#[derive(Clone, Copy)]
enum Shape {
    Config,
    Descriptor,
    Policy,
    Replace,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Config => "RateLimitConfig",
            Shape::Descriptor => "RateLimitDescriptor",
            Shape::Policy => "RateLimitPolicy",
            Shape::Replace => "RateLimitReplace",
        }
    }

    /// None: not a field of this message. Some(None): known, nothing to look into.
    fn field(self, number: u64) -> Option<Option<Shape>> {
        match (self, number) {
            (Shape::Config, 3) | (Shape::Descriptor, 4) => Some(Some(Shape::Descriptor)),
            (Shape::Descriptor, 3) => Some(Some(Shape::Policy)),
            (Shape::Policy, 5) => Some(Some(Shape::Replace)),
            (Shape::Config, 1..=2)
            | (Shape::Descriptor, 1..=2 | 5..=8)
            | (Shape::Policy, 1..=4)
            | (Shape::Replace, 1) => Some(None),
            _ => None,
        }
    }
}

/// Where the encoded `RateLimitConfig` holds a field number sluice does not read, e.g.
/// `RateLimitDescriptor field 9 (descriptors[0].descriptors[1])`. Malformed bytes are left to
/// the decoder, which reports them.
pub fn unknown_field(bytes: &[u8]) -> Option<String> {
    walk(bytes, Shape::Config, "")
}

fn walk(mut bytes: &[u8], shape: Shape, path: &str) -> Option<String> {
    let mut seen: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    while !bytes.is_empty() {
        let key = varint(&mut bytes)?;
        let (number, wire) = (key >> 3, key & 7);
        let Some(inner) = shape.field(number) else {
            let at = if path.is_empty() {
                shape.name().to_owned()
            } else {
                format!("{} at {path}", shape.name())
            };
            return Some(format!("{at}: field {number}"));
        };
        match wire {
            0 => {
                varint(&mut bytes)?;
            }
            1 => bytes = bytes.get(8..)?,
            5 => bytes = bytes.get(4..)?,
            2 => {
                let len = usize::try_from(varint(&mut bytes)?).ok()?;
                let (value, rest) = (bytes.get(..len)?, bytes.get(len..)?);
                bytes = rest;
                if let Some(inner) = inner {
                    let index = seen.entry(number).or_default();
                    let name = match (shape, number) {
                        (Shape::Descriptor, 3) => "rate_limit".to_owned(),
                        (Shape::Policy, _) => format!("replaces[{index}]"),
                        _ => format!("descriptors[{index}]"),
                    };
                    *index += 1;
                    let here = if path.is_empty() {
                        name
                    } else {
                        format!("{path}.{name}")
                    };
                    if let Some(found) = walk(value, inner, &here) {
                        return Some(found);
                    }
                }
            }
            _ => return None,
        }
    }
    None
}

/// A protobuf varint, advancing `bytes`; None when it runs out or overflows.
fn varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = bytes.split_first()?;
        *bytes = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}
