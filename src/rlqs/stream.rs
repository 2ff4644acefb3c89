//! One Envoy's stream: its buckets, the reports that come in, the ticks that end windows and
//! renew assignments, and the engine calls that draw grants from the counters.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};

use super::policy::{
    Assigned, BLANKET_TTL_US, Carry, Fleet, Holding, Step, Treatment, Usage, refill_of,
};
use super::{AssignmentKind, CounterId, Refusal, Shared, period_end_us, ttl_seconds, wire};
use crate::clock::MICROS_PER_SECOND;
use crate::counter::FailureMode;
use crate::engine::{self, Enforcement, EngineError, EngineSettings, ResolvedDescriptor};
use crate::limiter::Limit;
use crate::proto::rlqs::{
    BucketAction, BucketId, BucketQuotaUsage, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::rules::RuleSet;
use crate::store::{DecidedBy, Store};

type Outbound = Result<RateLimitQuotaResponse, tonic::Status>;

/// Starts serving one stream; what to send back.
pub(super) fn spawn<S: Store>(
    shared: Arc<Shared<S>>,
    inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
    peer: Option<SocketAddr>,
    headers: tonic::codegen::http::HeaderMap,
) -> impl Stream<Item = Outbound> + Send + 'static {
    let (out, responses) = mpsc::channel(16);
    tokio::spawn(serve(Session::new(shared), inbound, out, peer, headers));
    futures_util::stream::unfold(responses, |mut responses| async move {
        responses.recv().await.map(|next| (next, responses))
    })
}

/// Runs a session on a stream: reports in, ticks on the second, actions out, until the Envoy
/// goes, refuses itself out, or the server stops.
async fn serve<S: Store>(
    mut session: Session<S>,
    mut inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
    out: mpsc::Sender<Outbound>,
    peer: Option<SocketAddr>,
    headers: tonic::codegen::http::HeaderMap,
) {
    tracing::info!(?peer, "RLQS stream opened");
    let stopped = stopping(session.shared.stopped.clone());
    tokio::pin!(stopped);
    let mut ticker = session.ticker();
    let send = |actions: Vec<BucketAction>| {
        let out = out.clone();
        async move {
            if !actions.is_empty() {
                let _ = out
                    .send(Ok(RateLimitQuotaResponse {
                        bucket_action: actions,
                    }))
                    .await;
            }
        }
    };
    let ended = loop {
        tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(reports)) => match traced_report(&mut session, reports, &headers).await {
                    Ok(actions) => send(actions).await,
                    Err(status) => {
                        tracing::warn!(?peer, error = %status.message(), "RLQS stream refused");
                        let _ = out.send(Err(status)).await;
                        break "refused";
                    }
                },
                Ok(None) => break "closed by the client",
                Err(e) => {
                    tracing::debug!(?peer, error = %e, "RLQS stream broke");
                    break "broken";
                }
            },
            _ = ticker.tick() => send(session.tick().await).await,
            () = &mut stopped => break "server stopping",
        }
    };
    drop(session);
    tracing::info!(?peer, why = ended, "RLQS stream ended");
}

/// [`Session::report`], and when traces are on a span for a report that changed assignments,
/// a child of the stream's caller when its `headers` named one.
async fn traced_report<S: Store>(
    session: &mut Session<S>,
    reports: RateLimitQuotaUsageReports,
    headers: &tonic::codegen::http::HeaderMap,
) -> Result<Vec<BucketAction>, tonic::Status> {
    let started = std::time::SystemTime::now();
    let buckets = reports.bucket_quota_usages.len();
    let actions = session.report(reports).await?;
    if !actions.is_empty() && crate::trace::on() {
        let domain = session.domain.as_deref().unwrap_or_default();
        crate::trace::rlqs_report(started, headers, domain, buckets, actions.len());
    }
    Ok(actions)
}

/// How the rules treat a bucket: what the explain tool prints and the stream acts on. None
/// when no rule nests these entries (or the domain is not configured): allowed.
#[derive(Debug, Clone, Default)]
pub struct Resolved(pub Option<ResolvedDescriptor>);

impl Resolved {
    /// The bucket's entries in the order the rules nest them, when a rule nests them.
    pub fn entries(&self) -> Option<&Vec<(String, String)>> {
        self.0.as_ref().map(|d| &d.entries)
    }

