//! The Rate Limit Quota Service against clients that behave as Envoy 1.40's `rate_limit_quota`
//! filter does (`common::rlqs_envoy`), on one manual clock: each test runs sessions by hand
//! (reports every 5 s, the server's tick on every second) and counts what the Envoys admitted
//! in every window. One sluice node on memory, two on one real Redis; then the gRPC stream.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::S;
use common::redis::{RedisServer, shared_config};
use common::rlqs_envoy::{Blanket, FakeEnvoy};
use sluice::clock::{Clock, ManualClock};
use sluice::engine::{Descriptor, Engine, EngineSettings, Request};
use sluice::proto::rlqs::{
    BucketId, BucketQuotaUsage, RateLimitQuotaUsageReports, bucket_action, rate_limit_strategy,
};
use sluice::rlqs::{QuotaOptions, QuotaService, Session};
use sluice::rules::load_texts;
use sluice::store::redis::Topology;
use sluice::store::{Clocks, FailureMode, Stack, StoreConfig, build};
use tokio::sync::watch;

const MS: u64 = 1_000;
/// A whole hour, so windows start on round numbers.
const START: u64 = 1_800_000_000 * S;

const RULES: &str = r#"
domain: q
descriptors:
  - key: route
    value: api
    rate_limit: {unit: minute, requests_per_unit: 1200}
  - key: route
    value: tiers
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: hour, requests_per_unit: 300}
  - key: route
    value: small
    rate_limit: {unit: minute, requests_per_unit: 40}
  - key: route
    value: mid
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: route
    value: fast
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: route
    value: login
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: route
    value: budget
    rate_limits:
      - {unit: minute, requests_per_unit: 20}
      - {unit: hour, requests_per_unit: 30}
  - key: route
    value: free
    rate_limit: {unlimited: true}
  - key: route
    value: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: route
    value: sliding
    rate_limit: {unit: minute, requests_per_unit: 600, algorithm: sliding_window}
  - key: route
    value: closed
    failure_mode: deny
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: route
    value: open
    failure_mode: allow
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: route
    value: local
    failure_mode: local
    rate_limit: {unit: minute, requests_per_unit: 600}
"#;

struct Node {
    service: QuotaService<Stack>,
    engine: Arc<Engine<Stack>>,
    _stop: watch::Sender<bool>,
}

fn node(store: &StoreConfig, clock: &Arc<ManualClock>, options: QuotaOptions) -> Node {
    let (stack, _upkeep) = build(store).expect("the store builds");
    let engine = Arc::new(Engine::new(
        load_texts([("rules.yaml", RULES)]).unwrap(),
        stack,
        EngineSettings::default(),
    ));
    let (stop, stopped) = watch::channel(false);
    Node {
        service: QuotaService::new(engine.clone(), clock.clone(), options, None, stopped),
        engine,
        _stop: stop,
    }
}

/// Two nodes on `redis`, on one clock (Redis's too); nothing is decided by a failure policy.
fn two_redis_nodes(redis: &RedisServer, clock: &Arc<ManualClock>) -> (Node, Node) {
    let store = StoreConfig {
        failure_mode: FailureMode::Error,
        clocks: Clocks::pinned(clock.clone()),
        ..shared_config(Topology::Standalone(redis.url()), Duration::from_secs(5))
    };
    (
        node(&store, clock, QuotaOptions::default()),
        node(&store, clock, QuotaOptions::default()),
    )
}

fn memory_node(clock: &Arc<ManualClock>) -> Node {
    node(
        &common::memory(clock, 100_000),
        clock,
        QuotaOptions::default(),
    )
}

/// One Envoy in the simulation: its bucket cache, its stream's session, its demand.
struct SimEnvoy {
    envoy: FakeEnvoy,
    session: Session<Stack>,
    /// Requests per second for `bucket`.
    rate: f64,
    carry: f64,
    bucket: Vec<(&'static str, &'static str)>,
    /// When its next 5-second report goes.
    next_report: u64,
    /// What it had admitted when it last reported.
    admitted_at_report: u64,
    /// What the server sent, and when it reaches the Envoy.
    inbox: Vec<(u64, Vec<sluice::proto::rlqs::BucketAction>)>,
    admitted: u64,
    denied: u64,
    /// Of those, denied by its `DENY_ALL` fallback before any answer reached it.
    denied_unanswered: u64,
    answered: bool,
}

