//! Load run and Redis memory, outside criterion (they report distributions and bytes, not one
//! time). Starts its own redis-server processes on loopback ports and stops them at the end.
//!
//! cargo bench --bench load -- load [seconds] [clients] [rows]
//!     decisions/s, latency percentiles and Redis calls per decision: no-op, memory, Redis and
//!     Redis Cluster, strict and hybrid; `clients` distinct callers (3 descriptors each); `rows`
//!     a comma list of rows to run (default all)
//! cargo bench --bench load -- hotkey [seconds]   every request on one key (below, then far above
//!     its limit), strict vs hybrid
//! cargo bench --bench load -- fleet [seconds]    4 hybrid nodes with uneven load: admitted vs limit
//! cargo bench --bench load -- memory [keys]      Redis bytes per key per algorithm
//! cargo bench --bench load -- store-memory [keys] [algorithm]   the memory store's bytes per key
//! cargo bench --bench load -- full [keys] [seconds]   the memory store at its --max-keys cap:
//!     latency of requests on existing keys, alone and while new keys flood in

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "common/servers.rs"]
mod servers;

// As the `sluice` binary runs (src/main.rs): every row, the no-op ceiling included.
#[global_allocator]
static ALLOCATOR: sluice::allocator::Mimalloc = sluice::allocator::Mimalloc;

use servers::{serve_noop, serve_sluice};
use sluice::clock::{Clock, SystemClock};
use sluice::engine::{Code, Descriptor, Engine, EngineSettings, Request};
use sluice::limiter::{Algorithm, Limit};
use sluice::proto::{self, RateLimitServiceClient};
use sluice::store::redis::{RedisOptions, RedisStore, Topology};
use sluice::store::{
    BackendConfig, Check, FailureMode, LeaseOptions, MemoryStore, Mode, Stack, Store, StoreConfig,
    build,
};

const RULES: &str = "domain: load\ndescriptors:\n  - key: over\n    rate_limit: {unit: second, requests_per_unit: 1000}\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n    descriptors:\n      - key: path\n        rate_limit: {unit: second, requests_per_unit: 1000000000}\n";

struct Redis(Vec<Child>, Vec<u16>);

