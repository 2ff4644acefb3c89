//! The Redis and Redis Cluster backends against real redis-server processes: the same
//! decisions as memory, accuracy under concurrency, one script call per slot, TTLs, the failure
//! policy when Redis dies and comes back, and slot migration during traffic.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer, commandstat, shared_config};
use common::{Assembled, assemble};
use sluice::clock::ManualClock;
use sluice::engine::{Code, Decision, Descriptor, Engine, EngineError, EngineSettings, Request};
use sluice::rules::load_texts;
use sluice::server::RulesSource;
use sluice::store::redis::{RedisOptions, RedisStore, Topology};
use sluice::store::{
    BackendConfig, BreakerOptions, Clocks, FailureMode, LeaseOptions, MemoryStore, Mode,
    StoreConfig,
};

const S: u64 = 1_000_000;

/// The tests that bound how long calls take during an outage run one at a time, so the other
/// tests' load on this 2-core machine does not stretch their clocks.
static TIMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const RULES: &str = r#"
domain: d
descriptors:
  - key: fixed
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: sliding
    rate_limit: {unit: second, requests_per_unit: 6, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: sliding_log}
  - key: token
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: token_bucket, burst: 5}
  - key: leaky
    rate_limit: {unit: minute, requests_per_unit: 30, algorithm: leaky_bucket, burst: 4}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 7, algorithm: gcra, burst: 2}
  - key: tiers
    rate_limits:
      - {unit: second, requests_per_unit: 3, algorithm: gcra, name: fast}
      - {unit: minute, requests_per_unit: 20, algorithm: sliding_log, name: slow}
      - {unit: second, requests_per_unit: 2, unit_multiplier: 5, algorithm: sliding_window, name: five}
  - key: zero
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: bulk
    rate_limit: {unit: minute, requests_per_unit: 40}
  - key: sliding_bulk
    rate_limit: {unit: minute, requests_per_unit: 40, algorithm: sliding_window}
  - key: quota_a
    quota_mode: true
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: quota_b
    quota_mode: true
    rate_limits:
      - {unit: second, requests_per_unit: 2, algorithm: token_bucket, burst: 3}
      - {unit: minute, requests_per_unit: 30, algorithm: sliding_window}
  - key: cost
    overdraft: true
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: cost_bucket
    overdraft: true
    rate_limits:
      - {unit: second, requests_per_unit: 3, algorithm: gcra, burst: 4}
      - {unit: minute, requests_per_unit: 40, algorithm: token_bucket}
  - key: flight
    descriptors:
      - key: request
        concurrency: {limit: 2, max_hold: 3s}
"#;

fn redis_store(topology: Topology, timeout: Duration) -> RedisStore {
    RedisStore::new(&RedisOptions {
        topology,
        pool_size: 4,
        timeout,
        connect_timeout: Duration::from_secs(2),
        key_prefix: "sluice:".into(),
        read_string_windows: false,
    })
    .unwrap()
}

/// The memory store's engine on `clock`, with `RULES`: what Redis must answer alike.
fn memory_engine(clock: &Arc<ManualClock>) -> Engine<MemoryStore> {
    Engine::new(
        load_texts([("d.yaml", RULES)]).unwrap(),
        MemoryStore::new(clock.clone(), 100_000),
        EngineSettings::default(),
    )
}

fn pinned_engine(topology: Topology, clock: &Arc<ManualClock>) -> Engine<RedisStore> {
    pinned_engine_with(topology, clock, RULES)
}

fn pinned_engine_with(
    topology: Topology,
    clock: &Arc<ManualClock>,
    rules: &str,
) -> Engine<RedisStore> {
    let store = redis_store(topology, Duration::from_secs(5)).with_pinned_clock(clock.clone());
    Engine::new(
        load_texts([("d.yaml", rules)]).unwrap(),
        store,
        EngineSettings::default(),
    )
}

/// Where Redis has no Functions (Redis 6, or an ACL or proxy refusing them), the same code runs
/// as a script: the same decisions, by EVALSHA.
#[tokio::test]
async fn without_functions_the_limiter_runs_as_a_script() {
    let redis = RedisServer::start_without_functions();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let engine = pinned_engine(Topology::Standalone(redis.url()), &clock);
    let request = Request {
        domain: "d".into(),
        descriptors: vec![descriptor(&[("fixed", "a")], 1, false)],
    };
    let mut codes = Vec::new();
    for _ in 0..7 {
        codes.push(engine.decide(&request).await.unwrap().code);
    }
    // 5 a second.
    assert_eq!(
        codes.iter().filter(|c| **c == Code::Ok).count(),
        5,
        "{codes:?}"
    );
    let info = redis.cli(&["INFO", "commandstats"]);
    assert!(commandstat(&info, "evalsha") >= 7, "{info}");
    assert_eq!(commandstat(&info, "fcall"), 0, "{info}");
}

/// xorshift64*: a reproducible sequence without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn descriptor(entries: &[(&str, &str)], hits: u64, refund: bool) -> Descriptor {
    Descriptor {
        refund,
        ..Descriptor::of(entries, hits)
    }
}

/// The descriptor key of each rule in `RULES` (`flight` with a request's id below it: a
/// concurrency limit).
const RULE_KEYS: [&str; 16] = [
    "fixed",
    "sliding",
    "log",
    "token",
    "leaky",
    "gcra",
    "tiers",
    "zero",
    "shadow",
    "bulk",
    "sliding_bulk",
    "quota_a",
    "quota_b",
    "cost",
    "cost_bucket",
    "flight",
];

fn random_request(rng: &mut Rng) -> Request {
    const VALUES: [&str; 3] = ["a", "b{x}", "c:}{"];
    const REQUESTS: [&str; 4] = ["r1", "r2", "r3", "r4"];
    let n = 1 + rng.below(3) as usize;
    // A request holds one slot of a concurrency counter: one request id per call.
    let request = REQUESTS[rng.below(REQUESTS.len() as u64) as usize];
    let descriptors = (0..n)
        .map(|_| {
            let key = RULE_KEYS[rng.below(RULE_KEYS.len() as u64) as usize];
            let value = VALUES[rng.below(VALUES.len() as u64) as usize];
            let hits = [0, 1, 1, 1, 2, 3][rng.below(6) as usize];
            if key == "flight" {
                // Releases as often as acquires: each request's stream ends.
                let release = rng.below(2) == 0;
                return descriptor(&[(key, value), ("request", request)], hits, release);
            }
            let refund = rng.below(10) == 0;
            descriptor(&[(key, value)], hits, refund)
        })
        .collect();
    Request {
        domain: "d".into(),
        descriptors,
    }
}

/// The production stack on one manual clock: the over-limit cache on, every leasable rule in
/// hybrid mode, and no fallback (an outage would fail the test).
fn stack_engine(topology: Topology, clock: &Arc<ManualClock>, mode: Mode) -> Assembled {
    stack_engine_with(topology, clock, mode, RULES)
}

