//! Shared test helpers: an in-process server on free loopback ports with a manual clock.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sluice::clock::ManualClock;
use sluice::engine::Engine;
use sluice::engine::EngineSettings;
use sluice::proto::{self, RateLimitServiceClient};
use sluice::rules::{LoadOptions, load_texts};
use sluice::server::{self, Config, RulesSource, Running};
use sluice::service::HeaderSet;
use sluice::store::{BackendConfig, Clocks, Stack, StoreConfig, Upkeep, build};
use tonic::transport::Channel;

pub const S: u64 = 1_000_000;

pub struct TestServer {
    pub clock: Arc<ManualClock>,
    pub running: Running,
}

pub async fn start(rules: &str, headers: &str, settings: EngineSettings) -> TestServer {
    start_with_tls(rules, headers, settings, None).await
}

/// [`start`], serving gRPC over TLS (or mutual TLS) when `grpc_tls` is given.
pub async fn start_with_tls(
    rules: &str,
    headers: &str,
    settings: EngineSettings,
    grpc_tls: Option<Arc<sluice::tls::ServerTls>>,
) -> TestServer {
    // A round time (a whole hour) so window boundaries in tests are predictable.
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let rules = load_texts([("rules.yaml", rules)]).expect("test rules are valid");
    let config = Config {
        headers: HeaderSet::parse(headers).unwrap(),
        // A small series cap, so tests reach it.
        metrics: Some(Arc::new(sluice::metrics::Metrics::new(0.8, 3))),
        json: true,
        dynamic_metadata: true,
        grpc_tls,
        engine: settings,
        ..config(RulesSource::Given(rules), memory(&clock, 100_000))
    };
    let running = server::start(config).await.expect("server starts");
    TestServer { clock, running }
}

/// A node as `sluice serve` assembles it, without listeners: the engine over the built store,
/// and the store's upkeep (its report; the give-back the server's timer runs).
pub struct Assembled {
    pub engine: Engine<Stack>,
    pub upkeep: Upkeep,
}

impl std::ops::Deref for Assembled {
    type Target = Engine<Stack>;

    fn deref(&self) -> &Engine<Stack> {
        &self.engine
    }
}

/// [`Assembled`] from `store` and one rules file's text.
pub fn assemble(store: &StoreConfig, rules: &str) -> Assembled {
    let (stack, upkeep) = build(store).expect("the store builds");
    Assembled {
        engine: Engine::new(
            load_texts([("rules.yaml", rules)]).expect("test rules are valid"),
            stack,
            EngineSettings::default(),
        ),
        upkeep,
    }
}

/// The memory backend with at most `max_keys` counters, on `clock`.
pub fn memory(clock: &Arc<ManualClock>, max_keys: usize) -> StoreConfig {
    StoreConfig {
        max_keys,
        clocks: Clocks::pinned(clock.clone()),
        ..StoreConfig::new(BackendConfig::Memory)
    }
}

/// A server on free loopback ports with `rules` and `store`: no metrics, no headers, no JSON
/// endpoint, no drain, nothing swept during a test.
pub fn config(rules: RulesSource, store: StoreConfig) -> Config {
    Config {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        grpc_tls: None,
        reference_metrics: None,
        rules,
        load: LoadOptions::default(),
        store,
        engine: EngineSettings::default(),
        headers: HeaderSet::parse("none").unwrap(),
        json: false,
        dynamic_metadata: false,
        show_descriptor_values: false,
        metrics: None,
        sweep_every: Duration::from_secs(3600),
        drain_delay: Duration::ZERO,
        shutdown_grace: Duration::from_secs(10),
        quota: sluice::rlqs::QuotaOptions::default(),
    }
}

impl TestServer {
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(self.channel().await)
    }

    /// A channel to the gRPC listener, for the other services on it (health, reflection).
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.running.grpc_addr))
            .expect("a valid address")
            .connect()
            .await
            .expect("connects")
    }
}

pub fn descriptor(entries: &[(&str, &str)]) -> proto::RateLimitDescriptor {
    proto::RateLimitDescriptor::with_entries(entries)
}

