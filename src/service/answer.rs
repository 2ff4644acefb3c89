//! A `ShouldRateLimit` answer, written as protobuf straight from the decision.
//!
//! Why not build a `RateLimitResponse` and let prost encode it: the message is a tree of
//! allocations (the statuses, three headers of two `String`s each) made only to be walked twice
//! (once for its length, once for its bytes) and freed. Here the lengths are computed from the
//! decision and the bytes written into tonic's buffer, the header values through one reused
//! buffer. The bytes are the ones prost writes for [`Answer::into_message`]'s message (a property
//! test holds the two equal), so Envoy reads the same answer either way.
//!
//! An answer with `dynamic_metadata` (a `Struct` tree) is the message itself, encoded by prost.

use prost::Message;
use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use super::headers::{HeaderSet, HeaderSink};
use super::{ceil_seconds, code, limit_remaining, response_unit};
use crate::engine::{Decision, ReportedLimit, Status};
use crate::proto::{self, RateLimitResponse};

/// What a `ShouldRateLimit` call answers, before it is bytes. The service's header set renders
/// a decision's headers when it becomes bytes or a message.
pub enum Answer {
    /// The decision.
    Decided(Decision),
    /// A message built in full (it carries dynamic metadata).
    Message(RateLimitResponse),
}

impl Answer {
    /// The answer as the wire message (the JSON door's answer).
    pub fn into_message(self, headers: &HeaderSet) -> RateLimitResponse {
        match self {
            Answer::Decided(decision) => message(&decision, headers, None),
            Answer::Message(m) => m,
        }
    }

    /// Writes the answer's protobuf bytes to `buf`.
    pub fn encode(&self, headers: &HeaderSet, buf: &mut impl BufMut) {
        match self {
            Answer::Decided(decision) => write_decided(decision, headers, buf),
            Answer::Message(m) => {
                let _ = m.encode(buf);
            }
        }
    }
}

/// The wire message of a decision.
pub(super) fn message(
    decision: &Decision,
    headers: &HeaderSet,
    dynamic_metadata: Option<prost_types::Struct>,
) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code(decision.code) as i32,
        statuses: decision.statuses.iter().map(status).collect(),
        response_headers_to_add: headers.render(decision),
        dynamic_metadata,
        ..RateLimitResponse::default()
    }
}

fn status(s: &Status) -> proto::DescriptorStatus {
    proto::DescriptorStatus {
        code: code(s.code) as i32,
        current_limit: s.limit.as_ref().map(|l| proto::RateLimit {
            requests_per_unit: l.requests_per_unit,
            unit: response_unit(l.unit) as i32,
            name: l.name.as_deref().unwrap_or_default().to_owned(),
            unit_multiplier: multiplier(l),
        }),
        limit_remaining: limit_remaining(s),
        duration_until_reset: s.duration_us.map(|us| prost_types::Duration {
            seconds: reset_seconds(us),
            nanos: 0,
        }),
        quota: None,
    }
}

/// `duration_until_reset`'s seconds: whole seconds, rounded up.
fn reset_seconds(us: u64) -> i64 {
    i64::try_from(ceil_seconds(us)).unwrap_or(i64::MAX)
}

// Field numbers, from proto/envoy/service/ratelimit/v3/rls.proto and
// proto/envoy/config/core/v3/base.proto.
const RESPONSE_OVERALL_CODE: u32 = 1;
const RESPONSE_STATUSES: u32 = 2;
const RESPONSE_HEADERS_TO_ADD: u32 = 3;
const STATUS_CODE: u32 = 1;
const STATUS_CURRENT_LIMIT: u32 = 2;
const STATUS_LIMIT_REMAINING: u32 = 3;
const STATUS_DURATION_UNTIL_RESET: u32 = 4;
const LIMIT_REQUESTS_PER_UNIT: u32 = 1;
const LIMIT_UNIT: u32 = 2;
const LIMIT_NAME: u32 = 3;
const LIMIT_UNIT_MULTIPLIER: u32 = 4;
/// `google.protobuf.UInt32Value.value` and `google.protobuf.Duration.seconds`.
const WRAPPED_VALUE: u32 = 1;
const HEADER_KEY: u32 = 1;
const HEADER_VALUE: u32 = 2;