fn stack_engine_with(
    topology: Topology,
    clock: &Arc<ManualClock>,
    mode: Mode,
    rules: &str,
) -> Assembled {
    let mut config = shared_config(topology, Duration::from_secs(5));
    if let BackendConfig::Redis(redis) = &mut config.backend {
        // Its own counters, beside the other engines' in the same database.
        redis.key_prefix = format!("{mode}:");
    }
    assemble(
        &StoreConfig {
            failure_mode: FailureMode::Error,
            over_limit_cache: 10_000,
            leases: LeaseOptions {
                default_mode: mode,
                // This sequence is slow (a few requests a second): leases sized for 10 s of it.
                target: Duration::from_secs(10),
                ttl: Duration::from_secs(5),
                ..LeaseOptions::default()
            },
            clocks: Clocks::pinned(clock.clone()),
            ..config
        },
        rules,
    )
}

/// `got` must be `want`, status by status. `estimated_sliding`: a hybrid sliding-window status
/// is an estimate — the lease layer sees Redis's verdicts, not the weighted counts, and the
/// previous window's weight decays between calls — so its remaining may be up to one above
/// memory's and up to a quarter of the limit (the most a lease takes) below, and its reset
/// may differ; its code, limit and the decision may not. Returns the largest difference seen.
fn assert_same(mut got: Decision, want: &Decision, estimated_sliding: bool, what: &str) -> u64 {
    let mut worst = 0;
    if estimated_sliding && got.statuses.len() == want.statuses.len() {
        for (g, w) in got.statuses.iter_mut().zip(&want.statuses) {
            if g.stats
                .as_ref()
                .is_some_and(|s| s.rule.starts_with("sliding"))
            {
                let off = g.remaining.abs_diff(w.remaining);
                let quarter = g
                    .limit
                    .as_ref()
                    .map_or(0, |l| u64::from(l.requests_per_unit) / 4);
                assert!(
                    g.remaining <= w.remaining + 1 && w.remaining <= g.remaining + quarter.max(1),
                    "{what}: {g:?} is far from {w:?}"
                );
                worst = worst.max(off);
                g.remaining = w.remaining;
                g.duration_us = w.duration_us;
            }
        }
    }
    assert_eq!(&got, want, "{what}");
    worst
}

/// Drives the same random sequence through memory, Redis, and the production stack on Redis
/// (over-limit cache on; strict, and hybrid for every leasable rule) at the same (manual)
/// times: every decision and every status must be identical.
async fn differential(topology: Topology, seed: u64, steps: usize) {
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S + 123_456));
    let memory = memory_engine(&clock);
    let redis = pinned_engine(topology.clone(), &clock);
    let strict = stack_engine(topology.clone(), &clock, Mode::Strict);
    let hybrid = stack_engine(topology, &clock, Mode::Hybrid);
    let mut rng = Rng(seed);
    let (mut over, mut ok) = (0, 0);
    let (mut cached, mut leased, mut worst) = (0, 0, 0);
    for step in 0..steps {
        let dt = match rng.below(10) {
            0 => rng.below(3 * S),
            1..=3 => 0,
            _ => rng.below(300_000),
        };
        clock.advance(dt);
        let request = random_request(&mut rng);
        let want: Decision = memory.decide(&request).await.unwrap();
        let got: Decision = redis.decide(&request).await.unwrap();
        assert_eq!(got, want, "seed {seed} step {step}: {request:?}");
        let what = format!("seed {seed} step {step}: {request:?}");
        let got = strict.decide(&request).await.unwrap();
        assert_same(got, &want, false, &format!("strict stack, {what}"));
        // The server's sweep (every ttl/4): leftovers of leases that ran out go back.
        hybrid.upkeep.give_back(false).await;
        let got = hybrid.decide(&request).await.unwrap();
        worst = worst.max(assert_same(
            got,
            &want,
            true,
            &format!("hybrid stack, {what}"),
        ));
        cached = strict.upkeep.report().cached_denials.unwrap().max(cached);
        leased = hybrid.upkeep.report().lease_hits_held.unwrap().max(leased);
        if want.code == Code::OverLimit {
            over += 1;
        } else {
            ok += 1;
        }
    }
    assert!(
        over > steps / 10 && ok > steps / 10,
        "the sequence exercised both answers: {ok} ok, {over} over"
    );
    println!(
        "seed {seed}: {ok} ok, {over} over; {cached} cached denials and {leased} leased hits at most; hybrid sliding-window remaining off by {worst} at most"
    );
    assert!(
        cached > 0 && leased > 0,
        "the layers were used: {cached} cached denials, {leased} leased hits at most"
    );
}

