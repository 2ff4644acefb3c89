//! Redis and Redis Cluster: a request's checks decided by the limiter library per cluster slot,
//! all or nothing; the groups of requests that queue meanwhile leave in one call (`batcher`).
//!
//! Each check's key is `prefix{tag}encoded-key`: the tag is 8 hex digits of a hash of the
//! descriptor (domain and matched entries), so every tier of one descriptor lands in one slot
//! and is decided by one script, and no byte of a descriptor value can move a key or make two
//! descriptors collide (the encoded key is length-prefixed). Checks are grouped by slot; the
//! groups run concurrently, each in an FCALL it may share with other requests' groups of the
//! same server (standalone) or master (cluster; see `Queues`) (the library loaded again when
//! Redis lost it; EVALSHA of the same code where Redis has no Functions). When one group denies,
//! the groups that consumed are refunded, so a denied request consumes nothing in the end; a
//! concurrent request may see those hits for the length of one round trip (under-admission,
//! never over-admission).
//!
//! Connections are made ahead, in the background, when the store is built and again after one
//! is lost, each bounded by its own connect timeout: a request's `--redis-timeout` pays for its
//! script call, not for a TCP and TLS handshake.

mod batcher;
mod codec;
mod fleet;
mod keys;
mod masters;
mod options;
mod pool;
mod script;
mod sentinel;

use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use super::{Check, CheckKind, DecidedBy, Outcome, Rollback, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::Verdict;

use codec::{GroupReply, group_reply, push_check};
pub use fleet::FleetBeat;
pub use keys::redis_key;
pub use options::{RedisConfigError, RedisOptions, Topology, redact};
pub use pool::Reached;
use pool::{CallFailure, Lanes, RedisFailure};
use script::Group;
pub use script::LIMITER_SCRIPT;

pub struct RedisStore {
    /// The connections, and the queues requests' groups leave together by (see `batcher`).
    lanes: Lanes,
    prefix: Vec<u8>,
    timeout: Duration,
    /// Tests only: a time for the script instead of Redis `TIME`.
    pinned: Option<Arc<dyn Clock>>,
    /// The clock calendar limits' windows are sent around (see `push_check`): the system's, or
    /// in tests the pinned clock or one set off from it.
    node_clock: Arc<dyn Clock>,
}

impl RedisStore {
    /// No connection is made here (see [`RedisStore::connect_ahead`]), so sluice starts while
    /// Redis is down.
    pub fn new(options: &RedisOptions) -> Result<Self, RedisConfigError> {
        // rediss:// needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if options.key_prefix.contains(['{', '}']) {
            return Err(RedisConfigError::BracesInPrefix);
        }
        Ok(Self {
            lanes: Lanes::new(options)?,
            prefix: options.key_prefix.as_bytes().to_vec(),
            timeout: options.timeout,
            pinned: None,
            node_clock: Arc::new(crate::clock::SystemClock),
        })
    }
    /// This node's heartbeat in the fleet set (see [`FleetBeat`]), as `member`.
    pub fn fleet_beat(&self, member: String) -> FleetBeat {
        let mut key = self.prefix.clone();
        key.extend_from_slice(b"{fleet}");
        FleetBeat::new(
            self.lanes.pool().clone(),
            key,
            member,
            self.timeout.max(Duration::from_millis(100)),
        )
    }

    /// Whether Redis has been reached, for the upkeep (readiness).
    pub fn reached(&self) -> Reached {
        Reached::of(self.lanes.pool())
    }

    /// Makes the connections in the background now (on the current Tokio runtime; without one,
    /// the first calls make them).
    pub fn connect_ahead(&self) {
        self.lanes.pool().fill_in_background();
    }

    /// Tests only: the scripts use this clock instead of Redis `TIME`, so a run can be replayed
    /// against the memory store at the same times.
    pub fn with_pinned_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.node_clock = clock.clone();
        self.pinned = Some(clock);
        self
    }

    /// Whether a cluster's masters are known (so groups leave by master); when not, starts
    /// reading them if a connection is made. Tests wait on it; false for a standalone server.
    pub fn masters_known(&self) -> bool {
        self.lanes.pool().with_masters(|_| ()).is_some()
    }

    /// Tests only: this node's clock as calendar limits read it, apart from the script's (a
    /// node a little off Redis at a window's edge).
    pub fn with_node_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.node_clock = clock;
        self
    }

    fn redis_key(&self, check: &Check<'_>) -> (Vec<u8>, u16) {
        redis_key(&self.prefix, check.tag, check.key, check.limit.algorithm)
    }

    /// Runs the script for the checks `indices` (one slot) and returns
    /// (allowed, one verdict per index).
    async fn run_group(
        &self,
        slot: u16,
        keys: Vec<Vec<u8>>,
        checks: &[Check<'_>],
        indices: &[usize],
        now: Option<u64>,
        node_now_us: u64,
    ) -> Result<GroupReply, StoreError> {
        let (span, trace) = crate::trace::redis_group(indices.len());
        let mut group = Group {
            keys,
            now,
            args: Vec::with_capacity(8 * indices.len()),
            trace: trace.map(Box::new),
        };
        for &i in indices {
            push_check(&mut group.args, &checks[i], node_now_us);
        }
        // The batcher answers by the deadline (one timer a call, not one a request).
        let deadline = tokio::time::Instant::now() + self.timeout;
        match self
            .lanes
            .call(slot, group, deadline)
            .instrument(span)
            .await
        {
            Ok(Ok(reply)) => Ok(group_reply(reply, checks, indices)),
            // The group's own error (its neighbours in the call were answered).
            Ok(Err(text)) => Err(StoreError::unavailable(RedisFailure(text))),
            Err(CallFailure::Timeout) => Err(StoreError::Timeout(self.timeout)),
            Err(CallFailure::Failed(text)) => Err(StoreError::unavailable(RedisFailure(text))),
            Err(CallFailure::Stopped) => Err(StoreError::unavailable(RedisFailure(
                "the Redis batcher stopped (its runtime shut down)".into(),
            ))),
        }
    }
}