    pub fn enforcement(&self) -> Enforcement {
        self.0
            .as_ref()
            .map_or(Enforcement::Unlimited, |d| d.enforcement)
    }

    /// The limits a grant is drawn from.
    pub fn limits(&self) -> &[Limit] {
        self.0.as_ref().map_or(&[], |d| &d.limits)
    }

    pub fn treatment(&self, now_us: u64) -> Treatment {
        match self.enforcement() {
            Enforcement::Unlimited => Treatment::Allow,
            Enforcement::Shadow => Treatment::Shadow,
            Enforcement::Limited => match period_end_us(self.limits(), now_us) {
                Some(period_end_us) => Treatment::Limited {
                    period_end_us,
                    rate: self
                        .limits()
                        .iter()
                        .map(|l| l.requests as f64 * 1e6 / l.period_us as f64)
                        .fold(f64::INFINITY, f64::min),
                    refill: refill_of(self.limits()),
                },
                None => Treatment::Allow,
            },
        }
    }
}

/// How `rules` treat a bucket of `domain` with these entries (a map: any order) under
/// `settings`. The entries are matched as one descriptor, ordered as the rules nest them
/// (`Domain::order_entries`), and resolved by the engine once.
pub fn resolve(
    rules: &RuleSet,
    settings: &EngineSettings,
    domain: &str,
    entries: &[(&str, &str)],
) -> Result<Resolved, EngineError> {
    let Some(ordered) = rules.domain(domain).and_then(|d| d.order_entries(entries)) else {
        return Ok(Resolved(None));
    };
    let entries = ordered
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Ok(Resolved(engine::resolve_descriptor(
        rules, settings, domain, entries,
    )?))
}

/// One bucket of the stream.
struct Bucket {
    /// As Envoy sent it, to name the bucket in actions.
    id: BucketId,
    /// The rules it was resolved against (a reload resolves it again).
    rules: Arc<RuleSet>,
    resolved: Resolved,
    holding: Holding,
    /// Where each check's window ends for the tokens of the grant the Envoy holds (see
    /// `ResolvedDescriptor::window_ends`): what it does not spend goes back only there.
    charged: Vec<u64>,
    /// The same for ended grants still settling: the earliest per check.
    settling: Vec<u64>,
    /// Its share weight as the node's ledger has it (`Holding::share_weight`).
    weight: f64,
}

/// One Envoy's stream without its transport: what it reported and holds, and the steps that
/// answer reports and ticks. The gRPC stream runs one (`serve`); tests drive one by hand, with
/// their own clock and no network. Dropping it takes its buckets out of the node's ledger.
pub struct Session<S: Store> {
    shared: Arc<Shared<S>>,
    /// The stream's domain, from its first report.
    domain: Option<String>,
    /// By the stream's domain and the bucket id's entries, sorted: the counter's id in the
    /// node's ledger too.
    buckets: HashMap<CounterId, Bucket>,
}

/// A tick starts this long after the second, so a window that ends on the second has ended.
const TICK_LAG: Duration = Duration::from_millis(5);

impl<S: Store> Session<S> {
    pub(super) fn new(shared: Arc<Shared<S>>) -> Self {
        shared.ledger.streams.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = &shared.observer {
            o.stream_opened();
        }
        Self {
            shared,
            domain: None,
            buckets: HashMap::new(),
        }
    }

    /// Ticks on the second of the wall clock (plus a little), where windows end.
    fn ticker(&self) -> tokio::time::Interval {
        let tick = self.shared.options.tick.max(Duration::from_millis(1));
        let mut start = Instant::now();
        if tick >= Duration::from_secs(1) {
            let into_second = self.shared.clock.now_micros() % MICROS_PER_SECOND;
            start += Duration::from_micros(MICROS_PER_SECOND - into_second) + TICK_LAG;
        }
        let mut ticker = tokio::time::interval_at(start, tick);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        ticker
    }

    fn observe(&self, f: impl FnOnce(&dyn super::QuotaObserver)) {
        if let Some(o) = &self.shared.observer {
            f(o.as_ref());
        }
    }

