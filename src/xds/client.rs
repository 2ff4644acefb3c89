//! The ADS stream: connect, subscribe, apply or reject each response, answer it, and
//! reconnect with backoff when the stream ends.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::resource::{TYPE_URL, rules_from};
use super::{Backoff, XdsError, XdsOptions};
use crate::proto::envoy::config::core::v3::{Node, node::UserAgentVersionType};
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::google::rpc::Status;
use crate::rules::reload::Reloader;

/// The largest response accepted: as large as a rules file may be.
const MAX_MESSAGE_BYTES: usize = crate::rules::MAX_FILE_BYTES as usize;
/// gRPC's INVALID_ARGUMENT, the code of a NACK's error.
const INVALID_ARGUMENT: i32 = 3;

pub(super) struct Client {
    pub options: XdsOptions,
    pub sink: Arc<Reloader>,
    /// The version last applied; None until the first.
    pub applied: watch::Sender<Option<String>>,
}

impl Client {
    /// Runs until the task is aborted: one stream at a time, a pause between them.
    pub async fn run(self) {
        let mut failures: u32 = 0;
        loop {
            let mut answered = false;
            let outcome = self.stream(&mut answered).await;
            // A stream that delivered a response was healthy: the next pause starts short.
            if answered {
                failures = 0;
            }
            let pause = self.options.retry.pause(failures, random_unit());
            failures = failures.saturating_add(1);
            match outcome {
                Ok(()) => {
                    tracing::warn!(server = %self.options.server, ?pause, "xDS stream ended; reconnecting")
                }
                Err(e) => {
                    tracing::warn!(server = %self.options.server, error = %e, ?pause, "xDS stream failed; reconnecting")
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// One stream, until it ends or fails. `answered` turns true at its first response.
    async fn stream(&self, answered: &mut bool) -> Result<(), XdsError> {
        let channel = self.connect().await?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
        // The subscription: every RateLimitConfig (no names), with the version already held,
        // so a server that has nothing newer need not resend it.
        let held = self.applied.borrow().clone().unwrap_or_default();
        let _ = tx.try_send(self.request(held.clone(), String::new(), None));
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|request| (request, rx))
        });
        let mut request = tonic::Request::new(outbound);
        for (name, value) in &self.options.headers {
            request.metadata_mut().insert(name.clone(), value.clone());
        }
        let mut inbound = client
            .stream_aggregated_resources(request)
            .await
            .map_err(XdsError::Stream)?
            .into_inner();
        tracing::info!(server = %self.options.server, node = %self.options.node_id, "xDS stream open");
        let mut good = held;
        while let Some(response) = inbound.message().await.map_err(XdsError::Stream)? {
            *answered = true;
            let reply = self.answer(response, &mut good).await;
            if tx.send(reply).await.is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Applies one response, or rejects it: the ACK or NACK to send back.
    async fn answer(&self, response: DiscoveryResponse, good: &mut String) -> DiscoveryRequest {
        let DiscoveryResponse {
            version_info,
            resources,
            type_url,
            nonce,
            ..
        } = response;
        if type_url != TYPE_URL {
            let why = format!("sluice subscribes to {TYPE_URL} only, not '{type_url}'");
            tracing::warn!(version = %version_info, "xDS response rejected: {why}");
            return self.request(good.clone(), nonce, Some(why));
        }
        let sink = self.sink.clone();
        let load = sink.load_options();
        // Compiling a large set takes a while: off the async workers.
        let outcome =
            tokio::task::spawn_blocking(move || sink.offer(rules_from(&resources, load))).await;
        match outcome {
            Ok(Ok(())) => {
                tracing::info!(version = %version_info, "xDS rules applied");
                good.clone_from(&version_info);
                self.applied.send_replace(Some(version_info));
                self.request(good.clone(), nonce, None)
            }
            Ok(Err(errors)) => {
                tracing::warn!(version = %version_info, kept = %good, "xDS rules rejected (NACK); the previous rules keep serving");
                self.request(good.clone(), nonce, Some(errors.to_string()))
            }
            Err(e) => self.request(good.clone(), nonce, Some(format!("compiling failed: {e}"))),
        }
    }

    /// A request on the stream: the subscription, an ACK (`error` None) or a NACK.
    fn request(&self, version: String, nonce: String, error: Option<String>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version,
            node: Some(self.node()),
            resource_names: Vec::new(),
            type_url: TYPE_URL.into(),
            response_nonce: nonce,
            error_detail: error.map(|message| Status {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            }),
        }
    }

    fn node(&self) -> Node {
        let fields = self
            .options
            .node_metadata
            .iter()
            .map(|(k, v)| {
                let value = prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Node {
            id: self.options.node_id.clone(),
            cluster: String::new(),
            metadata: Some(prost_types::Struct { fields }),
            user_agent_name: "sluice".into(),
            user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            )),
        }
    }

    /// A channel to the server. The TLS files are read on every connect, so rotated ones are
    /// used from the next reconnect.
    async fn connect(&self) -> Result<Channel, XdsError> {
        let o = &self.options;
        let uri = if o.server.contains("://") {
            o.server.clone()
        } else if o.tls.is_some() {
            format!("https://{}", o.server)
        } else {
            format!("http://{}", o.server)
        };
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|e| XdsError::Address(o.server.clone(), e.to_string()))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        if let Some(tls) = &o.tls {
            let read = |path: &std::path::PathBuf| {
                std::fs::read(path).map_err(|e| XdsError::TlsFile(path.clone(), e))
            };
            let mut config =
                ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
            if let Some((cert, key)) = &tls.identity {
                config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            if let Some(name) = &tls.server_name {
                config = config.domain_name(name.clone());
            }
            endpoint = endpoint.tls_config(config).map_err(XdsError::Connect)?;
        }
        endpoint.connect().await.map_err(XdsError::Connect)
    }
}

impl Backoff {
    /// The pause after `failures` failed streams in a row: `initial` doubled per failure up
    /// to `max`, then spread by ±half (`unit` in [0, 1)) so that nodes that lost the same
    /// server do not all come back at once.
    pub fn pause(&self, failures: u32, unit: f64) -> Duration {
        let base = self
            .initial
            .saturating_mul(2u32.saturating_pow(failures.min(30)))
            .min(self.max);
        base.mul_f64(0.5 + unit.clamp(0.0, 1.0))
    }
}

/// A number in [0, 1) that differs between processes and calls (std's per-hasher random keys),
/// enough for jitter.
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}
