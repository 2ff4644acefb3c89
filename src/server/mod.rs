//! The running system, owned in one place: [`run`] takes a [`Config`] and a shutdown signal
//! (mini-redis's `server::run(listener, shutdown)` is the shape) and does everything between
//! the command line and the exit:
//!
//! 1. **Rules**: loaded from files (then reloaded on change and on SIGHUP) or taken from an xDS
//!    server (waiting for the first set unless told not to); see `rules`.
//! 2. **Store**: built with its upkeep (`store::build`); the upkeep's timers run here (`upkeep`):
//!    expired counters swept, leftover leases given back, gRPC health kept in step with
//!    [`readiness`](crate::readiness).
//! 3. **Listeners**: gRPC (RLS, RLQS, health, reflection; TLS with rotation), HTTP (admin), and the
//!    reference's metrics listener when asked; see `grpc`.
//! 4. **Stop**: the first shutdown signal starts the drain (health NOT_SERVING, calls still
//!    answered) for `drain_delay`, a second one ends it early; then the listeners close,
//!    in-flight calls get `shutdown_grace` to finish, and every lease goes back to the fleet.
//!
//! Tests and benches use [`start`] and [`Running`] (the same path, with their own clocks and
//! port 0) and stop it themselves.

mod grpc;
mod rules;
mod upkeep;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::engine::{Engine, EngineSettings};
use crate::metrics::Metrics;
use crate::readiness::Gate;
use crate::rlqs::{QuotaObserver, QuotaOptions, QuotaService};
use crate::rules::reload::Reloader;
use crate::rules::{LoadOptions, RuleSet};
use crate::service::health::HealthStatus;
use crate::service::{HeaderSet, RateLimitGrpc};
use crate::store::{BackendObserver, Stack, StoreConfig, Upkeep, build};
use crate::tls::ServerTls;
use crate::xds::{XdsOptions, XdsRules};

pub use crate::service::health::HEALTH_NAMES;

/// Everything a running sluice needs; the command line and the reference's environment both
/// produce one (`cli`).
pub struct Config {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// TLS (and mutual TLS) on the gRPC listener; None serves plaintext HTTP/2.
    pub grpc_tls: Option<Arc<ServerTls>>,
    /// A listener of its own serving the reference service's metric names at this path.
    pub reference_metrics: Option<(SocketAddr, String)>,
    pub rules: RulesSource,
    /// How rules are loaded, at the start and at every reload.
    pub load: LoadOptions,
    pub store: StoreConfig,
    pub engine: EngineSettings,
    pub headers: HeaderSet,
    /// Serves `POST /json` (it spends real quota: keep it off where untrusted clients reach the
    /// HTTP port).
    pub json: bool,
    /// Answers carry `dynamic_metadata` (`--response-dynamic-metadata`).
    pub dynamic_metadata: bool,
    /// `/counters` shows descriptor values whole (`--show-descriptor-values`), not masked.
    pub show_descriptor_values: bool,
    /// Records calls and serves `/metrics`; None for no metrics. The store's backend calls are
    /// reported to it too.
    pub metrics: Option<Arc<Metrics>>,
    /// How often the store's expired counters and denials are swept.
    pub sweep_every: Duration,
    /// How long health says NOT_SERVING before the listeners close.
    pub drain_delay: Duration,
    /// How long in-flight calls may take to finish after the drain.
    pub shutdown_grace: Duration,
    /// The Rate Limit Quota Service's bounds and pace (its default failure policy is the
    /// store's).
    pub quota: QuotaOptions,
}

/// Where the rules come from.
pub enum RulesSource {
    /// Files, reloaded on SIGHUP and, with `watch` (the debounce), on change.
    Files {
        path: PathBuf,
        watch: Option<Duration>,
    },
    /// An xDS server; with `wait`, nothing is served before its first rules.
    Xds { options: XdsOptions, wait: bool },
    /// Fixed rules, never reloaded (tests, benches).
    Given(RuleSet),
}

/// How fast the most-limited view (`GET /top`) forgets: counts halve every minute.
const TOP_HALF_LIFE: Duration = Duration::from_secs(60);

