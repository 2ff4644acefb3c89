//! Where limiter state lives, and how it stays trustworthy when the backend does not.
//!
//! One call, [`Store::apply`], decides a whole request's checks all-or-nothing: if any
//! enforced check is denied, no check consumes anything. Two stores hold state: [`MemoryStore`]
//! (this process) and [`redis::RedisStore`] (shared by a fleet). Everything else is a *layer*:
//! a type that implements `Store` by wrapping another and does one thing, in tower's shape.
//! [`build`] composes them in one place, outermost first:
//!
//! ```text
//! OverLimitCache   counters the backend denied are denied here until they can fit again
//!  └ Fallback      the failure policy when the backend is down (allow / deny / local / error)
//!     └ Leases     mode: hybrid — decide from a lease of the shared quota, no backend call
//!        └ Metered backend call latency and errors (by error variant) for the metrics
//!           └ Breaker  stop calling a backend that keeps failing; probe it to recover
//!              └ RedisStore
//! ```
//!
//! The order matters: the cache must see the policy's answers to ignore them (they say nothing
//! of the shared counters); the policy must see every way the backend failed, the leases'
//! extra calls included, and decide the *request's* checks, not a lease's; the breaker must see
//! each real call, and the metrics the calls the breaker refused.
//!
//! The store only decides. What runs on timers (sweeping expired counters and denials, giving
//! leftover leases back) and what the store reports (readiness, gauges) is its [`Upkeep`],
//! which [`build`] returns beside the stack, as tower's `Buffer::pair` hands back its worker;
//! the server runs it.
//!
//! Errors are typed ([`StoreError`]): layers act on the variant, never on a message.

mod batch;
pub mod breaker;
mod build;
pub mod fallback;
pub mod lease;
mod memory;
pub mod metered;
pub mod over_limit;
pub mod redis;
mod sharded;
mod upkeep;

use std::future::Future;

pub use crate::counter::{FailureMode, KeyBuf, Mode};
pub use batch::{Check, CheckKind, DecidedBy, Outcome, Rollback, StoreError};
pub use breaker::{Breaker, BreakerOptions, BreakerState};
pub use build::{Backend, BackendConfig, BuildError, Clocks, Shared, Stack, StoreConfig, build};
pub use fallback::Fallback;
pub use lease::{LeaseOptions, Leases};
pub use memory::MemoryStore;
pub use metered::{BackendObserver, Metered};
pub use over_limit::OverLimitCache;
pub use upkeep::{StoreStatus, Upkeep};

pub trait Store: Send + Sync + 'static {
    /// Applies `checks` atomically with respect to every other call: all enforced and shadow
    /// checks that fit consume if and only if no enforced check is denied.
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send;
}

/// A store shared with its [`Upkeep`] (the lease layer's backend, which the upkeep also gives
/// leftovers back through) is still a store.
impl<S: Store> Store for std::sync::Arc<S> {
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        (**self).apply(checks)
    }
}
