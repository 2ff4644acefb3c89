//! The gRPC listener: the RLS, the RLQS, gRPC health and reflection on one port, told apart by
//! path;
//! plaintext HTTP/2 or TLS (mutual TLS too) with certificates read again as they rotate.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;

use crate::proto::rlqs::RateLimitQuotaServiceServer;
use crate::proto::{QUOTA_SERVICE_NAME, SERVICE_NAME};
use crate::rlqs::QuotaService;
use crate::service::health::HealthService;
use crate::service::{RateLimitGrpc, RlsServer};
use crate::store::Store;
use crate::tls::{Reload, ServerTls};

/// Serves gRPC on `listener` until `stopped`; the tasks to wait for.
pub(super) fn serve<S: Store>(
    listener: TcpListener,
    service: Arc<RateLimitGrpc<S>>,
    quota: Arc<QuotaService<S>>,
    health: tonic_health::pb::health_server::HealthServer<HealthService>,
    tls: Option<Arc<ServerTls>>,
    stopped: watch::Receiver<bool>,
) -> anyhow::Result<Vec<JoinHandle<anyhow::Result<()>>>> {
    let dispatch = Dispatch {
        rls: RlsServer::new(service),
        rlqs: RateLimitQuotaServiceServer::from_arc(quota),
        health,
        reflection: reflection()?,
    };
    let shutdown = super::stopped_signal(&stopped);
    Ok(match tls {
        None => vec![tokio::spawn(
            tonic::transport::Server::builder()
                .serve_with_incoming_shutdown(
                    dispatch,
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .map_err_into(),
        )],
        Some(tls) => vec![
            reload_certificates(tls.clone(), &stopped),
            tokio::spawn(
                tonic::transport::Server::builder()
                    .serve_with_incoming_shutdown(
                        dispatch,
                        tls_incoming(listener, tls, stopped),
                        shutdown,
                    )
                    .map_err_into(),
            ),
        ],
    })
}

/// The gRPC server's result as the tasks' one type.
trait MapErrInto {
    fn map_err_into(self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

impl<F> MapErrInto for F
where
    F: Future<Output = Result<(), tonic::transport::Error>> + Send,
{
    async fn map_err_into(self) -> anyhow::Result<()> {
        self.await.context("gRPC server")
    }
}

/// Accepted connections after their TLS handshake, for tonic. Each handshake runs in its own
/// task, so a slow or silent client holds up no one else; one that fails is dropped here
/// (logged at debug: a port scan or a client with the wrong CA is not the server's fault).
fn tls_incoming(
    listener: TcpListener,
    tls: Arc<ServerTls>,
    mut stopped: watch::Receiver<bool>,
) -> impl futures_util::Stream<
    Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
> {
    let (ready, handshaken) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = stopped.wait_for(|stop| *stop) => return,
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, say: back off a little rather than spin.
                    tracing::warn!(error = %e, "accepting a gRPC connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (tls, ready) = (tls.clone(), ready.clone());
            tokio::spawn(async move {
                match tls.accept(tcp).await {
                    Ok(stream) => {
                        let _ = ready.send(Ok(stream)).await;
                    }
                    Err(e) => tracing::debug!(error = %e, "a gRPC connection failed TLS"),
                }
            });
        }
    });
    futures_util::stream::unfold(handshaken, |mut handshaken| async move {
        handshaken.recv().await.map(|next| (next, handshaken))
    })
}

/// Reads the certificate files again every `reload_every` (see [`crate::tls`]).
fn reload_certificates(
    tls: Arc<ServerTls>,
    stopped: &watch::Receiver<bool>,
) -> JoinHandle<anyhow::Result<()>> {
    let period = tls.reload_every().max(Duration::from_millis(10));
    super::every(period, stopped, move || {
        let tls = tls.clone();
        async move {
            match tokio::task::spawn_blocking(move || tls.reload()).await {
                Ok(Reload::Unchanged) | Err(_) => {}
                Ok(Reload::Replaced) => tracing::info!("gRPC TLS certificates reloaded"),
                Ok(Reload::Failed(e)) => {
                    tracing::warn!(error = %e, "gRPC TLS certificates changed but do not load; the previous ones keep serving")
                }
            }
        }
    })
}

/// gRPC server reflection (v1) of the RLS and health services, for grpcurl and grpcui.
fn reflection() -> anyhow::Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the gRPC reflection service")
}

/// The gRPC services on the one listener, told apart by the path's service name. tonic's
/// `Router` (an axum router) would match routes and box a service and a future per call; for
/// four services a prefix test is all it takes, and each service already boxes its future.
/// ShouldRateLimit is tested first; anything that is none of the others goes to
/// health, which answers UNIMPLEMENTED for what it does not know.
#[derive(Clone)]
struct Dispatch<R, Q, H, F> {
    rls: R,
    rlqs: Q,
    health: H,
    reflection: F,
}

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;
type GrpcResponse = tonic::codegen::http::Response<tonic::body::Body>;
type GrpcFuture = tonic::codegen::BoxFuture<GrpcResponse, std::convert::Infallible>;

/// A generated gRPC server, as `Dispatch` calls it.
trait GrpcService:
    tonic::codegen::Service<
        GrpcRequest,
        Response = GrpcResponse,
        Error = std::convert::Infallible,
        Future = GrpcFuture,
    >
{
}

impl<T> GrpcService for T where
    T: tonic::codegen::Service<
            GrpcRequest,
            Response = GrpcResponse,
            Error = std::convert::Infallible,
            Future = GrpcFuture,
        >
{
}

/// Whether `path` is a method of the gRPC service `name` (`/name/Method`).
fn is_method_of(path: &str, name: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.strip_prefix(name))
        .is_some_and(|method| method.starts_with('/'))
}

impl<R: GrpcService, Q: GrpcService, H: GrpcService, F: GrpcService>
    tonic::codegen::Service<GrpcRequest> for Dispatch<R, Q, H, F>
{
    type Response = GrpcResponse;
    type Error = std::convert::Infallible;
    type Future = GrpcFuture;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // Every service here is always ready.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: GrpcRequest) -> Self::Future {
        let path = request.uri().path();
        if is_method_of(path, SERVICE_NAME) {
            self.rls.call(request)
        } else if is_method_of(path, QUOTA_SERVICE_NAME) {
            self.rlqs.call(request)
        } else if path.starts_with("/grpc.reflection.") {
            self.reflection.call(request)
        } else {
            self.health.call(request)
        }
    }
}