    /// Answers one message of reports: the actions to send back, or the error that ends the
    /// stream (no domain, another domain, more buckets than a stream may hold). Each bucket's
    /// usage is validated, the policy steps from it, and the step is executed.
    pub async fn report(
        &mut self,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Vec<BucketAction>, tonic::Status> {
        self.validate(&reports)?;
        let shared = self.shared.clone();
        let domain = reports.domain;
        let rules = shared.engine.rules();
        let now = shared.clock.now_micros();
        let (mut allowed, mut denied) = (0u64, 0u64);
        let mut actions = Vec::new();
        let mut abandoned = Vec::new();
        for usage in reports.bucket_quota_usages {
            let Some((counter, id, usage)) = self.validate_usage(&domain, usage) else {
                continue;
            };
            allowed = allowed.saturating_add(usage.allowed);
            denied = denied.saturating_add(usage.denied);
            let fresh = !self.buckets.contains_key(&counter);
            let bucket = match self.buckets.entry(counter.clone()) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let resolved = resolve_id(&shared, &rules, &domain, &id);
                    shared.ledger.join(e.key());
                    e.insert(Bucket {
                        id,
                        rules: rules.clone(),
                        resolved,
                        holding: Holding::default(),
                        charged: Vec::new(),
                        settling: Vec::new(),
                        weight: 0.0,
                    })
                }
            };
            refresh(&shared, bucket, &rules, &domain);
            let treatment = bucket.resolved.treatment(now);
            if fresh
                && usage.elapsed_us == 0
                && usage.allowed > 0
                && matches!(treatment, Treatment::Limited { .. })
            {
                // Admitted by the Envoy's no-assignment behaviour before any grant: counted,
                // so later grants leave room for it.
                charge(&shared, &bucket.resolved, usage.allowed).await;
            }
            let fleet = fleet_of(&shared, &counter, treatment, now);
            let before = bucket.holding.demand;
            let held = Held::before(&bucket.holding, treatment);
            let step = bucket.holding.on_report(
                usage,
                now,
                treatment,
                fleet,
                shared.options.idle_reports_to_abandon,
            );
            let weight = weight_of(&bucket.holding, treatment);
            shared.ledger.demand_changed(
                &counter,
                (before, bucket.weight),
                (bucket.holding.demand, weight),
            );
            bucket.weight = weight;
            give_back(&shared, &domain, bucket).await;
            if step == Step::Abandon {
                held.after(&shared, &counter, &Holding::default());
                actions.push(wire::abandon(&bucket.id));
                self.observe(|o| o.assigned(AssignmentKind::Abandon));
                abandoned.push(counter);
                continue;
            }
            let turn = Turn {
                shared: &shared,
                domain: &domain,
                counter: &counter,
                now,
            };
            execute(turn, bucket, step, &mut actions).await;
            held.after(&shared, &counter, &bucket.holding);
        }
        for counter in abandoned {
            self.forget(&counter);
        }
        if rules.domain(&domain).is_some() {
            self.observe(|o| o.reported(&domain, allowed, denied));
        }
        Ok(actions)
    }

    /// The message as a whole: it names the stream's one domain, and no more buckets than a
    /// stream may hold. The stream's domain is its first report's.
    fn validate(&mut self, reports: &RateLimitQuotaUsageReports) -> Result<(), tonic::Status> {
        if reports.domain.is_empty() {
            self.observe(|o| o.refused(Refusal::NoDomain));
            return Err(tonic::Status::invalid_argument(
                "the usage reports name no domain",
            ));
        }
        match &self.domain {
            None => self.domain = Some(reports.domain.clone()),
            Some(d) if *d != reports.domain => {
                self.observe(|o| o.refused(Refusal::DomainChanged));
                return Err(tonic::Status::invalid_argument(format!(
                    "the stream's domain is {d:?}; a report named {:?} (one stream per domain)",
                    reports.domain
                )));
            }
            Some(_) => {}
        }
        let most = self.shared.options.max_buckets_per_stream;
        if reports.bucket_quota_usages.len() > most {
            self.observe(|o| o.refused(Refusal::TooManyBuckets));
            return Err(tonic::Status::resource_exhausted(format!(
                "a report of {} buckets; a stream holds at most {most} \
                 (--rlqs-max-buckets-per-stream)",
                reports.bucket_quota_usages.len(),
            )));
        }
        Ok(())
    }

    /// One bucket's usage: its counter, its id and what it reported, or None (counted as a
    /// refusal) when the id is empty or too large, a count is out of range, or a new bucket
    /// finds no room.
    fn validate_usage(
        &mut self,
        domain: &str,
        usage: BucketQuotaUsage,
    ) -> Option<(CounterId, BucketId, Usage)> {
        let Some(id) = usage.bucket_id.filter(|id| !id.bucket.is_empty()) else {
            self.observe(|o| o.refused(Refusal::EmptyBucketId));
            return None;
        };
        // A count past 2^53 − 1 (2^53 requests in one report) is never a real one — one past
        // i64 is a negative number sent as unsigned — and the counters charge hits exactly
        // only below it (the Lua twins compute in doubles).
        let limit = crate::limiter::EXACT_MAX - 1;
        if usage.num_requests_allowed > limit || usage.num_requests_denied > limit {
            self.observe(|o| o.refused(Refusal::CountOutOfRange));
            return None;
        }
        // The same bounds as a descriptor's (the map's entries, sorted).
        let counter: CounterId = (domain.to_owned(), sorted(&id));
        let bounds = self.shared.engine.settings().bounds;
        if bounds.check_entries(0, &counter.1).is_err() {
            self.observe(|o| o.refused(Refusal::BucketIdTooLarge));
            return None;
        }
        if !self.buckets.contains_key(&counter) && !self.admit_bucket() {
            return None;
        }
        let usage = Usage {
            allowed: usage.num_requests_allowed,
            denied: usage.num_requests_denied,
            elapsed_us: wire::elapsed_us(usage.time_elapsed.as_ref()),
        };
        Some((counter, id, usage))
    }

    /// Room for one more bucket on this stream and node.
    fn admit_bucket(&self) -> bool {
        let options = &self.shared.options;
        if self.buckets.len() >= options.max_buckets_per_stream {
            self.observe(|o| o.refused(Refusal::TooManyBuckets));
            return false;
        }
        let ledger = &self.shared.ledger;
        let taken = ledger
            .buckets
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < options.max_buckets).then_some(n + 1)
            });
        if taken.is_err() {
            self.observe(|o| o.refused(Refusal::NodeFull));
            return false;
        }
        self.observe(|o| o.buckets(1));
        true
    }

    fn forget(&mut self, counter: &CounterId) {
        if let Some(bucket) = self.buckets.remove(counter) {
            match bucket.holding.assigned {
                Assigned::Tokens { until_us, .. } => {
                    let unspent = bucket.holding.unspent(until_us);
                    self.shared
                        .ledger
                        .held_changed(counter, until_us, unspent, 0);
                }
                Assigned::Refill { expires_us, .. } => self.shared.ledger.linger(
                    counter,
                    bucket.holding.assigned.committed(),
                    expires_us,
                ),
                _ => {}
            }
            self.shared
                .ledger
                .leave(counter, bucket.holding.demand, bucket.weight);
            self.shared.ledger.buckets.fetch_sub(1, Ordering::Relaxed);
            self.observe(|o| o.buckets(-1));
        }
    }

    /// The periodic step (every second, on the second): new grants where a window ended,
    /// renewals that carry an assignment to its window's end.
    pub async fn tick(&mut self) -> Vec<BucketAction> {
        let Some(domain) = self.domain.as_deref() else {
            return Vec::new();
        };
        let shared = &self.shared;
        let rules = shared.engine.rules();
        let now = shared.clock.now_micros();
        let mut actions = Vec::new();
        for (counter, bucket) in &mut self.buckets {
            refresh(shared, bucket, &rules, domain);
            let treatment = bucket.resolved.treatment(now);
            let fleet = fleet_of(shared, counter, treatment, now);
            let held = Held::before(&bucket.holding, treatment);
            let step = bucket.holding.on_tick(now, treatment, fleet);
            let turn = Turn {
                shared,
                domain,
                counter,
                now,
            };
            execute(turn, bucket, step, &mut actions).await;
            held.after(shared, counter, &bucket.holding);
        }
        actions
    }
}