impl SimEnvoy {
    fn new(node: &Node, rate: f64, bucket: &[(&'static str, &'static str)], start: u64) -> Self {
        Self {
            envoy: FakeEnvoy::new("q", Blanket::Deny),
            session: node.service.session(),
            rate,
            carry: 0.0,
            bucket: bucket.to_vec(),
            next_report: start + 5 * S,
            inbox: Vec::new(),
            admitted_at_report: 0,
            admitted: 0,
            denied: 0,
            denied_unanswered: 0,
            answered: false,
        }
    }

    async fn send(&mut self, reports: RateLimitQuotaUsageReports, now: u64) {
        let actions = self
            .session
            .report(reports)
            .await
            .expect("reports accepted");
        self.inbox.push((now + DELIVERY, actions));
    }

    /// One request for its bucket at `now`: admitted ones counted in `tally`'s window, and a new
    /// bucket's report sent.
    async fn request(&mut self, now: u64, tally: &mut Tally) {
        let bucket = self.bucket.clone();
        let (admitted, report) = self.envoy.request(&bucket, now);
        if admitted {
            self.admitted += 1;
            let window = now / (tally.window_s * S) * tally.window_s;
            *tally.admitted.entry(window).or_default() += 1;
        } else {
            self.denied += 1;
            self.denied_unanswered += u64::from(!self.answered);
        }
        if let Some(report) = report {
            self.send(report, now).await;
        }
    }

    /// Applies what has reached the Envoy by `now`, in the order it was sent.
    fn receive(&mut self, now: u64) {
        let (due, later) = std::mem::take(&mut self.inbox)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.inbox = later;
        for (_, actions) in due {
            self.answered |= !actions.is_empty();
            self.envoy.apply(&actions, now);
        }
    }
}

/// What the Envoys admitted in each window of `window_s`, by window start.
struct Tally {
    window_s: u64,
    admitted: BTreeMap<u64, u64>,
}

impl Tally {
    fn per(window_s: u64) -> Self {
        Self {
            window_s,
            admitted: BTreeMap::new(),
        }
    }
}

/// How long the server's answers take to reach an Envoy in the simulation: a tick's new grants
/// reach it this long after the window ended, while it still spends the old ones.
const DELIVERY: u64 = 30 * MS;

/// Runs the Envoys from the clock's time for `seconds`, in 10 ms steps: requests at each
/// Envoy's rate, its reports every 5 s, the server's tick 10 ms after every second (a tick a
/// little late, as a loaded node's would be), and the answers [`DELIVERY`] on their way.
async fn run(clock: &ManualClock, envoys: &mut [SimEnvoy], seconds: u64, tally: &mut Tally) {
    run_until(clock, envoys, clock.now_micros() + seconds * S, tally).await;
}

/// [`run`] until the clock reads `end`.
async fn run_until(clock: &ManualClock, envoys: &mut [SimEnvoy], end: u64, tally: &mut Tally) {
    let step = 10 * MS;
    while clock.now_micros() < end {
        let now = clock.now_micros();
        if now % S == 10 * MS {
            for e in envoys.iter_mut() {
                let actions = e.session.tick().await;
                e.inbox.push((now + DELIVERY, actions));
            }
        }
        for e in envoys.iter_mut() {
            e.receive(now);
            if now >= e.next_report {
                e.next_report += 5 * S;
                e.admitted_at_report = e.admitted;
                let reports = e.envoy.report(now);
                e.send(reports, now).await;
            }
            e.carry += e.rate * step as f64 / S as f64;
            while e.carry >= 1.0 {
                e.carry -= 1.0;
                e.request(now, tally).await;
            }
        }
        clock.advance(step);
    }
}

const API: &[(&str, &str)] = &[("route", "api")];

/// Three Envoys with demand 60/30/10 above a limit of 1200 a minute (twice it): in every minute
/// they admit at most the limit and at least nine tenths of it, in shares that follow demand.
async fn above_the_limit(nodes: &[&Node], clock: &Arc<ManualClock>) -> (Tally, [u64; 3]) {
    let start = clock.now_micros();
    // 2400 a minute: 40/s.
    let mut envoys = vec![
        SimEnvoy::new(nodes[0], 24.0, API, start),
        SimEnvoy::new(nodes[1 % nodes.len()], 12.0, API, start + 1_700 * MS),
        SimEnvoy::new(nodes[0], 4.0, API, start + 3_300 * MS),
    ];
    let mut tally = Tally::per(60);
    run(clock, &mut envoys, 300, &mut tally).await;
    let shares = [envoys[0].admitted, envoys[1].admitted, envoys[2].admitted];
    (tally, shares)
}

