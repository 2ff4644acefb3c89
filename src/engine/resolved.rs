//! One descriptor resolved once against one rule set, for a caller that applies hits to it
//! again and again: an RLQS bucket, whose every grant and every charge of reported usage would
//! otherwise match the rules anew. [`resolve_descriptor`] matches the rules and writes the
//! counters' keys once; [`Engine::apply_hits`] makes one store call with them, deciding as
//! [`Engine::decide`] decides a request of that one descriptor (every limit all-or-nothing,
//! `replaces`, shadow and quota mode), and says who decided.

use std::ops::Range;

use super::{Descriptor, Engine, EngineError, EngineSettings, Limits, Request, plan, resolve};
use crate::counter::{FailureMode, Mode};
use crate::limiter::{Limit, Verdict};
use crate::rules::RuleSet;
use crate::store::{Check, CheckKind, DecidedBy, KeyBuf, Store};

/// How a resolved descriptor's hits are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    /// No limit applies: no rule matched, the rule is unlimited, or every limit was replaced.
    Unlimited,
    /// Counted and never denied (the rule's shadow mode, or the service's).
    Shadow,
    /// Denied past the limits.
    Limited,
}

/// One descriptor of one domain, resolved against one rule set: how its hits are treated, its
/// limits, and the checks a hit makes, their keys written once. (Its failure policy is the
/// checks'; an application says which mode decided, see [`Applied::decided_by`].)
#[derive(Debug, Clone)]
pub struct ResolvedDescriptor {
    /// The descriptor's entries, in the rules' nesting order.
    pub entries: Vec<(String, String)>,
    pub enforcement: Enforcement,
    /// The limits a hit is denied by (the ones `replaces` drops, shadow and quota-mode limits
    /// left out); empty unless [`Enforcement::Limited`].
    pub limits: Vec<Limit>,
    /// Quota mode (the rule's or the service's): the checks deny only together, and a
    /// denied one gives back what the others consumed, as [`Engine::decide`] does.
    quota: bool,
    keys: KeyBuf,
    checks: Vec<PreparedCheck>,
}

/// One check of a resolved descriptor, without its hits.
#[derive(Debug, Clone)]
struct PreparedCheck {
    key: Range<usize>,
    tag: Range<usize>,
    limit: Limit,
    kind: CheckKind,
    on_failure: Option<FailureMode>,
    mode: Option<Mode>,
}

impl PreparedCheck {
    /// The check of `hits`, its key and tag read from `keys`.
    fn with_hits<'a>(&'a self, keys: &'a KeyBuf, hits: u64) -> Check<'a> {
        Check {
            key: keys.slice(self.key.clone()),
            tag: keys.slice(self.tag.clone()),
            limit: &self.limit,
            hits,
            kind: self.kind,
            on_failure: self.on_failure,
            mode: self.mode,
            until_us: 0,
            slot: 0,
        }
    }
}

/// What applying hits to a resolved descriptor decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// The hits fit and were consumed; when not, nothing was.
    pub allowed: bool,
    /// What the deciding limit has left: the denying one, else the tightest.
    pub remaining: u64,
    pub decided_by: DecidedBy,
    /// The backend's clock when it decided (Redis `TIME`); None for the memory store, whose
    /// clock is the caller's.
    pub decided_at_us: Option<u64>,
}

/// Resolves the descriptor `entries` (in the rules' nesting order) of `domain` against `rules`,
/// as [`Engine::decide`] would under `settings`. None when the domain is not configured.
pub fn resolve_descriptor(
    rules: &RuleSet,
    settings: &EngineSettings,
    domain_name: &str,
    entries: Vec<(String, String)>,
) -> Result<Option<ResolvedDescriptor>, EngineError> {
    let Some(domain) = rules.domain(domain_name) else {
        return Ok(None);
    };
    let request = Request {
        domain: domain_name.to_owned(),
        descriptors: vec![Descriptor {
            entries,
            ..Descriptor::default()
        }],
    };
    let mut keys = KeyBuf::default();
    let resolved = [resolve(
        domain,
        domain_name,
        0,
        &request.descriptors[0],
        &mut keys,
        |_, _, _| {},
    )?];
    let planned = plan(&request, &resolved, &mut keys, false, settings.global_quota);
    let r = &resolved[0];
    let rule = r.rule;
    let own_rule = matches!(r.limits, Limits::Tiers(_));
    let shadow = own_rule && rule.is_some_and(|r| r.shadow_mode);
    let rule_quota = own_rule && rule.is_some_and(|r| r.quota_mode);
    let enforcement = match r.limits {
        Limits::None | Limits::Unlimited => Enforcement::Unlimited,
        _ if planned.is_empty() => Enforcement::Unlimited,
        // A concurrency limit counts requests in flight, by each request's own calls: a bucket
        // of usage reports has no request to hold a slot.
        _ if planned.iter().any(|p| p.tier.limit.algorithm.holds_slots()) => Enforcement::Unlimited,
        _ if settings.global_shadow || shadow => Enforcement::Shadow,
        _ if rule_quota => Enforcement::Unlimited,
        _ => Enforcement::Limited,
    };
    let limits = match enforcement {
        Enforcement::Limited => planned.iter().map(|p| p.tier.limit).collect(),
        Enforcement::Unlimited | Enforcement::Shadow => Vec::new(),
    };
    let checks = planned
        .iter()
        .map(|p| PreparedCheck {
            key: p.key.clone(),
            tag: p.tag.clone(),
            limit: p.tier.limit,
            kind: p.kind,
            on_failure: p.on_failure,
            mode: p.mode,
        })
        .collect();
    let quota = planned.iter().any(|p| p.quota);
    drop(planned);
    let [descriptor] = request.descriptors.try_into().expect("one descriptor");
    Ok(Some(ResolvedDescriptor {
        entries: descriptor.entries,
        enforcement,
        limits,
        quota,
        keys,
        checks,
    }))
}