fn write_decided(decision: &Decision, headers: &HeaderSet, buf: &mut impl BufMut) {
    // proto3: a field at its default value is not written; a present message field is, even
    // when empty. The codes are never 0 (UNKNOWN), so they are always written.
    write_varint_field(RESPONSE_OVERALL_CODE, code(decision.code) as u64, buf);
    for s in &decision.statuses {
        write_len_prefix(RESPONSE_STATUSES, status_len(s), buf);
        write_status(s, buf);
    }
    headers.render_into(
        decision,
        &mut HeaderWriter {
            field: RESPONSE_HEADERS_TO_ADD,
            buf,
        },
    );
}

/// A varint field, left out at 0.
fn write_varint_field(field: u32, value: u64, buf: &mut impl BufMut) {
    if value != 0 {
        encode_key(field, WireType::Varint, buf);
        encode_varint(value, buf);
    }
}

fn varint_field_len(field: u32, value: u64) -> usize {
    if value == 0 {
        0
    } else {
        key_len(field) + encoded_len_varint(value)
    }
}

/// A length-delimited field's key and length; its `len` bytes follow.
fn write_len_prefix(field: u32, len: usize, buf: &mut impl BufMut) {
    encode_key(field, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

fn len_field_len(field: u32, len: usize) -> usize {
    key_len(field) + encoded_len_varint(len as u64) + len
}

/// A string field, left out when empty.
fn write_str_field(field: u32, s: &str, buf: &mut impl BufMut) {
    if !s.is_empty() {
        write_len_prefix(field, s.len(), buf);
        buf.put_slice(s.as_bytes());
    }
}

fn str_field_len(field: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        len_field_len(field, s.len())
    }
}

fn status_len(s: &Status) -> usize {
    varint_field_len(STATUS_CODE, code(s.code) as u64)
        + s.limit
            .as_ref()
            .map_or(0, |l| len_field_len(STATUS_CURRENT_LIMIT, limit_len(l)))
        + varint_field_len(STATUS_LIMIT_REMAINING, limit_remaining(s).into())
        + s.duration_us.map_or(0, |us| {
            len_field_len(STATUS_DURATION_UNTIL_RESET, duration_len(us))
        })
}

fn write_status(s: &Status, buf: &mut impl BufMut) {
    write_varint_field(STATUS_CODE, code(s.code) as u64, buf);
    if let Some(l) = &s.limit {
        write_len_prefix(STATUS_CURRENT_LIMIT, limit_len(l), buf);
        write_limit(l, buf);
    }
    write_varint_field(STATUS_LIMIT_REMAINING, limit_remaining(s).into(), buf);
    if let Some(us) = s.duration_us {
        write_len_prefix(STATUS_DURATION_UNTIL_RESET, duration_len(us), buf);
        // An int64 is a varint of its two's complement; the seconds are never negative.
        write_varint_field(WRAPPED_VALUE, reset_seconds(us) as u64, buf);
    }
}

fn duration_len(us: u64) -> usize {
    varint_field_len(WRAPPED_VALUE, reset_seconds(us) as u64)
}

/// `unit_multiplier`: unset means 1, so only a real multiplier goes on the wire.
fn multiplier(l: &ReportedLimit) -> Option<u32> {
    (l.unit_multiplier != 1).then_some(l.unit_multiplier)
}

fn limit_len(l: &ReportedLimit) -> usize {
    varint_field_len(LIMIT_REQUESTS_PER_UNIT, l.requests_per_unit.into())
        + varint_field_len(LIMIT_UNIT, response_unit(l.unit) as u64)
        + str_field_len(LIMIT_NAME, l.name.as_deref().unwrap_or_default())
        + multiplier(l).map_or(0, |m| {
            len_field_len(
                LIMIT_UNIT_MULTIPLIER,
                varint_field_len(WRAPPED_VALUE, m.into()),
            )
        })
}

fn write_limit(l: &ReportedLimit, buf: &mut impl BufMut) {
    write_varint_field(LIMIT_REQUESTS_PER_UNIT, l.requests_per_unit.into(), buf);
    write_varint_field(LIMIT_UNIT, response_unit(l.unit) as u64, buf);
    write_str_field(LIMIT_NAME, l.name.as_deref().unwrap_or_default(), buf);
    if let Some(m) = multiplier(l) {
        write_len_prefix(
            LIMIT_UNIT_MULTIPLIER,
            varint_field_len(WRAPPED_VALUE, m.into()),
            buf,
        );
        write_varint_field(WRAPPED_VALUE, m.into(), buf);
    }
}

/// Writes each header as a `HeaderValue` message in `field`.
struct HeaderWriter<'a, B> {
    field: u32,
    buf: &'a mut B,
}

