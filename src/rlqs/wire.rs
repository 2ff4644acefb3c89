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

/// A refilling grant (`policy::Refill`) that admits at most `per_window` in any window of
/// `window_s`. The bucket holds at most [`REFILL_BURST`] tokens and gains `per_window −
/// REFILL_BURST + 1 − 1/k` a window, over a fill interval of `k` windows, so what a window
/// starts with and gains stays under `per_window + 1`. `k` is 100 where `tokens_per_fill`
/// fits 32 bits. A grant of fewer than [`REFILL_BURST`] a window holds one token and gains
/// `per_window − 1/k`.
pub fn refilling(id: &BucketId, ttl_s: u64, per_window: u64, window_s: u64) -> BucketAction {
    let per_window = per_window.clamp(1, u64::from(u32::MAX));
    let burst = if per_window >= 2 * REFILL_BURST {
        REFILL_BURST
    } else {
        1
    };
    let gained = per_window - burst + 1;
    let k = (u64::from(u32::MAX) / gained).clamp(1, 100);
    assign(
        id,
        ttl_s,
        rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
            max_tokens: burst as u32,
            tokens_per_fill: Some(u32::try_from(k * gained - 1).unwrap_or(u32::MAX).max(1)),
            fill_interval: Some(duration(k.saturating_mul(window_s.max(1)))),
        }),
    )
}

/// What a refilling grant's bucket holds at most: two tokens, so one that arrives between two
/// requests is not lost to a full bucket (a bucket of one loses the refill between a denied
/// request and the next; at half a token between requests it admits half as many).
pub const REFILL_BURST: u64 = 2;

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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn bucket_of(action: &BucketAction) -> TokenBucket {
        match &action.bucket_action {
            Some(bucket_action::BucketAction::QuotaAssignmentAction(a)) => {
                match a
                    .rate_limit_strategy
                    .as_ref()
                    .and_then(|s| s.strategy.as_ref())
                {
                    Some(rate_limit_strategy::Strategy::TokenBucket(b)) => *b,
                    other => panic!("not a token bucket: {other:?}"),
                }
            }
            other => panic!("not an assignment: {other:?}"),
        }
    }

    proptest! {
        /// What a refilling bucket holds at a window's start and gains in it stays under one
        /// more than `per_window` (so the Envoy admits at most `per_window`), and within a
        /// hundredth of a token of it where the fill fits 32 bits; Envoy 1.40 reads it
        /// (a non-zero fill, whole seconds).
        #[test]
        fn a_refilling_bucket_admits_at_most_its_rate_a_window(
            per_window in 1u64..=u64::from(u32::MAX),
            window_s in 1u64..5,
        ) {
            let id = BucketId::default();
            let b = bucket_of(&refilling(&id, 2, per_window, window_s));
            let fill = b.fill_interval.unwrap();
            prop_assert_eq!(fill.nanos, 0);
            prop_assert!(fill.seconds >= 1);
            let per_fill = b.tokens_per_fill.unwrap();
            prop_assert!(per_fill >= 1 && b.max_tokens >= 1);
            // Gained in a window, exactly: per_fill · window_s / fill seconds.
            let gained = u128::from(per_fill) * u128::from(window_s);
            let fill_s = fill.seconds as u128;
            let most = u128::from(b.max_tokens) * fill_s + gained;
            prop_assert!(most < (u128::from(per_window) + 1) * fill_s, "{b:?}");
            if per_window <= u64::from(u32::MAX) / 100 {
                prop_assert!(most * 100 >= (u128::from(per_window) * 100 - 1) * fill_s);
            }
        }
    }
}
