//! What runs beside the store, and what it reports. [`build`](super::build) returns it with the
//! stack, as tower's `Buffer::pair` hands its worker back: the stack only decides
//! ([`Store::apply`](super::Store::apply)); the server runs this on its timers and reads its
//! report for readiness and gauges.
//!
//! Each layer keeps what its upkeep needs behind an `Arc` it shares with this value: the memory
//! counters (swept of expired keys), the over-limit cache's denials (swept), the failure
//! policy's tally, the leases' leftovers (given back), the breaker's circuit and whether Redis
//! was ever reached. The upkeep owns no decision.

use std::sync::Arc;
use std::time::Duration;

use super::breaker::{BreakerState, Circuit};
use super::fallback::{FleetShare, LastSeen, PolicyDecisions};
use super::lease::GiveBack;
use super::over_limit::Denials;
use super::redis::{FleetBeat, Reached};
use super::{Backend, MemoryStore};

/// The upkeep of one store stack.
pub struct Upkeep {
    /// The memory backend's counters, or the failure policy's own.
    memory: Arc<MemoryStore>,
    /// The shared backend's layers; None for the memory backend.
    shared: Option<SharedUpkeep>,
}

/// The parts of the shared stack's layers that the upkeep tends or reads.
pub(super) struct SharedUpkeep {
    pub denials: Arc<Denials>,
    pub last_seen: Arc<LastSeen>,
    pub policy: Arc<PolicyDecisions>,
    pub serves_without_backend: bool,
    pub leases: GiveBack<Backend>,
    pub circuit: Arc<Circuit>,
    pub reached: Reached,
    /// The fleet heartbeat (None with `--fleet-heartbeat 0s`), and what `local` learns of it.
    pub fleet: Option<Fleet>,
    /// What stopping may spend on the backend in all: one `--redis-timeout`.
    pub stop_budget: Duration,
}

/// This node's heartbeat and the fleet share the failure policy reads.
pub(super) struct Fleet {
    pub beat: FleetBeat,
    pub share: Arc<FleetShare>,
    pub every: Duration,
    pub clock: Arc<dyn crate::clock::Clock>,
}

impl Upkeep {
    pub(super) fn memory(memory: Arc<MemoryStore>) -> Self {
        Self {
            memory,
            shared: None,
        }
    }

    pub(super) fn shared(memory: Arc<MemoryStore>, shared: SharedUpkeep) -> Self {
        Self {
            memory,
            shared: Some(shared),
        }
    }

    /// Forgets expired counters and denials: CPU-bound (a walk of every key), so the server
    /// runs it every few seconds on a blocking thread, never on an async worker.
    pub fn sweep(&self) {
        self.memory.sweep();
        if let Some(s) = &self.shared {
            s.denials.sweep();
            s.last_seen.sweep(self.memory.now());
        }
    }

    /// What this node holds in a quota lease of the counter `key` (hybrid mode); None without a
    /// shared backend or without a lease of it.
    pub fn leased(&self, key: &[u8]) -> Option<u64> {
        self.shared.as_ref().and_then(|s| s.leases.held_for(key))
    }

    /// How often [`Upkeep::beat`] should run; None without a fleet heartbeat.
    pub fn beat_every(&self) -> Option<Duration> {
        self.shared.as_ref()?.fleet.as_ref().map(|f| f.every)
    }

    /// Announces this node to the fleet and learns how many nodes are live (kept for
    /// `failure_mode: local` while Redis is lost: the last count seen stands). Returns it.
    pub async fn beat(&self) -> Option<u64> {
        let fleet = self.shared.as_ref()?.fleet.as_ref()?;
        let every_ms = u64::try_from(fleet.every.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let now_ms = fleet.clock.now_micros() / 1_000;
        match fleet.beat.beat(now_ms, every_ms.saturating_mul(3)).await {
            Ok(Some(live)) => {
                fleet.share.set(live);
                Some(live)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "fleet heartbeat failed; the last fleet size stands");
                None
            }
        }
    }

    /// The fleet size `failure_mode: local` divides limits by now.
    pub fn fleet_nodes(&self) -> u64 {
        self.shared
            .as_ref()
            .and_then(|s| s.fleet.as_ref())
            .map_or(1, |f| f.share.nodes())
    }

    /// How often [`Upkeep::give_back`] should run; None when nothing is ever held.
    pub fn give_back_every(&self) -> Option<Duration> {
        self.shared.as_ref().map(|s| s.leases.every())
    }

    /// Gives quota held on this node back to the shared store: what ran out, or everything
    /// when the node stops (`all`).
    pub async fn give_back(&self, all: bool) {
        if let Some(s) = &self.shared {
            s.leases.run(all).await;
        }
    }

    /// The node stops: what it holds in leases goes back and it leaves the fleet, in one
    /// bounded go. At most one backend timeout in all, and none while the breaker is not
    /// closed (a backend that is failing would only make the stop wait): what is not given
    /// back stays counted until its window ends — under-admission, never more — and the fleet
    /// forgets the node when its heartbeat expires.
    pub async fn stop(&self) {
        let Some(s) = &self.shared else {
            return;
        };
        let held = s.leases.held();
        if s.circuit.state() != BreakerState::Closed {
            tracing::info!(
                lease_hits_held = held,
                "the backend's circuit is not closed: leases stay counted until their windows end"
            );
            return;
        }
        let leave = async {
            if let Some(fleet) = &s.fleet
                && let Err(e) = fleet.beat.leave().await
            {
                tracing::debug!(error = %e, "could not leave the fleet; its heartbeat expires");
            }
        };
        let both = futures_util::future::join(s.leases.run(true), leave);
        if tokio::time::timeout(s.stop_budget, both).await.is_err() {
            tracing::warn!(
                lease_hits_held = held,
                budget = ?s.stop_budget,
                "the backend did not answer while stopping: leases stay counted until their windows end"
            );
        }
    }

    /// What the store reports now.
    pub fn report(&self) -> StoreStatus {
        let keys_in_memory = Some(self.memory.len());
        let Some(s) = &self.shared else {
            return StoreStatus {
                keys_in_memory,
                ..StoreStatus::default()
            };
        };
        StoreStatus {
            keys_in_memory,
            lease_hits_held: Some(s.leases.held()),
            cached_denials: Some(s.denials.len()),
            policy_decisions: Some(s.policy.get()),
            breaker: Some(s.circuit.state()),
            serves_without_backend: s.serves_without_backend,
            backend_reached: s.reached.get(),
        }
    }
}

/// What the store reports for health and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStatus {
    /// Counters held in this process's memory.
    pub keys_in_memory: Option<usize>,
    /// Hits held in quota leases.
    pub lease_hits_held: Option<u64>,
    /// Denials the over-limit cache holds.
    pub cached_denials: Option<usize>,
    /// Requests the failure policy answered.
    pub policy_decisions: Option<u64>,
    pub breaker: Option<BreakerState>,
    /// Calls are still answered while the backend is down (false when the policy is `error`).
    pub serves_without_backend: bool,
    /// The backend has been reached at least once since the start (always, without one).
    pub backend_reached: bool,
}

impl Default for StoreStatus {
    fn default() -> Self {
        Self {
            keys_in_memory: None,
            lease_hits_held: None,
            cached_denials: None,
            policy_decisions: None,
            breaker: None,
            serves_without_backend: true,
            backend_reached: true,
        }
    }
}

impl StoreStatus {
    /// The backend answers now (false while its circuit is open or half-open).
    pub fn backend_up(&self) -> bool {
        self.breaker.is_none_or(|b| b == BreakerState::Closed)
    }
}
