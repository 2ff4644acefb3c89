//! Load run and Redis memory, outside criterion (they report distributions and bytes, not one
//! time). Starts its own redis-server processes on loopback ports and stops them at the end.
//!
//! cargo bench --bench load -- load [seconds]     decisions/s and latency percentiles per backend
//! cargo bench --bench load -- memory [keys]      Redis bytes per key per algorithm

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "common/servers.rs"]
mod servers;

use servers::{serve_noop, serve_sluice};
use sluice::clock::SystemClock;
use sluice::limiter::{Algorithm, Limit};
use sluice::proto::{self, RateLimitServiceClient};
use sluice::store::breaker::Breaker;
use sluice::store::redis::{RedisOptions, RedisStore, Topology};
use sluice::store::{Check, CheckKind, FailureMode, MemoryStore, Resilient, Store};

const RULES: &str = "domain: load\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n    descriptors:\n      - key: path\n        rate_limit: {unit: second, requests_per_unit: 1000000000}\n";

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

fn redis_store(topology: Topology) -> Resilient<RedisStore> {
    let redis = RedisStore::new(&RedisOptions {
        topology,
        pool_size: 8,
        timeout: Duration::from_millis(50),
        key_prefix: "sluice:".into(),
    })
    .unwrap();
    let clock = Arc::new(SystemClock);
    Resilient::new(
        redis,
        MemoryStore::new(clock.clone(), 10_000_000),
        Breaker::new(5, Duration::from_millis(500), clock),
        FailureMode::Error,
    )
}

fn request(i: u64) -> proto::RateLimitRequest {
    let d = |entries: Vec<(&str, String)>| proto::RateLimitDescriptor {
        entries: entries
            .into_iter()
            .map(|(k, v)| proto::Entry {
                key: k.into(),
                value: v,
            })
            .collect(),
        ..Default::default()
    };
    let client = i % 10_000;
    proto::RateLimitRequest {
        domain: "load".into(),
        descriptors: vec![
            d(vec![(
                "remote_address",
                format!("10.0.{}.{}", client / 256, client % 256),
            )]),
            d(vec![("api_key", format!("key-{client}"))]),
            d(vec![
                ("api_key", format!("key-{client}")),
                ("path", "/v1/search".into()),
            ]),
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
                let r = request(i);
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

fn evalsha_calls(ports: &[u16]) -> u64 {
    ports
        .iter()
        .map(|p| {
            cli(*p, &["INFO", "commandstats"])
                .lines()
                .find(|l| l.starts_with("cmdstat_evalsha:"))
                .and_then(|l| l.split("calls=").nth(1))
                .and_then(|s| s.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        })
        .sum()
}

async fn load(seconds: u64) {
    let base = 23_000 + (std::process::id() % 500) as u16 * 8;
    let standalone = start_redis(1, base);
    let cluster = start_redis(3, base + 1);
    let concurrency = 64;
    println!(
        "backend         | decisions/s | p50 µs | p99 µs | p999 µs | errors | EVALSHA per request"
    );
    println!(
        "----------------|-------------|--------|--------|---------|--------|--------------------"
    );
    for backend in ["noop", "memory", "redis", "redis-cluster"] {
        let addr = match backend {
            "noop" => serve_noop().await,
            "memory" => {
                serve_sluice(RULES, MemoryStore::new(Arc::new(SystemClock), 10_000_000)).await
            }
            "redis" => {
                serve_sluice(
                    RULES,
                    redis_store(Topology::Standalone(format!(
                        "redis://127.0.0.1:{}",
                        standalone.1[0]
                    ))),
                )
                .await
            }
            _ => {
                serve_sluice(
                    RULES,
                    redis_store(Topology::Cluster(
                        cluster
                            .1
                            .iter()
                            .map(|p| format!("redis://127.0.0.1:{p}"))
                            .collect(),
                    )),
                )
                .await
            }
        };
        let ports: &[u16] = match backend {
            "redis" => &standalone.1,
            "redis-cluster" => &cluster.1,
            _ => &[],
        };
        // Warm up (connections, script load), then measure.
        drive(addr, concurrency, 1).await;
        let before = evalsha_calls(ports);
        let (rate, lat, errors) = drive(addr, concurrency, seconds).await;
        let per_request = (evalsha_calls(ports) - before) as f64 / lat.len() as f64;
        println!(
            "{backend:<15} | {rate:>11.0} | {:>6} | {:>6} | {:>7} | {errors:>6} | {}",
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            pct(&lat, 0.999),
            if ports.is_empty() {
                "-".to_string()
            } else {
                format!("{per_request:.2}")
            }
        );
    }
}

async fn memory(keys: u64) {
    let redis = start_redis(1, 27_000 + (std::process::id() % 500) as u16 * 8);
    let port = redis.1[0];
    let store = RedisStore::new(&RedisOptions {
        topology: Topology::Standalone(format!("redis://127.0.0.1:{port}")),
        pool_size: 8,
        timeout: Duration::from_secs(10),
        key_prefix: "sluice:".into(),
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
    for alg in Algorithm::ALL {
        cli(port, &["FLUSHALL"]);
        let before = used();
        // Buckets drain: a rate of 1 per hour keeps one hit's state for the whole run.
        let limit = if alg.has_burst() {
            Limit::new(alg, 1, 3_600_000_000, Some(1_000))
        } else {
            Limit::new(alg, 1_000, 3_600_000_000, None)
        };
        let limit = Arc::new(limit.unwrap());
        let mut tasks = Vec::new();
        let per_task = keys / 16;
        for t in 0..16u64 {
            let (store, limit) = (store.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let mut batch_keys = Vec::new();
                for i in 0..per_task {
                    // A typical key: domain, one entry (an IPv4 address), the limit.
                    let mut k = sluice::store::KeyBuf::default();
                    k.domain("edge");
                    let n = t * per_task + i;
                    k.entry(
                        "remote_address",
                        sluice::rules::KeyPart::Value(&format!(
                            "10.{}.{}.{}",
                            n >> 16 & 255,
                            n >> 8 & 255,
                            n & 255
                        )),
                    );
                    let prefix = k.len();
                    k.limit(alg, sluice::rules::Unit::Hour, 1);
                    batch_keys.push((k.slice(0..k.len()).to_vec(), prefix));
                    if batch_keys.len() == 50 || i + 1 == per_task {
                        let checks: Vec<Check<'_>> = batch_keys
                            .iter()
                            .map(|(k, p)| Check {
                                key: k,
                                tag: &k[..*p],
                                limit: &limit,
                                hits: 1,
                                kind: CheckKind::Enforce,
                                on_failure: None,
                                mode: None,
                                until_us: 0,
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
        Some("load") => rt.block_on(load(args.get(1).map_or(10, |n| n.parse().unwrap()))),
        _ => {
            // `cargo bench` with no arguments: a short load run.
            rt.block_on(load(3));
        }
    }
}
