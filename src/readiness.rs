//! Whether this node takes traffic: the one rule that gRPC health, `/readyz` and `/healthcheck`
//! all read, so they can never disagree about why.
//!
//! A node is *ready* when it is not draining, its backend has been reached since the start (a
//! node that never could is misconfigured or cut off, as the reference service treats it), and
//! the backend is up or the failure policy answers without it. `/healthcheck` (the reference's
//! probe, which Envoy Gateway uses for liveness as well as readiness) asks less: a backend that
//! went down *after* it was reached does not fail it, so a node answering by its failure policy
//! is never restarted for an outage it cannot fix.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::store::Upkeep;

/// Where a node stands, most serious first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Shutting down: calls are still answered, but traffic should go elsewhere.
    Draining,
    /// The backend has not been reached since the start.
    NeverReached,
    /// The backend is down and the failure policy is `error`: calls fail with UNAVAILABLE.
    BackendDown,
    /// The backend is down; the failure policy answers.
    ByPolicy,
    Ready,
}

impl Readiness {
    /// Takes traffic (gRPC health SERVING, `/readyz` 200).
    pub fn ready(self) -> bool {
        matches!(self, Readiness::Ready | Readiness::ByPolicy)
    }

    /// The reference's `/healthcheck` passes: everything but a drain or a backend never reached.
    pub fn healthy(self) -> bool {
        !matches!(self, Readiness::Draining | Readiness::NeverReached)
    }

    /// Why, in a line (the body of `/readyz`).
    pub fn reason(self) -> &'static str {
        match self {
            Readiness::Draining => "NOT SERVING: shutting down",
            Readiness::NeverReached => "NOT READY: the rate limit backend has not been reached yet",
            Readiness::BackendDown => {
                "NOT READY: the rate limit backend is down and the failure policy is error"
            }
            Readiness::ByPolicy => "READY: backend down, answering by the failure policy",
            Readiness::Ready => "READY",
        }
    }
}

/// Reads a node's readiness from its store's upkeep and its own drain flag.
pub struct Gate {
    upkeep: Arc<Upkeep>,
    draining: AtomicBool,
}

impl Gate {
    pub fn new(upkeep: Arc<Upkeep>) -> Self {
        Self {
            upkeep,
            draining: AtomicBool::new(false),
        }
    }

    /// From now on the node says it is going (it cannot come back).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn now(&self) -> Readiness {
        if self.draining.load(Ordering::Acquire) {
            return Readiness::Draining;
        }
        let store = self.upkeep.report();
        if !store.backend_reached {
            Readiness::NeverReached
        } else if store.backend_up() {
            Readiness::Ready
        } else if store.serves_without_backend {
            Readiness::ByPolicy
        } else {
            Readiness::BackendDown
        }
    }
}
