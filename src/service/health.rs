//! `grpc.health.v1.Health` as the gRPC health checking spec says, for the names sluice answers
//! for ([`HEALTH_NAMES`]), which all share one status.
//!
//! tonic-health's own service ends a `Watch` on an unknown name with NOT_FOUND; the spec says
//! the server "must send a single message with status SERVICE_UNKNOWN but must not end the
//! call", so a client watching a name that is registered later (or a typo) keeps its stream and
//! learns what is wrong. `Check` on an unknown name is NOT_FOUND, as the spec says.

use std::pin::Pin;

use futures_util::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::proto::SERVICE_NAME;

/// The names sluice answers for: the server as a whole (""), the RLS by its full name, and
/// `ratelimit`, the name the reference service registers (Envoy health checks written for it
/// keep working).
pub const HEALTH_NAMES: [&str; 3] = ["", SERVICE_NAME, "ratelimit"];

/// What the names report; `closed`: the server is stopping, so every `Watch` ends (a graceful
/// shutdown waits for open calls, and a watch would otherwise never end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reported {
    status: ServingStatus,
    closed: bool,
}

/// Sets the status every health name reports.
#[derive(Debug, Clone)]
pub struct HealthStatus {
    tx: watch::Sender<Reported>,
}

impl HealthStatus {
    /// SERVING, and the service that reports it.
    pub fn new() -> (Self, HealthServer<HealthService>) {
        let (tx, rx) = watch::channel(Reported {
            status: ServingStatus::Serving,
            closed: false,
        });
        (Self { tx }, HealthServer::new(HealthService { rx }))
    }

    /// Watchers hear of a change only.
    pub fn set(&self, status: ServingStatus) {
        self.tx.send_if_modified(|r| {
            let changed = r.status != status;
            r.status = status;
            changed
        });
    }

    /// Ends every `Watch` (the last status stays what `Check` answers).
    pub fn close(&self) {
        self.tx.send_modify(|r| r.closed = true);
    }
}

pub struct HealthService {
    rx: watch::Receiver<Reported>,
}

fn response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        if !HEALTH_NAMES.contains(&request.get_ref().service.as_str()) {
            return Err(Status::not_found("unknown service"));
        }
        Ok(Response::new(response(self.rx.borrow().status)))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let known = HEALTH_NAMES.contains(&request.get_ref().service.as_str());
        // The status now, then every change; an unknown name hears SERVICE_UNKNOWN once and the
        // call stays open (until the client ends it or the server stops).
        let mut rx = self.rx.clone();
        rx.mark_changed();
        let stream = futures_util::stream::unfold(
            (rx, None::<ServingStatus>, false),
            move |(mut rx, last, done)| async move {
                if done {
                    return None;
                }
                loop {
                    rx.changed().await.ok()?;
                    let now = *rx.borrow_and_update();
                    let status = if known {
                        now.status
                    } else {
                        ServingStatus::ServiceUnknown
                    };
                    // Sent once per change; a stopping server's last status, then the end.
                    if Some(status) != last {
                        return Some((Ok(response(status)), (rx, Some(status), now.closed)));
                    }
                    if now.closed {
                        return None;
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}