/// The stream ended: its buckets leave the ledger. What the Envoy holds stays with it until its
/// time to live (at most the window it was charged to).
impl<S: Store> Drop for Session<S> {
    fn drop(&mut self) {
        let counters: Vec<_> = self.buckets.keys().cloned().collect();
        for counter in counters {
            self.forget(&counter);
        }
        self.shared.ledger.streams.fetch_sub(1, Ordering::Relaxed);
        self.observe(|o| o.stream_closed());
    }
}

/// What an Envoy held unspent of a period's grants before a step, to tell the ledger the change.
struct Held(Option<(u64, u64)>);

impl Held {
    fn before(holding: &Holding, treatment: Treatment) -> Self {
        Self(match treatment {
            Treatment::Limited { period_end_us, .. } => {
                Some((period_end_us, holding.unspent(period_end_us)))
            }
            _ => None,
        })
    }

    fn after<S: Store>(self, shared: &Shared<S>, counter: &CounterId, holding: &Holding) {
        if let Some((period, before)) = self.0 {
            let after = holding.unspent(period);
            shared.ledger.held_changed(counter, period, before, after);
        }
    }
}

/// Resolves once the server stops.
async fn stopping(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

fn sorted(id: &BucketId) -> Vec<(String, String)> {
    let mut key: Vec<_> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    key.sort_unstable();
    key
}

fn resolve_id<S: Store>(
    shared: &Shared<S>,
    rules: &RuleSet,
    domain: &str,
    id: &BucketId,
) -> Resolved {
    let entries: Vec<(&str, &str)> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    resolve(rules, shared.engine.settings(), domain, &entries).unwrap_or_else(|e| {
        // The bounds were checked on the way in; a rule the engine refuses is allowed rather
        // than guessed at.
        tracing::warn!(error = %e, "RLQS bucket not resolved; allowed");
        Resolved(None)
    })
}

/// Resolves the bucket again when the rules changed. Its grants' windows were of the old
/// checks: nothing of them is given back to the new ones.
fn refresh<S: Store>(shared: &Shared<S>, bucket: &mut Bucket, rules: &Arc<RuleSet>, domain: &str) {
    if !Arc::ptr_eq(&bucket.rules, rules) {
        bucket.resolved = resolve_id(shared, rules, domain, &bucket.id);
        bucket.rules = rules.clone();
        bucket.charged.clear();
        bucket.settling.clear();
    }
}

/// The grant the Envoy holds is about to be replaced: its windows join the settling ones.
fn end_grant(bucket: &mut Bucket) {
    if bucket.holding.assigned.charged().is_none() {
        return;
    }
    let charged = std::mem::take(&mut bucket.charged);
    if !bucket.holding.settling() || bucket.settling.len() != charged.len() {
        bucket.settling = charged;
    } else {
        for (settling, charged) in bucket.settling.iter_mut().zip(charged) {
            *settling = (*settling).min(charged);
        }
    }
}

/// Gives back what the last report proved the bucket's ended grants did not spend, to every
/// limit whose window is still the one they were charged to.
async fn give_back<S: Store>(shared: &Shared<S>, domain: &str, bucket: &mut Bucket) {
    let tokens = bucket.holding.take_returned();
    if tokens > 0
        && let Some(descriptor) = &bucket.resolved.0
    {
        match shared
            .engine
            .return_hits(descriptor, tokens, &bucket.settling)
            .await
        {
            Ok(true) => {
                if let Some(o) = &shared.observer {
                    o.returned(domain, tokens);
                }
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "RLQS: giving back unspent tokens failed"),
        }
    }
    // Settled: the windows are of no grant still waiting.
    if !bucket.holding.settling() {
        bucket.settling.clear();
    }
}

/// How much the Envoy's share weighs under `treatment`: by `Holding::share_weight` for a
/// refilling rule, else its demand.
fn weight_of(holding: &Holding, treatment: Treatment) -> f64 {
    match treatment {
        Treatment::Limited {
            refill: Some(refill),
            ..
        } => holding.share_weight(refill),
        _ => holding.demand,
    }
}

fn fleet_of<S: Store>(
    shared: &Shared<S>,
    counter: &CounterId,
    treatment: Treatment,
    now: u64,
) -> Fleet {
    match treatment {
        Treatment::Limited { period_end_us, .. } => {
            shared.ledger.fleet(counter, period_end_us, now)
        }
        _ => Fleet::default(),
    }
}

/// Charges `hits` the Envoy admitted on its own (its fallback, or a shadow rule).
async fn charge<S: Store>(shared: &Shared<S>, resolved: &Resolved, hits: u64) {
    let Some(descriptor) = &resolved.0 else {
        return;
    };
    if let Err(e) = shared.engine.apply_hits(descriptor, hits).await {
        tracing::debug!(error = %e, "RLQS: charging reported usage failed");
    }
}

/// What one bucket's step runs against: the node's shared state, the stream's domain, the
/// bucket's counter in the node's ledger, and the time.
struct Turn<'a, S> {
    shared: &'a Shared<S>,
    domain: &'a str,
    counter: &'a CounterId,
    now: u64,
}

