//! The store's vocabulary: a batch of [`Check`]s, its [`Outcome`] and who decided it, the
//! [`Rollback`] that undoes an allowed batch, and why a store could not decide ([`StoreError`]).

use std::time::Duration;

use super::{FailureMode, Mode};
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
    /// A concurrency limit's check: the request's slot (see `limiter::slot_id`), which an
    /// enforced check acquires and a refund releases; 0 elsewhere.
    pub slot: u64,
}

impl<'a> Check<'a> {
    /// Applied whatever the batch decides, never undone: a refund (it returns hits an earlier
    /// request consumed) or a cost limit's charge (the cost was spent already). Every other
    /// check consumes only with its batch, and a rollback gives back what it consumed.
    pub fn always_applied(&self) -> bool {
        self.kind == CheckKind::Refund || crate::limiter::charges_always(self.limit, self.hits)
    }

    /// The refund that gives back what this check consumed, decided at `decided_at_us` (the
    /// backend's clock; 0: unknown). A concurrency limit's slot is released only if it expires
    /// when this check's acquisition made it expire: a slot the request held already (a retried
    /// call) is not this call's to give back.
    pub fn undo(&self, decided_at_us: u64) -> Self {
        let until_us = if self.limit.algorithm.holds_slots() && decided_at_us != 0 {
            decided_at_us.saturating_add(self.limit.period_us)
        } else {
            0
        };
        Self {
            kind: CheckKind::Refund,
            until_us,
            ..*self
        }
    }

    /// This check sent again, after a call that already applied it: what stands for good there
    /// (a refund, a cost limit's charge) is only looked at now (0 hits), so it reports the
    /// counter's state without applying twice.
    pub fn again(&self) -> Self {
        if self.always_applied() {
            Self { hits: 0, ..*self }
        } else {
            *self
        }
    }

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
            slot: 0,
        }
    }
}

/// What an allowed batch consumed and must give back because the request is denied after all
/// (another Redis Cluster slot's group denied, or every quota descriptor is over): the checks
/// that consumed hits, the refunds that undo them, and their verdicts as a denied batch reports
/// them. A refund or a cost limit's charge stands whatever the batch does, so it is not undone.
pub struct Rollback(Vec<usize>);

impl Rollback {
    /// The checks among `members` that consumed.
    pub fn of(
        checks: &[Check<'_>],
        verdicts: &[Verdict],
        members: impl IntoIterator<Item = usize>,
    ) -> Self {
        Self(
            members
                .into_iter()
                .filter(|&i| {
                    !checks[i].always_applied() && checks[i].hits > 0 && verdicts[i].allowed
                })
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The indices of the checks it undoes.
    pub fn indices(&self) -> &[usize] {
        &self.0
    }

    /// The refunds that undo them, in [`Rollback::indices`]' order; `decided_at_us`: when the
    /// backend decided each check (empty: unknown), see [`Check::undo`].
    pub fn refunds<'a, 'c>(
        &'a self,
        checks: &'a [Check<'c>],
        decided_at_us: &'a [u64],
    ) -> impl Iterator<Item = Check<'c>> + 'a {
        self.0
            .iter()
            .map(|&i| checks[i].undo(decided_at_us.get(i).copied().unwrap_or(0)))
    }

    /// Reports each undone check as if it had not consumed, as a denied batch reports it.
    pub fn report(&self, checks: &[Check<'_>], verdicts: &mut [Verdict]) {
        for &i in &self.0 {
            verdicts[i] = verdicts[i].unconsumed(checks[i].hits);
        }
    }
}

/// Why a store could not decide. The backend variants (`Timeout`, `Unavailable`,
/// `CircuitOpen`) are what the failure policy answers for; `Full` is this process's own limit.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The memory store is at `--max-keys` and cannot track a new counter.
    #[error("the store holds its maximum of {0} keys")]
    Full(usize),
    /// The backend did not answer in time (`--redis-timeout`).
    #[error("the rate limit backend did not answer within {0:?}")]
    Timeout(Duration),
    /// The backend refused, failed or answered something unusable.
    #[error("the rate limit backend is unavailable: {source}")]
    Unavailable {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The breaker stopped calling a backend that kept failing.
    #[error("the circuit to the rate limit backend is open after repeated failures")]
    CircuitOpen,
}

impl StoreError {
    pub fn unavailable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Unavailable {
            source: source.into(),
        }
    }

    /// The backend cannot answer now: the failure policy decides instead.
    pub fn is_backend_down(&self) -> bool {
        !matches!(self, StoreError::Full(_))
    }

    /// A metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Full(_) => "full",
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::CircuitOpen => "circuit_open",
        }
    }
}

/// Who decided a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecidedBy {
    /// The counters: the backend, or a lease of its quota.
    #[default]
    Counters,
    /// The failure policy, the backend being down, with the mode that decided: `deny` when an
    /// enforced check's mode denies, else `local` when a check was counted on this node alone,
    /// else `allow`. (`error` decides nothing: the call fails.)
    Policy(FailureMode),
}

impl DecidedBy {
    /// The failure policy decided: the verdicts say nothing of the shared counters.
    pub fn is_policy(self) -> bool {
        matches!(self, DecidedBy::Policy(_))
    }
}

/// The outcome of a batch: one verdict per check, in order, and whether the batch was allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub allowed: bool,
    pub verdicts: Vec<Verdict>,
    /// The counters, or the failure policy when the backend could not answer.
    pub decided_by: DecidedBy,
    /// The backend's clock when it decided each check (Redis `TIME`; empty for the memory
    /// store): where a lease's window ends is computed from it.
    pub backend_now_us: Vec<u64>,
}