impl<S: Store> Engine<S> {
    /// Applies `hits` to every limit of `resolved` in one store call: all of them or none.
    pub async fn apply_hits(
        &self,
        resolved: &ResolvedDescriptor,
        hits: u64,
    ) -> Result<Applied, EngineError> {
        self.apply_hits_to(resolved, hits, |_| true).await
    }

    /// Applies `hits` to the limits of `resolved` whose windows are flagged in `tiers` (as
    /// [`ResolvedDescriptor::window_ends`] orders them), all of them or none: an RLQS grant's
    /// tokens that may still be spent after the windows they were charged to ended are charged
    /// again to the windows that follow, and only to those.
    pub async fn apply_hits_on(
        &self,
        resolved: &ResolvedDescriptor,
        hits: u64,
        tiers: &[bool],
    ) -> Result<Applied, EngineError> {
        self.apply_hits_to(resolved, hits, |i| tiers.get(i).copied().unwrap_or(false))
            .await
    }

    async fn apply_hits_to(
        &self,
        resolved: &ResolvedDescriptor,
        hits: u64,
        on: impl Fn(usize) -> bool,
    ) -> Result<Applied, EngineError> {
        let checks: Vec<Check<'_>> = resolved
            .checks
            .iter()
            .enumerate()
            .filter(|(i, _)| on(*i))
            .map(|(_, c)| c.with_hits(&resolved.keys, hits))
            .collect();
        if checks.is_empty() {
            return Ok(Applied {
                allowed: true,
                remaining: 0,
                decided_by: DecidedBy::Counters,
                decided_at_us: None,
            });
        }
        let mut outcome = self.store.apply(&checks).await?;
        let denied = |v: &Verdict, c: &Check<'_>| {
            !v.allowed && (c.kind == CheckKind::Enforce || resolved.quota)
        };
        let quota_over = resolved.quota && outcome.verdicts.iter().any(|v| !v.allowed);
        if quota_over && outcome.allowed {
            // The quota checks went as shadow checks: what fitted was consumed.
            self.give_back(&checks, &mut outcome).await;
        }
        let (deciding, check) = outcome
            .verdicts
            .iter()
            .zip(&checks)
            .reduce(|cur, next| {
                if super::tighter(next.0, cur.0) {
                    next
                } else {
                    cur
                }
            })
            .expect("at least one check");
        Ok(Applied {
            allowed: !denied(deciding, check),
            remaining: deciding.remaining,
            decided_by: outcome.decided_by,
            decided_at_us: outcome.backend_now_us.iter().copied().find(|&t| t != 0),
        })
    }

    /// Gives `hits` back to each enforced limit of `resolved` whose window is still the one
    /// that ends at `window_ends[i]` (see [`ResolvedDescriptor::window_ends`]; 0: none, left
    /// alone): hits charged and proven never spent. Whether any limit took them.
    pub async fn return_hits(
        &self,
        resolved: &ResolvedDescriptor,
        hits: u64,
        window_ends: &[u64],
    ) -> Result<bool, EngineError> {
        if window_ends.len() != resolved.checks.len() {
            return Ok(false);
        }
        let checks: Vec<Check<'_>> = resolved
            .checks
            .iter()
            .zip(window_ends)
            .filter(|(c, until)| **until != 0 && c.kind == CheckKind::Enforce)
            .map(|(c, &until_us)| Check {
                kind: CheckKind::Refund,
                until_us,
                ..c.with_hits(&resolved.keys, hits)
            })
            .collect();
        if checks.is_empty() || hits == 0 {
            return Ok(false);
        }
        self.store.apply(&checks).await?;
        Ok(true)
    }
}

impl ResolvedDescriptor {
    /// Where the window each check charged at `at_us` ends, for [`Engine::return_hits`]: 0 for
    /// a limit without windows (a bucket's state has no window to give back to).
    pub fn window_ends(&self, at_us: u64) -> Vec<u64> {
        self.checks
            .iter()
            .map(|c| {
                if c.limit.algorithm.windowed() {
                    c.limit.window_at(at_us).1
                } else {
                    0
                }
            })
            .collect()
    }
}
