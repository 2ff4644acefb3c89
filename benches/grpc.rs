//! A full gRPC round trip on loopback: tonic client → sluice (memory store) → response, for a
//! 3-descriptor request, next to the same call against a no-op RLS built with the same stack
//! (the ceiling).
//!
//! cargo bench --bench grpc

use criterion::{Criterion, criterion_group, criterion_main};
#[path = "common/servers.rs"]
mod servers;

use servers::{serve_noop, serve_sluice};
use sluice::proto::{self, RateLimitServiceClient};
use sluice::store::{BackendConfig, StoreConfig};
use tonic::transport::Channel;

const RULES: &str = "domain: bench\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n    descriptors:\n      - key: path\n        rate_limit: {unit: second, requests_per_unit: 1000000000}\n";

fn request() -> proto::RateLimitRequest {
    let d = proto::RateLimitDescriptor::with_entries;
    proto::RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![
            d(&[("remote_address", "10.0.0.1")]),
            d(&[("api_key", "key-1")]),
            d(&[("api_key", "key-1"), ("path", "/v1/search")]),
        ],
        hits_addend: 0,
    }
}

fn round_trip(c: &mut Criterion) {
    // One thread for client and servers: the number is the stack's work, not cross-thread wake-ups.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (sluice_client, noop_client) = rt.block_on(async {
        let store = StoreConfig {
            max_keys: 10_000_000,
            ..StoreConfig::new(BackendConfig::Memory)
        };
        let sluice = serve_sluice(RULES, store).await;
        let noop = serve_noop().await;
        let connect = |addr| RateLimitServiceClient::connect(format!("http://{addr}"));
        (connect(sluice).await.unwrap(), connect(noop).await.unwrap())
    });
    let mut group = c.benchmark_group("grpc_round_trip");
    for (name, client) in [
        ("sluice_memory", sluice_client),
        ("noop_server", noop_client),
    ] {
        let client: RateLimitServiceClient<Channel> = client;
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let mut client = client.clone();
                async move { client.should_rate_limit(request()).await.unwrap() }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, round_trip);
criterion_main!(benches);
