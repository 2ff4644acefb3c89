//! An RLQS client that behaves as Envoy 1.40's `rate_limit_quota` filter does (seen live, see
//! docs/rlqs.md): a new bucket's first request follows `no_assignment_behavior`
//! and is reported at once (`time_elapsed` 0); every bucket is reported every 5 s; a time to
//! live is read in whole seconds (under one expires at once); only blanket rules and token
//! buckets are honoured; a token bucket refills at `tokens_per_fill / whole seconds of
//! fill_interval`; the same bucket again only extends the time to live; a different one that
//! replaces an active bucket starts at the old one's fill ratio, and full only when none is
//! active; an expired assignment falls back to `no_assignment_behavior` at once.

use std::collections::BTreeMap;

use sluice::proto::rlqs::{
    BucketAction, BucketId, BucketQuotaUsage, RateLimitQuotaUsageReports, bucket_action,
    rate_limit_strategy,
};

const S: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blanket {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy)]
enum Action {
    Blanket(Blanket),
    Tokens {
        max: u32,
        per_fill: u32,
        interval_s: i64,
        interval_nanos: i32,
        tokens: f64,
        last_us: u64,
    },
}

impl Action {
    /// Refills a token bucket to `now` (whole seconds of the interval, as Envoy reads it).
    fn refill(&mut self, now: u64) {
        if let Action::Tokens {
            max,
            per_fill,
            interval_s,
            tokens,
            last_us,
            ..
        } = self
        {
            let rate = if *interval_s <= 0 {
                f64::INFINITY
            } else {
                f64::from(*per_fill) / *interval_s as f64
            };
            let gained = now.saturating_sub(*last_us) as f64 / S as f64 * rate;
            *tokens = (*tokens + gained).min(f64::from(*max));
            *last_us = now;
        }
    }
}

#[derive(Debug)]
struct Bucket {
    id: BucketId,
    action: Option<(Action, u64)>,
    allowed: u64,
    denied: u64,
    last_report_us: Option<u64>,
}

impl Bucket {
    /// The action in force at `now` (None once expired).
    fn active(&mut self, now: u64) -> Option<&mut Action> {
        match &mut self.action {
            Some((action, expires)) if *expires > now => Some(action),
            _ => None,
        }
    }
}

/// One Envoy's bucket cache for one domain.
#[derive(Debug)]
pub struct FakeEnvoy {
    pub domain: String,
    pub no_assignment: Blanket,
    buckets: BTreeMap<Vec<(String, String)>, Bucket>,
    /// Assignments Envoy 1.40 would reject (requests_per_time_unit) or could not apply.
    pub rejected: u64,
}

fn key_of(entries: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut key: Vec<_> = entries
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    key.sort();
    key
}

fn key_of_id(id: &BucketId) -> Vec<(String, String)> {
    let mut key: Vec<_> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    key.sort();
    key
}

impl FakeEnvoy {
    pub fn new(domain: &str, no_assignment: Blanket) -> Self {
        Self {
            domain: domain.to_owned(),
            no_assignment,
            buckets: BTreeMap::new(),
            rejected: 0,
        }
    }

