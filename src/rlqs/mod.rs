//! Envoy's Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, the
//! `rate_limit_quota` HTTP filter): each Envoy decides locally from quota assignments this
//! service streams to it, and reports its usage back; no call sits on the request path.
//!
//! **Why it never admits more than the limit across a fleet.** An assignment is a *lease*
//! drawn from the rule's counters through the same [`Engine`] every RLS call goes through (every
//! tier, all-or-nothing, memory or Redis): `n` tokens are charged to the counters first, then
//! handed to one Envoy as a token bucket of `n` that does not refill within its life, with a
//! time to live that ends with the window the tokens were charged to. So whatever the number of
//! Envoys and whichever node each streams to, the Envoys together hold at most what the
//! counters admitted. A bucket's new grant goes out as `DENY_ALL` then the new bucket in one
//! response: Envoy 1.40 starts a token bucket that *replaces* another at the old one's fill
//! ratio, and full only after a blanket rule; the old grant's unspent tokens are dropped, never
//! counted twice.
//!
//! **Where the window ends.** Envoy spends a grant until something replaces it: the tick just
//! after a window's end (`TICK_LAG`, 5 ms) sends every bucket the new window's grant, so for
//! those few milliseconds, and the trip to the Envoy, it may still admit with the tokens of the
//! window before. What it may still spend is charged to the new window first
//! (`Holding::carry`), and given back there once reports prove it unspent, so counted by when
//! each Envoy decided no window passes its limit. The time to live cannot close that gap (Envoy
//! reads it in whole seconds, from when it gets the assignment, and a one-second window could
//! then never hold a grant); it only bounds it if this node stops before the tick (see
//! `ttl_seconds`). A window shorter than the 5-s reports would so be charged with nearly all of
//! the grant before it: such a bucket gets one refilling token bucket instead, charged window
//! by window (`policy::Refill`).
//!
//! **Why it is full.** Grants follow each Envoy's reported demand (requests allowed and denied
//! per second, smoothed), sized to cover about two of Envoy's 5-second reports, and capped at
//! the Envoy's share, by demand, of what the counter has left. While plenty is left, a grant is
//! topped up before it runs out (the unspent rest is lost, which plenty can afford); when little
//! is left, only once it is (nearly) spent, so almost nothing another Envoy could use sits idle.
//! At a window's end every bucket gets the new window's grant at once, so no Envoy waits in its
//! fallback between windows.
//!
//! **What Envoy 1.40 really does** (`../shared/reference/rlqs.md`, seen live) shapes the rest:
//! reports every 5 s whatever the interval says; time to live in whole seconds, an unset one
//! expiring at once; only blanket rules and token buckets honoured; a refill rate of
//! `tokens_per_fill / whole seconds of fill_interval`, so "no refill" is one token per century.
//!
//! `policy`: what to tell an Envoy about a bucket, as pure functions of what it reported, held
//! and the time. `stream`: one Envoy's stream, which runs the policy's steps against the
//! engine. `wire`: the protobuf messages.

mod policy;
mod stream;
mod wire;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::watch;

pub use policy::{
    Assigned, BLANKET_TTL_US, Carry, DELIVERY_BOUND_US, ENVOY_REPORT_INTERVAL_US, Fleet, Holding,
    MAX_GRANT, Refill, Step, Treatment, Usage, period_end_us, refill_of, ttl_seconds,
};
pub use stream::{Resolved, Session, resolve};

use crate::clock::Clock;
use crate::engine::Engine;
use crate::proto::rlqs::{RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use crate::store::Store;

#[derive(Debug, Clone)]
pub struct QuotaOptions {
    /// Buckets one stream may hold; a report naming more is refused.
    pub max_buckets_per_stream: usize,
    /// Buckets all streams of this node may hold; past it new buckets get no assignment.
    pub max_buckets: usize,
    /// Reports in a row without a request before a bucket is abandoned (0: never).
    pub idle_reports_to_abandon: u32,
    /// How often each stream looks for windows that end and assignments to renew.
    pub tick: Duration,
}

impl Default for QuotaOptions {
    fn default() -> Self {
        Self {
            max_buckets_per_stream: 10_000,
            max_buckets: 100_000,
            // A minute of 5-second reports.
            idle_reports_to_abandon: 12,
            tick: Duration::from_secs(1),
        }
    }
}

/// What kind of assignment went out, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssignmentKind {
    TokenBucket,
    Renewal,
    AllowAll,
    DenyAll,
    Abandon,
}

impl AssignmentKind {
    pub fn label(self) -> &'static str {
        match self {
            AssignmentKind::TokenBucket => "token_bucket",
            AssignmentKind::Renewal => "renewal",
            AssignmentKind::AllowAll => "allow_all",
            AssignmentKind::DenyAll => "deny_all",
            AssignmentKind::Abandon => "abandon",
        }
    }
}

