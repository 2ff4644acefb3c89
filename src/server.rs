//! Wiring and lifecycle: bind the gRPC and HTTP listeners, serve until told to stop, then stop
//! gracefully (health goes NOT_SERVING first, in-flight calls finish).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::engine::Engine;
use crate::proto::{RateLimitServiceServer, SERVICE_NAME};
use crate::rules::reload::Reloader;
use crate::service::{HeaderSet, RateLimitGrpc};
use crate::store::Store;
use crate::tls::{Reload, ServerTls};

pub use crate::service::health::HEALTH_NAMES;
use crate::service::health::HealthStatus;

#[derive(Debug, Clone)]
pub struct Options {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub headers: HeaderSet,
    /// How often the store forgets expired keys.
    pub housekeeping_every: Duration,
    /// Reloads the rules (for `/config`); None when the rules are fixed.
    pub reloader: Option<Arc<Reloader>>,
    /// Serves `/metrics` and records calls; None for no metrics.
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Serves `POST /json` (it spends real quota: keep it off where untrusted clients reach the
    /// HTTP port).
    pub json: bool,
    /// Answers carry `dynamic_metadata` (`--response-dynamic-metadata`).
    pub dynamic_metadata: bool,
    /// TLS (and mutual TLS) on the gRPC listener; None serves plaintext HTTP/2.
    pub grpc_tls: Option<Arc<ServerTls>>,
    /// A listener of its own serving the reference service's metric names at this path (the
    /// metrics must be made [`with_reference_names`](crate::metrics::Metrics::with_reference_names)).
    pub reference_metrics: Option<(SocketAddr, String)>,
}

/// A running server. Dropping it does not stop it; call [`Running::stop`].
pub struct Running<S> {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// Where the reference's metric names are served, when they are.
    pub reference_metrics_addr: Option<SocketAddr>,
    pub engine: Arc<Engine<S>>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    serving: Arc<AtomicBool>,
    health: HealthStatus,
}

pub async fn start<S: Store>(
    options: Options,
    engine: Arc<Engine<S>>,
) -> anyhow::Result<Running<S>> {
    let grpc_listener = TcpListener::bind(options.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC address {}", options.grpc_addr))?;
    let http_listener = TcpListener::bind(options.http_addr)
        .await
        .with_context(|| format!("binding the HTTP address {}", options.http_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let http_addr = http_listener.local_addr()?;
    let reference_listener = match &options.reference_metrics {
        Some((addr, path)) => {
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the reference metrics address {addr}"))?;
            Some((listener, path.clone()))
        }
        None => None,
    };
    let reference_metrics_addr = match &reference_listener {
        Some((l, _)) => Some(l.local_addr()?),
        None => None,
    };

    let (health, health_service) = HealthStatus::new();
    let serving = Arc::new(AtomicBool::new(true));
    let service = Arc::new(
        RateLimitGrpc::new(engine.clone(), options.headers, options.metrics.clone())
            .with_dynamic_metadata(options.dynamic_metadata),
    );
    let (stop, stopped) = watch::channel(false);
    let signal = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let dispatch = Dispatch {
        rls: RateLimitServiceServer::from_arc(service.clone()),
        health: health_service,
        reflection: reflection()?,
    };
    let mut tasks = Vec::new();
    let grpc = match options.grpc_tls.clone() {
        None => tokio::spawn(
            tonic::transport::Server::builder()
                .serve_with_incoming_shutdown(
                    dispatch,
                    TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                    signal(stopped.clone()),
                )
                .map_err_into(),
        ),
        Some(tls) => {
            tasks.push(tokio::spawn(reload_certificates(
                tls.clone(),
                stopped.clone(),
            )));
            tokio::spawn(
                tonic::transport::Server::builder()
                    .serve_with_incoming_shutdown(
                        dispatch,
                        tls_incoming(grpc_listener, tls, stopped.clone()),
                        signal(stopped.clone()),
                    )
                    .map_err_into(),
            )
        }
    };
    let http = axum::serve(
        http_listener,
        crate::admin::router(
            service,
            serving.clone(),
            options.reloader.clone(),
            options.json,
        ),
    )
    .with_graceful_shutdown(signal(stopped.clone()));

    let housekeeping = {
        let engine = engine.clone();
        let mut stopped = stopped.clone();
        let every = options.housekeeping_every;
        async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.wait_for(|stop| *stop) => return Ok(()),
                }
                // CPU-bound (a sweep of every key): off the async workers.
                let engine = engine.clone();
                let _ = tokio::task::spawn_blocking(move || engine.store().housekeeping()).await;
            }
        }
    };
    // gRPC health follows readiness: NOT_SERVING while the backend is down and the failure
    // policy is `error` (Envoy's health checks then steer away from this node).
    let health_watch = {
        let (engine, health, stopped) = (engine.clone(), health.clone(), stopped.clone());
        let serving = serving.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            let mut was_ready = true;
            loop {
                tick.tick().await;
                let stopping = *stopped.borrow();
                if stopping || !serving.load(Ordering::Acquire) {
                    // Shutting down: stop() owns the health status now.
                    return Ok(());
                }
                let ready = engine.store().report().ready();
                if ready != was_ready {
                    let status = if ready {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    health.set(status);
                    was_ready = ready;
                }
            }
        }
    };

    if let (Some((listener, path)), Some(metrics)) = (reference_listener, options.metrics.clone()) {
        let server = axum::serve(listener, crate::admin::reference_metrics(metrics, &path))
            .with_graceful_shutdown(signal(stopped.clone()));
        tasks.push(tokio::spawn(async move {
            server.await.context("reference metrics server")
        }));
    }
    tasks.extend([
        grpc,
        tokio::spawn(async move { http.await.context("HTTP server") }),
        tokio::spawn(housekeeping),
        tokio::spawn(health_watch),
    ]);
    // Leases that ran out go back to the shared store soon, not when their window ends.
    if let Some(every) = engine.store().flush_every() {
        let engine = engine.clone();
        let mut stopped = stopped.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.wait_for(|stop| *stop) => return Ok(()),
                }
                engine.store().flush(false).await;
            }
        }));
    }
    tracing::info!(%grpc_addr, %http_addr, "serving");
    Ok(Running {
        grpc_addr,
        http_addr,
        reference_metrics_addr,
        engine,
        stop,
        tasks,
        serving,
        health,
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
async fn reload_certificates(
    tls: Arc<ServerTls>,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(tls.reload_every().max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|stop| *stop) => return Ok(()),
        }
        let tls = tls.clone();
        match tokio::task::spawn_blocking(move || tls.reload()).await {
            Ok(Reload::Unchanged) | Err(_) => {}
            Ok(Reload::Replaced) => tracing::info!("gRPC TLS certificates reloaded"),
            Ok(Reload::Failed(e)) => {
                tracing::warn!(error = %e, "gRPC TLS certificates changed but do not load; the previous ones keep serving")
            }
        }
    }
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
/// three services a prefix test is all it takes, and the generated servers already box their
/// futures. ShouldRateLimit is tested first; anything that is neither it nor reflection goes to
/// health, which answers UNIMPLEMENTED for what it does not know.
#[derive(Clone)]
struct Dispatch<R, H, F> {
    rls: R,
    health: H,
    reflection: F,
}

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;
type GrpcResponse = tonic::codegen::http::Response<tonic::body::Body>;
type GrpcFuture = tonic::codegen::BoxFuture<GrpcResponse, std::convert::Infallible>;

impl<R, H, F> tonic::codegen::Service<GrpcRequest> for Dispatch<R, H, F>
where
    R: tonic::codegen::Service<
            GrpcRequest,
            Response = GrpcResponse,
            Error = std::convert::Infallible,
            Future = GrpcFuture,
        >,
    H: tonic::codegen::Service<
            GrpcRequest,
            Response = GrpcResponse,
            Error = std::convert::Infallible,
            Future = GrpcFuture,
        >,
    F: tonic::codegen::Service<
            GrpcRequest,
            Response = GrpcResponse,
            Error = std::convert::Infallible,
            Future = GrpcFuture,
        >,
{
    type Response = GrpcResponse;
    type Error = std::convert::Infallible;
    type Future = GrpcFuture;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // The generated servers are always ready.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: GrpcRequest) -> Self::Future {
        let rls = request
            .uri()
            .path()
            .strip_prefix('/')
            .and_then(|p| p.strip_prefix(SERVICE_NAME))
            .is_some_and(|method| method.starts_with('/'));
        if rls {
            self.rls.call(request)
        } else if request.uri().path().starts_with("/grpc.reflection.") {
            self.reflection.call(request)
        } else {
            self.health.call(request)
        }
    }
}

impl<S: Store> Running<S> {
    /// The start of a rollout's goodbye: gRPC health, `/healthcheck` and `/readyz` say this node
    /// is going, so Envoy's health checks and Kubernetes move traffic away, while every call that
    /// still arrives is answered as before.
    pub fn drain(&self) {
        self.serving.store(false, Ordering::Release);
        self.health.set(ServingStatus::NotServing);
    }

    /// Health goes NOT_SERVING, listeners close, in-flight calls finish, then this returns.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.drain();
        // Open health watches end, so the graceful shutdown does not wait on them.
        self.health.close();
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await.context("server task panicked")??;
        }
        // No call is in flight now: what this node still holds goes back to the fleet.
        self.engine.store().flush(true).await;
        tracing::info!("stopped");
        Ok(())
    }
}
