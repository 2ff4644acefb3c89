//! One rate-limit request, start to finish, in domain terms: match each descriptor against the
//! live rules, apply `replaces`, build one check per limit, let the store apply them
//! all-or-nothing, and report a status per descriptor. No protobuf here.

mod request;
mod resolved;

use std::ops::Range;
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use request::{
    Bounds, Code, Decision, Descriptor, LimitOverride, ReportedLimit, Request, Status, StatusStats,
};
pub use resolved::{Applied, Enforcement, ResolvedDescriptor, resolve_descriptor};

use crate::limiter::{Algorithm, Limit, Verdict};
use crate::rules::{Domain, KeyPart, Plan, PlanSource, Rule, RuleSet, Tier, Via};
use crate::store::{Check, CheckKind, DecidedBy, KeyBuf, Outcome, Rollback, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request breaks the protocol or the configured bounds.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, Clone, Default)]
pub struct EngineSettings {
    /// Global shadow mode: the overall code is always OK; statuses tell the truth.
    pub global_shadow: bool,
    /// Global quota mode: every descriptor is in quota mode (the reference's `QUOTA_MODE`).
    pub global_quota: bool,
    pub bounds: Bounds,
}

pub struct Engine<S> {
    rules: ArcSwap<RuleSet>,
    store: S,
    settings: EngineSettings,
}

/// Where one descriptor's limits come from.
#[derive(Debug, Clone)]
pub enum Limits<'r> {
    /// No rule matched (or unknown domain): OK with no limit.
    None,
    Unlimited,
    Tiers(&'r [Tier]),
    /// The request's own limit replaces the configured one.
    Override(Tier),
}

struct Resolved<'r> {
    rule: Option<&'r Rule>,
    /// The caller's plan, when the rule takes its limits from one.
    plan: Option<&'r Plan>,
    limits: Limits<'r>,
    /// Bytes of the descriptor's key prefix (domain and matched entries) in the key buffer.
    prefix: Range<usize>,
    /// Bytes that pick the Redis Cluster slot: the prefix, or the rule's `hash_tag` entry.
    tag: Range<usize>,
    /// A concurrency limit's rule: the request's slot, from its entry (0 elsewhere).
    slot: u64,
}

/// One check before its key slice is borrowed.
struct Planned<'r> {
    descriptor: usize,
    tier: &'r Tier,
    key: Range<usize>,
    /// The descriptor's prefix: what picks the Redis Cluster slot.
    tag: Range<usize>,
    /// Index of the check that carries it (repeats of one counter share a check).
    check: usize,
    /// The request's slot under a concurrency limit (0 elsewhere).
    slot: u64,
    on_failure: Option<crate::counter::FailureMode>,
    mode: Option<crate::counter::Mode>,
    kind: CheckKind,
    hits: u64,
    /// Named by another matched limit's `replaces`: kept only when explaining, never checked.
    replaced: bool,
    /// Quota mode: the store applies it as a shadow check (its denial alone does not deny the
    /// batch); the engine denies the request when every quota descriptor is over.
    quota: bool,
    /// The hits of the other occurrences of this counter in the request (a descriptor named
    /// twice), before and after this one: each occurrence reports as if charged in order.
    earlier_hits: u64,
    later_hits: u64,
}