/// Why a report, or a bucket in it, was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NoDomain,
    DomainChanged,
    TooManyBuckets,
    EmptyBucketId,
    BucketIdTooLarge,
    CountOutOfRange,
    NodeFull,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::NoDomain => "no_domain",
            Refusal::DomainChanged => "domain_changed",
            Refusal::TooManyBuckets => "too_many_buckets",
            Refusal::EmptyBucketId => "empty_bucket_id",
            Refusal::BucketIdTooLarge => "bucket_id_too_large",
            Refusal::CountOutOfRange => "count_out_of_range",
            Refusal::NodeFull => "node_full",
        }
    }
}

/// What the service reports as it works (the metrics implement it; `rlqs` does not know them).
pub trait QuotaObserver: Send + Sync {
    fn stream_opened(&self);
    fn stream_closed(&self);
    /// Buckets held by all streams changed by `delta`.
    fn buckets(&self, delta: i64);
    fn assigned(&self, kind: AssignmentKind);
    /// Tokens handed out for a configured domain.
    fn granted(&self, domain: &str, tokens: u64);
    /// Tokens of ended grants proven unspent and given back to the counters.
    fn returned(&self, domain: &str, tokens: u64);
    /// What the Envoys said they allowed and denied, for a configured domain.
    fn reported(&self, domain: &str, allowed: u64, denied: u64);
    fn refused(&self, why: Refusal);
}

/// A counter as the node's streams share knowledge of it: the domain and the ordered entries.
type CounterId = (String, Vec<(String, String)>);

#[derive(Debug, Default)]
struct LedgerEntry {
    holders: u32,
    demand: f64,
    /// The holders' share weights (`Holding::share_weight`), for refilling grants.
    weight: f64,
    /// What the counter had left after the last grant from it, and for which period.
    remaining: Option<(u64, u64)>,
    /// What this node's Envoys hold unspent of the period's grants, and for which period.
    held: (u64, u64),
    /// What this node's refilling grants of the counter let their Envoys admit a window.
    committed: u64,
    /// Refilling grants of streams that ended: what they commit, until their assignment
    /// expires (the Envoy may still admit with it, and no other may take that room).
    lingering: Vec<(u64, u64)>,
}

impl LedgerEntry {
    /// What this node's refilling grants commit at `now_us`, those of ended streams whose
    /// assignments still live included (the others are forgotten).
    fn committed_at(&mut self, now_us: u64) -> u64 {
        self.lingering.retain(|&(_, until)| until > now_us);
        self.lingering
            .iter()
            .fold(self.committed, |sum, &(c, _)| sum.saturating_add(c))
    }
}

/// What this node's streams know together: how many buckets they hold, and per counter every
/// Envoy's demand and what was left at the last grant (so shares follow demand).
#[derive(Debug, Default)]
struct Ledger {
    buckets: AtomicUsize,
    streams: AtomicUsize,
    counters: Mutex<HashMap<CounterId, LedgerEntry>>,
}

impl Ledger {
    fn counters(&self) -> std::sync::MutexGuard<'_, HashMap<CounterId, LedgerEntry>> {
        // A panic elsewhere while holding it leaves numbers that are still numbers.
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fleet(&self, id: &CounterId, period_end_us: u64, now_us: u64) -> Fleet {
        let mut counters = self.counters();
        counters.get_mut(id).map_or_else(Fleet::default, |e| Fleet {
            weight: e.weight,
            committed: e.committed_at(now_us),
            demand: e.demand,
            remaining: e
                .remaining
                .and_then(|(until, left)| (until == period_end_us).then_some(left)),
            held: if e.held.0 == period_end_us {
                e.held.1
            } else {
                0
            },
        })
    }

    fn join(&self, id: &CounterId) {
        self.counters().entry(id.clone()).or_default().holders += 1;
    }

    fn leave(&self, id: &CounterId, demand: f64, weight: f64) {
        let mut counters = self.counters();
        if let Some(e) = counters.get_mut(id) {
            e.holders = e.holders.saturating_sub(1);
            e.demand = (e.demand - demand).max(0.0);
            e.weight = (e.weight - weight).max(0.0);
            if e.holders == 0 && e.lingering.is_empty() {
                counters.remove(id);
            }
        }
    }

    /// One Envoy's demand and share weight went from `before` to `after`.
    fn demand_changed(&self, id: &CounterId, before: (f64, f64), after: (f64, f64)) {
        if let Some(e) = self.counters().get_mut(id) {
            e.demand = (e.demand - before.0 + after.0).max(0.0);
            e.weight = (e.weight - before.1 + after.1).max(0.0);
        }
    }