impl<S> Clone for Turn<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Turn<'_, S> {}

/// Runs one step for a bucket, adding what to send to `actions`. A refilling grant keeps the
/// node's commitments itself (it takes their room before it charges); any other step that
/// ends one gives its room back here.
async fn execute<S: Store>(
    turn: Turn<'_, S>,
    bucket: &mut Bucket,
    step: Step,
    actions: &mut Vec<BucketAction>,
) {
    if let Step::Refill { .. } = step {
        return execute_refill(turn, bucket, step, actions).await;
    }
    let committed = bucket.holding.assigned.committed();
    execute_step(turn, bucket, step, actions).await;
    let after = bucket.holding.assigned.committed();
    if after != committed {
        turn.shared
            .ledger
            .commit(turn.counter, committed, after, u64::MAX, turn.now);
    }
}

fn observe<S: Store>(shared: &Shared<S>, kind: AssignmentKind) {
    if let Some(o) = &shared.observer {
        o.assigned(kind);
    }
}

/// Runs one step but a refilling grant's.
async fn execute_step<S: Store>(
    turn: Turn<'_, S>,
    bucket: &mut Bucket,
    step: Step,
    actions: &mut Vec<BucketAction>,
) {
    let Turn {
        shared,
        domain,
        now,
        ..
    } = turn;
    let observe = |kind| observe(shared, kind);
    match step {
        Step::Nothing | Step::Abandon | Step::Refill { .. } => {}
        Step::Renew { ttl_s } => {
            let action = match bucket.holding.assigned {
                Assigned::Tokens { size, .. } => wire::tokens(&bucket.id, ttl_s, size),
                Assigned::Refill { per_window, .. } => match refill_of(bucket.resolved.limits()) {
                    Some(refill) => wire::refilling(&bucket.id, ttl_s, per_window, refill.window_s),
                    None => return,
                },
                Assigned::DenyAll { .. } => wire::deny_all(&bucket.id, ttl_s),
                Assigned::AllowAll { .. } | Assigned::Nothing => return,
            };
            actions.push(action);
            bucket.holding.renewed(now, ttl_s);
            observe(AssignmentKind::Renewal);
        }
        Step::Count { hits } => {
            charge(shared, &bucket.resolved, hits).await;
            allow_all(bucket, now, actions, observe);
        }
        Step::AllowAll => allow_all(bucket, now, actions, observe),
        Step::Grant {
            want,
            until_us,
            carry,
        } => {
            if let Some(carry) = carry {
                carry_over(turn, bucket, carry).await;
            }
            // Under a second left: the tick at the window's end grants the next one.
            let Some(ttl_s) = ttl_seconds(now, until_us) else {
                return;
            };
            let granted = grant(turn, bucket, want, until_us).await;
            if !matches!(granted, Granted::Unanswered | Granted::PolicyAllow) {
                end_grant(bucket);
            }
            match granted {
                Granted::Tokens(size, at_us) => {
                    actions.extend(wire::fresh_tokens(&bucket.id, ttl_s, size));
                    charged_at(bucket, at_us.unwrap_or(now));
                    bucket.holding.assign(
                        Assigned::Tokens {
                            size,
                            until_us,
                            expires_us: now + ttl_s * MICROS_PER_SECOND,
                            granted_us: now,
                        },
                        now,
                    );
                    if let Some(o) = &shared.observer {
                        o.granted(domain, size);
                    }
                    observe(AssignmentKind::TokenBucket);
                }
                Granted::Nothing | Granted::PolicyDeny => {
                    let ttl_s = granted.deny_ttl(ttl_s);
                    deny_all(bucket, until_us, ttl_s, now, actions, observe);
                }
                Granted::PolicyAllow => allow_all(bucket, now, actions, observe),
                Granted::Unanswered => {}
            }
        }
    }
}