impl<S: Store> Engine<S> {
    pub fn new(rules: RuleSet, store: S, settings: EngineSettings) -> Self {
        Self {
            rules: ArcSwap::from_pointee(rules),
            store,
            settings,
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The live rules; a caller keeps the snapshot it got for as long as it needs.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    /// Swaps in new rules: requests already running finish on the old ones.
    pub fn replace_rules(&self, rules: RuleSet) {
        self.rules.store(Arc::new(rules));
    }

    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    pub async fn decide(&self, request: &Request) -> Result<Decision, EngineError> {
        self.settings.bounds.check(request)?;
        // A guard, not an `Arc` clone: no reference-count traffic per call (arc-swap falls back to
        // a clone by itself when too many calls hold guards at once, e.g. awaiting Redis).
        let rules = self.rules.load();
        let Some(domain) = rules.domain(&request.domain) else {
            // Unknown domain: OK, as the reference service answers.
            return Ok(Decision::all_ok(request.descriptors.len()));
        };
        let mut keys = KeyBuf::with_capacity(64 * request.descriptors.len());
        let resolved = request
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| resolve(domain, &request.domain, i, d, &mut keys, |_, _, _| {}))
            .collect::<Result<Vec<_>, _>>()?;
        let global_quota = self.settings.global_quota;
        let mut planned = plan(request, &resolved, &mut keys, false, global_quota);
        one_slot_per_counter(&planned, &keys)?;
        let checks = merge_repeats(&mut planned, &keys);
        let mut outcome = self.store.apply(&checks).await?;
        // Counted once: giving back changes only allowed verdicts, and the tally reads denied ones.
        let quota = quota_tally(&resolved, &planned, &outcome, global_quota);
        if outcome.allowed && quota.all_over() {
            // Every quota descriptor is over, so the request is denied, but the store (which
            // applies quota checks as shadow checks) consumed what fitted: give it back.
            self.give_back(&checks, &mut outcome).await;
        }
        Ok(report(
            request,
            &resolved,
            &planned,
            &outcome,
            &quota,
            self.settings.global_shadow,
        ))
    }
}

impl<S: Store> Engine<S> {
    /// Refunds what an allowed batch consumed and marks it denied, reporting every check as if
    /// nothing had been consumed (as a denied batch reports). A refund the backend cannot take
    /// is logged: the counters then hold this request's hits until their window ends.
    async fn give_back(&self, checks: &[Check<'_>], outcome: &mut Outcome) {
        let rollback = Rollback::of(checks, &outcome.verdicts, 0..checks.len());
        let refunds: Vec<Check<'_>> = rollback.refunds(checks, &outcome.backend_now_us).collect();
        if !refunds.is_empty()
            && let Err(e) = self.store.apply(&refunds).await
        {
            tracing::warn!(error = %e, "could not give back the hits of a request every quota descriptor denied");
        }
        rollback.report(checks, &mut outcome.verdicts);
        outcome.allowed = false;
    }
}

/// The quota-mode descriptors of a request: how many, how many are over, and the soonest one
/// of those would allow again.
#[derive(Debug, Default)]
struct QuotaTally {
    total: usize,
    over: usize,
    soonest_retry_us: Option<u64>,
}

impl QuotaTally {
    /// The reference's rule: a request with quota descriptors is denied when all are over.
    fn all_over(&self) -> bool {
        self.total > 0 && self.over == self.total
    }
}

/// Counts as the reference does: with global quota mode every descriptor but an unlimited one
/// is a quota descriptor (one without a limit passes); otherwise those whose rule applies
/// `quota_mode`.
fn quota_tally(
    resolved: &[Resolved<'_>],
    planned: &[Planned<'_>],
    outcome: &Outcome,
    global_quota: bool,
) -> QuotaTally {
    let mut tally = QuotaTally::default();
    // The common case, no quota mode anywhere: nothing to count (every request passes here).
    if !global_quota
        && !resolved
            .iter()
            .any(|r| r.rule.is_some_and(|r| r.quota_mode))
    {
        return tally;
    }
    for (i, r) in resolved.iter().enumerate() {
        let mut checks = planned.iter().filter(|p| p.descriptor == i).peekable();
        // An override or a rule whose limits were all replaced has no quota_mode of its own.
        let quota = match r.limits {
            Limits::Unlimited => false,
            _ if global_quota => true,
            Limits::Tiers(_) => r.rule.is_some_and(|r| r.quota_mode) && checks.peek().is_some(),
            Limits::None | Limits::Override(_) => false,
        };
        if !quota {
            continue;
        }
        tally.total += 1;
        // A shadow-mode quota descriptor counts, and is never over (its status is OK).
        let denied = checks
            .filter(|p| p.quota)
            .map(|p| occurrence(outcome.verdicts[p.check], p))
            .filter(|v| !v.allowed)
            .map(|v| v.retry_after_us)
            .max();
        if let Some(retry) = denied {
            tally.over += 1;
            tally.soonest_retry_us = Some(tally.soonest_retry_us.map_or(retry, |s| s.min(retry)));
        }
    }
    tally
}

/// Matches one descriptor: its rule, where its limits come from, and its key prefix and slot
/// tag written into `keys`. `on_level` sees every matched level.
fn resolve<'r>(
    domain: &'r Domain,
    domain_name: &str,
    i: usize,
    d: &Descriptor,
    keys: &mut KeyBuf,
    on_level: impl FnMut(&str, KeyPart<'_>, Via<'_>),
) -> Result<Resolved<'r>, EngineError> {
    let entries = || d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    let start = keys.len();
    let rule = counter_prefix(domain, domain_name, &d.entries, keys, on_level);
    // The caller's plan decides the limits of a plan rule.
    let plan = rule
        .and_then(|r| r.plan.as_ref())
        .and_then(|plan| domain.plan_for(plan, entries()));
    let limits = match (&d.limit_override, rule) {
        (Some(o), _) => Limits::Override(override_tier(i, o, rule)?),
        (None, Some(r)) if r.unlimited => Limits::Unlimited,
        (None, Some(r)) => match (&r.plan, plan) {
            (Some(_), Some((p, _))) if p.unlimited => Limits::Unlimited,
            (Some(_), Some((_, tiers))) => Limits::Tiers(tiers),
            (Some(_), None) => Limits::None,
            (None, _) => Limits::Tiers(&r.tiers),
        },
        (None, None) => Limits::None,
    };
    if rule.is_none() && d.limit_override.is_some() {
        // An override with no matching rule still needs the entries in its key.
        keys.truncate(start);
        keys.domain(domain_name);
        for (k, v) in &d.entries {
            keys.entry(k, KeyPart::Value(v));
        }
    }
    let prefix = start..keys.len();
    let tag = hash_tag(rule, domain_name, &d.entries, keys).unwrap_or_else(|| prefix.clone());
    let slot = rule
        .and_then(|r| r.slot_key.as_deref())
        .and_then(|key| d.entries.iter().find(|(k, _)| k == key))
        .map_or(0, |(_, value)| crate::counter::slot_id(value.as_bytes()));
    Ok(Resolved {
        rule,
        plan: plan.map(|(p, _)| p),
        limits,
        prefix,
        tag,
        slot,
    })
}

/// Matches `entries` and writes their counter prefix (domain and matched entries) to `keys`.
/// An entry that names the caller's plan is left out: a caller moved to another plan keeps what
/// it used where the tiers match; so is the entry that names a request's slot under a
/// concurrency limit: the counter is the path above it. `on_level` sees every matched level.
fn counter_prefix<'r>(
    domain: &'r Domain,
    domain_name: &str,
    entries: &[(String, String)],
    keys: &mut KeyBuf,
    mut on_level: impl FnMut(&str, KeyPart<'_>, Via<'_>),
) -> Option<&'r Rule> {
    let pairs = || entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    let start = keys.len();
    keys.domain(domain_name);
    let rule = domain.find(pairs(), |key, part, via| {
        keys.entry(key, part);
        on_level(key, part, via);
    });
    let plan_key = match rule.and_then(|r| r.plan.as_ref()).map(|p| &p.source) {
        Some(PlanSource::Entry(plan_key)) => Some(plan_key.as_str()),
        _ => None,
    };
    let left_out = plan_key.or(rule.and_then(|r| r.slot_key.as_deref()));
    if let Some(left_out) = left_out {
        keys.truncate(start);
        keys.domain(domain_name);
        domain.find(pairs(), |key, part, _| {
            if key != left_out {
                keys.entry(key, part)
            }
        });
    }
    rule
}