pub fn request(
    domain: &str,
    descriptors: Vec<proto::RateLimitDescriptor>,
) -> proto::RateLimitRequest {
    proto::RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// A fresh directory under the system temp dir, removed by the caller.
/// µs of a local civil time (`2026-03-29T00:30`) in `zone`, the earlier instant of an ambiguous
/// one.
pub fn civil_us(zone: &str, civil: &str) -> u64 {
    let dt: jiff::civil::DateTime = civil.parse().unwrap();
    let z = dt.to_zoned(jiff::tz::TimeZone::get(zone).unwrap()).unwrap();
    z.timestamp().as_microsecond() as u64
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A minimal HTTP/1.1 client: enough for the admin endpoints, without another dependency.
pub async fn http_call(addr: std::net::SocketAddr, raw: String) -> (u16, String) {
    try_http_call(addr, &raw)
        .await
        .unwrap_or_else(|e| panic!("HTTP to {addr}: {e}"))
}

async fn try_http_call(addr: std::net::SocketAddr, raw: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(raw.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// Waits until a freshly started `sluice serve` answers `/healthcheck` with 200 (a port that
/// accepts connections may not be serving HTTP yet).
pub async fn wait_healthy(addr: std::net::SocketAddr) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let get = "GET /healthcheck HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    loop {
        match try_http_call(addr, get).await {
            Ok((200, _)) => return,
            other => assert!(
                std::time::Instant::now() < deadline,
                "{addr} never became healthy: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_call(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
    .await
}

pub async fn http_post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    http_call(
        addr,
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await
}

/// The whole HTTP response (status line, headers, body) of a GET with extra request headers.
pub async fn http_get_raw(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut raw = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str("\r\n");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

/// A tool the tests need from the Python venv that `scripts/test` makes (`.venv`), or from the
/// environment variable `var`. Fails the test with instructions when missing: an end-to-end
/// test that silently skips checks nothing.
pub fn venv_tool(var: &str, name: &str) -> PathBuf {
    if let Ok(p) = std::env::var(var) {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".venv/bin")
        .join(name);
    assert!(
        p.exists(),
        "{name} not found at {}: run scripts/test (it makes .venv with tests/requirements.txt) or set {var}",
        p.display()
    );
    p
}
pub mod otlp;
pub mod pki;
pub mod redis;
pub mod rlqs_envoy;
pub mod xds;

/// Waits (bounded) until a server process started by a test accepts connections.
pub async fn wait_listening(addr: std::net::SocketAddr) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing listens on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `sluice` binary serving the rules folder `dir` on free loopback ports, with no drain
/// delay, `args` after `serve` and the environment variables `envs`: the process (killed when
/// dropped) and its HTTP and gRPC addresses, once its HTTP port listens.
pub async fn serve_binary(
    dir: &std::path::Path,
    args: &[&str],
    envs: &[(&str, String)],
) -> (
    tokio::process::Child,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    let (http, grpc): (std::net::SocketAddr, std::net::SocketAddr) = (
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
    );
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        // A failed test must not leave a server holding the test runner's output open.
        .kill_on_drop(true)
        .args(["serve", "--drain-delay", "0s"])
        .arg("--config")
        .arg(dir)
        .args(["--grpc-addr", &grpc.to_string()])
        .args(["--http-addr", &http.to_string()])
        .args(args)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(http).await;
    (child, http, grpc)
}

/// The value of the series `series` (its name and labels as exposed) in a Prometheus text
/// exposition; None when it is not there.
pub fn metric(exposition: &str, series: &str) -> Option<u64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Run as the reference service is: a `ratelimit` binary (a link in `dir`), no arguments, its
/// environment only (stderr piped).
pub fn as_reference(dir: &std::path::Path) -> tokio::process::Command {
    let link = dir.join("ratelimit");
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_sluice"), &link).unwrap();
    }
    let mut c = tokio::process::Command::new(link);
    c.kill_on_drop(true)
        .env_clear()
        .stderr(std::process::Stdio::piped());
    c
}

/// [`as_reference`] serving the rules under `dir/runtime/ratelimit/config` (the reference's
/// RUNTIME_ROOT and RUNTIME_SUBDIRECTORY) on loopback ports `http` and `grpc`, statsd off.
pub fn as_reference_on(dir: &std::path::Path, http: u16, grpc: u16) -> tokio::process::Command {
    let mut c = as_reference(dir);
    c.env("HOST", "127.0.0.1")
        .env("PORT", http.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("RUNTIME_ROOT", dir.join("runtime"))
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("USE_STATSD", "false");
    c
}

/// The `sluice` binary on the Redis at `redis_url`, in hybrid mode with leases held for an
/// hour (so only a shutdown gives them back), `/json` on, no drain delay, `extra` flags after;
/// serving `s=v`-style descriptors of domain `s`, a million a day (a day-long window: a test
/// straddles two only at midnight UTC). The process, its HTTP address, and its rules folder.
pub async fn serve_hybrid_on_redis(
    redis_url: &str,
    name: &str,
    extra: &[&str],
) -> (tokio::process::Child, std::net::SocketAddr, PathBuf) {
    let dir = temp_dir(name);
    std::fs::write(
        dir.join("s.yaml"),
        "domain: s\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 1000000}\n",
    )
    .unwrap();
    let mut args = vec![
        "--backend",
        "redis",
        "--mode",
        "hybrid",
        "--lease-ttl",
        "3600s",
        "--json-endpoint",
        "--redis-url",
        redis_url,
    ];
    args.extend_from_slice(extra);
    let (child, http, _) = serve_binary(&dir, &args, &[]).await;
    (child, http, dir)
}
