//! An xDS management server for the tests, written here: the real ADS protocol (state of the
//! world on `StreamAggregatedResources`) over gRPC, optionally over mutual TLS, serving
//! `RateLimitConfig` snapshots as Envoy Gateway's server does, and recording every request a
//! client sends (subscriptions, ACKs, NACKs).
//!
//! It runs on a runtime of its own, so [`XdsServer::stop`] kills it outright (listener and open
//! streams), as a control plane that crashes or restarts does.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::Stream;
use prost::Message;
use sluice::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use sluice::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use sluice::proto::ratelimit::config::ratelimit::v3::RateLimitConfig;
use sluice::xds::resource::TYPE_URL;
use tokio::sync::{mpsc, watch};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

/// A version and every resource of it.
type Snapshot = Option<(String, Vec<RateLimitConfig>)>;

struct State {
    snapshot: watch::Sender<Snapshot>,
    requests: watch::Sender<Vec<DiscoveryRequest>>,
    nonces: AtomicU64,
}

/// The server's certificate and key, and the CA its clients' certificates must chain to.
#[derive(Clone)]
pub struct MutualTls {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
    pub client_ca: Vec<u8>,
}

pub struct XdsServer {
    pub addr: SocketAddr,
    state: Arc<State>,
    tls: Option<MutualTls>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl XdsServer {
    /// On a free loopback port; plaintext when `tls` is None.
    pub fn start(tls: Option<MutualTls>) -> Self {
        let state = Arc::new(State {
            snapshot: watch::channel(None).0,
            requests: watch::channel(Vec::new()).0,
            nonces: AtomicU64::new(0),
        });
        let addr = SocketAddr::from(([127, 0, 0, 1], super::free_port()));
        let mut server = Self {
            addr,
            state,
            tls,
            runtime: None,
        };
        server.restart();
        server
    }

    /// Serves `configs` as `version` from now on: to every open stream, and to later ones.
    pub fn set(&self, version: &str, configs: Vec<RateLimitConfig>) {
        self.state
            .snapshot
            .send_replace(Some((version.to_owned(), configs)));
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<DiscoveryRequest> {
        self.state.requests.borrow().clone()
    }

    /// Waits (bounded) for a request that `pred` accepts, among all received so far.
    pub async fn wait_request(
        &self,
        what: &str,
        pred: impl Fn(&DiscoveryRequest) -> bool,
    ) -> DiscoveryRequest {
        let mut rx = self.state.requests.subscribe();
        let found = tokio::time::timeout(
            Duration::from_secs(20),
            rx.wait_for(|all| all.iter().any(&pred)),
        )
        .await;
        let all = self.requests();
        assert!(found.is_ok(), "no {what} among {all:#?}");
        all.into_iter().rev().find(|r| pred(r)).expect("found")
    }

    /// Kills the server: the listener and every open stream go at once.
    pub fn stop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }

    /// Starts again on the same port (the snapshot and the request log are kept).
    pub fn restart(&mut self) {
        self.stop();
        // The old listener closes as its runtime winds down: retry the bind briefly.
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match std::net::TcpListener::bind(self.addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("rebinding {}: {e}", self.addr),
            }
        };
        listener.set_nonblocking(true).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let ads = Ads {
            state: self.state.clone(),
        };
        let tls = self.tls.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let mut builder = tonic::transport::Server::builder();
            if let Some(t) = tls {
                let config = ServerTlsConfig::new()
                    .identity(Identity::from_pem(t.cert, t.key))
                    .client_ca_root(Certificate::from_pem(t.client_ca));
                builder = builder.tls_config(config).unwrap();
            }
            builder
                .add_service(AggregatedDiscoveryServiceServer::new(ads))
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        self.runtime = Some(runtime);
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Ads {
    state: Arc<State>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let state = self.state.clone();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut snapshot = state.snapshot.subscribe();
            // The version this stream's client holds: what it subscribed with, then what was
            // sent. None until it subscribes.
            let mut holds: Option<String> = None;
            loop {
                tokio::select! {
                    request = inbound.message() => match request {
                        Ok(Some(request)) => {
                            if holds.is_none() {
                                holds = Some(request.version_info.clone());
                            }
                            state.requests.send_modify(|all| all.push(request));
                        }
                        _ => return,
                    },
                    changed = snapshot.changed() => if changed.is_err() { return },
                }
                let current = snapshot.borrow_and_update().clone();
                let (Some(held), Some((version, configs))) = (&holds, current) else {
                    continue;
                };
                if *held == version {
                    continue;
                }
                let nonce = state.nonces.fetch_add(1, Ordering::Relaxed).to_string();
                let response = DiscoveryResponse {
                    version_info: version.clone(),
                    resources: configs
                        .iter()
                        .map(|c| prost_types::Any {
                            type_url: TYPE_URL.into(),
                            value: c.encode_to_vec(),
                        })
                        .collect(),
                    type_url: TYPE_URL.into(),
                    nonce,
                    ..DiscoveryResponse::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
                holds = Some(version);
            }
        });
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(outbound)))
    }
}