/// Writes the bytes of a rule's `hash_tag` entry (what picks the Redis Cluster slot) to `keys`;
/// None when the rule has none or the descriptor lacks that entry (the prefix is the tag then).
fn hash_tag(
    rule: Option<&Rule>,
    domain_name: &str,
    entries: &[(String, String)],
    keys: &mut KeyBuf,
) -> Option<Range<usize>> {
    let tag_key = rule?.hash_tag.as_deref()?;
    let (k, v) = entries.iter().find(|(k, _)| k == tag_key)?;
    let start = keys.len();
    keys.domain(domain_name);
    keys.entry(k, KeyPart::Value(v));
    Some(start..keys.len())
}

/// One check per limit that applies, after `replaces`; each check's key written into `keys`.
/// `keep_replaced`: also plan the replaced limits, marked (for `explain`).
fn plan<'r>(
    request: &Request,
    resolved: &'r [Resolved<'r>],
    keys: &mut KeyBuf,
    keep_replaced: bool,
    global_quota: bool,
) -> Vec<Planned<'r>> {
    // `replaces`: a limit named by another matched limit's `replaces` is dropped.
    let replaced: Vec<&str> = resolved
        .iter()
        .filter_map(|r| match &r.limits {
            Limits::Tiers(tiers) => Some(*tiers),
            _ => None,
        })
        .flatten()
        .flat_map(|t| t.replaces.iter().map(String::as_str))
        .collect();
    let mut planned = Vec::with_capacity(request.descriptors.len());
    for (i, (r, d)) in resolved.iter().zip(&request.descriptors).enumerate() {
        let tiers: &[Tier] = match &r.limits {
            Limits::Tiers(t) => t,
            Limits::Override(t) => std::slice::from_ref(t),
            Limits::None | Limits::Unlimited => continue,
        };
        let own_rule = !matches!(r.limits, Limits::Override(_));
        let shadow = own_rule && r.rule.is_some_and(|r| r.shadow_mode);
        // A concurrency limit is never a quota: its slot is one request's.
        let quota = r.slot == 0
            && !d.refund
            && !shadow
            && (global_quota || own_rule && r.rule.is_some_and(|r| r.quota_mode));
        let kind = match (d.refund, shadow || quota) {
            (true, _) => CheckKind::Refund,
            // A quota check's denial alone does not deny the batch: the engine decides.
            (false, true) => CheckKind::Shadow,
            (false, false) => CheckKind::Enforce,
        };
        for tier in tiers {
            let is_replaced = tier.name.as_deref().is_some_and(|n| replaced.contains(&n));
            if is_replaced && !keep_replaced {
                continue;
            }
            let start = keys.len();
            keys.repeat(r.prefix.clone());
            keys.limit(
                tier.limit.algorithm,
                tier.unit,
                tier.unit_multiplier,
                tier.limit.calendar.map(|c| c.zone_name()),
            );
            planned.push(Planned {
                descriptor: i,
                tier,
                key: start..keys.len(),
                tag: r.tag.clone(),
                check: 0,
                slot: r.slot,
                on_failure: r.rule.and_then(|r| r.failure_mode),
                mode: r.rule.and_then(|r| r.mode),
                kind,
                // A request holds one slot of a concurrency limit, whatever its hits say.
                hits: if tier.limit.algorithm.holds_slots() {
                    d.hits.min(1)
                } else {
                    d.hits
                },
                replaced: is_replaced,
                quota,
                earlier_hits: 0,
                later_hits: 0,
            });
        }
    }
    planned
}