/// Serves until `shutdown` yields: the first item starts the drain, a second ends it early
/// (a rollout's SIGTERM, then an impatient operator's Ctrl-C). `shutdown` ending counts as a
/// signal.
pub async fn run(config: Config, shutdown: impl Stream<Item = ()> + Unpin) -> anyhow::Result<()> {
    let mut shutdown = shutdown;
    let (drain_delay, grace) = (config.drain_delay, config.shutdown_grace);
    let running = tokio::select! {
        running = start(config) => running?,
        _ = shutdown.next() => {
            tracing::info!("stopped before serving");
            return Ok(());
        }
    };
    shutdown.next().await;
    if !drain_delay.is_zero() {
        tracing::info!(delay = ?drain_delay, "draining: health NOT_SERVING, calls still answered");
        running.drain();
        tokio::select! {
            _ = tokio::time::sleep(drain_delay) => {}
            _ = shutdown.next() => tracing::info!("second signal: the drain ends now"),
        }
    }
    tracing::info!("shutting down");
    match tokio::time::timeout(grace, running.stop()).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                ?grace,
                "calls still in flight after the grace period; exiting"
            );
            Ok(())
        }
    }
}

/// A running server. Dropping it does not stop it; call [`Running::stop`].
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// Where the reference's metric names are served, when they are.
    pub reference_metrics_addr: Option<SocketAddr>,
    engine: Arc<Engine<Stack>>,
    upkeep: Arc<Upkeep>,
    gate: Arc<Gate>,
    health: HealthStatus,
    rules: rules::Live,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

/// Builds the store, loads the rules (waiting for xDS's first set when asked), binds the
/// listeners and starts serving.
pub async fn start(config: Config) -> anyhow::Result<Running> {
    let mut store_config = config.store.clone();
    if store_config.observer.is_none() {
        store_config.observer = config
            .metrics
            .clone()
            .map(|m| m as Arc<dyn BackendObserver>);
    }
    // Inside the runtime: connections to Redis are made ahead, in the background.
    let (store, upkeep) = build(&store_config)?;
    let upkeep = Arc::new(upkeep);
    // No rules until the source gives them; nothing is served before then.
    let engine = Arc::new(Engine::new(RuleSet::default(), store, config.engine));
    let rules =
        rules::Live::start(config.rules, config.load, &engine, config.metrics.clone()).await?;

    let gate = Arc::new(Gate::new(upkeep.clone()));
    let (health, health_service) = HealthStatus::new();
    let service = Arc::new(
        RateLimitGrpc::new(engine.clone(), config.headers, config.metrics.clone())
            .with_dynamic_metadata(config.dynamic_metadata)
            .with_top(Arc::new(crate::top::TopLimited::new(
                store_config.clocks.monotonic.clone(),
                TOP_HALF_LIFE,
            ))),
    );
    let (stop, stopped) = watch::channel(false);
    let quota = Arc::new(QuotaService::new(
        engine.clone(),
        store_config.clocks.wall.clone(),
        QuotaOptions { ..config.quota },
        config.metrics.clone().map(|m| m as Arc<dyn QuotaObserver>),
        stopped.clone(),
    ));
    let mut tasks = Vec::new();

    let grpc_listener = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC address {}", config.grpc_addr))?;
    let http_listener = TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding the HTTP address {}", config.http_addr))?;
    let reference_listener = match &config.reference_metrics {
        Some((addr, _)) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the reference metrics address {addr}"))?,
        ),
        None => None,
    };
    // Every listener is bound before any task starts: a failed bind leaves nothing running.
    let grpc_addr = grpc_listener.local_addr()?;
    let http_addr = http_listener.local_addr()?;
    tasks.extend(grpc::serve(
        grpc_listener,
        service.clone(),
        quota.clone(),
        health_service,
        config.grpc_tls,
        stopped.clone(),
    )?);
    let admin = crate::admin::router(crate::admin::AdminState {
        service,
        gate: gate.clone(),
        upkeep: upkeep.clone(),
        reloader: rules.reloader(),
        json: config.json,
        key_prefix: match &store_config.backend {
            crate::store::BackendConfig::Redis(redis) => redis.key_prefix.clone(),
            crate::store::BackendConfig::Memory => "sluice:".to_owned(),
        },
        quota: Some(quota.clone()),
        reveal: if config.show_descriptor_values {
            crate::admin::counters::Reveal::Whole
        } else {
            crate::admin::counters::Reveal::Masked
        },
    });
    let http = axum::serve(http_listener, admin).with_graceful_shutdown(stopped_signal(&stopped));
    tasks.push(tokio::spawn(
        async move { http.await.context("HTTP server") },
    ));
    let mut reference_metrics_addr = None;
    if let (Some(listener), Some((_, path)), Some(metrics)) = (
        reference_listener,
        &config.reference_metrics,
        &config.metrics,
    ) {
        reference_metrics_addr = Some(listener.local_addr()?);
        let server = axum::serve(
            listener,
            crate::admin::reference_metrics(metrics.clone(), path),
        )
        .with_graceful_shutdown(stopped_signal(&stopped));
        tasks.push(tokio::spawn(async move {
            server.await.context("reference metrics server")
        }));
    }
    tasks.extend(upkeep::spawn(
        &upkeep,
        &gate,
        &health,
        config.sweep_every,
        &stopped,
    ));
    tracing::info!(%grpc_addr, %http_addr, "serving");
    Ok(Running {
        grpc_addr,
        http_addr,
        reference_metrics_addr,
        engine,
        upkeep,
        gate,
        health,
        rules,
        stop,
        tasks,
    })
}

