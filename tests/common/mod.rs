//! Shared test helpers: an in-process server on free loopback ports with a manual clock.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sluice::clock::ManualClock;
use sluice::engine::{Engine, EngineSettings};
use sluice::proto::{self, RateLimitServiceClient};
use sluice::rules::load_texts;
use sluice::server::{self, Options, Running};
use sluice::service::HeaderSet;
use sluice::store::MemoryStore;
use tonic::transport::Channel;

pub const S: u64 = 1_000_000;

pub struct TestServer {
    pub clock: Arc<ManualClock>,
    pub running: Running<MemoryStore>,
}

pub async fn start(rules: &str, headers: &str, settings: EngineSettings) -> TestServer {
    // A round time (a whole hour) so window boundaries in tests are predictable.
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let rules = load_texts([("rules.yaml", rules)]).expect("test rules are valid");
    let store = MemoryStore::new(clock.clone(), 100_000);
    let engine = Arc::new(Engine::new(rules, store, settings));
    let options = Options {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        headers: HeaderSet::parse(headers).unwrap(),
        housekeeping_every: Duration::from_secs(3600),
    };
    let running = server::start(options, engine).await.expect("server starts");
    TestServer { clock, running }
}

impl TestServer {
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.running.grpc_addr))
            .await
            .expect("connects")
    }
}

pub fn descriptor(entries: &[(&str, &str)]) -> proto::RateLimitDescriptor {
    proto::RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| proto::Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
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
