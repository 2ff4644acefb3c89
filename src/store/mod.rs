//! Where limiter state lives. One call, [`Store::apply`], decides a whole request's checks
//! all-or-nothing: if any enforced check is denied, no check consumes anything.

pub mod breaker;
pub mod key;
mod memory;
pub mod over_limit;
pub mod redis;
mod resilient;

use std::future::Future;

pub use key::KeyBuf;
pub use memory::MemoryStore;
pub use resilient::{FailureMode, Resilient};

use crate::limiter::{Limit, Verdict};

/// What a check does to its counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckKind {
    /// Consumes when the whole batch is allowed; a denial denies the batch.
    Enforce,
    /// Consumes like `Enforce` when it fits, but its denial never denies the batch.
    Shadow,
    /// Gives hits back. Applied even when the batch is denied: a refund returns hits that an
    /// earlier request consumed, and dropping it would under-admit later.
    Refund,
}

/// One limit to apply to one counter.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    pub key: &'a [u8],
    /// The bytes that choose the key's Redis Cluster slot (the descriptor's domain and entries,
    /// so all tiers of a descriptor share a slot). The memory store ignores it.
    pub tag: &'a [u8],
    pub limit: &'a Limit,
    pub hits: u64,
    pub kind: CheckKind,
    /// The rule's failure mode, when it sets one (else the store's default).
    pub on_failure: Option<FailureMode>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// The memory store is at `--max-keys` and cannot track a new counter.
    #[error("the store holds its maximum of {0} keys")]
    Full(usize),
    /// The backend cannot answer now (down, erroring, too slow, circuit open).
    #[error("the rate limit backend is unavailable: {0}")]
    Unavailable(String),
}

/// The outcome of a batch: one verdict per check, in order, and whether the batch was allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub allowed: bool,
    pub verdicts: Vec<Verdict>,
    /// Decided by the failure policy, not the backend.
    pub by_policy: bool,
}

pub trait Store: Send + Sync + 'static {
    /// Applies `checks` atomically with respect to every other call: all enforced and shadow
    /// checks that fit consume if and only if no enforced check is denied.
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send;

    /// Periodic upkeep (the memory store forgets expired keys). Called every few seconds.
    fn housekeeping(&self) {}

    /// Whether the backend answers now (false while a remote store's circuit is open).
    fn backend_up(&self) -> bool {
        true
    }

    /// Whether calls are still answered while the backend is down (false when the failure
    /// policy is `error`).
    fn serves_without_backend(&self) -> bool {
        true
    }

    /// Counters held in this process's memory, for metrics.
    fn keys_in_memory(&self) -> Option<usize> {
        None
    }

    /// The backend's circuit breaker (0 closed, 1 open, 2 half-open), for metrics.
    fn breaker_state(&self) -> Option<i64> {
        None
    }

    /// Ready to take traffic: the backend is up, or the failure policy answers without it.
    fn ready(&self) -> bool {
        self.backend_up() || self.serves_without_backend()
    }
}