fn assert_exact_and_full(tally: &Tally, limit: u64, shares: [u64; 3]) {
    assert_eq!(
        tally.admitted.len(),
        5,
        "five whole minutes: {:?}",
        tally.admitted
    );
    for (window, admitted) in &tally.admitted {
        assert!(
            *admitted <= limit,
            "minute {window}: {admitted} admitted, the limit is {limit}"
        );
        assert!(
            *admitted * 10 >= limit * 9,
            "minute {window}: only {admitted} of {limit} admitted"
        );
    }
    // Shares follow demand (60/30/10), give or take.
    let total: u64 = shares.iter().sum();
    let share = |i: usize| shares[i] as f64 / total as f64;
    assert!(
        share(0) > 0.45 && share(1) > 0.2 && share(2) > 0.05,
        "shares {shares:?}"
    );
    assert!(
        share(0) > share(1) && share(1) > share(2),
        "shares {shares:?}"
    );
}

#[tokio::test]
async fn three_envoys_above_the_limit_admit_at_most_it_and_nine_tenths_of_it() {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let (tally, shares) = above_the_limit(&[&node], &clock).await;
    eprintln!(
        "memory, one node: admitted per minute {:?}, by Envoy {shares:?}",
        tally.admitted
    );
    assert_exact_and_full(&tally, 1200, shares);
}

#[tokio::test]
async fn two_nodes_on_one_redis_hold_the_limit_together() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(START));
    let (a, b) = two_redis_nodes(&redis, &clock);
    let (tally, shares) = above_the_limit(&[&a, &b], &clock).await;
    eprintln!(
        "Redis, two nodes: admitted per minute {:?}, by Envoy {shares:?}",
        tally.admitted
    );
    assert_exact_and_full(&tally, 1200, shares);
}

/// Three Envoys sharing `load` of the limit (60/30/10): how many requests were denied (but
/// those their `DENY_ALL` fallback denied before any answer reached them), of how many, over
/// three minutes; and every minute within the limit.
async fn under_the_limit(load: f64) -> (u64, u64) {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let start = clock.now_micros();
    let rate = 20.0 * load;
    let mut envoys = vec![
        SimEnvoy::new(&node, rate * 0.6, API, start),
        SimEnvoy::new(&node, rate * 0.3, API, start + 2_100 * MS),
        SimEnvoy::new(&node, rate * 0.1, API, start + 4_000 * MS),
    ];
    let mut tally = Tally::per(60);
    run(&clock, &mut envoys, 180, &mut tally).await;
    assert!(
        tally.admitted.values().all(|n| *n <= 1200),
        "{:?}",
        tally.admitted
    );
    let denied: u64 = envoys.iter().map(|e| e.denied - e.denied_unanswered).sum();
    let all: u64 = envoys.iter().map(|e| e.denied + e.admitted).sum();
    (denied, all)
}

#[tokio::test]
async fn under_three_quarters_of_the_limit_nothing_is_denied() {
    for load in [0.25, 0.5, 0.75] {
        let (denied, of) = under_the_limit(load).await;
        assert_eq!(denied, 0, "{denied} of {of} denied at {load} of the limit");
    }
}

#[tokio::test]
async fn near_the_limit_few_are_denied() {
    // What top-ups leave unspent in the Envoys' buckets is charged: near the limit it runs out
    // a little before the window ends (docs/rlqs.md states the figure).
    let (denied, of) = under_the_limit(0.9).await;
    eprintln!("at 0.9 of the limit: {denied} of {of} denied");
    assert!(
        denied * 100 <= of * 3,
        "{denied} of {of} denied at 0.9 of the limit"
    );
}

#[tokio::test]
async fn several_tiers_hold_together() {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let start = clock.now_micros();
    let tiers: &[(&str, &str)] = &[("route", "tiers")];
    let mut envoys = vec![
        SimEnvoy::new(&node, 12.0, tiers, start),
        SimEnvoy::new(&node, 8.0, tiers, start + 2_500 * MS),
    ];
    let mut seconds = Tally::per(1);
    run(&clock, &mut envoys, 120, &mut seconds).await;
    // 10 a second, 300 an hour: the hour runs out after about half a minute.
    for (second, n) in &seconds.admitted {
        assert!(*n <= 10, "second {second}: {n} admitted");
    }
    let total: u64 = seconds.admitted.values().sum();
    assert!(total <= 300, "{total} admitted in the hour");
    assert!(total >= 250, "only {total} of 300 admitted");
}

