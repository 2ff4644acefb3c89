//! The lease layer: decides hybrid batches from leases, or sends one backend call that takes
//! new leases and gives old leftovers back; and [`GiveBack`], which returns what ran out.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use super::table::{Ask, LeaseTable, Leftover, Returned};
use crate::limiter::Verdict;
use crate::store::{Check, CheckKind, DecidedBy, Outcome, Store, StoreError};

/// The layer: hybrid checks are decided from leases when they hold enough, else by one call to
/// the inner store that also takes new leases (and gives the old leftovers back). Strict
/// batches pass straight through. A backend failure is returned as it is: the failure policy
/// outside decides the request's own checks.
pub struct Leases<S> {
    /// Shared with [`GiveBack`], which refunds leftovers through it.
    inner: Arc<S>,
    table: Arc<LeaseTable>,
}

impl<S: Store> Leases<S> {
    pub fn new(inner: S, table: LeaseTable) -> Self {
        Self {
            inner: Arc::new(inner),
            table: Arc::new(table),
        }
    }

    /// What gives this layer's leftovers back, for the upkeep.
    pub fn give_back(&self) -> GiveBack<S> {
        GiveBack {
            inner: self.inner.clone(),
            table: self.table.clone(),
        }
    }

    /// Hybrid checks: from the leases when they hold enough; else one backend call that also
    /// takes new leases, and when those do not fit, a second call for the request alone.
    async fn apply_hybrid(&self, request: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let table = &self.table;
        let checks = match table.absorb_into_refunds(request) {
            Some(absorbed) => Cow::Owned(absorbed),
            None => Cow::Borrowed(request),
        };
        let now = table.now();
        if let Some(verdicts) = table.decide_locally(&checks, now) {
            return Ok(Outcome {
                allowed: true,
                verdicts,
                decided_by: DecidedBy::Counters,
                backend_now_us: Vec::new(),
            });
        }
        let mut sent = Sent::with_leases(table, request, checks, now);
        loop {
            let outcome = self.inner.apply(&sent.call()).await?;
            match sent.answer(table, outcome) {
                Answer::Done(outcome) => return Ok(outcome),
                Answer::Again(alone) => sent = alone,
            }
        }
    }
}

impl<S: Store> Store for Leases<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        if checks.iter().any(|c| self.table.is_hybrid(c)) {
            return self.apply_hybrid(checks).await;
        }
        let absorbed = self.table.absorb_into_refunds(checks);
        let checks = absorbed.as_deref().unwrap_or(checks);
        let outcome = self.inner.apply(checks).await?;
        self.table.learn_refunds(checks, &outcome);
        Ok(outcome)
    }
}

/// A hybrid request on its way to the backend, as a value (as `Rollback` is): the request as
/// the caller sent it, the same with live leases absorbed into its refunds, what each check
/// asked of a lease and which old leftovers go back with it. [`Sent::answer`] turns the
/// backend's outcome into the caller's; it is the one place a `remaining` is adjusted.
struct Sent<'r, 'c> {
    /// The request as the caller sent it.
    request: &'r [Check<'c>],
    /// The request with live leases absorbed into its refunds (see
    /// `LeaseTable::absorb_into_refunds`): what the backend is asked to apply.
    checks: Cow<'r, [Check<'c>]>,
    /// One per check: the extra hits asked for a lease, the old lease's leftover given back, or
    /// the live lease kept.
    asks: Vec<Ask>,
    /// The local clock when the request was first sent (a lease's deadline counts from it).
    sent_at: u64,
    pass: Pass,
}

enum Pass {
    /// Each check with its lease's extra hits, the old leftovers given back after them.
    WithLeases,
    /// The leases did not fit: the request alone, exactly. What the first call applied for
    /// good (every refund, every cost limit's charge) only looks now, and a charge reports what
    /// the first call decided (`first`).
    Alone { first: Vec<Verdict> },
}

/// What the backend's answer to a [`Sent`] batch means for the caller.
enum Answer<'r, 'c> {
    Done(Outcome),
    /// The leases did not fit: send the request alone.
    Again(Sent<'r, 'c>),
}