    /// One Envoy's unspent tokens of the period went from `before` to `after`.
    fn held_changed(&self, id: &CounterId, period_end_us: u64, before: u64, after: u64) {
        if before == after {
            return;
        }
        if let Some(e) = self.counters().get_mut(id) {
            if e.held.0 != period_end_us {
                e.held = (period_end_us, 0);
            }
            e.held.1 = e.held.1.saturating_sub(before).saturating_add(after);
        }
    }

    /// One Envoy's refilling grant of the counter goes from letting it admit `before` a window
    /// to `wanted`: as much of `wanted` as `limit` leaves beside every other commitment (taken
    /// under the lock, so two streams cannot both take the same room).
    fn commit(&self, id: &CounterId, before: u64, wanted: u64, limit: u64, now_us: u64) -> u64 {
        let mut counters = self.counters();
        let Some(e) = counters.get_mut(id) else {
            return 0;
        };
        let others = e.committed_at(now_us).saturating_sub(before);
        let after = wanted
            .min(limit.saturating_sub(others))
            .max(before.min(wanted));
        e.committed = e.committed.saturating_sub(before).saturating_add(after);
        after
    }

    /// A stream that held a refilling grant ended: what it commits stays until `expires_us`.
    fn linger(&self, id: &CounterId, committed: u64, expires_us: u64) {
        if let Some(e) = self.counters().get_mut(id) {
            e.committed = e.committed.saturating_sub(committed);
            if committed > 0 {
                e.lingering.push((committed, expires_us));
            }
        }
    }

    fn left(&self, id: &CounterId, period_end_us: u64, remaining: u64) {
        if let Some(e) = self.counters().get_mut(id) {
            e.remaining = Some((period_end_us, remaining));
        }
    }
}

/// What every stream of the service shares.
struct Shared<S> {
    engine: Arc<Engine<S>>,
    /// Wall time: windows end on it (the store's own clock, so memory windows agree).
    clock: Arc<dyn Clock>,
    options: QuotaOptions,
    observer: Option<Arc<dyn QuotaObserver>>,
    ledger: Ledger,
    stopped: watch::Receiver<bool>,
}

/// Serves `StreamRateLimitQuotas` from an [`Engine`]; streams end when `stopped` says so.
pub struct QuotaService<S> {
    shared: Arc<Shared<S>>,
}

impl<S: Store> QuotaService<S> {
    pub fn new(
        engine: Arc<Engine<S>>,
        clock: Arc<dyn Clock>,
        options: QuotaOptions,
        observer: Option<Arc<dyn QuotaObserver>>,
        stopped: watch::Receiver<bool>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                engine,
                clock,
                options,
                observer,
                ledger: Ledger::default(),
                stopped,
            }),
        }
    }

    /// A stream's logic without its transport, for tests and tools that drive it by hand.
    pub fn session(&self) -> Session<S> {
        Session::new(self.shared.clone())
    }

    /// Buckets held by all streams now.
    pub fn buckets(&self) -> usize {
        self.shared.ledger.buckets.load(Ordering::Relaxed)
    }

    /// Streams open now (one per Envoy and domain).
    pub fn streams(&self) -> usize {
        self.shared.ledger.streams.load(Ordering::Relaxed)
    }

    /// What this node's Envoys hold of the counter of `domain` and `entries` (any order) in
    /// grants of the window now running, unspent as far as their reports tell, and how many of
    /// this node's streams hold a bucket of it; None when no stream does. Other nodes' grants are
    /// theirs to say.
    pub fn grants(&self, domain: &str, entries: &[(String, String)]) -> Option<GrantsHeld> {
        let mut sorted = entries.to_vec();
        sorted.sort_unstable();
        let id: CounterId = (domain.to_owned(), sorted);
        let now = self.shared.clock.now_micros();
        let counters = self.shared.ledger.counters();
        counters.get(&id).map(|e| GrantsHeld {
            tokens: if e.held.0 > now { e.held.1 } else { 0 },
            streams: e.holders,
        })
    }
}

/// What a node's Envoys hold of one counter in RLQS grants (see [`QuotaService::grants`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantsHeld {
    pub tokens: u64,
    pub streams: u32,
}

type ResponseStream =
    Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl<S: Store> crate::proto::rlqs::RateLimitQuotaService for QuotaService<S> {
    type StreamRateLimitQuotasStream = ResponseStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<Self::StreamRateLimitQuotasStream>, tonic::Status> {
        let peer = request.remote_addr();
        let headers = request.metadata().clone().into_headers();
        let responses = stream::spawn(self.shared.clone(), request.into_inner(), peer, headers);
        Ok(tonic::Response::new(Box::pin(responses)))
    }
}