/// How many seeds a differential test runs: `DIFF_SEEDS=N` for a longer search than CI's.
fn diff_seeds(ci: u64) -> u64 {
    std::env::var("DIFF_SEEDS").map_or(ci, |n| n.parse().expect("DIFF_SEEDS is a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_decides_exactly_as_memory() {
    let redis = RedisServer::start();
    for seed in 1..=diff_seeds(3) {
        redis.cli(&["FLUSHALL"]);
        differential(Topology::Standalone(redis.url()), seed, 400).await;
    }
    // No key is left without a TTL.
    let keys = redis.cli(&["--scan"]);
    let keys: Vec<&str> = keys.lines().collect();
    assert!(!keys.is_empty());
    for key in keys {
        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
        // -1 is a key without a TTL, the one answer that is wrong. 0 is a key in its last
        // millisecond (the scripts' shortest TTL is 1 ms); -2 one that expired after SCAN.
        assert!(ttl >= 0 || ttl == -2, "{key} has PTTL {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_decides_exactly_as_memory() {
    let cluster = RedisCluster::start();
    for seed in 7..7 + diff_seeds(1) {
        for node in &cluster.nodes {
            node.cli(&["FLUSHALL"]);
        }
        differential(Topology::Cluster(cluster.urls()), seed, 400).await;
    }
    // Keys are spread over the masters (values with braces did not pin them to one slot).
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap())
        .collect();
    assert!(
        per_node.iter().filter(|&&n| n > 0).count() >= 2,
        "{per_node:?}"
    );
}

const CONCURRENT_RULES: &str = r#"
domain: c
descriptors:
  - {key: fixed_window, rate_limit: {unit: hour, requests_per_unit: 150}}
  - {key: sliding_window, rate_limit: {unit: hour, requests_per_unit: 150, algorithm: sliding_window}}
  - {key: sliding_log, rate_limit: {unit: hour, requests_per_unit: 150, algorithm: sliding_log}}
  - {key: token_bucket, rate_limit: {unit: hour, requests_per_unit: 150, algorithm: token_bucket}}
  - {key: leaky_bucket, rate_limit: {unit: hour, requests_per_unit: 150, algorithm: leaky_bucket}}
  - {key: gcra, rate_limit: {unit: hour, requests_per_unit: 150, algorithm: gcra}}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_nodes_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let cluster = RedisCluster::start();
    for topology in [
        Topology::Standalone(redis.url()),
        Topology::Cluster(cluster.urls()),
    ] {
        for alg in [
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
            "leaky_bucket",
            "gcra",
        ] {
            let n = admitted_concurrently_with(topology.clone(), alg).await;
            // With all requests at one instant the sliding window's estimate is exact too.
            assert_eq!(n, 150, "{alg} on {topology:?}");
        }
    }
}

/// 4 sluice nodes, each with its own pool, 100 concurrent requests each, on one key.
async fn admitted_concurrently_with(topology: Topology, alg: &str) -> u64 {
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let store =
            redis_store(topology.clone(), Duration::from_secs(5)).with_pinned_clock(clock.clone());
        let engine = Arc::new(Engine::new(
            load_texts([("c.yaml", CONCURRENT_RULES)]).unwrap(),
            store,
            EngineSettings::default(),
        ));
        for _ in 0..100 {
            let (engine, admitted, alg) = (engine.clone(), admitted.clone(), alg.to_owned());
            tasks.push(tokio::spawn(async move {
                let r = Request {
                    domain: "c".into(),
                    descriptors: vec![descriptor(&[(&alg, "hot")], 1, false)],
                };
                if engine.decide(&r).await.unwrap().code == Code::Ok {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_script_call_per_slot_group() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let engine = Arc::new(pinned_engine(Topology::Standalone(redis.url()), &clock));
    let request = Request {
        domain: "d".into(),
        descriptors: vec![
            descriptor(&[("tiers", "a")], 1, false),
            descriptor(&[("fixed", "a")], 1, false),
            descriptor(&[("log", "a")], 1, false),
        ],
    };
    let allowed = |d: Decision| assert_eq!(d.code, Code::Ok, "no rollback calls in this test");
    // The first burst on a server without the library: every call misses it, one loads it.
    let burst: Vec<_> = (0..16)
        .map(|i| {
            let (engine, request) = (engine.clone(), request.clone());
            tokio::spawn(async move {
                let r = Request {
                    descriptors: vec![descriptor(&[("fixed", &i.to_string())], 1, false)],
                    ..request
                };
                engine.decide(&r).await.unwrap()
            })
        })
        .collect();
    for call in burst {
        allowed(call.await.unwrap());
    }
    let info = redis.cli(&["INFO", "commandstats"]);
    assert_eq!(commandstat(&info, "function|load"), 1, "{info}");
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..20 {
        clock.advance(5 * S);
        allowed(engine.decide(&request).await.unwrap());
    }
    let info = redis.cli(&["INFO", "commandstats"]);
    assert_eq!(commandstat(&info, "fcall"), 20, "{info}");
    // INFO commandstats also counts what the function runs (GET, SET, ...); of the commands only
    // a client sends, there is none but FCALL: no health-check PING, no script, no second
    // FUNCTION LOAD.
    for client_only in [
        "ping", "unwatch", "eval", "evalsha", "script", "function", "multi", "exec",
    ] {
        assert_eq!(commandstat(&info, client_only), 0, "{client_only}: {info}");
    }

    // In a cluster: 3 descriptors in (most likely) 3 slots, one FCALL each, and all 5 limits
    // of `tiers` in one slot.
    let cluster = RedisCluster::start();
    let engine = pinned_engine(Topology::Cluster(cluster.urls()), &clock);
    engine.decide(&request).await.unwrap();
    for n in &cluster.nodes {
        n.cli(&["CONFIG", "RESETSTAT"]);
    }
    for _ in 0..10 {
        clock.advance(5 * S);
        allowed(engine.decide(&request).await.unwrap());
    }
    let calls: u64 = cluster
        .nodes
        .iter()
        .map(|n| commandstat(&n.cli(&["INFO", "commandstats"]), "fcall"))
        .sum();
    assert!((10..=30).contains(&calls), "{calls}");
}

const RESILIENT_RULES: &str = "domain: f\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n  - key: local_only\n    failure_mode: local\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

fn resilient_store(url: String, mode: FailureMode, timeout: Duration) -> StoreConfig {
    StoreConfig {
        max_keys: 10_000,
        failure_mode: mode,
        breaker: BreakerOptions {
            threshold: 3,
            cooldown: Duration::from_millis(200),
        },
        ..shared_config(Topology::Standalone(url), timeout)
    }
}

fn resilient_engine(url: String, mode: FailureMode, timeout: Duration) -> Arc<Assembled> {
    Arc::new(assemble(
        &resilient_store(url, mode, timeout),
        RESILIENT_RULES,
    ))
}

fn req(key: &str) -> Request {
    Request {
        domain: "f".into(),
        descriptors: vec![descriptor(&[(key, "v")], 1, false)],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_applies_the_policy_and_recovers() {
    let _serial = TIMING.lock().await;
    let mut redis = RedisServer::start();
    let timeout = Duration::from_millis(50);
    let engines = [
        (
            FailureMode::Allow,
            resilient_engine(redis.url(), FailureMode::Allow, timeout),
        ),
        (
            FailureMode::Deny,
            resilient_engine(redis.url(), FailureMode::Deny, timeout),
        ),
        (
            FailureMode::Error,
            resilient_engine(redis.url(), FailureMode::Error, timeout),
        ),
        (
            FailureMode::Local,
            resilient_engine(redis.url(), FailureMode::Local, timeout),
        ),
    ];
    for (_, e) in &engines {
        assert_eq!(e.decide(&req("k")).await.unwrap().code, Code::Ok);
    }
    redis.kill();
    for round in 0..20 {
        for (mode, e) in &engines {
            let started = Instant::now();
            let result = e.decide(&req("k")).await;
            let took = started.elapsed();
            assert!(
                took < timeout + Duration::from_millis(500),
                "{mode} round {round} took {took:?}"
            );
            match (mode, result) {
                (FailureMode::Allow | FailureMode::Local, Ok(d)) => assert_eq!(d.code, Code::Ok),
                (FailureMode::Deny, Ok(d)) => {
                    assert_eq!(d.code, Code::OverLimit);
                    assert_eq!(d.retry_after_us, Some(S));
                }
                (FailureMode::Error, Err(EngineError::Store(_))) => {}
                (mode, other) => panic!("{mode}: {other:?}"),
            }
            // The rule's own failure_mode wins over the default: this node limits alone.
            let local = e.decide(&req("local_only")).await;
            if round < 2 {
                assert_eq!(local.unwrap().code, Code::Ok, "{mode} round {round}");
            } else {
                assert_eq!(local.unwrap().code, Code::OverLimit, "{mode} round {round}");
            }
        }
    }
    // With the circuit open, calls answer without waiting for a timeout: 100 calls would take
    // 100 × 50 ms without it; with it, only the occasional probe waits.
    let started = Instant::now();
    for _ in 0..100 {
        let _ = engines[0].1.decide(&req("k")).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(!engines[0].1.upkeep.report().backend_up());

    redis.restart();
    for (mode, e) in &engines {
        let back = Instant::now();
        loop {
            let before: u64 = redis.cli(&["DBSIZE"]).trim().parse().unwrap();
            // A counter of its own per mode, so each engine's first write shows in DBSIZE.
            let own = Request {
                domain: "f".into(),
                descriptors: vec![descriptor(&[("k", mode.name())], 1, false)],
            };
            let _ = e.decide(&own).await;
            let after: u64 = redis.cli(&["DBSIZE"]).trim().parse().unwrap();
            if e.upkeep.report().backend_up() && after > before {
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(1),
                "{mode} did not recover within a second"
            );
            let _ = mode;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_while_redis_is_down() {
    let _serial = TIMING.lock().await;
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.kill();
    let engine = resilient_engine(url, FailureMode::Local, Duration::from_millis(20));
    assert_eq!(engine.decide(&req("k")).await.unwrap().code, Code::Ok);
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        engine.decide(&req("k")).await.unwrap();
        if redis.cli(&["DBSIZE"]).trim() != "0" {
            break;
        }
        assert!(Instant::now() < deadline, "never reached Redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_under_concurrent_load() {
    let _serial = TIMING.lock().await;
    let mut redis = RedisServer::start();
    let timeout = Duration::from_millis(30);
    let engine = resilient_engine(redis.url(), FailureMode::Local, timeout);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slowest = Arc::new(AtomicU64::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (engine, stop, slowest, calls) =
            (engine.clone(), stop.clone(), slowest.clone(), calls.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = Request {
                    domain: "f".into(),
                    descriptors: vec![descriptor(&[("k", &format!("client-{t}"))], 1, false)],
                };
                let started = Instant::now();
                let d = engine
                    .decide(&r)
                    .await
                    .expect("the local policy always answers");
                assert_eq!(d.code, Code::Ok, "{d:?}");
                slowest.fetch_max(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                calls.fetch_add(1, Ordering::Relaxed);
                // Pacing (about 1000 calls per second per task), so 16 tasks load the machine
                // without starving it.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.restart();
    let back = Instant::now();
    // Traffic reaches Redis again within a second.
    loop {
        if redis.cli(&["DBSIZE"]).trim() != "0" && engine.upkeep.report().backend_up() {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(1),
            "no recovery within a second"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("no task panicked");
    }
    let slowest = Duration::from_micros(slowest.load(Ordering::Relaxed));
    assert!(
        slowest < timeout + Duration::from_millis(500),
        "a call took {slowest:?}"
    );
    assert!(calls.load(Ordering::Relaxed) > 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moves_between_masters_during_traffic() {
    let cluster = RedisCluster::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let store = redis_store(Topology::Cluster(cluster.urls()), Duration::from_secs(2))
        .with_pinned_clock(clock.clone());
    let rules = "domain: m\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 300}\n";
    let engine = Arc::new(Engine::new(
        load_texts([("m.yaml", rules)]).unwrap(),
        store,
        EngineSettings::default(),
    ));
    let request = Request {
        domain: "m".into(),
        descriptors: vec![descriptor(&[("k", "hot")], 1, false)],
    };
    assert_eq!(engine.decide(&request).await.unwrap().code, Code::Ok);
    // Find the hot key's slot and owner.
    let (port, key) = cluster
        .nodes
        .iter()
        .find_map(|n| {
            let keys = n.cli(&["--scan"]);
            keys.lines().next().map(|k| (n.port, k.to_owned()))
        })
        .expect("the key is somewhere");
    let slot: u16 = cluster.nodes[0]
        .cli(&["CLUSTER", "KEYSLOT", &key])
        .trim()
        .parse()
        .unwrap();
    let (source_id, source_port) = cluster.owner_of(slot);
    assert_eq!(source_port, port);
    let target = cluster
        .nodes
        .iter()
        .find(|n| n.port != source_port)
        .unwrap();
    let target_id = cluster.node_id(target.port);

    let admitted = Arc::new(AtomicU64::new(1));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (engine, request, admitted, errors) = (
            engine.clone(),
            request.clone(),
            admitted.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for _ in 0..100 {
                match engine.decide(&request).await {
                    Ok(d) if d.code == Code::Ok => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Move the slot while the requests run: IMPORTING/MIGRATING, MIGRATE the key, then assign.
    let source = cluster
        .nodes
        .iter()
        .find(|n| n.port == source_port)
        .unwrap();
    target.cli(&[
        "CLUSTER",
        "SETSLOT",
        &slot.to_string(),
        "IMPORTING",
        &source_id,
    ]);
    source.cli(&[
        "CLUSTER",
        "SETSLOT",
        &slot.to_string(),
        "MIGRATING",
        &target_id,
    ]);
    source.cli(&[
        "MIGRATE",
        "127.0.0.1",
        &target.port.to_string(),
        "",
        "0",
        "5000",
        "KEYS",
        &key,
    ]);
    for n in &cluster.nodes {
        n.cli(&["CLUSTER", "SETSLOT", &slot.to_string(), "NODE", &target_id]);
    }
    for t in tasks {
        t.await.expect("no task panicked");
    }
    cluster.wait_ok();
    assert_eq!(cluster.owner_of(slot).1, target.port);
    // Every request was answered; the limit was never exceeded; calls that hit the move while
    // a key was in flight may have failed (the failure policy answers those in production).
    let admitted = admitted.load(Ordering::Relaxed);
    let errors = errors.load(Ordering::Relaxed);
    assert!(admitted <= 300, "{admitted}");
    assert!(
        admitted + errors >= 300,
        "{admitted} admitted, {errors} errors of 401 calls"
    );
    // After the move, the counter carried over and the limit still holds exactly.
    let mut more = 0;
    for _ in 0..400 {
        if engine.decide(&request).await.unwrap().code == Code::Ok {
            more += 1;
        }
    }
    assert_eq!(admitted + more, 300, "{admitted} before, {more} after");
    assert_eq!(
        target.cli(&["EXISTS", &key]).trim(),
        "1",
        "the key lives on the new master"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_urls_speak_tls() {
    let redis = RedisServer::start_tls();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let engine = pinned_engine(Topology::Standalone(redis.url()), &clock);
    let r = Request {
        domain: "d".into(),
        descriptors: vec![descriptor(&[("fixed", "tls")], 5, false)],
    };
    assert_eq!(engine.decide(&r).await.unwrap().code, Code::Ok);
    assert_eq!(engine.decide(&r).await.unwrap().code, Code::OverLimit);
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_backend_when_the_policy_is_error() {
    let _serial = TIMING.lock().await;
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let mut redis = RedisServer::start();
    let store = resilient_store(redis.url(), FailureMode::Error, Duration::from_millis(30));
    let rules = load_texts([("f.yaml", RESILIENT_RULES)]).unwrap();
    let running = sluice::server::start(common::config(RulesSource::Given(rules), store))
        .await
        .unwrap();
    let engine = running.engine().clone();
    let http = running.http_addr;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", running.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let status = |h: &mut HealthClient<tonic::transport::Channel>| {
        let mut h = h.clone();
        async move {
            h.check(HealthCheckRequest {
                service: "envoy.service.ratelimit.v3.RateLimitService".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
        }
    };
    // Ready once the connections made in the background have reached Redis.
    let deadline = Instant::now() + Duration::from_secs(5);
    while common::http_get(http, "/readyz").await.0 != 200
        || status(&mut health).await != ServingStatus::Serving as i32
    {
        assert!(Instant::now() < deadline, "never ready with Redis up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    redis.kill();
    for _ in 0..5 {
        assert!(
            engine.decide(&req("k")).await.is_err(),
            "policy error: UNAVAILABLE"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&mut health).await != ServingStatus::NotServing as i32 {
        assert!(
            Instant::now() < deadline,
            "gRPC health did not go NOT_SERVING"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (code, body) = common::http_get(http, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        common::http_get(http, "/healthcheck").await.0,
        200,
        "liveness is not readiness"
    );

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let _ = engine.decide(&req("k")).await;
        if status(&mut health).await == ServingStatus::Serving as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "gRPC health did not recover");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(common::http_get(http, "/readyz").await.0, 200);
    running.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_counters_are_answered_locally_until_they_fit() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let store = StoreConfig {
        max_keys: 100,
        failure_mode: FailureMode::Error,
        over_limit_cache: 100,
        clocks: Clocks::pinned(clock.clone()),
        ..shared_config(Topology::Standalone(redis.url()), Duration::from_secs(5))
    };
    let rules = "domain: o\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: other\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
    let engine = assemble(&store, rules);
    let hot = |hits| Request {
        domain: "o".into(),
        descriptors: vec![descriptor(&[("k", "hot")], hits, false)],
    };
    let script_calls = || commandstat(&redis.cli(&["INFO", "commandstats"]), "fcall");
    assert_eq!(engine.decide(&hot(2)).await.unwrap().code, Code::Ok);
    let first = engine.decide(&hot(1)).await.unwrap();
    assert_eq!(first.code, Code::OverLimit);
    let calls = script_calls();
    // Denied here, with the same answer, and no Redis call.
    clock.advance(10 * S);
    for _ in 0..50 {
        let d = engine.decide(&hot(1)).await.unwrap();
        assert_eq!(d.code, Code::OverLimit);
        assert_eq!(d.statuses[0].remaining, 0);
        assert_eq!(
            d.retry_after_us,
            Some(first.retry_after_us.unwrap() - 10 * S)
        );
    }
    assert_eq!(script_calls(), calls, "no Redis call for a cached denial");
    // A probe still asks Redis (it asks for nothing, so no denial applies to it).
    assert_eq!(engine.decide(&hot(0)).await.unwrap().code, Code::Ok);
    assert_eq!(script_calls(), calls + 1);
    // With another descriptor: Redis decides the whole request, so every status is its own
    // (the other at its real hits, as memory reports it); the denied batch consumes nothing.
    let both = Request {
        domain: "o".into(),
        descriptors: vec![
            descriptor(&[("k", "hot")], 1, false),
            descriptor(&[("other", "x")], 3, false),
        ],
    };
    let d = engine.decide(&both).await.unwrap();
    assert_eq!(d.code, Code::OverLimit);
    assert_eq!(
        (d.statuses[1].code, d.statuses[1].remaining),
        (Code::Ok, 10)
    );
    assert_eq!(script_calls(), calls + 2);
    // When the window ends, the counter fits again: Redis decides.
    clock.advance(first.retry_after_us.unwrap());
    assert_eq!(engine.decide(&hot(1)).await.unwrap().code, Code::Ok);
    assert_eq!(script_calls(), calls + 3);
    assert_eq!(
        engine.upkeep.report().cached_denials,
        Some(0),
        "an allowed counter is forgotten"
    );
}

/// Issue 10: a probe whose caller gives up while Redis is paused must not leave the circuit
/// half-open for ever. Redis is paused (SIGSTOP) until the breaker opens, the probe's caller
/// times out, Redis is resumed (SIGCONT): the node is back on Redis within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_cancelled_while_redis_is_paused_does_not_wedge_the_breaker() {
    use sluice::store::BreakerState;
    let _serial = TIMING.lock().await;
    let redis = RedisServer::start();
    // The breaker's clock is manual: the cooldown passes when the test says so.
    let breaker_clock = Arc::new(ManualClock::new(1_000 * S));
    let cooldown = Duration::from_millis(500);
    let store = StoreConfig {
        failure_mode: FailureMode::Allow,
        breaker: BreakerOptions {
            threshold: 2,
            cooldown,
        },
        clocks: Clocks {
            monotonic: breaker_clock.clone(),
            ..Clocks::system()
        },
        ..shared_config(
            Topology::Standalone(redis.url()),
            Duration::from_millis(300),
        )
    };
    let rules = "domain: f\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";
    let engine = assemble(&store, rules);
    let breaker = || engine.upkeep.report().breaker.unwrap();
    let by_policy = async || {
        let decision = engine.decide(&req("k")).await.unwrap();
        decision.decided_by.is_policy()
    };
    assert!(!by_policy().await, "on Redis");

    redis.pause();
    for _ in 0..2 {
        assert!(by_policy().await, "timeout: policy");
    }
    assert_eq!(breaker(), BreakerState::Open);
    assert!(by_policy().await, "open: policy at once");
    breaker_clock.advance(cooldown.as_micros() as u64);
    // The probe goes to the paused Redis, and its caller gives up first (Envoy's deadline).
    let gave_up = tokio::time::timeout(Duration::from_millis(50), engine.decide(&req("k"))).await;
    assert!(
        gave_up.is_err(),
        "the probe was still waiting on the paused Redis"
    );
    assert_eq!(
        breaker(),
        BreakerState::Open,
        "a dropped probe counts as a failure, not a probe still out"
    );

    redis.resume();
    breaker_clock.advance(cooldown.as_micros() as u64);
    let resumed = Instant::now();
    loop {
        let d = engine.decide(&req("k")).await.unwrap();
        if !d.decided_by.is_policy() {
            break;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(1),
            "not back on Redis within a second of SIGCONT (breaker {:?})",
            breaker()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(breaker(), BreakerState::Closed);
    println!("back on Redis {:?} after SIGCONT", resumed.elapsed());
}

/// Issue 26 item 1, as its user met it: a million tokens a day, `burst` a million, a cost limit.
/// A debit of two million on a full bucket (Envoy's `apply_on_stream_done`) leaves a debt of a
/// million, a day to drain; giving 43 000 back leaves ~957 000 to drain. The same on memory and
/// on Redis (time from Redis `TIME` there, so its figures are bounded by the test's own time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_records_a_debit_twice_its_size_on_memory_and_redis() {
    const BUDGET: &str = "domain: llm\ndescriptors:\n  - key: user\n    overdraft: true\n    rate_limit: {unit: day, requests_per_unit: 1000000, algorithm: token_bucket, burst: 1000000}\n";
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    for (backend, store) in [
        ("memory", common::memory(&clock, 1_000)),
        (
            "redis",
            shared_config(Topology::Standalone(redis.url()), Duration::from_secs(2)),
        ),
    ] {
        let engine = assemble(&store, BUDGET);
        let call = |hits: u64, refund: bool| Request {
            domain: "llm".into(),
            descriptors: vec![descriptor(&[("user", "ann")], hits, refund)],
        };
        let retry_s = |d: &Decision| d.statuses[0].duration_us.unwrap() as f64 / S as f64;
        let started = Instant::now();
        let debit = engine.decide(&call(2_000_000, false)).await.unwrap();
        assert_eq!(
            debit.code,
            Code::Ok,
            "{backend}: under the limit, the debit is admitted"
        );
        let probe = engine.decide(&call(0, false)).await.unwrap();
        assert_eq!(probe.code, Code::OverLimit, "{backend}: in debt");
        // A million and one tokens to drain before one is free: 86 400.0864 s.
        let slack = started.elapsed().as_secs_f64() + 0.001;
        let want = 86_400.086_4;
        assert!(
            (want - slack..=want).contains(&retry_s(&probe)),
            "{backend}: retry after {} s, not a day",
            retry_s(&probe)
        );
        engine.decide(&call(43_000, true)).await.unwrap();
        let after = engine.decide(&call(0, false)).await.unwrap();
        assert_eq!(
            after.code,
            Code::OverLimit,
            "{backend}: still ~957 000 in debt"
        );
        let want = 86_400.086_4 * 957_001.0 / 1_000_001.0;
        let slack = started.elapsed().as_secs_f64() + 0.001;
        assert!(
            (want - slack..=want + 0.001).contains(&retry_s(&after)),
            "{backend}: retry after {} s, want {want}",
            retry_s(&after)
        );
    }
}

/// Issue 26 item 3: calendar windows decide alike on memory, on Redis (its script, pinned to
/// the same times) and through the production stack on Redis, strict and hybrid, on both sides
/// of a month's end in Berlin, the days the clocks change there, a leap day and a month's end in
/// Kolkata (UTC+5:30); and the reset each reports is the calendar's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_windows_roll_over_alike_on_memory_and_redis() {
    const RULES: &str = r#"
domain: cal
descriptors:
  - key: month
    rate_limit: {unit: month, requests_per_unit: 3, calendar: Europe/Berlin}
  - key: day
    rate_limits:
      - {unit: day, requests_per_unit: 2, calendar: Europe/Berlin, name: berlin_day}
      - {unit: week, requests_per_unit: 5, calendar: UTC, name: utc_week}
  - key: cost
    overdraft: true
    rate_limit: {unit: month, requests_per_unit: 4, calendar: Asia/Kolkata}
  - key: zero
    rate_limit: {unit: year, requests_per_unit: 0, calendar: UTC}
"#;
    let at = common::civil_us;
    const H: u64 = 3_600 * S;
    let redis = RedisServer::start();
    let topology = Topology::Standalone(redis.url());
    let clock = Arc::new(ManualClock::new(0));
    let memory = Engine::new(
        load_texts([("cal.yaml", RULES)]).unwrap(),
        MemoryStore::new(clock.clone(), 10_000),
        EngineSettings::default(),
    );
    let script = pinned_engine_with(topology.clone(), &clock, RULES);
    let strict = stack_engine_with(topology.clone(), &clock, Mode::Strict, RULES);
    let hybrid = stack_engine_with(topology, &clock, Mode::Hybrid, RULES);
    let request = |key: &str, hits: u64| Request {
        domain: "cal".into(),
        descriptors: vec![descriptor(&[(key, "u1")], hits, false)],
    };
    // Each edge: the last µs before it, the first at it; the DST days from their start.
    let berlin = "Europe/Berlin";
    let edges = [
        at(berlin, "2026-02-01T00:00"),
        at(berlin, "2026-03-29T00:00"),
        at(berlin, "2026-03-30T00:00"),
        at("Asia/Kolkata", "2026-05-01T00:00"),
        at(berlin, "2026-10-25T00:00"),
        at(berlin, "2026-10-26T00:00"),
        at("UTC", "2028-02-29T00:00"),
        at("UTC", "2028-03-01T00:00"),
    ];
    // In time order: the stacks' own clock (leases, cached denials) never goes back.
    assert!(edges.is_sorted());
    let mut steps = 0;
    for edge in edges {
        for now in [edge - S, edge - 1, edge, edge + 1] {
            clock.set(now);
            for (key, hits) in [
                ("month", 1),
                ("day", 1),
                ("cost", 3),
                ("zero", 1),
                ("month", 2),
            ] {
                let what = format!("{key} ×{hits} at {now}");
                let want = memory.decide(&request(key, hits)).await.unwrap();
                let got = script.decide(&request(key, hits)).await.unwrap();
                assert_eq!(got, want, "script: {what}");
                hybrid.upkeep.give_back(false).await;
                for (stack, engine) in [("strict", &strict), ("hybrid", &hybrid)] {
                    let got = engine.decide(&request(key, hits)).await.unwrap();
                    assert_same(got, &want, false, &format!("{stack} stack, {what}"));
                }
                steps += 1;
            }
        }
    }
    assert_eq!(steps, 8 * 4 * 5);
    // The reset each reports is the calendar's: a month's last µs, the 23- and 25-hour days.
    let reset = |d: &Decision| d.statuses[0].duration_us;
    let month_end = at(berlin, "2028-12-01T00:00");
    clock.set(month_end - 1);
    let d = memory.decide(&request("month", 1)).await.unwrap();
    assert_eq!((d.code, reset(&d)), (Code::Ok, Some(1)));
    clock.set(month_end);
    let d = memory.decide(&request("month", 1)).await.unwrap();
    assert_eq!(reset(&d), Some(31 * 24 * H), "December");
    for (day, hours) in [("2029-03-25T00:00", 23), ("2029-10-28T00:00", 25)] {
        clock.set(at(berlin, day));
        let d = script.decide(&request("day", 1)).await.unwrap();
        // The day's limit is the tighter (1 left, the week's 4): its status is reported.
        assert_eq!(d.code, Code::Ok, "{day}");
        assert_eq!(reset(&d), Some(hours * H), "{day} in Berlin: {d:?}");
    }
}

/// A decision not yet answered.
type Pending<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Decision, EngineError>> + 'a>>;

/// `n` decisions of `request`, each run up to its first wait: its groups sent, or queued behind
/// a call in flight.
async fn sent<'a>(
    engine: &'a Engine<RedisStore>,
    request: &'a Request,
    n: usize,
) -> Vec<Pending<'a>> {
    let mut decisions: Vec<Pending<'a>> = (0..n)
        .map(|_| Box::pin(engine.decide(request)) as Pending<'a>)
        .collect();
    for d in &mut decisions {
        std::future::poll_fn(|cx| {
            let _ = d.as_mut().poll(cx);
            std::task::Poll::Ready(())
        })
        .await;
    }
    decisions
}

/// How many of `decisions` were allowed, once answered.
async fn allowed_of(decisions: Vec<Pending<'_>>) -> usize {
    futures_util::future::join_all(decisions)
        .await
        .into_iter()
        .filter(|d| d.as_ref().unwrap().code == Code::Ok)
        .count()
}

/// Requests that queued behind a call admitted exactly the limit (4) across them, and left in
/// `calls` FCALLs: the one in flight, then the queue.
fn assert_batched(admitted: usize, calls: u64, requests: &str) {
    assert_eq!(
        admitted, 4,
        "exactly the limit, across the batched requests"
    );
    assert!(
        (1..=2).contains(&calls),
        "{requests} in {calls} FCALLs: the one in flight, then the queue"
    );
}

/// A store whose calls wait on one another (one connection, one call out), with a timeout a
/// paused Redis does not reach and the script's time pinned to `clock`.
fn one_call_store(topology: Topology, clock: &Arc<ManualClock>) -> RedisStore {
    RedisStore::new(&RedisOptions {
        topology,
        pool_size: 1,
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        key_prefix: "b:".into(),
        read_string_windows: false,
    })
    .unwrap()
    .with_pinned_clock(clock.clone())
}

/// Issue 27 item 1: requests that queue while a call is in flight (Redis paused here) leave
/// together — two FCALLs for nine requests — and each is still its own request: the window
/// admits exactly its limit across them, and a group that fails (a calendar window its node
/// computed two months off Redis's clock) fails alone; its neighbours are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_queue_leave_together_each_answered_on_its_own() {
    const RULES: &str = "domain: b\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 4}\n  - key: cal\n    rate_limit: {unit: month, requests_per_unit: 5, calendar: UTC}\n";
    let redis = RedisServer::start();
    let script_clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let node_clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let store = one_call_store(Topology::Standalone(redis.url()), &script_clock)
        .with_node_clock(node_clock.clone());
    let engine = Engine::new(
        load_texts([("b.yaml", RULES)]).unwrap(),
        store,
        EngineSettings::default(),
    );
    let req = |key: &str| Request {
        domain: "b".into(),
        descriptors: vec![descriptor(&[(key, "x")], 1, false)],
    };
    // The library loaded and the connection made; one of the four spent.
    assert_eq!(engine.decide(&req("a")).await.unwrap().code, Code::Ok);
    let fcalls = || commandstat(&redis.cli(&["INFO", "commandstats"]), "fcall");
    let before = fcalls();

    redis.pause();
    let (a, cal) = (req("a"), req("cal"));
    let mut queued = sent(&engine, &a, 1).await;
    // Two months ahead: Redis's time is outside the windows this group carries.
    node_clock.advance(60 * 86_400 * S);
    let off = sent(&engine, &cal, 1).await;
    node_clock.set(1_800_000_000 * S);
    queued.extend(sent(&engine, &a, 6).await);
    let on_time = sent(&engine, &cal, 1).await;
    redis.resume();

    let admitted = 1 + allowed_of(queued).await;
    let failed = futures_util::future::join_all(off)
        .await
        .remove(0)
        .expect_err("a window two months off Redis's clock");
    assert!(
        failed.to_string().contains("outside the calendar windows"),
        "{failed}"
    );
    assert_eq!(allowed_of(on_time).await, 1, "its neighbour");
    assert_batched(admitted, fcalls() - before, "9 requests");
}

/// A call's numbers travel packed (one argument in, one string out; batch.lua), unpacked a
/// thousand at a time: a request of 300 checks (1 202 numbers in, 1 201 out) is decided and
/// answered check by check like one of a few, and a second sees the first's hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_a_thousand_numbers_is_answered_check_by_check() {
    const RULES: &str = "domain: b\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 4}\n";
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let mut settings = EngineSettings::default();
    settings.bounds.max_descriptors = 300;
    let engine = Engine::new(
        load_texts([("b.yaml", RULES)]).unwrap(),
        one_call_store(Topology::Standalone(redis.url()), &clock),
        settings,
    );
    let values: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    let request = Request {
        domain: "b".into(),
        descriptors: values
            .iter()
            .enumerate()
            // The last check takes 3 hits: its verdict is told apart from its neighbours'.
            .map(|(i, v)| descriptor(&[("a", v)], if i == 299 { 3 } else { 1 }, false))
            .collect(),
    };
    for left in [3, 2] {
        let d = engine.decide(&request).await.unwrap();
        if left == 2 {
            assert_eq!(d.code, Code::OverLimit, "the last check has 1 left, not 3");
            assert_eq!(d.statuses[299].remaining, 1);
            break;
        }
        assert_eq!(d.code, Code::Ok);
        assert_eq!(d.statuses.len(), 300);
        assert!(d.statuses[..299].iter().all(|s| s.remaining == left));
        assert_eq!(d.statuses[299].remaining, 1);
    }
    let without_last = Request {
        domain: "b".into(),
        descriptors: request.descriptors[..299].to_vec(),
    };
    let d = engine.decide(&without_last).await.unwrap();
    assert!(
        d.statuses.iter().all(|s| s.remaining == 2),
        "the denied request consumed nothing: {:?}",
        d.statuses.iter().map(|s| s.remaining).collect::<Vec<_>>()
    );
}

/// Any u64 of hits comes from the wire: on every rule (each algorithm, tiers, cost limits,
/// shadow, quota) and as a refund, memory and Redis answer a request of hits past any limit
/// alike, and what it leaves behind decides the next request alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_past_any_limit_decide_alike_on_memory_and_redis() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S + 123_456));
    let memory = memory_engine(&clock);
    let engine = pinned_engine(Topology::Standalone(redis.url()), &clock);
    // All but the zero limit, which no hits get past.
    for key in RULE_KEYS.into_iter().filter(|k| *k != "zero") {
        for hits in [
            u64::from(u32::MAX) + 1,
            1 << 53,
            (1 << 53) + 1,
            1 << 60,
            u64::MAX,
        ] {
            for (refund, then) in [(false, 1), (true, 1), (false, 0)] {
                for (hits, refund) in [(hits, refund), (then, false)] {
                    let request = Request {
                        domain: "d".into(),
                        descriptors: vec![descriptor(&[(key, "h")], hits, refund)],
                    };
                    let want = memory.decide(&request).await.unwrap();
                    let got = engine.decide(&request).await;
                    assert_eq!(
                        got.as_ref().ok(),
                        Some(&want),
                        "{key}: {hits} hits, refund {refund}: {got:?}"
                    );
                }
                clock.advance(7_000);
            }
        }
    }
}

/// A tier Redis refuses (its key holds another type) fails its request, and the tiers before it
/// that had added their hits take them back: an error consumes nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_redis_refuses_fails_the_request_and_consumes_nothing() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S + 123_456));
    let engine = pinned_engine(Topology::Standalone(redis.url()), &clock);
    let request = |keys: &[&str]| Request {
        domain: "d".into(),
        descriptors: keys
            .iter()
            .map(|k| descriptor(&[(k, "w")], 1, false))
            .collect(),
    };
    let tiers = request(&["fixed", "bulk"]);
    assert_eq!(engine.decide(&tiers).await.unwrap().code, Code::Ok);
    let scanned = redis.cli(&["--scan"]);
    let bulk = scanned
        .lines()
        .find(|k| k.contains("bulk"))
        .expect("the bulk tier's key");
    redis.cli(&["DEL", bulk]);
    redis.cli(&["SET", bulk, "not a hash"]);
    let failed = engine.decide(&tiers).await.expect_err("WRONGTYPE");
    assert!(failed.to_string().contains("WRONGTYPE"), "{failed}");
    // A lone check takes batch.lua's inline path: Redis's refusal is its error too.
    let alone = engine
        .decide(&request(&["bulk"]))
        .await
        .expect_err("WRONGTYPE");
    assert!(alone.to_string().contains("WRONGTYPE"), "{alone}");
    let d = engine.decide(&request(&["fixed"])).await.unwrap();
    assert_eq!(
        d.statuses[0].remaining, 3,
        "5 per second: the first request's hit and this one's, not the failed one's"
    );
}

/// A cluster of three masters and an engine on it with `rules` (domain `b`, descriptor key
/// `a`), its calls waiting on one another and the script's time pinned, once it knows the
/// cluster's masters (its groups then leave by master).
async fn cluster_engine(rules: &str) -> (RedisCluster, Engine<RedisStore>) {
    let cluster = RedisCluster::start_with(0, 15_000);
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let store = one_call_store(Topology::Cluster(cluster.urls()), &clock);
    store.connect_ahead();
    let by = Instant::now() + Duration::from_secs(10);
    while !store.masters_known() {
        assert!(Instant::now() < by, "the cluster's masters are read");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let engine = Engine::new(
        load_texts([("b.yaml", rules)]).unwrap(),
        store,
        EngineSettings::default(),
    );
    (cluster, engine)
}

/// The node that holds descriptor `a`'s key for `value` (of `cluster_engine`'s rules), once hit.
fn holder(cluster: &RedisCluster, value: &str) -> usize {
    let found: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&i| {
            cluster.nodes[i]
                .cli(&["KEYS", "b:*"])
                .lines()
                .any(|k| k.ends_with(&format!("1:a{}:{value}#12*1#", value.len())))
        })
        .collect();
    assert_eq!(found.len(), 1, "{value} on one master: {found:?}");
    found[0]
}

/// On a Redis Cluster the requests on a hot key queue on its master while its calls are out and
/// leave together, admitting exactly the limit across them, and a master that stops answering
/// holds up only its own queue — a request on another master's slot is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_hot_keys_requests_leave_together() {
    let (cluster, engine) = cluster_engine(
        "domain: b\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 4}\n",
    )
    .await;
    let req = |value: &str| Request {
        domain: "b".into(),
        descriptors: vec![descriptor(&[("a", value)], 1, false)],
    };
    let holder = |value: &str| holder(&cluster, value);
    // The hot key, and a key on another master (every value is tried until one is).
    assert_eq!(engine.decide(&req("hot")).await.unwrap().code, Code::Ok);
    let hot_master = holder("hot");
    let mut elsewhere = None;
    for i in 0..100 {
        let v = format!("v{i}");
        engine.decide(&req(&v)).await.unwrap();
        if holder(&v) != hot_master {
            elsewhere = Some(v);
            break;
        }
    }
    let elsewhere = elsewhere.expect("a value on another master");
    let fcalls = || {
        commandstat(
            &cluster.nodes[hot_master].cli(&["INFO", "commandstats"]),
            "fcall",
        )
    };
    let before = fcalls();

    cluster.nodes[hot_master].pause();
    let hot = req("hot");
    let mut queued = sent(&engine, &hot, 1).await;
    queued.extend(sent(&engine, &hot, 6).await);
    // Another master's slot does not wait on the paused one.
    let answered = tokio::time::timeout(Duration::from_secs(5), engine.decide(&req(&elsewhere)))
        .await
        .expect("answered while the hot key's master is paused")
        .unwrap();
    assert_eq!(answered.code, Code::Ok);
    cluster.nodes[hot_master].resume();

    let admitted = 1 + allowed_of(queued).await;
    assert_eq!(
        admitted, 4,
        "exactly the limit, across the batched requests"
    );
    let calls = fcalls() - before;
    assert!(
        (1..=3).contains(&calls),
        "7 requests on one key in {calls} FCALLs: the two a master may have out, then the queue"
    );
}

/// On a Redis Cluster the groups of every slot a master serves queue together once the masters
/// are known: requests on eight values (eight slots) of one paused master leave in at most
/// three FCALLs — the two a master may have out, then the queue — where a queue per slot sent
/// eight; each is answered as its own request, and a key on another master is answered while
/// that master is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_one_masters_slots_leave_together() {
    let (cluster, engine) = cluster_engine(
        "domain: b\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .await;
    let hits = |value: &str, hits: u64| Request {
        domain: "b".into(),
        descriptors: vec![descriptor(&[("a", value)], hits, false)],
    };
    // Values until eight are found on one master and one on another, each key's home read
    // after its first hit.
    let mut by_master: Vec<Vec<String>> = vec![Vec::new(); cluster.nodes.len()];
    for i in 0..200 {
        let v = format!("v{i}");
        assert_eq!(engine.decide(&hits(&v, 1)).await.unwrap().code, Code::Ok);
        by_master[holder(&cluster, &v)].push(v);
        if by_master.iter().filter(|vs| vs.len() >= 8).count() >= 1
            && by_master.iter().filter(|vs| !vs.is_empty()).count() >= 2
        {
            break;
        }
    }
    let hot = (0..by_master.len())
        .find(|&m| by_master[m].len() >= 8)
        .expect("eight values on one master");
    let elsewhere = (0..by_master.len())
        .find(|&m| m != hot && !by_master[m].is_empty())
        .map(|m| by_master[m][0].clone())
        .expect("a value on another master");
    let values: Vec<String> = by_master[hot][..8].to_vec();
    let fcalls = || commandstat(&cluster.nodes[hot].cli(&["INFO", "commandstats"]), "fcall");
    let before = fcalls();

    cluster.nodes[hot].pause();
    // Each value was hit once (its limit is 2 a minute): one more hit fits, two do not.
    let requests: Vec<Request> = values
        .iter()
        .enumerate()
        .map(|(i, v)| hits(v, 1 + (i as u64 % 2)))
        .collect();
    let mut queued = Vec::new();
    for r in &requests {
        queued.extend(sent(&engine, r, 1).await);
    }
    let answered =
        tokio::time::timeout(Duration::from_secs(5), engine.decide(&hits(&elsewhere, 1)))
            .await
            .expect("answered while the other master is paused")
            .unwrap();
    assert_eq!(answered.code, Code::Ok, "{elsewhere}'s second hit fits");
    cluster.nodes[hot].resume();

    let codes: Vec<Code> = futures_util::future::join_all(queued)
        .await
        .into_iter()
        .map(|d| d.unwrap().code)
        .collect();
    let expected: Vec<Code> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                Code::Ok
            } else {
                Code::OverLimit
            }
        })
        .collect();
    assert_eq!(codes, expected, "each request answered as its own");
    let calls = fcalls() - before;
    assert!(
        (1..=3).contains(&calls),
        "eight slots' requests in {calls} FCALLs: the two out, then the queue"
    );
}

/// A request of fixed windows only (a per-second and a per-minute tier, with and without a
/// shadow rule) takes batch.lua's fast path: each window adds its hits at once, and where one
/// is new or over its limit everything is taken back and the general path decides. Memory and
/// Redis answer alike through the windows' starts, the tiers' denials and a shadow denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_of_fixed_windows_decide_alike_on_memory_and_redis() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S + 123_456));
    let memory = memory_engine(&clock);
    let engine = pinned_engine(Topology::Standalone(redis.url()), &clock);
    let tiers = |keys: &[&str], hits: u64| Request {
        domain: "d".into(),
        descriptors: keys
            .iter()
            .map(|k| descriptor(&[(k, "t")], hits, false))
            .collect(),
    };
    let (mut ok, mut over) = (0, 0);
    for step in 0..120 {
        let request = match step % 4 {
            0 | 1 => tiers(&["fixed", "bulk"], 1),
            2 => tiers(&["bulk", "fixed", "shadow"], 1),
            _ => tiers(&["quota_a", "bulk"], 2),
        };
        let want = memory.decide(&request).await.unwrap();
        let got = engine.decide(&request).await.unwrap();
        assert_eq!(got, want, "step {step}: {request:?}");
        if want.code == Code::Ok {
            ok += 1;
        } else {
            over += 1;
        }
        clock.advance(90_000);
    }
    assert!(ok > 30 && over > 30, "{ok} allowed, {over} denied");
    // More hits than any limit (any u64 comes from the wire): denied alike, nothing written.
    for hits in [u64::from(u32::MAX) + 1, 1 << 60, u64::MAX] {
        for keys in [&["fixed"][..], &["fixed", "bulk"][..]] {
            let request = tiers(keys, hits);
            let want = memory.decide(&request).await.unwrap();
            let got = engine.decide(&request).await;
            assert_eq!(
                got.as_ref().ok(),
                Some(&want),
                "{hits} hits on {keys:?}: {got:?}"
            );
        }
    }
}