impl<B: BufMut> HeaderSink for HeaderWriter<'_, B> {
    fn header(&mut self, key: &str, value: &str) {
        let len = str_field_len(HEADER_KEY, key) + str_field_len(HEADER_VALUE, value);
        write_len_prefix(self.field, len, self.buf);
        write_str_field(HEADER_KEY, key, self.buf);
        write_str_field(HEADER_VALUE, value, self.buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Code, StatusStats};
    use crate::rules::Unit;
    use crate::service::headers::LimitHeaderNames;
    use crate::store::{DecidedBy, FailureMode};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn units() -> impl Strategy<Value = Unit> {
        prop_oneof![
            Just(Unit::Second),
            Just(Unit::Minute),
            Just(Unit::Hour),
            Just(Unit::Day),
            Just(Unit::Week),
            Just(Unit::Month),
            Just(Unit::Year),
        ]
    }

    fn codes() -> impl Strategy<Value = Code> {
        prop_oneof![Just(Code::Ok), Just(Code::OverLimit)]
    }

    /// Names: none, empty, plain, and any text (quotes, backslashes, non-ASCII).
    fn names() -> impl Strategy<Value = Option<Arc<str>>> {
        prop_oneof![
            Just(None),
            Just(Some(Arc::from(""))),
            "[a-z_]{1,12}".prop_map(|s| Some(Arc::from(s))),
            any::<String>().prop_map(|s| Some(Arc::from(s))),
        ]
    }

    fn limits() -> impl Strategy<Value = ReportedLimit> {
        (
            any::<u32>(),
            units(),
            prop_oneof![Just(0u32), Just(1), Just(2), any::<u32>()],
            names(),
        )
            .prop_map(
                |(requests_per_unit, unit, unit_multiplier, name)| ReportedLimit {
                    requests_per_unit,
                    unit,
                    unit_multiplier,
                    name,
                },
            )
    }

    fn statuses() -> impl Strategy<Value = Status> {
        (
            codes(),
            proptest::option::of(limits()),
            prop_oneof![Just(0u64), any::<u32>().prop_map(u64::from), any::<u64>()],
            proptest::option::of(prop_oneof![Just(0u64), 1..2_000_000u64, any::<u64>()]),
        )
            .prop_map(|(code, limit, remaining, duration_us)| Status {
                code,
                limit,
                remaining,
                duration_us,
                stats: Some(StatusStats {
                    rule: Arc::from("r"),
                    detailed: false,
                    hits: 1,
                    shadow_denied: false,
                }),
                metadata: None,
            })
    }

    fn decisions() -> impl Strategy<Value = Decision> {
        (
            codes(),
            proptest::collection::vec(statuses(), 0..6),
            proptest::option::of(any::<u64>()),
            proptest::option::of(proptest::sample::select(vec![
                FailureMode::Allow,
                FailureMode::Deny,
                FailureMode::Local,
            ])),
        )
            .prop_map(|(code, statuses, retry_after_us, policy)| Decision {
                code,
                statuses,
                retry_after_us,
                decided_by: policy.map_or(DecidedBy::Counters, DecidedBy::Policy),
            })
    }

    fn header_sets() -> impl Strategy<Value = HeaderSet> {
        (any::<[bool; 4]>(), any::<bool>()).prop_map(
            |([retry_after, draft03, ietf, ratelimit], custom)| HeaderSet {
                retry_after,
                draft03,
                ietf,
                ratelimit: ratelimit.then(|| {
                    if custom {
                        LimitHeaderNames::parse("X-Limit,X-Left,X-Reset").unwrap()
                    } else {
                        LimitHeaderNames::default()
                    }
                }),
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The bytes written straight from a decision are the bytes prost writes for its
        /// message, for any decision (every number over its whole range) and header set.
        #[test]
        fn decided_answers_are_the_bytes_prost_writes(d in decisions(), set in header_sets()) {
            let expected = message(&d, &set, None).encode_to_vec();
            let answer = Answer::Decided(d);
            let mut written = Vec::new();
            answer.encode(&set, &mut written);
            prop_assert_eq!(&written, &expected);
            prop_assert_eq!(
                RateLimitResponse::decode(written.as_slice()).unwrap(),
                answer.into_message(&set)
            );
        }
    }
}