    /// One request for the bucket `entries` at `now`: whether it is admitted, and for a new
    /// bucket the report Envoy sends at once.
    pub fn request(
        &mut self,
        entries: &[(&str, &str)],
        now: u64,
    ) -> (bool, Option<RateLimitQuotaUsageReports>) {
        let key = key_of(entries);
        let fresh = !self.buckets.contains_key(&key);
        let fallback = self.no_assignment;
        let bucket = self.buckets.entry(key).or_insert_with(|| Bucket {
            id: BucketId {
                bucket: entries
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            },
            action: None,
            allowed: 0,
            denied: 0,
            last_report_us: None,
        });
        let admitted = match bucket.active(now) {
            Some(Action::Blanket(b)) => *b == Blanket::Allow,
            Some(action @ Action::Tokens { .. }) => {
                action.refill(now);
                match action {
                    Action::Tokens { tokens, .. } if *tokens >= 1.0 => {
                        *tokens -= 1.0;
                        true
                    }
                    _ => false,
                }
            }
            None => fallback == Blanket::Allow,
        };
        if admitted {
            bucket.allowed += 1;
        } else {
            bucket.denied += 1;
        }
        let report = fresh.then(|| {
            let usage = Self::usage_of(bucket, now);
            RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: vec![usage],
            }
        });
        (admitted, report)
    }

    fn usage_of(bucket: &mut Bucket, now: u64) -> BucketQuotaUsage {
        let elapsed_s = bucket
            .last_report_us
            .map_or(0, |last| now.saturating_sub(last) / S);
        bucket.last_report_us = Some(now);
        let usage = BucketQuotaUsage {
            bucket_id: Some(bucket.id.clone()),
            time_elapsed: Some(prost_types::Duration {
                seconds: elapsed_s as i64,
                nanos: 0,
            }),
            num_requests_allowed: bucket.allowed,
            num_requests_denied: bucket.denied,
        };
        bucket.allowed = 0;
        bucket.denied = 0;
        usage
    }

    /// The 5-second report: every bucket, in one message.
    pub fn report(&mut self, now: u64) -> RateLimitQuotaUsageReports {
        RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: self
                .buckets
                .values_mut()
                .map(|b| Self::usage_of(b, now))
                .collect(),
        }
    }

    /// Applies a response's actions, in order, at `now`.
    pub fn apply(&mut self, actions: &[BucketAction], now: u64) {
        for action in actions {
            let Some(id) = &action.bucket_id else {
                continue;
            };
            let key = key_of_id(id);
            let Some(what) = &action.bucket_action else {
                continue;
            };
            match what {
                bucket_action::BucketAction::AbandonAction(_) => {
                    self.buckets.remove(&key);
                }
                bucket_action::BucketAction::QuotaAssignmentAction(assignment) => {
                    // Envoy ignores actions for buckets it does not have.
                    let Some(bucket) = self.buckets.get_mut(&key) else {
                        continue;
                    };
                    let ttl_s = assignment
                        .assignment_time_to_live
                        .as_ref()
                        .map_or(0, |d| d.seconds.max(0) as u64);
                    let expires = now + ttl_s * S;
                    let strategy = assignment
                        .rate_limit_strategy
                        .as_ref()
                        .and_then(|s| s.strategy.as_ref());
                    let next = match strategy {
                        Some(rate_limit_strategy::Strategy::BlanketRule(rule)) => {
                            Action::Blanket(if *rule == 1 {
                                Blanket::Deny
                            } else {
                                Blanket::Allow
                            })
                        }
                        Some(rate_limit_strategy::Strategy::TokenBucket(tb)) => {
                            let per_fill = tb.tokens_per_fill.unwrap_or(0);
                            let (interval_s, interval_nanos) = tb
                                .fill_interval
                                .as_ref()
                                .map_or((0, 0), |d| (d.seconds, d.nanos));
                            let active = bucket.active(now).copied();
                            let tokens = match active {
                                Some(Action::Tokens {
                                    max,
                                    per_fill: old_fill,
                                    interval_nanos: old_nanos,
                                    ..
                                }) if max == tb.max_tokens
                                    && old_fill == per_fill
                                    && old_nanos == interval_nanos =>
                                {
                                    // The same bucket: only the time to live changes.
                                    if let Some((_, e)) = &mut bucket.action {
                                        *e = expires;
                                    }
                                    continue;
                                }
                                Some(mut old @ Action::Tokens { max, .. }) => {
                                    old.refill(now);
                                    let Action::Tokens { tokens, .. } = old else {
                                        unreachable!()
                                    };
                                    (f64::from(tb.max_tokens) * tokens / f64::from(max)).floor()
                                }
                                _ => f64::from(tb.max_tokens),
                            };
                            Action::Tokens {
                                max: tb.max_tokens,
                                per_fill,
                                interval_s,
                                interval_nanos,
                                tokens,
                                last_us: now,
                            }
                        }
                        _ => {
                            self.rejected += 1;
                            continue;
                        }
                    };
                    bucket.action = Some((next, expires));
                }
            }
        }
    }

    /// Buckets the Envoy holds.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }
}

/// An RLQS stream on `channel` that opens with `first`: the sender of further reports, and what
/// the server sends back.
pub async fn open_stream(
    channel: tonic::transport::Channel,
    first: RateLimitQuotaUsageReports,
) -> (
    tokio::sync::mpsc::Sender<RateLimitQuotaUsageReports>,
    tonic::Streaming<sluice::proto::rlqs::RateLimitQuotaResponse>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(first).await.unwrap();
    let outbound =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let inbound = sluice::proto::rlqs::RateLimitQuotaServiceClient::new(channel)
        .stream_rate_limit_quotas(outbound)
        .await
        .unwrap()
        .into_inner();
    (tx, inbound)
}
