//! Quota leases (`mode: hybrid`): a node takes a slice of a counter's remaining quota from the
//! shared store, charged there up front in the same script call as the request that needed it,
//! and then admits requests from the slice locally, with no backend call, until it is spent, it
//! expires (`ttl`) or its window ends. An unused slice goes back (a refund) when it expires or
//! the node stops, and the refund is applied only while the window it came from lasts.
//!
//! Why it never over-admits: every leased hit is in the shared counter before this node admits
//! it, and it is admitted within the window it was charged to (the lease's local deadline is
//! computed from the time the request was sent, so it falls before the window's end in Redis).
//! That holds for `fixed_window` and `sliding_window` (a hit charged early in the current
//! window counts exactly as one charged later in it). It does not hold for the others, which
//! stay strict under `mode: hybrid` (see `Algorithm::leasable`):
//! - the buckets (token_bucket, leaky_bucket, gcra) keep draining while the slice sits unused,
//!   so Redis would hand the drained room to other nodes and the fleet could exceed the burst by
//!   up to rate × lease lifetime; reserving that drain up front costs as much as the lease saves;
//! - sliding_log stamps hits with the time they were charged, so early charges expire early.
//!
//! The price is under-admission: hits in other nodes' leases. A lease is sized from this node's
//! own recent rate for the counter (`target` of its traffic; up to its `ttl` of traffic while
//! that is under 1/64 of what remains), at most double the last one, and never more than a
//! quarter of what remains, so near the limit a node falls back to one backend call per request.
//!
//! `table`: [`LeaseTable`], the bookkeeping and the sizing policy (sharded, so threads do not
//! queue on one lock). `layer`: [`Leases`], the store layer that uses it, and [`GiveBack`], the
//! upkeep's part (leftovers back to the backend).

mod layer;
mod table;

use std::time::Duration;

use super::Mode;

pub use layer::{GiveBack, Leases};
pub use table::{Ask, LeaseTable, Leftover, Returned};

#[derive(Debug, Clone, Copy)]
pub struct LeaseOptions {
    /// The mode of rules that set none.
    pub default_mode: Mode,
    /// A lease is used for at most this long; then its leftover goes back.
    pub ttl: Duration,
    /// A lease covers about this much of the node's recent traffic for its counter.
    pub target: Duration,
    /// Counters with lease state at most (rounded up to a whole number per shard); beyond it
    /// new counters are strict.
    pub max_entries: usize,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        Self {
            default_mode: Mode::Strict,
            ttl: Duration::from_secs(2),
            target: Duration::from_millis(100),
            max_entries: 100_000,
        }
    }
}
