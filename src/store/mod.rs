//! Where limiter state lives. One call, [`Store::apply`], decides a whole request's checks
//! all-or-nothing: if any enforced check is denied, no check consumes anything.

pub mod key;
mod memory;

use std::future::Future;

pub use key::KeyBuf;
pub use memory::MemoryStore;

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
    pub limit: &'a Limit,
    pub hits: u64,
    pub kind: CheckKind,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// The memory store is at `--max-keys` and cannot track a new counter.
    #[error("the store holds its maximum of {0} keys")]
    Full(usize),
}

/// The outcome of a batch: one verdict per check, in order, and whether the batch was allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub allowed: bool,
    pub verdicts: Vec<Verdict>,
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
}
