//! The timers the running system keeps: the store's sweep, lease give-back and fleet heartbeat (what
//! [`Upkeep`] asks for), and gRPC health kept in step with [`readiness`](crate::readiness).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::readiness::Gate;
use crate::service::health::HealthStatus;
use crate::store::Upkeep;

/// How often gRPC health reads readiness.
const HEALTH_EVERY: Duration = Duration::from_millis(250);

/// Starts the timers; each ends when `stopped` turns true.
pub(super) fn spawn(
    upkeep: &Arc<Upkeep>,
    gate: &Arc<Gate>,
    health: &HealthStatus,
    sweep_every: Duration,
    stopped: &watch::Receiver<bool>,
) -> Vec<JoinHandle<anyhow::Result<()>>> {
    let mut tasks = Vec::new();
    let sweep = upkeep.clone();
    tasks.push(super::every(sweep_every, stopped, move || {
        let upkeep = sweep.clone();
        // CPU-bound (a walk of every key): off the async workers.
        async move {
            let _ = tokio::task::spawn_blocking(move || upkeep.sweep()).await;
        }
    }));
    // Leases that ran out go back to the shared store soon, not when their window ends.
    if let Some(period) = upkeep.give_back_every() {
        let give_back = upkeep.clone();
        tasks.push(super::every(period, stopped, move || {
            let upkeep = give_back.clone();
            async move { upkeep.give_back(false).await }
        }));
    }
    // The fleet heartbeat: how many nodes share each limit when Redis is lost (`local`).
    if let Some(period) = upkeep.beat_every() {
        let beat = upkeep.clone();
        tasks.push(super::every(period, stopped, move || {
            let upkeep = beat.clone();
            async move {
                upkeep.beat().await;
            }
        }));
    }
    // gRPC health follows readiness (Envoy's health checks then steer away from this node).
    let (gate, health) = (gate.clone(), health.clone());
    let mut was_ready = true;
    tasks.push(super::every(HEALTH_EVERY, stopped, move || {
        let now = gate.now();
        // Draining: `Running::drain` and `stop` own the health status from then on.
        if now.ready() != was_ready && now != crate::readiness::Readiness::Draining {
            was_ready = now.ready();
            health.set(if was_ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            });
        }
        std::future::ready(())
    }));
    tasks
}
