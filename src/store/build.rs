//! The one place the store is assembled: the server, the tests and the benches all call [`build`],
//! so what runs in production is what the tests prove.

use std::sync::Arc;
use std::time::Duration;

use super::breaker::{Breaker, BreakerOptions};
use super::fallback::Fallback;
use super::lease::{LeaseOptions, LeaseTable, Leases};
use super::metered::{BackendObserver, Metered};
use super::over_limit::OverLimitCache;
use super::redis::{RedisConfigError, RedisOptions, RedisStore};
use super::upkeep::{SharedUpkeep, Upkeep};
use super::{Check, FailureMode, MemoryStore, Outcome, Store, StoreError};
use crate::clock::{Clock, MonotonicClock, SystemClock};

/// Where the counters live.
#[derive(Debug, Clone)]
pub enum BackendConfig {
    /// This process only.
    Memory,
    /// Redis or a Redis Cluster, shared by every node.
    Redis(RedisOptions),
}

/// The clocks the layers read. Production: the system's; tests: one manual clock for all,
/// with Redis's `TIME` pinned to it too, so a run can be replayed exactly.
#[derive(Clone)]
pub struct Clocks {
    /// Wall time: the memory stores' windows.
    pub wall: Arc<dyn Clock>,
    /// Durations on this node only (lease deadlines, cached denials, the breaker): a wall clock
    /// set back must not stretch them.
    pub monotonic: Arc<dyn Clock>,
    /// Tests only: the Lua scripts use this instead of Redis `TIME`.
    pub redis_pinned: Option<Arc<dyn Clock>>,
}

impl Clocks {
    pub fn system() -> Self {
        Self {
            wall: Arc::new(SystemClock),
            monotonic: Arc::new(MonotonicClock::new()),
            redis_pinned: None,
        }
    }

    /// Every layer and Redis on one clock.
    pub fn pinned(clock: Arc<dyn Clock>) -> Self {
        Self {
            wall: clock.clone(),
            monotonic: clock.clone(),
            redis_pinned: Some(clock),
        }
    }
}

#[derive(Clone)]
pub struct StoreConfig {
    pub backend: BackendConfig,
    /// Counters the memory store holds at most (the backend's, or the failure policy's own).
    pub max_keys: usize,
    /// For rules that set no `failure_mode`.
    pub failure_mode: FailureMode,
    pub breaker: BreakerOptions,
    /// Denials cached at most (0: off).
    pub over_limit_cache: usize,
    pub leases: LeaseOptions,
    pub observer: Option<Arc<dyn BackendObserver>>,
    pub clocks: Clocks,
    /// How often this node announces itself in Redis, so `failure_mode: local` enforces its
    /// share of each limit over the live fleet (zero: off, each node enforces the whole limit).
    pub fleet_heartbeat: Duration,
}