/// A budget of two tiers, 20 a minute and 30 an hour, and three Envoys asking twice the minute's
/// limit (60/30/10) from 8 s before a minute's end. What a grant did not spend when it ended
/// goes back to the hour (bounded by what the Envoy's next report proves it did not admit), so
/// the hour is not used up by tokens nobody spent, and a grant sized on demand since fallen is
/// replaced so the minute's rest reaches the Envoys that want it: counted by when each Envoy
/// decided, no minute passes 20 nor the hour 30, and the hour admits at least 27 by the end of
/// the minute after the full one. The full minute admits all of its 20 but what the Envoys
/// admitted between their last reports and its start: what the old grants may still spend is
/// charged to it (nothing late), and no report tells those requests from late ones, so they
/// are the one thing it cannot get back (docs/rlqs.md).
#[tokio::test]
async fn two_tiers_give_back_what_a_grant_did_not_spend() {
    let clock = Arc::new(ManualClock::new(START + 52 * S));
    let node = memory_node(&clock);
    let start = clock.now_micros();
    let budget: &[(&str, &str)] = &[("route", "budget")];
    // 40 a minute in all.
    let mut envoys = vec![
        SimEnvoy::new(&node, 0.4, budget, start),
        SimEnvoy::new(&node, 0.2, budget, start + 1_300 * MS),
        SimEnvoy::new(&node, 40.0 / 60.0 - 0.6, budget, start + 2_900 * MS),
    ];
    let mut minutes = Tally::per(60);
    run_until(&clock, &mut envoys, START + 60 * S, &mut minutes).await;
    let unreported: u64 = envoys
        .iter()
        .map(|e| e.admitted - e.admitted_at_report)
        .sum();
    run_until(&clock, &mut envoys, start + 128 * S, &mut minutes).await;
    let per_minute: Vec<u64> = minutes.admitted.values().copied().collect();
    let hour: u64 = per_minute.iter().sum();
    eprintln!(
        "two tiers (20/minute, 30/hour): admitted per minute {per_minute:?}, the hour {hour}, \
         {unreported} admitted after the Envoys' last reports before the full minute (before \
         unspent tokens went back: [4, 15], 19; with them, spending late: [4, 20, 4], 28)"
    );
    for (minute, n) in &minutes.admitted {
        assert!(*n <= 20, "minute {minute}: {n} admitted of 20");
    }
    assert!(hour <= 30, "the hour admitted {hour} of 30");
    assert!(
        per_minute[1] + unreported >= 20,
        "the full minute admitted only {}, {unreported} admitted unreported before it",
        per_minute[1]
    );
    assert!(
        hour >= 27,
        "the hour admitted only {hour} of 30 by the end of the next minute"
    );
}

impl SimEnvoy {
    /// `n` requests at once, at the clock's time.
    async fn burst(&mut self, n: u64, clock: &ManualClock, tally: &mut Tally) {
        let now = clock.now_micros();
        self.receive(now);
        for _ in 0..n {
            self.request(now, tally).await;
        }
    }
}

/// "5 login attempts a minute" must not allow a sixth, even from an Envoy that holds tokens of
/// the minute before when the minute ends and spends them all at once before the next minute's
/// grants reach it: what a grant may still spend after its window is charged to the next one.
/// Counted by when each Envoy decided, with answers 30 ms on their way; once with the Envoy's
/// report (which holds the burst) the first word of the new minute, once with the tick's.
#[tokio::test]
async fn a_burst_at_a_window_boundary_spends_within_the_new_windows_limit() {
    for offset_ms in [0, 500] {
        let clock = Arc::new(ManualClock::new(START + 50 * S + offset_ms * MS));
        let node = memory_node(&clock);
        let login: &[(&str, &str)] = &[("route", "login")];
        let start = clock.now_micros();
        // Envoys set to deny until they have an assignment, as such a rule wants (an Envoy set
        // to allow admits a new bucket's requests before any grant can reach it).
        let envoy = || {
            let mut e = SimEnvoy::new(&node, 0.0, login, start);
            e.envoy.no_assignment = Blanket::Deny;
            e
        };
        let mut a = envoy();
        let mut minutes = Tally::per(60);
        // One attempt makes the bucket (denied: no grant yet) and its grant, still whole when
        // the minute ends.
        a.burst(1, &clock, &mut minutes).await;
        run_until(
            &clock,
            std::slice::from_mut(&mut a),
            START + 60 * S,
            &mut minutes,
        )
        .await;
        assert!(minutes.admitted.is_empty(), "{:?}", minutes.admitted);
        // The minute has ended; no tick has run yet. Ten attempts at once, then more from both
        // Envoys once the new grants are on their way and have arrived.
        clock.advance(MS);
        a.burst(10, &clock, &mut minutes).await;
        let mut both = [a, envoy()];
        for seconds in [1, 6, 50] {
            run(&clock, &mut both, seconds, &mut minutes).await;
            for e in &mut both {
                e.burst(10, &clock, &mut minutes).await;
            }
        }
        let per_minute: Vec<u64> = minutes.admitted.values().copied().collect();
        eprintln!(
            "5 a minute, a burst at the boundary (the Envoy's reports {offset_ms} ms into a \
             second): admitted per minute {per_minute:?}"
        );
        assert_eq!(per_minute, [5], "no sixth, and the new minute is full");
    }
}

