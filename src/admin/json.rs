//! Proto3 JSON for `POST /json`: a `RateLimitRequest` in, the `RateLimitResponse` out, as
//! protojson writes them (lowerCamelCase names, the original names also accepted on input,
//! 64-bit integers as strings or numbers, enums by name or number, durations as `"1s"`, zero
//! values omitted).

use serde::{Deserialize, Deserializer, Serialize};

use crate::proto::{self, Code, OverrideUnit, ResponseUnit};

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JsonError(String);

pub fn parse_request(body: &[u8]) -> Result<proto::RateLimitRequest, JsonError> {
    let r: JsonRequest = serde_json::from_slice(body).map_err(|e| JsonError(e.to_string()))?;
    Ok(proto::RateLimitRequest {
        domain: r.domain,
        hits_addend: r.hits_addend.map_or(Ok(0), |n| u32_of(n.0, "hitsAddend"))?,
        descriptors: r
            .descriptors
            .into_iter()
            .map(|d| {
                Ok(proto::RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| proto::Entry {
                            key: e.key,
                            value: e.value,
                        })
                        .collect(),
                    limit: d
                        .limit
                        .map(|l| {
                            Ok::<_, JsonError>(proto::RateLimitOverride {
                                requests_per_unit: l
                                    .requests_per_unit
                                    .map_or(Ok(0), |n| u32_of(n.0, "requestsPerUnit"))?,
                                unit: l.unit.map_or(0, |u| u.0),
                                unit_multiplier: l
                                    .unit_multiplier
                                    .map(|n| u32_of(n.0, "unitMultiplier"))
                                    .transpose()?,
                            })
                        })
                        .transpose()?,
                    hits_addend: d.hits_addend.map(|n| n.0),
                    is_negative_hits: d.is_negative_hits,
                })
            })
            .collect::<Result<_, JsonError>>()?,
    })
}

fn u32_of(n: u64, field: &str) -> Result<u32, JsonError> {
    u32::try_from(n).map_err(|_| JsonError(format!("{field}: {n} does not fit in uint32")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Number>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Number>,
    #[serde(default, rename = "isNegativeHits", alias = "is_negative_hits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(default, rename = "requestsPerUnit", alias = "requests_per_unit")]
    requests_per_unit: Option<Number>,
    #[serde(default)]
    unit: Option<UnitValue>,
    #[serde(default, rename = "unitMultiplier", alias = "unit_multiplier")]
    unit_multiplier: Option<Number>,
}

/// An integer written as a JSON number or a string (protojson writes 64-bit ones as strings).
struct Number(u64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            N(u64),
            S(String),
        }
        match Either::deserialize(d)? {
            Either::N(n) => Ok(Number(n)),
            Either::S(s) => s
                .parse()
                .map(Number)
                .map_err(|_| serde::de::Error::custom(format!("'{s}' is not an unsigned integer"))),
        }
    }
}

/// `envoy.type.v3.RateLimitUnit` by name or number.
struct UnitValue(i32);

impl<'de> Deserialize<'de> for UnitValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            N(i32),
            S(String),
        }
        match Either::deserialize(d)? {
            Either::N(n) => Ok(UnitValue(n)),
            Either::S(s) => OverrideUnit::from_str_name(&s)
                .map(|u| UnitValue(u as i32))
                .ok_or_else(|| serde::de::Error::custom(format!("unknown unit '{s}'"))),
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse {
    overall_code: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus {
    code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_limit: Option<JsonLimit>,
    #[serde(skip_serializing_if = "is_zero")]
    limit_remaining: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_until_reset: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonLimit {
    #[serde(skip_serializing_if = "is_zero")]
    requests_per_unit: u32,
    unit: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    unit_multiplier: Option<u32>,
}

#[derive(Serialize)]
struct JsonHeader {
    key: String,
    value: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn code_name(c: i32) -> &'static str {
    Code::try_from(c).map_or("UNKNOWN", |c| c.as_str_name())
}

pub fn render_response(r: &proto::RateLimitResponse) -> serde_json::Value {
    let body = JsonResponse {
        overall_code: code_name(r.overall_code),
        statuses: r
            .statuses
            .iter()
            .map(|s| JsonStatus {
                code: code_name(s.code),
                current_limit: s.current_limit.as_ref().map(|l| JsonLimit {
                    requests_per_unit: l.requests_per_unit,
                    unit: ResponseUnit::try_from(l.unit).map_or("UNKNOWN", |u| u.as_str_name()),
                    name: l.name.clone(),
                    unit_multiplier: l.unit_multiplier,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s
                    .duration_until_reset
                    .as_ref()
                    .map(|d| format!("{}s", d.seconds)),
            })
            .collect(),
        response_headers_to_add: r
            .response_headers_to_add
            .iter()
            .map(|h| JsonHeader {
                key: h.key.clone(),
                value: h.value.clone(),
            })
            .collect(),
    };
    serde_json::to_value(body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_camel_and_original_names_and_string_numbers() {
        let r = parse_request(
            br#"{"domain":"d","hitsAddend":2,"descriptors":[
                {"entries":[{"key":"k","value":"v"}],"hits_addend":"0","isNegativeHits":true,
                 "limit":{"requestsPerUnit":5,"unit":"MINUTE","unit_multiplier":3}}]}"#,
        )
        .unwrap();
        assert_eq!(r.hits_addend, 2);
        let d = &r.descriptors[0];
        assert_eq!(d.hits_addend, Some(0));
        assert!(d.is_negative_hits);
        let l = d.limit.unwrap();
        assert_eq!(
            (l.requests_per_unit, l.unit, l.unit_multiplier),
            (5, 2, Some(3))
        );
    }

    #[test]
    fn rejects_unknown_fields_and_bad_numbers() {
        assert!(parse_request(br#"{"domian":"d"}"#).is_err());
        assert!(parse_request(br#"{"hitsAddend":"x"}"#).is_err());
        assert!(parse_request(br#"{"hitsAddend":5000000000}"#).is_err());
        assert!(parse_request(b"not json").is_err());
    }
}