impl StoreConfig {
    /// Production defaults for `backend`.
    pub fn new(backend: BackendConfig) -> Self {
        Self {
            backend,
            max_keys: 10_000_000,
            failure_mode: FailureMode::default(),
            breaker: BreakerOptions::default(),
            over_limit_cache: 100_000,
            leases: LeaseOptions::default(),
            observer: None,
            clocks: Clocks::system(),
            fleet_heartbeat: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Redis(#[from] RedisConfigError),
}

/// The shared backend as the lease layer sees it: Redis behind its breaker, metered.
pub type Backend = Metered<Breaker<RedisStore>>;

/// The shared-backend stack, outermost first (see the module documentation of `store`).
pub type Shared = OverLimitCache<Fallback<Leases<Backend>>>;

/// What [`build`] returns: the memory store alone, or the shared stack.
pub enum Stack {
    Memory(Arc<MemoryStore>),
    Shared(Box<Shared>),
}

/// Assembles the store `config` describes, and the upkeep that runs beside it (see
/// [`Upkeep`]). Connections to Redis are made ahead, in the background, when called inside a
/// Tokio runtime; sluice starts while Redis is down.
pub fn build(config: &StoreConfig) -> Result<(Stack, Upkeep), BuildError> {
    let clocks = &config.clocks;
    let memory = Arc::new(MemoryStore::new(clocks.wall.clone(), config.max_keys));
    let options = match &config.backend {
        BackendConfig::Memory => {
            return Ok((Stack::Memory(memory.clone()), Upkeep::memory(memory)));
        }
        BackendConfig::Redis(options) => options,
    };
    let mut redis = RedisStore::new(options)?;
    if let Some(pinned) = &clocks.redis_pinned {
        redis = redis.with_pinned_clock(pinned.clone());
    }
    redis.connect_ahead();
    let reached = redis.reached();
    let beat = (!config.fleet_heartbeat.is_zero()).then(|| redis.fleet_beat(node_id()));
    let breaker = Breaker::new(redis, config.breaker, clocks.monotonic.clone());
    let circuit = breaker.circuit();
    let metered = Metered::new(breaker, config.observer.clone());
    // Leases are kept for rules that ask for them even when the default mode is strict.
    let leases = Leases::new(
        metered,
        LeaseTable::new(config.leases, clocks.monotonic.clone()),
    );
    let give_back = leases.give_back();
    let fallback = Fallback::new(leases, memory.clone(), config.failure_mode, config.max_keys);
    let fleet = beat.map(|beat| super::upkeep::Fleet {
        beat,
        share: fallback.fleet(),
        every: config.fleet_heartbeat,
        clock: clocks.wall.clone(),
    });
    let last_seen = fallback.last_seen();
    let (policy, serves_without_backend) =
        (fallback.decisions(), fallback.serves_without_backend());
    let cache = OverLimitCache::new(fallback, config.over_limit_cache, clocks.monotonic.clone());
    let upkeep = Upkeep::shared(
        memory,
        SharedUpkeep {
            denials: cache.denials(),
            last_seen,
            policy,
            serves_without_backend,
            leases: give_back,
            circuit,
            reached,
            fleet,
            stop_budget: options.timeout,
        },
    );
    Ok((Stack::Shared(Box::new(cache)), upkeep))
}

/// This process's name in the fleet set: random, so a restarted node counts once its old
/// entry expires.
fn node_id() -> String {
    use std::hash::BuildHasher;
    let seed = (std::process::id(), std::time::SystemTime::now());
    format!(
        "{:016x}",
        std::collections::hash_map::RandomState::new().hash_one(seed)
    )
}

impl Store for Stack {
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Outcome, StoreError>> + Send {
        // The shared stack's future is ~2 KB (five layers and a Redis call, nested): inline, it
        // would size every call's future, the memory backend's too, and be copied into each
        // boxed gRPC handler future. Boxed, it costs one allocation beside a network round trip.
        match self {
            Stack::Memory(m) => {
                futures_util::future::Either::Left(std::future::ready(m.apply_now(checks)))
            }
            Stack::Shared(s) => futures_util::future::Either::Right(Box::pin(s.apply(checks))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::Topology;

    /// The shared stack's future is boxed per request (see `Stack::apply`): at a word's
    /// alignment the global allocator serves that box from its fast path (see `allocator`); a
    /// 16-byte field held across an await (a span context's 128-bit trace id, once) took the
    /// slow aligned one, ~300 instructions a request.
    #[tokio::test]
    async fn the_shared_stacks_future_is_word_aligned() {
        let options = RedisOptions {
            topology: Topology::Standalone("redis://127.0.0.1:1".into()),
            pool_size: 1,
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            key_prefix: "sluice:".into(),
            read_string_windows: false,
        };
        let (stack, _upkeep) = build(&StoreConfig::new(BackendConfig::Redis(options))).unwrap();
        let Stack::Shared(shared) = &stack else {
            panic!("a Redis backend builds the shared stack");
        };
        let apply = shared.apply(&[]);
        assert_eq!(std::mem::align_of_val(&apply), std::mem::size_of::<usize>());
    }
}
