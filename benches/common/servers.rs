//! The servers the benchmarks call: sluice as in production (metrics on), and a no-op RLS built
//! with the same stack that answers OK without deciding — the ceiling.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sluice::engine::EngineSettings;
use sluice::metrics::Metrics;
use sluice::proto::{self, RateLimitServiceServer};
use sluice::rules::{LoadOptions, load_texts};
use sluice::server::{self, Config, RulesSource};
use sluice::service::HeaderSet;
use sluice::store::StoreConfig;

/// sluice on a loopback port with `rules` and `store`, for the rest of the process.
pub async fn serve_sluice(rules: &str, store: StoreConfig) -> SocketAddr {
    let config = Config {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        grpc_tls: None,
        reference_metrics: None,
        rules: RulesSource::Given(load_texts([("bench.yaml", rules)]).unwrap()),
        load: LoadOptions::default(),
        store,
        engine: EngineSettings::default(),
        headers: HeaderSet::parse("retry-after,draft03").unwrap(),
        json: false,
        dynamic_metadata: false,
        show_descriptor_values: false,
        metrics: Some(Arc::new(Metrics::new(0.8, 10_000))),
        sweep_every: Duration::from_secs(5),
        drain_delay: Duration::ZERO,
        shutdown_grace: Duration::from_secs(10),
        quota: sluice::rlqs::QuotaOptions::default(),
    };
    let running = server::start(config).await.unwrap();
    let addr = running.grpc_addr;
    std::mem::forget(running);
    addr
}

/// The no-op RLS on a loopback port.
pub async fn serve_noop() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimitServiceServer::new(NoOp))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    addr
}

/// Answers OK without deciding anything.
pub struct NoOp;

#[tonic::async_trait]
impl proto::RateLimitService for NoOp {
    async fn should_rate_limit(
        &self,
        r: tonic::Request<proto::RateLimitRequest>,
    ) -> Result<tonic::Response<proto::RateLimitResponse>, tonic::Status> {
        let n = r.into_inner().descriptors.len();
        Ok(tonic::Response::new(proto::RateLimitResponse {
            overall_code: proto::Code::Ok as i32,
            statuses: vec![
                proto::DescriptorStatus {
                    code: proto::Code::Ok as i32,
                    ..Default::default()
                };
                n
            ],
            ..Default::default()
        }))
    }
}