/// A refilling grant (see `policy::Refill`): takes the rate's room in the node's commitments
/// first (under the ledger's lock), charges the window what the Envoy may admit in it, and
/// sends the bucket only when its rate changed (the same bucket again renews it, and Envoy
/// keeps its token).
async fn execute_refill<S: Store>(
    turn: Turn<'_, S>,
    bucket: &mut Bucket,
    step: Step,
    actions: &mut Vec<BucketAction>,
) {
    let Turn {
        shared,
        domain,
        counter,
        now,
    } = turn;
    let Step::Refill {
        per_window: wanted,
        until_us,
        refill,
    } = step
    else {
        return;
    };
    let Some(ttl_s) = ttl_seconds(now, until_us) else {
        return;
    };
    let running = bucket.holding.assigned;
    let before = running.committed();
    let reserved = shared
        .ledger
        .commit(counter, before, wanted, refill.limit, now);
    let charge = bucket
        .holding
        .refill_charge(reserved, now, until_us, refill.window_s);
    let granted = if charge == 0 {
        Granted::Nothing
    } else {
        grant(turn, bucket, charge, until_us).await
    };
    if !matches!(granted, Granted::Unanswered | Granted::PolicyAllow) {
        end_grant(bucket);
    }
    let expires_us = now + ttl_s * MICROS_PER_SECOND;
    let per_window = match granted {
        Granted::Tokens(charged, at_us) => {
            // Short of room (another node, or RLS calls on the same counters): the rate the
            // charge covers.
            let per_window = if charged < charge {
                reserved.min(charged)
            } else {
                reserved
            };
            let same = matches!(running, Assigned::Refill { per_window: p, .. } if p == per_window);
            actions.push(wire::refilling(
                &bucket.id,
                ttl_s,
                per_window,
                refill.window_s,
            ));
            charged_at(bucket, at_us.unwrap_or(now));
            bucket.holding.assign(
                Assigned::Refill {
                    per_window,
                    charged,
                    until_us,
                    expires_us,
                    granted_us: now,
                },
                now,
            );
            if let Some(o) = &shared.observer {
                o.granted(domain, charged);
            }
            observe(
                shared,
                if same {
                    AssignmentKind::Renewal
                } else {
                    AssignmentKind::TokenBucket
                },
            );
            per_window
        }
        Granted::Nothing | Granted::PolicyDeny => {
            let ttl_s = granted.deny_ttl(ttl_s);
            deny_all(bucket, until_us, ttl_s, now, actions, |kind| {
                observe(shared, kind)
            });
            0
        }
        Granted::PolicyAllow => {
            allow_all(bucket, now, actions, |kind| observe(shared, kind));
            0
        }
        Granted::Unanswered => before,
    };
    shared
        .ledger
        .commit(counter, reserved, per_window, u64::MAX, now);
}