/// A request holds at most one slot of a concurrency counter: two descriptors that name two
/// slots of one counter (two request ids under one key) are refused, since one call cannot say
/// which of them its release would end.
fn one_slot_per_counter(planned: &[Planned<'_>], keys: &KeyBuf) -> Result<(), EngineError> {
    let slots = || planned.iter().filter(|p| p.slot != 0);
    for (n, a) in slots().enumerate() {
        if let Some(b) = slots()
            .skip(n + 1)
            .find(|b| b.slot != a.slot && keys.slice(b.key.clone()) == keys.slice(a.key.clone()))
        {
            return Err(EngineError::Invalid(format!(
                "descriptors {} and {} name two requests under one concurrency limit; a call acquires or releases one request's slot",
                a.descriptor, b.descriptor
            )));
        }
    }
    Ok(())
}

/// One check per counter: a request that names a counter twice (two identical descriptors)
/// charges it once with the sum of the hits, so every store sees each consuming key once.
fn merge_repeats<'a>(planned: &mut [Planned<'a>], keys: &'a KeyBuf) -> Vec<Check<'a>> {
    let mut checks: Vec<Check<'a>> = Vec::with_capacity(planned.len());
    for p in planned.iter_mut() {
        let key = keys.slice(p.key.clone());
        let repeat = (p.kind != CheckKind::Refund)
            .then(|| {
                checks
                    .iter()
                    .position(|c| c.kind != CheckKind::Refund && c.key == key)
            })
            .flatten();
        match repeat {
            Some(j) => {
                let c = &mut checks[j];
                // What the earlier occurrences charged: this one reports as charged after them.
                p.earlier_hits = c.hits;
                c.hits = c.hits.saturating_add(p.hits);
                if p.kind == CheckKind::Enforce {
                    c.kind = CheckKind::Enforce;
                }
                p.check = j;
            }
            None => {
                p.check = checks.len();
                checks.push(Check {
                    key,
                    tag: keys.slice(p.tag.clone()),
                    limit: &p.tier.limit,
                    hits: p.hits,
                    kind: p.kind,
                    on_failure: p.on_failure,
                    mode: p.mode,
                    until_us: 0,
                    slot: p.slot,
                });
            }
        }
    }
    // A merged check's hits are the sum of its occurrences: what the later ones add is the rest.
    for p in planned.iter_mut().filter(|p| p.kind != CheckKind::Refund) {
        p.later_hits = checks[p.check]
            .hits
            .saturating_sub(p.earlier_hits)
            .saturating_sub(p.hits);
    }
    checks
}