/// 0, 1, 2, ...: a request's checks in order, the members of its one group without a Vec.
const IN_ORDER: [usize; 32] = {
    let mut all = [0; 32];
    let mut i = 0;
    while i < all.len() {
        all[i] = i;
        i += 1;
    }
    all
};

impl Store for RedisStore {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let now = self.pinned.as_ref().map(|c| c.now_micros());
        // Only calendar limits read it (to send their windows around it).
        let node_now_us = if checks.iter().any(|c| c.limit.calendar.is_some()) {
            self.node_clock.now_micros()
        } else {
            0
        };
        // Standalone: one group for everything. Cluster: one per slot. Each with its keys.
        let by_slot = self.lanes.by_slot();
        let mut keys = Vec::with_capacity(checks.len());
        let mut slots = Vec::new();
        for check in checks {
            let (key, slot) = self.redis_key(check);
            keys.push(key);
            if by_slot {
                slots.push(slot);
            }
        }
        if !checks.is_empty() && slots.windows(2).all(|w| w[0] == w[1]) {
            // One group (standalone, or one slot): all or nothing in one script, so nothing to
            // give back when it denies, and its verdicts are the request's, in order. (No
            // checks: no call, below.)
            let slot = slots.first().copied().unwrap_or(0);
            let owned: Vec<usize>;
            let members = match IN_ORDER.get(..checks.len()) {
                Some(members) => members,
                None => {
                    owned = (0..checks.len()).collect();
                    &owned
                }
            };
            let reply = self
                .run_group(slot, keys, checks, members, now, node_now_us)
                .await?;
            return Ok(Outcome {
                allowed: reply.allowed,
                backend_now_us: vec![reply.now_us; checks.len()],
                verdicts: reply.verdicts,
                decided_by: DecidedBy::Counters,
            });
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut group_keys: Vec<Vec<Vec<u8>>> = Vec::new();
        for (i, (key, slot)) in keys.into_iter().zip(slots).enumerate() {
            match groups.iter().position(|(s, _)| *s == slot) {
                Some(g) => {
                    groups[g].1.push(i);
                    group_keys[g].push(key);
                }
                None => {
                    groups.push((slot, vec![i]));
                    group_keys.push(vec![key]);
                }
            }
        }
        let results = futures_util::future::join_all(groups.iter().zip(group_keys).map(
            |((slot, members), keys)| {
                self.run_group(*slot, keys, checks, members, now, node_now_us)
            },
        ))
        .await;

        let mut verdicts = vec![Verdict::default(); checks.len()];
        let mut backend_now_us = vec![0; checks.len()];
        let mut allowed = true;
        let mut failed = false;
        for ((_, members), result) in groups.iter().zip(&results) {
            match result {
                Ok(reply) => {
                    allowed &= reply.allowed;
                    for (&i, v) in members.iter().zip(&reply.verdicts) {
                        verdicts[i] = *v;
                        backend_now_us[i] = reply.now_us;
                    }
                }
                Err(_) => failed = true,
            }
        }
        if failed || !allowed {
            // Give back what the allowed groups consumed, then look again at the group's own
            // refunds (a zero refund reports the state), so they report the final state.
            let consumed_groups = groups
                .iter()
                .zip(&results)
                .filter(|(_, r)| matches!(r, Ok(reply) if reply.allowed))
                .map(|((slot, members), _)| (*slot, members));
            for (slot, members) in consumed_groups {
                let rollback = Rollback::of(checks, &verdicts, members.iter().copied());
                if rollback.is_empty() {
                    continue;
                }
                let refunds: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&i| checks[i].kind == CheckKind::Refund)
                    .collect();
                let undone = rollback.indices().len();
                let sent: Vec<Check<'_>> = rollback
                    .refunds(checks, &backend_now_us)
                    .chain(refunds.iter().map(|&i| checks[i].again()))
                    .collect();
                let sent_keys: Vec<Vec<u8>> = sent.iter().map(|c| self.redis_key(c).0).collect();
                let all: Vec<usize> = (0..sent.len()).collect();
                match self
                    .run_group(slot, sent_keys, &sent, &all, now, node_now_us)
                    .await
                {
                    Ok(reply) => {
                        for (&i, v) in refunds.iter().zip(&reply.verdicts[undone..]) {
                            verdicts[i] = *v;
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not refund a rolled-back group"),
                }
                rollback.report(checks, &mut verdicts);
            }
        }
        // Any group's error means Redis failed the request; the last one is reported.
        if let Some(e) = results.into_iter().filter_map(Result::err).last() {
            return Err(e);
        }
        Ok(Outcome {
            allowed,
            verdicts,
            decided_by: DecidedBy::Counters,
            backend_now_us,
        })
    }
}