/// Charges what an ended grant may still spend (see `Holding::carry`) to the windows that
/// followed the ended ones, as much as they have left, and moves where its settling gives back
/// to them (nowhere when they could not take it all, or the backend's clock still had the
/// ended windows: what is proven unspent then may be what they did not take).
async fn carry_over<S: Store>(turn: Turn<'_, S>, bucket: &mut Bucket, carry: Carry) {
    let Turn { shared, now, .. } = turn;
    let Some(descriptor) = &bucket.resolved.0 else {
        return;
    };
    let old = descriptor.window_ends(carry.ended_us.saturating_sub(1));
    let new = descriptor.window_ends(now);
    let ended: Vec<bool> = old
        .iter()
        .zip(&new)
        .map(|(o, n)| *o != 0 && o != n)
        .collect();
    if !ended.contains(&true) {
        return;
    }
    let mut hits = carry.tokens;
    let mut whole = false;
    for _ in 0..3 {
        match shared.engine.apply_hits_on(descriptor, hits, &ended).await {
            Ok(applied) if applied.decided_by != DecidedBy::Counters => break,
            Ok(applied) if applied.allowed => {
                let at = applied.decided_at_us.unwrap_or(now);
                whole = hits == carry.tokens && descriptor.window_ends(at) == new;
                break;
            }
            Ok(applied) if applied.remaining == 0 || hits <= 1 => break,
            Ok(applied) => hits = applied.remaining.min(hits - 1),
            Err(e) => {
                tracing::debug!(error = %e, "RLQS: charging a late grant's tokens failed");
                break;
            }
        }
    }
    for windows in [&mut bucket.charged, &mut bucket.settling] {
        if windows.len() == ended.len() {
            for ((w, &ended), &next) in windows.iter_mut().zip(&ended).zip(&new) {
                if ended {
                    *w = if whole { next } else { 0 };
                }
            }
        }
    }
}

