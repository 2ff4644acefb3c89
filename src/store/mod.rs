//! Where limiter state lives. One call, [`Store::apply`], decides a whole request's checks
//! all-or-nothing: if any enforced check is denied, no check consumes anything.

/// `name()`, `Display` and `FromStr` for an enum of settings spelled in rules and flags
/// (`failure_mode`, `mode`); an unknown spelling's error lists the choices.
macro_rules! spelled_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(format!(
                        "unknown {} '{s}' (expected {})",
                        $what,
                        $crate::store::choices(&[$($name),+])
                    )),
                }
            }
        }
    };
}

/// `a, b or c`.
fn choices(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

pub mod breaker;
pub mod key;
pub mod lease;
mod memory;
pub mod over_limit;
pub mod redis;
mod resilient;

use std::future::Future;

pub use key::KeyBuf;
pub use lease::{LeaseOptions, Mode};
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
    /// The rule's mode, when it sets one (else the store's default): `hybrid` lets a node
    /// decide from a lease of the shared quota (see `lease`).
    pub mode: Option<Mode>,
    /// Refunds only: applied only while the store's clock is before this (0: always). A lease's
    /// unused hits may be given back only to the window they were taken from.
    pub until_us: u64,
}

impl<'a> Check<'a> {
    /// An enforced check of `hits` on `key` (the key is its own slot tag), with the rule's
    /// defaults: no failure mode, no mode.
    pub fn enforce(key: &'a [u8], limit: &'a Limit, hits: u64) -> Self {
        Self {
            key,
            tag: key,
            limit,
            hits,
            kind: CheckKind::Enforce,
            on_failure: None,
            mode: None,
            until_us: 0,
        }
    }
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
    /// The backend's clock when it decided each check (Redis `TIME`; empty for the memory
    /// store): where a lease's window ends is computed from it.
    pub backend_now_us: Vec<u64>,
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

    /// Gives quota held on this node back to the shared store: the leases that ran out, or
    /// all of them when the node stops.
    fn return_leases(&self, _all: bool) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// How often `return_leases` should run (None: this store holds no leases).
    fn lease_sweep_every(&self) -> Option<std::time::Duration> {
        None
    }

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

    /// Hits held in quota leases, for metrics.
    fn lease_hits_held(&self) -> Option<u64> {
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