/// One occurrence's share of its counter's verdict, as the reference service reports a
/// descriptor named twice: each occurrence as if charged in request order (limit 20, unused:
/// remaining 19, then 18). The decision stays the counter's, all or nothing: when the sum does
/// not fit, nothing is consumed, the occurrences that would still have fit report OK and the
/// rest OVER_LIMIT.
fn occurrence(v: Verdict, p: &Planned<'_>) -> Verdict {
    if p.kind == CheckKind::Refund || (p.earlier_hits == 0 && p.later_hits == 0) {
        return v;
    }
    if v.allowed {
        return Verdict {
            remaining: v.remaining.saturating_add(p.later_hits),
            ..v
        };
    }
    // Denied: nothing was consumed, and `remaining` is what was left before the request.
    let through = p.earlier_hits.saturating_add(p.hits);
    if through <= v.remaining {
        Verdict {
            allowed: true,
            remaining: v.remaining - through,
            retry_after_us: 0,
            ..v
        }
    } else {
        Verdict {
            remaining: v.remaining.saturating_sub(p.earlier_hits),
            ..v
        }
    }
}

/// What the engine does with a request, stage by stage, without applying it: `sluice explain`
/// prints this, so it can never tell a different story from `decide`.
#[derive(Debug)]
pub struct Explanation<'r> {
    /// None: the domain is not configured (every descriptor is answered OK).
    pub domain: Option<&'r Domain>,
    pub descriptors: Vec<ExplainedDescriptor<'r>>,
}

#[derive(Debug)]
pub struct ExplainedDescriptor<'r> {
    /// Every matched level, outermost first: the entry's key and how it matched.
    pub levels: Vec<(String, MatchedBy)>,
    pub rule: Option<&'r Rule>,
    pub plan: Option<&'r Plan>,
    pub limits: Limits<'r>,
    /// One per limit, in order, the ones `replaces` drops included (marked).
    pub checks: Vec<ExplainedCheck>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchedBy {
    Exact,
    /// A wildcard value; `shared`: one counter for every value it matches.
    Wildcard {
        pattern: String,
        shared: bool,
    },
    AnyValue,
}

#[derive(Debug)]
pub struct ExplainedCheck {
    /// The limit (a request's override, or the rule's or plan's tier).
    pub tier: Tier,
    /// The counter's key, and the bytes that pick its Redis Cluster slot.
    pub key: Vec<u8>,
    pub tag: Vec<u8>,
    pub kind: CheckKind,
    /// Dropped by another matched limit's `replaces`: never checked.
    pub replaced: bool,
}