/// The bucket's grant was charged when the backend's clock said `at_us`: to those windows.
fn charged_at(bucket: &mut Bucket, at_us: u64) {
    bucket.charged = bucket
        .resolved
        .0
        .as_ref()
        .map(|d| d.window_ends(at_us))
        .unwrap_or_default();
}

/// Tells the Envoy to deny for `ttl_s`, the assignment belonging to the period that ends at
/// `until_us`.
fn deny_all(
    bucket: &mut Bucket,
    until_us: u64,
    ttl_s: u64,
    now: u64,
    actions: &mut Vec<BucketAction>,
    observe: impl Fn(AssignmentKind),
) {
    actions.push(wire::deny_all(&bucket.id, ttl_s));
    bucket.holding.assign(
        Assigned::DenyAll {
            until_us,
            expires_us: now + ttl_s * MICROS_PER_SECOND,
        },
        now,
    );
    observe(AssignmentKind::DenyAll);
}

fn allow_all(
    bucket: &mut Bucket,
    now: u64,
    actions: &mut Vec<BucketAction>,
    observe: impl Fn(AssignmentKind),
) {
    // Renewed by reports; only once half its life is gone.
    if let Assigned::AllowAll { expires_us } = bucket.holding.assigned
        && expires_us > now + BLANKET_TTL_US / 2
    {
        return;
    }
    end_grant(bucket);
    let ttl_s = BLANKET_TTL_US / MICROS_PER_SECOND;
    actions.push(wire::allow_all(&bucket.id, ttl_s));
    bucket.holding.assign(
        Assigned::AllowAll {
            expires_us: now + BLANKET_TTL_US,
        },
        now,
    );
    observe(AssignmentKind::AllowAll);
}

/// What the counters gave for a grant.
enum Granted {
    /// This many, charged when the backend's clock said this (None: the node's clock).
    Tokens(u64, Option<u64>),
    /// Nothing is left in the window.
    Nothing,
    /// The backend is away and the rule's failure policy says deny, or allow.
    PolicyDeny,
    PolicyAllow,
    /// No answer (the `error` policy, a full memory store): the Envoy keeps what it has, then
    /// its own fallback.
    Unanswered,
}

impl Granted {
    /// How long a denial for this answer lasts, where the grant would have lasted `ttl_s`: a
    /// failure policy's only a blanket assignment's time (the backend may be back by then).
    fn deny_ttl(&self, ttl_s: u64) -> u64 {
        match self {
            Granted::PolicyDeny => ttl_s.min(BLANKET_TTL_US / MICROS_PER_SECOND),
            _ => ttl_s,
        }
    }
}

/// Draws up to `want` tokens from the bucket's counters: all of them if they fit, else what
/// the tightest limit has left (asked again, since another node may take it meanwhile).
async fn grant<S: Store>(turn: Turn<'_, S>, bucket: &Bucket, want: u64, until_us: u64) -> Granted {
    let Turn {
        shared,
        domain,
        counter,
        ..
    } = turn;
    let Some(descriptor) = &bucket.resolved.0 else {
        return Granted::PolicyAllow;
    };
    let mut hits = want;
    for _ in 0..3 {
        let applied = match shared.engine.apply_hits(descriptor, hits).await {
            Ok(applied) => applied,
            Err(e) => {
                tracing::warn!(error = %e, domain, "RLQS grant failed; no assignment");
                return Granted::Unanswered;
            }
        };
        match applied.decided_by {
            DecidedBy::Policy(FailureMode::Allow) => return Granted::PolicyAllow,
            DecidedBy::Policy(FailureMode::Deny) => return Granted::PolicyDeny,
            // `local`: this node's own counters granted it (or not).
            DecidedBy::Policy(_) if applied.allowed => return Granted::Tokens(hits, None),
            DecidedBy::Policy(_) => return Granted::PolicyDeny,
            DecidedBy::Counters => {}
        }
        shared.ledger.left(counter, until_us, applied.remaining);
        if applied.allowed {
            return Granted::Tokens(hits, applied.decided_at_us);
        }
        if applied.remaining == 0 || hits <= 1 {
            return Granted::Nothing;
        }
        hits = applied.remaining.min(hits - 1);
    }
    Granted::Nothing
}