impl Drop for Redis {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn start_redis(nodes: usize, first_port: u16) -> Redis {
    let dir = std::env::temp_dir().join(format!("sluice-load-{}", std::process::id()));
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for i in 0..nodes {
        let port = first_port + i as u16;
        let d = dir.join(port.to_string());
        // A cluster node refuses to join a new cluster with an earlier run's nodes.conf.
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(&d)
        .stdout(Stdio::null());
        if nodes > 1 {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ]);
        }
        children.push(cmd.spawn().expect("redis-server"));
        while cli(port, &["PING"]).trim() != "PONG" {
            std::thread::sleep(Duration::from_millis(20));
        }
        ports.push(port);
    }
    if nodes > 1 {
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(out.status.success());
        for p in &ports {
            while !cli(*p, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Redis(children, ports)
}

/// The Redis store as `sluice serve` builds it, with `mode` the default mode.
fn redis_store(topology: Topology, mode: Mode) -> StoreConfig {
    StoreConfig {
        failure_mode: FailureMode::Error,
        leases: LeaseOptions {
            default_mode: mode,
            ..LeaseOptions::default()
        },
        ..StoreConfig::new(BackendConfig::Redis(RedisOptions {
            topology,
            pool_size: 8,
            timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(2),
            key_prefix: "sluice:".into(),
            read_string_windows: false,
        }))
    }
}

/// Every request one descriptor on one counter with a limit far above the load.
const HOT_KEY: u64 = 0;
/// Every request one descriptor on one counter limited to 1 000/s: nearly all are denied.
const HOT_KEY_OVER_LIMIT: u64 = u64::MAX;

/// The request mix: `clients` distinct callers, 3 descriptors each, or one of the hot keys.
fn request(i: u64, clients: u64) -> proto::RateLimitRequest {
    let d = proto::RateLimitDescriptor::with_entries;
    if clients == HOT_KEY || clients == HOT_KEY_OVER_LIMIT {
        let key = if clients == HOT_KEY {
            "remote_address"
        } else {
            "over"
        };
        return proto::RateLimitRequest {
            domain: "load".into(),
            descriptors: vec![d(&[(key, "10.0.0.1")])],
            hits_addend: 0,
        };
    }
    let client = i % clients;
    let address = format!("10.0.{}.{}", client / 256, client % 256);
    let api_key = format!("key-{client}");
    proto::RateLimitRequest {
        domain: "load".into(),
        descriptors: vec![
            d(&[("remote_address", &address)]),
            d(&[("api_key", &api_key)]),
            d(&[("api_key", &api_key), ("path", "/v1/search")]),
        ],
        hits_addend: 0,
    }
}

/// `concurrency` callers over 4 HTTP/2 connections for `seconds`; returns (calls/s, sorted
/// latencies in µs, errors).
async fn drive(
    addr: std::net::SocketAddr,
    concurrency: usize,
    seconds: u64,
    clients: u64,
) -> (f64, Vec<u32>, u64) {
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(
            RateLimitServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap(),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let mut client = channels[t % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            let mut i = t as u64 * 1_000_003;
            while Instant::now() < deadline {
                i += 1;
                let r = request(i, clients);
                let s = Instant::now();
                if client.should_rate_limit(r).await.is_err() {
                    errors += 1;
                }
                latencies.push(s.elapsed().as_micros() as u32);
            }
            (latencies, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    (all.len() as f64 / elapsed, all, errors)
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// The limiter's calls on these Redis nodes: FCALL (the Functions library) and EVALSHA (where
/// Redis refuses Functions).
fn script_calls(ports: &[u16]) -> u64 {
    ports
        .iter()
        .map(|p| {
            let info = cli(*p, &["INFO", "commandstats"]);
            ["cmdstat_fcall:", "cmdstat_evalsha:"]
                .iter()
                .filter_map(|name| {
                    info.lines()
                        .find(|l| l.starts_with(name))
                        .and_then(|l| l.split("calls=").nth(1))
                        .and_then(|s| s.split(',').next())
                        .map(|n| n.parse::<u64>().unwrap())
                })
                .sum::<u64>()
        })
        .sum()
}

/// One row per backend, all in this run: decisions/s, latency, Redis calls per decision. The
/// rows run in turn, `ROUNDS` times over (this VM's speed drifts by tens of percent within a
/// minute); each row reports its median round.
async fn load(seconds: u64, clients: u64, backends: &[&str]) {
    const ROUNDS: usize = 3;
    let base = 23_000 + (std::process::id() % 500) as u16 * 8;
    let standalone = start_redis(1, base);
    let cluster = start_redis(3, base + 1);
    let concurrency = 64;
    let what = if clients == HOT_KEY {
        "one key".to_string()
    } else if clients == HOT_KEY_OVER_LIMIT {
        "one key limited to 1000/s".to_string()
    } else {
        format!("{clients} clients x 3 descriptors")
    };
    let standalone_url = format!("redis://127.0.0.1:{}", standalone.1[0]);
    let cluster_urls: Vec<String> = cluster
        .1
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}"))
        .collect();
    let mut servers = Vec::new();
    for &backend in backends {
        let mode = if backend.ends_with("hybrid") {
            Mode::Hybrid
        } else {
            Mode::Strict
        };
        let addr = match backend {
            "noop" => serve_noop().await,
            "memory" => {
                let store = StoreConfig {
                    max_keys: 10_000_000,
                    ..StoreConfig::new(BackendConfig::Memory)
                };
                serve_sluice(RULES, store).await
            }
            "redis strict" | "redis hybrid" => {
                let store = redis_store(Topology::Standalone(standalone_url.clone()), mode);
                serve_sluice(RULES, store).await
            }
            "cluster strict" | "cluster hybrid" => {
                let store = redis_store(Topology::Cluster(cluster_urls.clone()), mode);
                serve_sluice(RULES, store).await
            }
            other => panic!("unknown row '{other}'"),
        };
        let ports: &[u16] = match backend {
            "redis strict" | "redis hybrid" => &standalone.1,
            "cluster strict" | "cluster hybrid" => &cluster.1,
            _ => &[],
        };
        // Warm up (connections, script load, leases).
        drive(addr, concurrency, 1, clients).await;
        servers.push((backend, addr, ports));
    }
    // Per row: (decisions/s, sorted latencies, errors, script calls per Redis node) per round.
    type Round = (f64, Vec<u32>, u64, Vec<u64>);
    let mut results: Vec<Vec<Round>> = vec![Vec::new(); servers.len()];
    for _ in 0..ROUNDS {
        for (i, (_, addr, ports)) in servers.iter().enumerate() {
            let before: Vec<u64> = ports.iter().map(|p| script_calls(&[*p])).collect();
            let (rate, lat, errors) = drive(*addr, concurrency, seconds, clients).await;
            let per_node: Vec<u64> = ports
                .iter()
                .zip(&before)
                .map(|(p, b)| script_calls(&[*p]) - b)
                .collect();
            results[i].push((rate, lat, errors, per_node));
        }
    }
    println!(
        "{concurrency} callers, {what}; median of {ROUNDS} interleaved rounds of {seconds} s per row"
    );
    println!();
    println!(
        "backend        | decisions/s (rounds)        | p50 µs | p99 µs | p999 µs | errors | Redis calls per decision | per Redis node"
    );
    println!(
        "---------------|-----------------------------|--------|--------|---------|--------|----------------------|---------------"
    );
    let mut medians = Vec::new();
    for ((backend, _, ports), mut rounds) in servers.iter().zip(results) {
        let all: Vec<String> = rounds.iter().map(|r| format!("{:.0}", r.0)).collect();
        rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (rate, lat, errors, per_node) = &rounds[ROUNDS / 2];
        let per_decision = per_node.iter().sum::<u64>() as f64 / lat.len() as f64;
        println!(
            "{backend:<14} | {rate:>6.0} ({:<19}) | {:>6} | {:>6} | {:>7} | {errors:>6} | {:>20} | {}",
            all.join(" "),
            pct(lat, 0.5),
            pct(lat, 0.99),
            pct(lat, 0.999),
            if ports.is_empty() {
                "-".to_string()
            } else {
                format!("{per_decision:.4}")
            },
            if ports.len() > 1 {
                format!("{per_node:?}")
            } else {
                "-".into()
            }
        );
        medians.push((*backend, *rate));
    }
    let rate = |name: &str| medians.iter().find(|(b, _)| *b == name).map(|(_, r)| *r);
    println!();
    if let (Some(noop), Some(memory)) = (rate("noop"), rate("memory")) {
        println!("memory / no-op: {:.0} %", 100.0 * memory / noop);
        for hybrid in ["redis hybrid", "cluster hybrid"] {
            if let Some(h) = rate(hybrid) {
                println!("{hybrid} / memory: {:.0} %", 100.0 * h / memory);
            }
        }
    }
}

const FLEET_RULES: &str = "domain: fleet\ndescriptors:\n  - key: fixed_window\n    mode: hybrid\n    rate_limit: {unit: second, requests_per_unit: 1000}\n  - key: sliding_window\n    mode: hybrid\n    rate_limit: {unit: second, requests_per_unit: 1000, algorithm: sliding_window}\n";

/// 4 hybrid nodes share one Redis; their load is split 60/25/10/5 %. For offered loads below,
/// at and above the limit, how much the fleet admits per second, against what it could (the
/// offered load, at most the limit), and how many Redis calls it makes per decision.
async fn fleet(seconds: u64) {
    let redis = start_redis(1, 29_000 + (std::process::id() % 500) as u16 * 8);
    let url = format!("redis://127.0.0.1:{}", redis.1[0]);
    let shares = [0.60, 0.25, 0.10, 0.05];
    println!("4 nodes, load split {shares:?}, limit 1000/s, {seconds} s per row");
    println!();
    println!(
        "algorithm      | offered/s | admitted/s | of admissible | worst second | over limit | Redis calls per decision"
    );
    println!(
        "---------------|-----------|------------|---------------|--------------|------------|---------------------"
    );
    for key in ["fixed_window", "sliding_window"] {
        for offered in [800.0, 1_000.0, 1_500.0, 3_000.0] {
            cli(redis.1[0], &["FLUSHALL"]);
            let nodes: Vec<Arc<Engine<Stack>>> = (0..4)
                .map(|_| {
                    Arc::new(Engine::new(
                        sluice::rules::load_texts([("fleet.yaml", FLEET_RULES)]).unwrap(),
                        build(&redis_store(
                            Topology::Standalone(url.clone()),
                            Mode::Strict,
                        ))
                        .unwrap()
                        .0,
                        EngineSettings::default(),
                    ))
                })
                .collect();
            // Start on a second boundary, so each second of the run is one window.
            let now = SystemClock.now_micros();
            tokio::time::sleep(Duration::from_micros(1_000_000 - now % 1_000_000)).await;
            let start_second = SystemClock.now_micros() / 1_000_000;
            let before = script_calls(&redis.1);
            let mut tasks = Vec::new();
            for (node, share) in nodes.iter().zip(shares) {
                let node = node.clone();
                let rate = offered * share;
                tasks.push(tokio::spawn(async move {
                    // Requests paced each millisecond; admitted counted per second (window).
                    let mut per_second = vec![0u64; seconds as usize];
                    let mut sent = 0u64;
                    let mut tick = tokio::time::interval(Duration::from_millis(1));
                    let started = Instant::now();
                    while started.elapsed() < Duration::from_secs(seconds) {
                        tick.tick().await;
                        let due = (started.elapsed().as_secs_f64() * rate) as u64;
                        while sent < due {
                            sent += 1;
                            let r = Request {
                                domain: "fleet".into(),
                                descriptors: vec![Descriptor::of(&[(key, "hot")], 1)],
                            };
                            let d = node.decide(&r).await.unwrap();
                            let second =
                                (SystemClock.now_micros() / 1_000_000 - start_second) as usize;
                            if d.code == Code::Ok && second < per_second.len() {
                                per_second[second] += 1;
                            }
                        }
                    }
                    (per_second, sent)
                }));
            }
            let mut per_second = vec![0u64; seconds as usize];
            let mut decisions = 0;
            for t in tasks {
                let (p, sent) = t.await.unwrap();
                decisions += sent;
                for (a, b) in per_second.iter_mut().zip(p) {
                    *a += b;
                }
            }
            let calls = script_calls(&redis.1) - before;
            // The last second is partial (the run ends inside it); leave it out.
            let full = &per_second[..per_second.len() - 1];
            let admitted = full.iter().sum::<u64>() as f64 / full.len() as f64;
            let admissible = offered.min(1_000.0);
            println!(
                "{key:<14} | {offered:>9.0} | {admitted:>10.0} | {:>12.1} % | {:>12} | {:>10} | {:.4}",
                100.0 * admitted / admissible,
                full.iter().min().unwrap(),
                full.iter().filter(|&&a| a > 1_000).count(),
                calls as f64 / decisions as f64
            );
        }
    }
}

/// An hourly limit whose state lasts the whole run: buckets drain, so a rate of 1 per hour
/// keeps one hit's state.
fn typical_limit(alg: Algorithm) -> Limit {
    if alg.has_burst() {
        Limit::new(alg, 1, 3_600_000_000, Some(1_000))
    } else {
        Limit::new(alg, 1_000, 3_600_000_000, None)
    }
    .unwrap()
}

/// The `n`th of many typical counter keys: domain, one entry (an IPv4 address), the limit; and
/// the length of its tag (domain and entry).
fn typical_key(alg: Algorithm, n: u64) -> (Vec<u8>, usize) {
    let mut k = sluice::store::KeyBuf::default();
    k.domain("edge");
    k.entry(
        "remote_address",
        sluice::rules::KeyPart::Value(&format!(
            "10.{}.{}.{}",
            n >> 16 & 255,
            n >> 8 & 255,
            n & 255
        )),
    );
    let tag = k.len();
    k.limit(alg, sluice::rules::Unit::Hour, 1, None);
    (k.slice(0..k.len()).to_vec(), tag)
}

/// The memory store's bytes per counter: the process's resident memory grown by `keys`
/// counters of `algorithm`, typical keys, one hit each. One algorithm per process: memory the
/// allocator got back from a dropped store would stay resident and hide the next one's.
/// Prints: algorithm | keys | resident bytes per key | the tables' bytes per key.
fn store_memory(keys: u64, algorithm: &str) {
    use sluice::clock::ManualClock;
    let alg = Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == algorithm)
        .unwrap_or_else(|| panic!("no algorithm {algorithm}"));
    let resident = || -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    };
    let store = MemoryStore::new(
        Arc::new(ManualClock::new(1_800_000_000_000_000)),
        usize::MAX,
    );
    let limit = typical_limit(alg);
    let before = resident();
    for n in 0..keys {
        let (key, tag) = typical_key(alg, n);
        let check = Check {
            tag: &key[..tag],
            ..Check::enforce(&key, &limit, 1)
        };
        store.apply_now(&[check]).unwrap();
    }
    let grown = resident() - before;
    // Resident growth includes what the allocator keeps of tables that grew; the tables'
    // own size is what the counters hold now.
    println!(
        "{:<14} | {:>9} | {:>12.1} | {:>12.1}",
        alg.name(),
        store.len(),
        grown as f64 / store.len() as f64,
        store.table_bytes() as f64 / store.len() as f64
    );
}

async fn memory(keys: u64) {
    let redis = start_redis(1, 27_000 + (std::process::id() % 500) as u16 * 8);
    let port = redis.1[0];
    let store = RedisStore::new(&RedisOptions {
        topology: Topology::Standalone(format!("redis://127.0.0.1:{port}")),
        pool_size: 8,
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        key_prefix: "sluice:".into(),
        read_string_windows: false,
    })
    .unwrap();
    let store = Arc::new(store);
    let used = || -> i64 {
        cli(port, &["INFO", "memory"])
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    println!("algorithm      | keys      | bytes per key");
    println!("---------------|-----------|--------------");
    for alg in Algorithm::RATES {
        cli(port, &["FLUSHALL"]);
        let before = used();
        let limit = Arc::new(typical_limit(alg));
        let mut tasks = Vec::new();
        let per_task = keys / 16;
        for t in 0..16u64 {
            let (store, limit) = (store.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let mut batch_keys = Vec::new();
                for i in 0..per_task {
                    batch_keys.push(typical_key(alg, t * per_task + i));
                    if batch_keys.len() == 50 || i + 1 == per_task {
                        let checks: Vec<Check<'_>> = batch_keys
                            .iter()
                            .map(|(k, p)| Check {
                                tag: &k[..*p],
                                ..Check::enforce(k, &limit, 1)
                            })
                            .collect();
                        store.apply(&checks).await.unwrap();
                        batch_keys.clear();
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let n: u64 = cli(port, &["DBSIZE"]).trim().parse().unwrap();
        println!(
            "{:<14} | {n:>9} | {:>12.1}",
            alg.name(),
            (used() - before) as f64 / n as f64
        );
    }
}

const ALL_BACKENDS: [&str; 6] = [
    "noop",
    "memory",
    "redis strict",
    "redis hybrid",
    "cluster strict",
    "cluster hybrid",
];

/// Requests on existing keys, timed one by one for `seconds`, while `other` runs on a second
/// thread (if any) until they end. Returns sorted latencies in nanoseconds and what `other`
/// says it did.
fn time_existing(
    store: &MemoryStore,
    limit: &Limit,
    hot: &[Vec<u8>],
    seconds: u64,
    other: Option<&(dyn Fn(&std::sync::atomic::AtomicBool) -> String + Sync)>,
) -> (Vec<u32>, String) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let other = other.map(|f| scope.spawn(|| f(&stop)));
        let mut latencies = Vec::with_capacity(4_000_000);
        let until = Instant::now() + Duration::from_secs(seconds);
        let mut i = 0;
        while Instant::now() < until {
            let key = &hot[i % hot.len()];
            i += 1;
            let started = Instant::now();
            let outcome = store.apply_now(&[Check::enforce(key, limit, 1)]).unwrap();
            latencies.push(started.elapsed().as_nanos() as u32);
            assert!(outcome.allowed);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let counted = other.map_or(String::new(), |h| h.join().unwrap());
        latencies.sort_unstable();
        (latencies, counted)
    })
}

/// Issue 10, item 5: at `--max-keys` full, a flood of new keys must not slow the requests on
/// existing keys. The store is filled to its cap; requests on 1 000 existing keys are timed
/// beside a second thread on 100 000 other existing keys (the same load without new keys), and
/// beside a second thread that asks for new keys only — first with nothing expired (every new
/// key is refused), then with every other key expired (every new key reclaims one that a
/// shard's clock hand passes).
fn full(keys: usize, seconds: u64) {
    use sluice::clock::ManualClock;
    let clock = Arc::new(ManualClock::new(1_800_000_000_000_000));
    let store = MemoryStore::new(clock.clone(), keys);
    let limit = Limit::new(Algorithm::FixedWindow, 1_000_000_000, 3_600_000_000, None).unwrap();
    let key = |prefix: &str, n: usize| format!("{prefix}{n}").into_bytes();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..2 {
            let (store, limit) = (&store, &limit);
            scope.spawn(move || {
                for n in (t..keys).step_by(2) {
                    store
                        .apply_now(&[Check::enforce(&key("k", n), limit, 1)])
                        .unwrap();
                }
            });
        }
    });
    println!(
        "filled {} keys in {:.1} s (max {keys})",
        store.len(),
        started.elapsed().as_secs_f64()
    );
    let hot: Vec<Vec<u8>> = (0..1_000).map(|n| key("k", n)).collect();
    let cold: Vec<Vec<u8>> = (1_000..101_000).map(|n| key("k", n)).collect();
    let existing_load = |stop: &std::sync::atomic::AtomicBool| {
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            store
                .apply_now(&[Check::enforce(&cold[n % cold.len()], &limit, 1)])
                .unwrap();
            n += 1;
        }
        format!("{n} requests")
    };
    let flood = |stop: &std::sync::atomic::AtomicBool| {
        let (mut n, mut refused) = (0, 0u64);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if store
                .apply_now(&[Check::enforce(&key("new", n), &limit, 1)])
                .is_err()
            {
                refused += 1;
            }
            n += 1;
        }
        format!("{n} new keys asked, {refused} refused")
    };
    // Rounds alternate between the second thread on existing keys and the flood, three each:
    // this machine's neighbours move a p99 by tens of percent between sittings.
    let median = |mut v: Vec<u32>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let compare = |scenario: &str| {
        let (mut base, mut flooded) = (Vec::new(), Vec::new());
        let mut said = String::new();
        for _ in 0..3 {
            let (l, _) = time_existing(&store, &limit, &hot, seconds, Some(&existing_load));
            base.push([pct(&l, 0.5), pct(&l, 0.99), pct(&l, 0.999)]);
            let (l, flood_said) = time_existing(&store, &limit, &hot, seconds, Some(&flood));
            flooded.push([pct(&l, 0.5), pct(&l, 0.99), pct(&l, 0.999)]);
            said = flood_said;
        }
        let row = |what: &str, rounds: &[[u32; 3]]| {
            let m: Vec<u32> = (0..3)
                .map(|i| median(rounds.iter().map(|r| r[i]).collect()))
                .collect();
            println!(
                "{scenario:<13} | {what:<32} | {:>6} | {:>6} | {:>7}",
                m[0], m[1], m[2]
            );
            m[1]
        };
        let b = row("beside existing-key requests", &base);
        let f = row("beside a flood of new keys", &flooded);
        println!(
            "{scenario:<13} | p99 {:+.1} % with the flood (last round's flood: {said})",
            (f64::from(f) / f64::from(b) - 1.0) * 100.0
        );
    };
    println!(
        "store full      | second thread                    | p50 ns | p99 ns | p999 ns   (medians of 3 rounds of {seconds} s)"
    );
    compare("none expired");
    // Every key but the hot ones expires; the hot ones are renewed in the new window.
    clock.advance(2 * 3_600_000_000);
    for k in &hot {
        store.apply_now(&[Check::enforce(k, &limit, 1)]).unwrap();
    }
    compare("rest expired");
    println!("keys held at the end: {} (max {keys})", store.len());
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    match args.first().map(String::as_str) {
        Some("memory") => rt.block_on(memory(
            args.get(1).map_or(1_000_000, |n| n.parse().unwrap()),
        )),
        Some("load") => {
            // An optional third argument picks rows: e.g. `noop,memory`.
            let rows: Vec<&str> = match args.get(3) {
                Some(list) => list.split(',').collect(),
                None => ALL_BACKENDS.to_vec(),
            };
            rt.block_on(load(
                args.get(1).map_or(10, |n| n.parse().unwrap()),
                args.get(2).map_or(10, |n| n.parse().unwrap()),
                &rows,
            ))
        }
        Some("hotkey") => {
            let seconds = args.get(1).map_or(10, |n| n.parse().unwrap());
            let rows = [
                "redis strict",
                "redis hybrid",
                "cluster strict",
                "cluster hybrid",
            ];
            rt.block_on(load(seconds, HOT_KEY, &rows));
            println!();
            rt.block_on(load(seconds, HOT_KEY_OVER_LIMIT, &rows));
        }
        Some("fleet") => rt.block_on(fleet(args.get(1).map_or(10, |n| n.parse().unwrap()))),
        Some("store-memory") => store_memory(
            args.get(1).map_or(1_000_000, |n| n.parse().unwrap()),
            args.get(2).map_or("fixed_window", String::as_str),
        ),
        Some("full") => full(
            args.get(1).map_or(10_000_000, |n| n.parse().unwrap()),
            args.get(2).map_or(5, |n| n.parse().unwrap()),
        ),
        _ => {
            // `cargo bench` with no arguments: a short load run.
            rt.block_on(load(3, 10, &ALL_BACKENDS));
        }
    }
}