/// A task that runs `tick` every `period` (the first at once; a late tick is not made up for)
/// until `stopped`: the timers of the upkeep and of the certificates' reload. A tick in
/// progress when the server stops is dropped, not awaited: a heartbeat or a give-back waiting on
/// a hung Redis must not hold up the stop (what the stop gives back is bounded on its own).
fn every<F, Fut>(
    period: Duration,
    stopped: &watch::Receiver<bool>,
    mut tick: F,
) -> JoinHandle<anyhow::Result<()>>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let mut stopped = stopped.clone();
    tokio::spawn(async move {
        let mut timer = tokio::time::interval(period.max(Duration::from_millis(1)));
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = timer.tick() => {}
                _ = stopped.wait_for(|stop| *stop) => return Ok(()),
            }
            tokio::select! {
                () = tick() => {}
                _ = stopped.wait_for(|stop| *stop) => return Ok(()),
            }
        }
    })
}

/// Resolves once `stop` says so.
fn stopped_signal(stopped: &watch::Receiver<bool>) -> impl Future<Output = ()> + Send + 'static {
    let mut rx = stopped.clone();
    async move {
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

impl Running {
    /// The engine every door decides through.
    pub fn engine(&self) -> &Arc<Engine<Stack>> {
        &self.engine
    }

    /// The store's upkeep: its report (leases held, cached denials, the breaker).
    pub fn upkeep(&self) -> &Arc<Upkeep> {
        &self.upkeep
    }

    /// What the rules reloads did; None when the rules are fixed.
    pub fn reloader(&self) -> Option<Arc<Reloader>> {
        self.rules.reloader()
    }

    /// The xDS client, when the rules come from one.
    pub fn xds(&self) -> Option<&XdsRules> {
        self.rules.xds()
    }

    /// The start of a rollout's goodbye: gRPC health, `/healthcheck` and `/readyz` say this node
    /// is going, so Envoy's health checks and Kubernetes move traffic away, while every call that
    /// still arrives is answered as before.
    pub fn drain(&self) {
        self.gate.drain();
        self.health
            .set(tonic_health::pb::health_check_response::ServingStatus::NotServing);
    }

    /// Health goes NOT_SERVING, listeners close, in-flight calls finish, then every lease this
    /// node holds goes back to the fleet and the node leaves it (within one backend timeout).
    pub async fn stop(self) -> anyhow::Result<()> {
        self.drain();
        // Open health watches end, so the graceful shutdown does not wait on them.
        self.health.close();
        let _ = self.stop.send(true);
        drop(self.rules);
        for task in self.tasks {
            task.await.context("server task panicked")??;
        }
        // No call is in flight now: what this node still holds goes back to the fleet.
        self.upkeep.stop().await;
        tracing::info!("stopped");
        Ok(())
    }
}
