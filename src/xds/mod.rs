//! Rules over xDS: sluice as the client of an xDS management server (Envoy Gateway's, or any
//! go-control-plane server), as the Go reference service is with `CONFIG_TYPE=GRPC_XDS_SOTW`.
//!
//! The protocol is xDS's state of the world on the aggregated stream
//! (`envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources`):
//!
//! 1. sluice opens the stream and subscribes: a `DiscoveryRequest` with its node id and the
//!    type `type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig`, no resource
//!    names (all of them), and the version it already holds (empty at first).
//! 2. The server sends a `DiscoveryResponse` whenever the rules change: every resource of the
//!    type, each one domain's rules, with a version and a nonce.
//! 3. sluice compiles all of them into one rule set, exactly as a directory of files
//!    ([`resource`]). A set that compiles is swapped in and ACKed (a request carrying the
//!    response's version and nonce); a set with any error is NACKed (the last good version, the
//!    nonce, and the errors in `error_detail`) and the old rules keep serving.
//! 4. When the stream ends or fails, sluice reconnects after a pause that doubles per failure
//!    ([`Backoff`]); the rules it holds keep serving meanwhile.
//!
//! Rules reach the engine through the same [`Reloader`] as files do, so they are logged,
//! counted in the reload metrics and shown on `/config` alike.

mod client;
pub mod resource;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};

use crate::rules::reload::Reloader;

/// Where the rules come from and who asks.
#[derive(Debug, Clone)]
pub struct XdsOptions {
    /// `host:port`, or a URL with `http://` or `https://`.
    pub server: String,
    /// The node id the server keys its snapshots by.
    pub node_id: String,
    /// The node's metadata (string values).
    pub node_metadata: Vec<(String, String)>,
    /// Extra headers on the stream (e.g. a token the server wants).
    pub headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
    /// TLS to the server; None for plaintext.
    pub tls: Option<XdsTls>,
    pub retry: Backoff,
}

/// TLS to the management server.
#[derive(Debug, Clone)]
pub struct XdsTls {
    /// The CA that signed the server's certificate (PEM).
    pub ca: PathBuf,
    /// A client certificate and its key (PEM), for a server that requires mutual TLS.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// The name the server's certificate must carry; default the host of `server`.
    pub server_name: Option<String>,
}

/// The pause between streams: `initial`, doubled per failure in a row, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("xDS server address '{0}': {1}")]
    Address(String, String),
    #[error("reading {0}: {1}")]
    TlsFile(PathBuf, #[source] std::io::Error),
    #[error("connecting: {0}")]
    Connect(#[source] tonic::transport::Error),
    #[error("stream: {0}")]
    Stream(#[source] tonic::Status),
}

/// The running client.
pub struct XdsRules {
    applied: watch::Receiver<Option<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl XdsRules {
    /// Starts the client: every response is offered to `sink`.
    pub fn start(options: XdsOptions, sink: Arc<Reloader>) -> Self {
        let (applied, rx) = watch::channel(None);
        let client = client::Client {
            options,
            sink,
            applied,
        };
        Self {
            applied: rx,
            task: tokio::spawn(client.run()),
        }
    }

    /// The version of the rules now serving; None before the first arrived.
    pub fn version(&self) -> Option<String> {
        self.applied.borrow().clone()
    }

    /// Resolves when the first rules have been applied.
    pub async fn first_rules(&self) {
        let mut rx = self.applied.clone();
        let _ = rx.wait_for(Option::is_some).await;
    }
}

impl Drop for XdsRules {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `k=v,k2=v2` (or `k:v`, as the reference also accepts) into pairs.
pub fn parse_pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|pair| {
            pair.split_once(['=', ':'])
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| format!("'{pair}' is not key=value"))
        })
        .collect()
}

#[cfg(test)]
mod tests;
