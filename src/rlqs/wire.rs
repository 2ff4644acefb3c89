//! The RLQS messages sluice sends, built from the policy's decisions.

use crate::clock::MICROS_PER_SECOND;
use crate::proto::rlqs::{
    BucketAction, BucketId, RateLimitStrategy, TokenBucket, bucket_action, rate_limit_strategy,
};

/// A granted bucket's fill interval: a token per century is "no refill" to Envoy 1.40, which
/// reads the rate as `tokens_per_fill / whole seconds of fill_interval` (and rejects a zero
/// `tokens_per_fill`). A grant lives at most a period (`policy::MAX_PERIOD_US`, 64 days), in
/// which this refills under a thousandth of a token. In nanoseconds it still fits an i64.
pub const NO_REFILL_SECONDS: i64 = 100 * 365 * 86_400;

fn duration(seconds: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

fn assign(id: &BucketId, ttl_s: u64, strategy: rate_limit_strategy::Strategy) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            bucket_action::QuotaAssignmentAction {
                assignment_time_to_live: Some(duration(ttl_s)),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}

fn blanket(rule: rate_limit_strategy::BlanketRule) -> rate_limit_strategy::Strategy {
    rate_limit_strategy::Strategy::BlanketRule(rule as i32)
}

pub fn allow_all(id: &BucketId, ttl_s: u64) -> BucketAction {
    assign(
        id,
        ttl_s,
        blanket(rate_limit_strategy::BlanketRule::AllowAll),
    )
}

pub fn deny_all(id: &BucketId, ttl_s: u64) -> BucketAction {
    assign(
        id,
        ttl_s,
        blanket(rate_limit_strategy::BlanketRule::DenyAll),
    )
}

/// `size` tokens that do not refill. Sent again unchanged, it only extends the time to live
/// (Envoy keeps the tokens left).
pub fn tokens(id: &BucketId, ttl_s: u64, size: u64) -> BucketAction {
    assign(
        id,
        ttl_s,
        rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
            max_tokens: u32::try_from(size).unwrap_or(u32::MAX),
            tokens_per_fill: Some(1),
            fill_interval: Some(prost_types::Duration {
                seconds: NO_REFILL_SECONDS,
                nanos: 0,
            }),
        }),
    )
}

/// A fresh grant: `DENY_ALL` first, so the new bucket starts full (Envoy 1.40 starts one that
/// replaces an active bucket at the old one's fill ratio).
pub fn fresh_tokens(id: &BucketId, ttl_s: u64, size: u64) -> [BucketAction; 2] {
    [deny_all(id, 1), tokens(id, ttl_s, size)]
}

pub fn abandon(id: &BucketId) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(bucket_action::BucketAction::AbandonAction(
            bucket_action::AbandonAction {},
        )),
    }
}

/// A report's `time_elapsed` in microseconds; a missing or negative one is 0.
pub fn elapsed_us(d: Option<&prost_types::Duration>) -> u64 {
    d.map_or(0, |d| {
        u64::try_from(d.seconds)
            .unwrap_or(0)
            .saturating_mul(MICROS_PER_SECOND)
            .saturating_add(u64::try_from(d.nanos).unwrap_or(0) / 1_000)
    })
}