/// Runs the stages of [`Engine::decide`] up to the checks, and returns what each produced.
pub fn explain<'r>(
    rules: &'r RuleSet,
    request: &'r Request,
) -> Result<Explanation<'r>, EngineError> {
    let Some(domain) = rules.domain(&request.domain) else {
        return Ok(Explanation {
            domain: None,
            descriptors: Vec::new(),
        });
    };
    let mut keys = KeyBuf::default();
    let mut levels = Vec::new();
    let resolved = request
        .descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut matched = Vec::new();
            let r = resolve(domain, &request.domain, i, d, &mut keys, |k, part, via| {
                let by = match via {
                    Via::Exact => MatchedBy::Exact,
                    Via::Wildcard(p) => MatchedBy::Wildcard {
                        pattern: p.to_owned(),
                        shared: matches!(part, KeyPart::Pattern(_)),
                    },
                    Via::KeyOnly => MatchedBy::AnyValue,
                };
                matched.push((k.to_owned(), by));
            });
            levels.push(matched);
            r
        })
        .collect::<Result<Vec<_>, _>>()?;
    let planned = plan(request, &resolved, &mut keys, true, false);
    let descriptors = resolved
        .iter()
        .zip(levels)
        .enumerate()
        .map(|(i, (r, levels))| ExplainedDescriptor {
            levels,
            rule: r.rule,
            plan: r.plan,
            limits: r.limits.clone(),
            checks: planned
                .iter()
                .filter(|p| p.descriptor == i)
                .map(|p| ExplainedCheck {
                    tier: p.tier.clone(),
                    key: keys.slice(p.key.clone()).to_vec(),
                    tag: keys.slice(p.tag.clone()).to_vec(),
                    kind: p.kind,
                    replaced: p.replaced,
                })
                .collect(),
        })
        .collect();
    Ok(Explanation {
        domain: Some(domain),
        descriptors,
    })
}

/// What each limit of a request's descriptors has left, read without spending (`GET /counters`).
#[derive(Debug)]
pub struct Peek {
    /// One per request descriptor.
    pub descriptors: Vec<Peeked>,
    /// The counters, or the failure policy when the backend could not answer (the verdicts are
    /// then the policy's, not the counters').
    pub decided_by: DecidedBy,
}

/// One descriptor's limits, as [`Engine::peek`] read them.
#[derive(Debug, Default)]
pub struct Peeked {
    /// The matched rule's path.
    pub rule: Option<String>,
    /// Each limit checked, with what the store says of its counter, and the counter's key.
    pub limits: Vec<(Tier, Verdict, Vec<u8>)>,
}

impl<S: Store> Engine<S> {
    /// Reads every limit `request`'s descriptors would be checked against, spending nothing: each
    /// counter is asked for zero hits, strictly (a node's leases are already charged to the
    /// shared counter), one check per limit, and a counter that does not exist stays absent.
    pub async fn peek(&self, request: &Request) -> Result<Peek, EngineError> {
        self.settings.bounds.check(request)?;
        let rules = self.rules();
        let explanation = explain(&rules, request)?;
        // The checks a decision would make (the ones `replaces` drops left out), by descriptor.
        let looked: Vec<(usize, &ExplainedCheck)> = explanation
            .descriptors
            .iter()
            .enumerate()
            .flat_map(|(i, d)| d.checks.iter().filter(|c| !c.replaced).map(move |c| (i, c)))
            .collect();
        let checks: Vec<Check<'_>> = looked
            .iter()
            .map(|(_, c)| Check {
                tag: &c.tag,
                mode: Some(crate::counter::Mode::Strict),
                ..Check::enforce(&c.key, &c.tier.limit, 0)
            })
            .collect();
        let outcome = if checks.is_empty() {
            Outcome::default()
        } else {
            self.store.apply(&checks).await?
        };
        // An unknown domain explains no descriptor: each is answered with no rule and no limit.
        let mut descriptors: Vec<Peeked> = request
            .descriptors
            .iter()
            .map(|_| Peeked::default())
            .collect();
        for (d, peeked) in explanation.descriptors.iter().zip(&mut descriptors) {
            peeked.rule = d.rule.map(|r| r.path.clone());
        }
        for ((i, c), verdict) in looked.iter().zip(&outcome.verdicts) {
            descriptors[*i]
                .limits
                .push((c.tier.clone(), *verdict, c.key.clone()));
        }
        Ok(Peek {
            descriptors,
            decided_by: outcome.decided_by,
        })
    }
}