/// Three Envoys at `load` times a limit of `limit` per `window_s` on `bucket` (split 60/30/10)
/// for `seconds`: what they admitted in each window, and how many of their requests were denied
/// of how many.
async fn fleet_of_three(
    bucket: &'static [(&'static str, &'static str)],
    limit: u64,
    window_s: u64,
    load: f64,
    seconds: u64,
) -> (Vec<u64>, u64, u64) {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let start = clock.now_micros();
    let rate = limit as f64 / window_s as f64 * load;
    let mut envoys = vec![
        SimEnvoy::new(&node, rate * 0.6, bucket, start),
        SimEnvoy::new(&node, rate * 0.3, bucket, start + 1_700 * MS),
        SimEnvoy::new(&node, rate * 0.1, bucket, start + 3_300 * MS),
    ];
    let mut tally = Tally::per(window_s);
    run(&clock, &mut envoys, seconds, &mut tally).await;
    let denied = envoys.iter().map(|e| e.denied - e.denied_unanswered).sum();
    let all = envoys.iter().map(|e| e.denied + e.admitted).sum();
    (tally.admitted.values().copied().collect(), denied, all)
}

/// The sizes an operator moving from RLS would try, three Envoys at twice the limit: a minute's
/// window never over and at least nine tenths full; a second's never over and at least 85 %
/// full over 20 s (a window shorter than the reports gets refilling grants, see `policy::Refill`;
/// the Envoys split the limit evenly until their first 5-second reports say their demand); at
/// 85 % of a limit, at most 0.5 % denied. Counted by when each Envoy decided, with
/// answers 30 ms on their way, so each window's first requests still meet the grants before.
#[tokio::test]
async fn the_usual_sizes_admit_at_most_the_limit_and_nine_tenths_of_it() {
    const SMALL: &[(&str, &str)] = &[("route", "small")];
    const MID: &[(&str, &str)] = &[("route", "mid")];
    const FAST: &[(&str, &str)] = &[("route", "fast")];
    for (bucket, limit) in [(SMALL, 40), (MID, 600)] {
        let (minutes, _, _) = fleet_of_three(bucket, limit, 60, 2.0, 300).await;
        eprintln!("{limit}/minute at twice the limit: admitted per minute {minutes:?}");
        for n in &minutes {
            assert!(*n <= limit, "{limit}/minute: {minutes:?}");
            assert!(*n * 10 >= limit * 9, "{limit}/minute: {minutes:?}");
        }
    }
    let (seconds, _, _) = fleet_of_three(FAST, 100, 1, 2.0, 20).await;
    let total: u64 = seconds.iter().sum();
    eprintln!(
        "100/second at twice the limit: admitted per second {seconds:?}, {total} in 20 s \
         ({:.0} %)",
        total as f64 / 20.0
    );
    assert!(seconds.iter().all(|n| *n <= 100), "{seconds:?}");
    assert!(total * 100 >= 2_000 * 85, "{total} of 2000 in 20 s");
    let (_, denied, all) = fleet_of_three(MID, 600, 60, 0.85, 180).await;
    eprintln!("600/minute at 85 % of the limit: {denied} of {all} denied");
    assert!(
        denied * 200 <= all,
        "{denied} of {all} denied at 85 % of the limit"
    );
}