/// The checks of `checks` on the counter of check `i` (same key and limit), `i` excluded.
fn same_counter<'a>(checks: &'a [Check<'_>], i: usize) -> impl Iterator<Item = usize> + 'a {
    let (key, limit) = (checks[i].key, checks[i].limit);
    (0..checks.len()).filter(move |&j| j != i && checks[j].key == key && checks[j].limit == limit)
}

/// The request's refunds of check `i`'s counter.
fn refunds_of<'a>(checks: &'a [Check<'_>], i: usize) -> impl Iterator<Item = usize> + 'a {
    same_counter(checks, i).filter(|&r| checks[r].kind == CheckKind::Refund)
}

impl<'r, 'c> Sent<'r, 'c> {
    /// The first call: each hybrid check asks for a lease sized by the table.
    fn with_leases(
        table: &LeaseTable,
        request: &'r [Check<'c>],
        checks: Cow<'r, [Check<'c>]>,
        now: u64,
    ) -> Self {
        let asks = table.plan(&checks, now);
        Self {
            request,
            checks,
            asks,
            sent_at: now,
            pass: Pass::WithLeases,
        }
    }

    /// The batch the backend applies: the checks, then the leftovers given back (under their
    /// own, maybe old, limit; applied last, as every store applies refunds).
    fn call(&self) -> Vec<Check<'_>> {
        let mut call: Vec<Check<'_>> = match self.pass {
            Pass::WithLeases => self
                .checks
                .iter()
                .zip(&self.asks)
                .map(|(c, a)| Check {
                    hits: c.hits.saturating_add(a.extra),
                    ..*c
                })
                .collect(),
            Pass::Alone { .. } => self.checks.iter().map(Check::again).collect(),
        };
        for (i, leftover) in self.given_back() {
            let c = &self.checks[i];
            call.push(Check {
                on_failure: c.on_failure,
                mode: c.mode,
                ..leftover.refund(c.key, c.tag)
            });
        }
        call
    }

    /// The checks whose old lease's leftover goes back in this call, with it, in call order.
    fn given_back(&self) -> impl Iterator<Item = (usize, &Leftover)> + '_ {
        self.asks
            .iter()
            .enumerate()
            .filter_map(|(i, a)| a.give_back.as_ref().map(|g| (i, g)))
    }

    /// The hits the request itself gives back to check `i`'s counter (as the caller sent them,
    /// before any lease was absorbed into them).
    fn own_refunds(&self, i: usize) -> u64 {
        refunds_of(self.request, i).fold(0u64, |sum, r| sum.saturating_add(self.request[r].hits))
    }

    /// The backend's outcome as the caller's. A status counts this node's held hits as
    /// remaining; a batch reports each check before the request's own refunds, and a refund the
    /// counter's final state. The table learns what the backend said; when the leases asked
    /// for did not fit, the request goes again alone.
    fn answer(self, table: &LeaseTable, mut outcome: Outcome) -> Answer<'r, 'c> {
        let n = self.checks.len();
        // The old leases' leftovers went back after the request's checks: a refund of the
        // counter reports the state after them, the counter's charge the state before the
        // request's own refunds (unless the limit changed: the leftover went to the old limit).
        for (k, (i, leftover)) in self.given_back().enumerate() {
            if leftover.limit != *self.checks[i].limit {
                continue;
            }
            let final_remaining = outcome.verdicts[n + k].remaining;
            for r in refunds_of(&self.checks, i) {
                outcome.verdicts[r].remaining = final_remaining;
            }
            outcome.verdicts[i].remaining = final_remaining.saturating_add(self.own_refunds(i));
        }
        let first_pass = matches!(self.pass, Pass::WithLeases);
        let asked = self.asks.iter().any(|a| a.extra > 0);
        if first_pass && !outcome.allowed && asked {
            table.learn_refunds(&self.checks, &outcome);
            return Answer::Again(Sent {
                asks: vec![Ask::default(); n],
                pass: Pass::Alone {
                    first: outcome.verdicts,
                },
                ..self
            });
        }
        let held = table.learn(&self.checks, &self.asks, &outcome, self.sent_at);
        if first_pass {
            // After `learn`: a refund's verdict is the counter's final state, later than the
            // charge's.
            table.learn_refunds(&self.checks, &outcome);
        }
        outcome.verdicts.truncate(n);
        outcome.backend_now_us.truncate(n);
        let verdicts = &mut outcome.verdicts;
        for (v, held) in verdicts.iter_mut().zip(held) {
            v.remaining = v.remaining.saturating_add(held);
        }
        match &self.pass {
            Pass::WithLeases => {
                // A refund of a counter the request also charges: the lease it absorbed was
                // held, not admitted, so the charge reports without it; the refund reports the
                // final state with the new lease (this node's hits) counted.
                for r in (0..n).filter(|&r| self.checks[r].kind == CheckKind::Refund) {
                    let taken = self.checks[r].hits.saturating_sub(self.request[r].hits);
                    for i in same_counter(&self.checks, r)
                        .filter(|&i| self.checks[i].kind != CheckKind::Refund)
                    {
                        verdicts[i].remaining = verdicts[i].remaining.saturating_add(taken);
                        if outcome.allowed {
                            verdicts[r].remaining =
                                verdicts[r].remaining.saturating_add(self.asks[i].extra);
                        }
                    }
                }
            }
            Pass::Alone { first } => {
                for (i, c) in self.checks.iter().enumerate() {
                    if c.kind == CheckKind::Refund {
                        continue;
                    }
                    if c.always_applied() {
                        verdicts[i] = first[i];
                        continue;
                    }
                    // This call saw the request's own refunds of the counter already applied.
                    verdicts[i].remaining =
                        verdicts[i].remaining.saturating_sub(self.own_refunds(i));
                }
            }
        }
        Answer::Done(outcome)
    }
}

/// Gives the leftovers of leases that ran out back to the backend; the upkeep runs it a few
/// times per lease lifetime, and once for every lease when the node stops.
pub struct GiveBack<S> {
    inner: Arc<S>,
    table: Arc<LeaseTable>,
}

impl<S> GiveBack<S> {
    /// What this node holds in a lease of the counter `key`.
    pub fn held_for(&self, key: &[u8]) -> Option<u64> {
        self.table.held_for(key)
    }
}

impl<S: Store> GiveBack<S> {
    /// Gives back the leftovers of leases that ran out (all of them when the node stops).
    pub async fn run(&self, all: bool) {
        let returned = self.table.take_leftovers(all);
        if returned.is_empty() {
            return;
        }
        let checks: Vec<Check<'_>> = returned.iter().map(Returned::check).collect();
        if let Err(e) = self.inner.apply(&checks).await {
            // They stay counted until their window ends: under-admission, never more.
            tracing::debug!(error = %e, leases = checks.len(), "could not give leases back");
        }
    }

    /// How often [`GiveBack::run`] should run: a few times per lease lifetime, so leftovers go
    /// back soon after they run out.
    pub fn every(&self) -> Duration {
        self.table.options().ttl / 4
    }

    /// Hits held in leases now.
    pub fn held(&self) -> u64 {
        self.table.held()
    }
}