/// A status per descriptor from the store's verdicts: the denying tier (the one that waits
/// longest), else the tier with the least remaining.
fn report(
    request: &Request,
    resolved: &[Resolved<'_>],
    planned: &[Planned<'_>],
    outcome: &Outcome,
    quota: &QuotaTally,
    global_shadow: bool,
) -> Decision {
    let mut chosen: Vec<Option<(&Planned<'_>, Verdict)>> = vec![None; resolved.len()];
    for p in planned {
        let v = &occurrence(outcome.verdicts[p.check], p);
        let slot = &mut chosen[p.descriptor];
        let better = match slot {
            None => true,
            Some((_, cur)) => tighter(v, cur),
        };
        if better {
            *slot = Some((p, *v));
        }
    }
    let mut retry_after_us = None::<u64>;
    let statuses = chosen
        .into_iter()
        .zip(resolved)
        .zip(&request.descriptors)
        .map(|((c, r), d)| {
            let Some((p, v)) = c else {
                return match r.limits {
                    Limits::Unlimited => Status::unlimited(),
                    _ => Status::ok_without_limit(),
                };
            };
            let denied = !v.allowed && (p.kind == CheckKind::Enforce || p.quota);
            if denied && !p.quota {
                retry_after_us = Some(retry_after_us.unwrap_or(0).max(v.retry_after_us));
            }
            let (label, detailed) = metric_label(r.rule, d);
            Status {
                code: if denied { Code::OverLimit } else { Code::Ok },
                limit: Some(ReportedLimit::of(p.tier)),
                remaining: v.remaining,
                duration_us: Some(if v.allowed {
                    v.reset_after_us
                } else {
                    v.retry_after_us
                }),
                stats: Some(StatusStats {
                    rule: label,
                    detailed,
                    hits: p.hits,
                    shadow_denied: !v.allowed && p.kind == CheckKind::Shadow && !p.quota,
                }),
                metadata: r.rule.and_then(|r| r.metadata.clone()),
            }
        })
        .collect();
    // Quota descriptors deny together: the request waits for the first of them to allow.
    if quota.all_over() {
        let soonest = quota.soonest_retry_us.unwrap_or(0);
        retry_after_us = Some(retry_after_us.unwrap_or(0).max(soonest));
    }
    let over = !outcome.allowed && !global_shadow;
    Decision {
        code: if over { Code::OverLimit } else { Code::Ok },
        statuses,
        retry_after_us: if over { retry_after_us } else { None },
        decided_by: outcome.decided_by,
    }
}

/// Whether verdict `v` decides a descriptor rather than `cur`: a denial over an allowance, the
/// denial that waits longest, else the allowance with the least remaining.
fn tighter(v: &Verdict, cur: &Verdict) -> bool {
    match (v.allowed, cur.allowed) {
        (false, true) => true,
        (false, false) => v.retry_after_us > cur.retry_after_us,
        (true, true) => v.remaining < cur.remaining,
        (true, false) => false,
    }
}

/// The `rule` label: the reference's stats key when it carries request values (capped by
/// the metrics), else the rule's path.
fn metric_label(rule: Option<&Rule>, d: &Descriptor) -> (Arc<str>, bool) {
    match rule {
        Some(r) => match r.metric_label(&d.entries) {
            Some(label) => (Arc::from(label), true),
            None => (r.label.clone(), false),
        },
        // A request override with no matching rule.
        None => (Arc::from("_override_"), false),
    }
}

/// The request's limit in place of the configured one: the matched rule's algorithm (fixed
/// window when none matched), no name, no shadow, no `replaces`, as in the reference.
fn override_tier(
    descriptor: usize,
    o: &LimitOverride,
    rule: Option<&Rule>,
) -> Result<Tier, EngineError> {
    let algorithm = rule
        .and_then(|r| r.tiers.first())
        .map_or(Algorithm::FixedWindow, |t| t.limit.algorithm);
    let invalid = |e: &dyn std::fmt::Display| {
        EngineError::Invalid(format!("descriptor {descriptor}: limit override: {e}"))
    };
    let period_us =
        crate::counter::period_us(o.unit, o.unit_multiplier).map_err(|e| invalid(&e))?;
    let limit = Limit::new(algorithm, u64::from(o.requests_per_unit), period_us, None)
        .map_err(|e| invalid(&e))?;
    Ok(Tier {
        name: None,
        unit: o.unit,
        unit_multiplier: o.unit_multiplier,
        requests_per_unit: o.requests_per_unit,
        limit,
        replaces: Vec::new(),
    })
}

#[cfg(test)]
mod tests;