#[tokio::test]
async fn a_sliding_window_holds_over_any_minute_boundary() {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let start = clock.now_micros();
    let sliding: &[(&str, &str)] = &[("route", "sliding")];
    let mut envoys = vec![
        SimEnvoy::new(&node, 15.0, sliding, start),
        SimEnvoy::new(&node, 5.0, sliding, start + 1_000 * MS),
    ];
    let mut tally = Tally::per(60);
    run(&clock, &mut envoys, 240, &mut tally).await;
    for (window, n) in &tally.admitted {
        assert!(*n <= 600, "minute {window}: {n} admitted of 600");
    }
}

#[tokio::test]
async fn an_envoy_that_moves_to_another_node_keeps_the_fleet_within_the_limit() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(START));
    let (a, b) = two_redis_nodes(&redis, &clock);
    let start = clock.now_micros();
    let mut envoys = vec![
        SimEnvoy::new(&a, 30.0, API, start),
        SimEnvoy::new(&b, 10.0, API, start + 2_000 * MS),
    ];
    let mut tally = Tally::per(60);
    run(&clock, &mut envoys, 37, &mut tally).await;
    // Node a goes away mid-window (a rollout): its Envoy's stream is gone, it keeps what it
    // holds, and resubscribes on node b at its next report with every bucket.
    envoys[0].session = b.service.session();
    run(&clock, &mut envoys, 143, &mut tally).await;
    for (window, n) in &tally.admitted {
        assert!(*n <= 1200, "minute {window}: {n} admitted");
    }
    assert!(
        tally.admitted.values().all(|n| *n * 10 >= 1200 * 8),
        "{:?}",
        tally.admitted
    );
    drop(a);
}

