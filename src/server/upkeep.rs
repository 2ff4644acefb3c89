//! The timers the running system keeps: the store's sweep and lease give-back (what
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
    tasks.push(tokio::spawn(every(
        sweep_every,
        stopped.clone(),
        move || {
            let upkeep = sweep.clone();
            async move {
                // CPU-bound (a walk of every key): off the async workers.
                let _ = tokio::task::spawn_blocking(move || upkeep.sweep()).await;
            }
        },
    )));
    // Leases that ran out go back to the shared store soon, not when their window ends.
    if let Some(period) = upkeep.give_back_every() {
        let upkeep = upkeep.clone();
        tasks.push(tokio::spawn(every(period, stopped.clone(), move || {
            let upkeep = upkeep.clone();
            async move { upkeep.give_back(false).await }
        })));
    }
    // gRPC health follows readiness (Envoy's health checks then steer away from this node).
    let (gate, health) = (gate.clone(), health.clone());
    let mut was_ready = true;
    tasks.push(tokio::spawn(every(
        HEALTH_EVERY,
        stopped.clone(),
        move || {
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
        },
    )));
    tasks
}

/// Runs `tick` every `period` (a late tick is not made up for) until `stopped`.
async fn every<F, Fut>(
    period: Duration,
    mut stopped: watch::Receiver<bool>,
    mut tick: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut timer = tokio::time::interval(period.max(Duration::from_millis(1)));
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            _ = stopped.wait_for(|stop| *stop) => return Ok(()),
        }
        tick().await;
    }
}