fn id(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

fn usage(entries: &[(&str, &str)], allowed: u64, denied: u64, elapsed_s: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(id(entries)),
        time_elapsed: Some(prost_types::Duration {
            seconds: elapsed_s,
            nanos: 0,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: usages,
    }
}

/// The strategies of `actions`, as short words: `allow`, `deny`, `tokens:N`, `abandon`.
fn kinds(actions: &[sluice::proto::rlqs::BucketAction]) -> Vec<String> {
    actions
        .iter()
        .map(|a| match a.bucket_action.as_ref().unwrap() {
            bucket_action::BucketAction::AbandonAction(_) => "abandon".to_owned(),
            bucket_action::BucketAction::QuotaAssignmentAction(q) => {
                let ttl = q.assignment_time_to_live.unwrap().seconds;
                assert!(ttl >= 1, "every time to live is a whole second or more");
                match q
                    .rate_limit_strategy
                    .as_ref()
                    .unwrap()
                    .strategy
                    .as_ref()
                    .unwrap()
                {
                    rate_limit_strategy::Strategy::BlanketRule(0) => "allow".to_owned(),
                    rate_limit_strategy::Strategy::BlanketRule(_) => "deny".to_owned(),
                    rate_limit_strategy::Strategy::TokenBucket(tb) => {
                        format!("tokens:{}", tb.max_tokens)
                    }
                    other => panic!("Envoy 1.40 rejects {other:?}"),
                }
            }
        })
        .collect()
}

#[tokio::test]
async fn unlimited_unmatched_and_unknown_are_allowed_and_shadow_rules_count() {
    let clock = Arc::new(ManualClock::new(START));
    let node = memory_node(&clock);
    let mut session = node.service.session();
    let answer = session
        .report(reports(
            "q",
            vec![
                usage(&[("route", "free")], 1, 0, 0),
                usage(&[("route", "nowhere")], 1, 0, 0),
                usage(&[("route", "api"), ("extra", "x")], 1, 0, 0),
                usage(&[("route", "trial")], 3, 0, 0),
            ],
        ))
        .await
        .unwrap();
    assert_eq!(kinds(&answer), ["allow", "allow", "allow", "allow"]);
    // The shadow rule counted the 3 its Envoy admitted (of 5 an hour).
    let check = Request {
        domain: "q".into(),
        descriptors: vec![Descriptor::of(&[("route", "trial")], 0)],
    };
    let decision = node.engine.decide(&check).await.unwrap();
    assert_eq!(decision.statuses[0].remaining, 2);
    let mut other = node.service.session();
    let answer = other
        .report(reports(
            "unknown",
            vec![usage(&[("route", "api")], 1, 0, 0)],
        ))
        .await
        .unwrap();
    assert_eq!(kinds(&answer), ["allow"]);
}

#[tokio::test]
async fn a_grant_is_deny_all_then_the_bucket_and_nothing_left_is_deny_all() {
    let clock = Arc::new(ManualClock::new(START + 30 * S));
    let node = memory_node(&clock);
    let mut session = node.service.session();
    let answer = session
        .report(reports("q", vec![usage(API, 1, 0, 0)]))
        .await
        .unwrap();
    // The request the fallback admitted is charged, and a first grant of the limit's rate
    // until the next report (20/s for 5 s) goes out, fresh.
    assert_eq!(kinds(&answer), ["deny", "tokens:100"]);
    let check = Request {
        domain: "q".into(),
        descriptors: vec![Descriptor::of(API, 0)],
    };
    let left = node.engine.decide(&check).await.unwrap().statuses[0].remaining;
    assert_eq!(left, 1200 - 101);
    // Time to live: to the minute's end (30 s) and the tick's slack past it, in whole seconds.
    let ttl = match answer[1].bucket_action.as_ref().unwrap() {
        bucket_action::BucketAction::QuotaAssignmentAction(q) => {
            q.assignment_time_to_live.unwrap().seconds
        }
        _ => unreachable!(),
    };
    assert_eq!(ttl, 31);
    // Someone else spends the rest through RLS; the Envoy runs out and asks again.
    let spend = Request {
        domain: "q".into(),
        descriptors: vec![Descriptor::of(API, left)],
    };
    node.engine.decide(&spend).await.unwrap();
    clock.advance(5 * S);
    let answer = session
        .report(reports("q", vec![usage(API, 100, 40, 5)]))
        .await
        .unwrap();
    assert_eq!(kinds(&answer), ["deny"]);
    // The next minute's grant comes with the tick on its first second.
    clock.set(START + 60 * S + 5 * MS);
    let answer = session.tick().await;
    assert!(matches!(kinds(&answer).as_slice(), [d, t] if d == "deny" && t.starts_with("tokens:")));
}

#[tokio::test]
async fn hostile_reports_get_a_clear_answer_and_cost_nothing_else() {
    let clock = Arc::new(ManualClock::new(START));
    let node = node(
        &common::memory(&clock, 1_000),
        &clock,
        QuotaOptions {
            max_buckets_per_stream: 5,
            max_buckets: 6,
            ..QuotaOptions::default()
        },
    );
    let mut session = node.service.session();
    let err = session.report(reports("", vec![])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("no domain"));
    // Empty ids, counts of 2^53 or more and oversized ids are skipped; the good one is answered.
    let long = "v".repeat(2_000);
    let answer = session
        .report(reports(
            "q",
            vec![
                BucketQuotaUsage {
                    bucket_id: Some(BucketId::default()),
                    ..BucketQuotaUsage::default()
                },
                BucketQuotaUsage {
                    bucket_id: None,
                    ..BucketQuotaUsage::default()
                },
                usage(API, 1 << 53, 0, 5),
                usage(&[("route", long.as_str())], 1, 0, 5),
                usage(&[("route", "free")], 1, 0, 0),
            ],
        ))
        .await
        .unwrap();
    assert_eq!(kinds(&answer), ["allow"]);
    // Nothing was charged for the refused counts.
    let check = Request {
        domain: "q".into(),
        descriptors: vec![Descriptor::of(API, 0)],
    };
    assert_eq!(
        node.engine.decide(&check).await.unwrap().statuses[0].remaining,
        1200
    );
    let err = session
        .report(reports("other", vec![usage(API, 1, 0, 0)]))
        .await
        .unwrap_err();
    assert!(
        err.message().contains("one stream per domain"),
        "{}",
        err.message()
    );
    let many: Vec<_> = (0..6)
        .map(|i| usage(&[("user", &format!("u{i}"))], 1, 0, 0))
        .collect();
    let err = session.report(reports("q", many)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    // The node holds at most six: a second stream gets five, and no more on this stream.
    let mut second = node.service.session();
    let users: Vec<String> = (0..5).map(|i| format!("u{i}")).collect();
    let answer = second
        .report(reports(
            "q",
            users
                .iter()
                .map(|u| usage(&[("user", u)], 1, 0, 0))
                .collect(),
        ))
        .await
        .unwrap();
    assert_eq!(answer.len(), 5);
    assert_eq!(node.service.buckets(), 6);
    let answer = second
        .report(reports("q", vec![usage(&[("user", "u9")], 1, 0, 0)]))
        .await
        .unwrap();
    assert!(
        answer.is_empty(),
        "past the stream's bound a bucket gets nothing"
    );
    let mut third = node.service.session();
    let answer = third
        .report(reports("q", vec![usage(&[("user", "u7")], 1, 0, 0)]))
        .await
        .unwrap();
    assert!(
        answer.is_empty(),
        "past the node's bound a bucket gets nothing"
    );
    drop(third);
    drop(second);
    drop(session);
    assert_eq!(
        node.service.buckets(),
        0,
        "a closed stream's buckets leave the node"
    );
}

#[tokio::test]
async fn the_stream_is_served_on_the_grpc_listener() {
    let server = common::start(RULES, "none", EngineSettings::default()).await;
    server.clock.set(START + 10 * S);
    let (tx, mut inbound) = common::rlqs_envoy::open_stream(
        server.channel().await,
        reports("q", vec![usage(API, 1, 0, 0)]),
    )
    .await;
    let first = inbound.message().await.unwrap().unwrap();
    assert_eq!(kinds(&first.bucket_action), ["deny", "tokens:100"]);
    let (_, metrics) = common::http_get(server.running.http_addr, "/metrics").await;
    assert!(metrics.contains("sluice_rlqs_streams 1"), "{metrics}");
    // The views: the node's streams and buckets, and what its grants hold of the counter.
    let (_, status) = common::http_get(server.running.http_addr, "/status").await;
    assert!(
        status.contains("\"rlqs\":{\"buckets\":1,\"streams\":1}"),
        "{status}"
    );
    let (_, counters) = common::http_get(
        server.running.http_addr,
        "/counters?domain=q&descriptor=route=api",
    )
    .await;
    assert!(
        counters.contains("\"rlqs\":{\"held_in_grants\":100,\"streams\":1}"),
        "{counters}"
    );
    assert!(metrics.contains("sluice_rlqs_tokens_granted_total{domain=\"q\"} 100"));
    // A report with no domain ends the stream with the reason.
    tx.send(reports("", vec![])).await.unwrap();
    let err = loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn with_redis_down_the_rules_failure_policy_becomes_the_assignment() {
    let mut redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(START + 10 * S));
    let store = StoreConfig {
        clocks: Clocks::pinned(clock.clone()),
        ..shared_config(Topology::Standalone(redis.url()), Duration::from_secs(1))
    };
    let node = node(&store, &clock, QuotaOptions::default());
    let mut session = node.service.session();
    let buckets = || {
        vec![
            usage(&[("route", "closed")], 1, 0, 0),
            usage(&[("route", "open")], 1, 0, 0),
            usage(&[("route", "local")], 1, 0, 0),
        ]
    };
    // Redis up: grants for all three.
    let answer = session.report(reports("q", buckets())).await.unwrap();
    assert_eq!(
        kinds(&answer),
        [
            "deny",
            "tokens:50",
            "deny",
            "tokens:50",
            "deny",
            "tokens:50"
        ]
    );
    redis.kill();
    // A new stream's buckets, with Redis gone: deny, allow, and this node's own counters.
    let mut other = node.service.session();
    let answer = other.report(reports("q", buckets())).await.unwrap();
    assert_eq!(kinds(&answer), ["deny", "allow", "deny", "tokens:50"]);
}

#[tokio::test]
async fn idle_buckets_are_abandoned_and_leave_the_node() {
    let clock = Arc::new(ManualClock::new(START + 10 * S));
    let node = node(
        &common::memory(&clock, 1_000),
        &clock,
        QuotaOptions {
            idle_reports_to_abandon: 2,
            ..QuotaOptions::default()
        },
    );
    let mut session = node.service.session();
    session
        .report(reports(
            "q",
            vec![usage(API, 1, 0, 0), usage(&[("route", "free")], 1, 0, 0)],
        ))
        .await
        .unwrap();
    assert_eq!(node.service.buckets(), 2);
    // The API bucket keeps seeing requests; the free one goes quiet for two reports.
    for i in 0..2 {
        clock.advance(5 * S);
        let answer = session
            .report(reports(
                "q",
                vec![usage(API, 5, 0, 5), usage(&[("route", "free")], 0, 0, 5)],
            ))
            .await
            .unwrap();
        let abandoned = kinds(&answer).iter().filter(|k| *k == "abandon").count();
        assert_eq!(abandoned, i, "report {i}: {:?}", kinds(&answer));
    }
    assert_eq!(
        node.service.buckets(),
        1,
        "the abandoned bucket left the node"
    );
}
