//! Redis and Redis Cluster: a request's checks decided by the limiter library per cluster slot,
//! all or nothing; the groups of requests that queue meanwhile leave in one call (`batcher`).
//!
//! Each check's key is `prefix{tag}encoded-key`: the tag is 8 hex digits of a hash of the
//! descriptor (domain and matched entries), so every tier of one descriptor lands in one slot
//! and is decided by one script, and no byte of a descriptor value can move a key or make two
//! descriptors collide (the encoded key is length-prefixed). Checks are grouped by slot; the
//! groups run concurrently, each in an FCALL it may share with other requests' groups of the
//! same server (standalone) or master (cluster; see `Queues`) (the library loaded again when
//! Redis lost it; EVALSHA of the same code where Redis has no Functions). When one group denies,
//! the groups that consumed are refunded, so a denied request consumes nothing in the end; a
//! concurrent request may see those hits for the length of one round trip (under-admission,
//! never over-admission).
//!
//! Connections are made ahead, in the background, when the store is built and again after one
//! is lost, each bounded by its own connect timeout: a request's `--redis-timeout` pays for its
//! script call, not for a TCP and TLS handshake.

mod batcher;
mod masters;
mod script;
mod sentinel;

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::{Check, CheckKind, Outcome, Rollback, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::{Algorithm, Verdict};

use batcher::{Batcher, CallFailure, GroupOutcome, Worker};
use masters::{Masters, SLOTS, ToNode};
pub use script::LIMITER_SCRIPT;
use script::{Group, GroupAnswer, Keys, Limiter};

/// Where the counters live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// `redis://[user:pass@]host:port[/db]` (or `rediss://`), or a master found through Redis
    /// Sentinel: `redis+sentinel://[user:pass@]host:port[,host:port...]/master[/db]`.
    Standalone(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub topology: Topology,
    /// Standalone: how many multiplexed connections requests are spread over (the most calls
    /// out at once; the second only while a whole call waits, see `batcher`).
    pub pool_size: usize,
    /// Per script call.
    pub timeout: Duration,
    /// Per connection attempt (made ahead, in the background, when it can be).
    pub connect_timeout: Duration,
    pub key_prefix: String,
}

/// A Redis failure, its message with any password hidden.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RedisFailure(String);

impl RedisFailure {
    fn of(e: &redis::RedisError) -> Self {
        RedisFailure(redact(&e.to_string()))
    }
}

/// Connections, made ahead in the background (so sluice starts while Redis is down, and no
/// request waits for a handshake) and dropped when one fails at the connection level (so they
/// are made afresh: Redis restarted means every connection is dead). Each is multiplexed:
/// concurrent calls share it without waiting, so no checkout — and no health-check round trip
/// per call, as a generic pool adds — is needed.
struct Pool {
    conns: Connections,
    /// A background task is making the missing connections.
    filling: AtomicBool,
    /// A connection has been made at least once (until then the node is not healthy, as the
    /// reference service is not before it reaches Redis).
    reached: AtomicBool,
    connect_timeout: Duration,
}

enum Connections {
    Standalone {
        client: Target,
        config: ConnectionManagerConfig,
        conns: Vec<ArcSwapOption<ConnectionManager>>,
        next: AtomicUsize,
    },
    Cluster {
        client: ClusterClient,
        conn: ArcSwapOption<ClusterConnection>,
        /// Each slot's master, as last read (see `masters`); None until read, and again after
        /// a call to a master found it stale.
        masters: ArcSwapOption<Masters>,
        /// A background task is reading the masters.
        mapping: AtomicBool,
    },
}

/// Which calls a group leaves in: its slot's (keys declared, routed by them) or a cluster
/// master's (the groups of all its slots, keys undeclared, sent to its address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Slot(u16),
    Master(u16),
}

/// Where a standalone pool connects.
enum Target {
    Server(redis::Client),
    /// The master the sentinels name at the time of connecting.
    Sentinel(sentinel::Sentinels),
}

impl Pool {
    /// Forgets every connection after a connection-level failure, and makes new ones in the
    /// background.
    fn reset(self: &Arc<Self>) {
        match &self.conns {
            Connections::Standalone { conns, .. } => conns.iter().for_each(|c| c.store(None)),
            Connections::Cluster { conn, masters, .. } => {
                conn.store(None);
                masters.store(None);
            }
        }
        self.fill_in_background();
    }

    /// `look` at the cluster's masters as last read; None for a standalone server, or while
    /// the masters are not known (their reading then starts: see `read_masters`).
    fn with_masters<T>(self: &Arc<Self>, look: impl FnOnce(&Masters) -> T) -> Option<T> {
        let Connections::Cluster { masters, .. } = &self.conns else {
            return None;
        };
        let known = masters.load();
        if known.is_none() {
            self.read_masters();
        }
        known.as_deref().map(look)
    }

    /// Starts reading the cluster's masters in the background, on a connection already made,
    /// unless a task is at it already.
    fn read_masters(self: &Arc<Self>) {
        let Connections::Cluster { conn, mapping, .. } = &self.conns else {
            return;
        };
        let (Some(c), Ok(runtime)) = (conn.load_full(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        if mapping.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut c = (*c).clone();
        let pool = self.clone();
        runtime.spawn(async move {
            let read = tokio::time::timeout(
                pool.connect_timeout,
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<redis::Value>(&mut c),
            )
            .await;
            let Connections::Cluster {
                masters, mapping, ..
            } = &pool.conns
            else {
                return;
            };
            let read = match read {
                Ok(Ok(reply)) => Masters::parse(&reply).map_err(|e| e.to_string()),
                Ok(Err(e)) => Err(RedisFailure::of(&e).0),
                Err(_) => Err("no answer within the connect timeout".into()),
            };
            match read {
                Ok(m) => masters.store(Some(Arc::new(m))),
                Err(e) => {
                    // Groups go by slot meanwhile; a server that refuses CLUSTER SLOTS (an ACL)
                    // is asked again a second later, not on every request.
                    tracing::warn!(error = %e, "cannot read the cluster's masters; calls go by slot");
                    tokio::time::sleep(MASTERS_RETRY).await;
                }
            }
            mapping.store(false, Ordering::Release);
        });
    }

    /// Forgets the cluster's masters (a call to one found the map stale): the next group reads
    /// them again, and groups go by slot meanwhile.
    fn forget_masters(&self) {
        if let Connections::Cluster { masters, .. } = &self.conns {
            masters.store(None);
        }
    }

    /// Starts making the missing connections on the current Tokio runtime (if any), unless a
    /// task is at it already. It retries with backoff until every slot is filled.
    fn fill_in_background(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = self.clone();
        runtime.spawn(async move {
            let mut backoff = Duration::from_millis(50);
            while !pool.fill_once().await {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            pool.filling.store(false, Ordering::Release);
        });
    }

    /// One attempt at every missing connection; true when none is missing.
    async fn fill_once(&self) -> bool {
        match &self.conns {
            Connections::Standalone {
                client,
                config,
                conns,
                ..
            } => {
                let mut all = true;
                for slot in conns.iter().filter(|s| s.load().is_none()) {
                    match self.connect_standalone(client, config).await {
                        Ok(conn) => slot.store(Some(Arc::new(conn))),
                        Err(e) => {
                            tracing::debug!(error = %RedisFailure::of(&e), "cannot connect to Redis yet");
                            all = false;
                            break;
                        }
                    }
                }
                all
            }
            Connections::Cluster { client, conn, .. } => {
                if conn.load().is_some() {
                    return true;
                }
                match self.connect_cluster(client).await {
                    Ok(c) => {
                        conn.store(Some(Arc::new(c)));
                        true
                    }
                    Err(e) => {
                        tracing::debug!(error = %RedisFailure::of(&e), "cannot connect to the Redis Cluster yet");
                        false
                    }
                }
            }
        }
    }

    async fn connect_standalone(
        &self,
        target: &Target,
        config: &ConnectionManagerConfig,
    ) -> redis::RedisResult<ConnectionManager> {
        let client = match target {
            Target::Server(client) => client.clone(),
            Target::Sentinel(sentinels) => sentinels.locate(self.connect_timeout).await?,
        };
        let connect = ConnectionManager::new_with_config(client, config.clone());
        self.reached_if_ok(tokio::time::timeout(self.connect_timeout, connect).await)
    }

    async fn connect_cluster(
        &self,
        client: &ClusterClient,
    ) -> redis::RedisResult<ClusterConnection> {
        self.reached_if_ok(
            tokio::time::timeout(self.connect_timeout, client.get_async_connection()).await,
        )
    }

    /// A connection attempt's outcome within its timeout; a connection made marks the backend
    /// reached.
    fn reached_if_ok<C>(
        &self,
        attempt: Result<redis::RedisResult<C>, tokio::time::error::Elapsed>,
    ) -> redis::RedisResult<C> {
        let made = attempt.unwrap_or_else(|_| Err(connect_timed_out()))?;
        self.reached.store(true, Ordering::Release);
        Ok(made)
    }

    /// One call of the limiter carrying `groups`, on a connection of the pool: to the server
    /// their keys route to, or to master `lane`'s address as the map says now.
    async fn invoke(
        self: &Arc<Self>,
        limiter: &Limiter,
        groups: &[Group],
        lane: Lane,
    ) -> redis::RedisResult<Vec<GroupAnswer>> {
        match &self.conns {
            Connections::Standalone {
                client,
                config,
                conns,
                next,
            } => {
                let start = next.fetch_add(1, Ordering::Relaxed);
                // The next live connection from a round-robin start.
                let live =
                    (0..conns.len()).find_map(|i| conns[(start + i) % conns.len()].load_full());
                let mut conn = match live {
                    Some(conn) => (*conn).clone(),
                    None => {
                        // None made yet (Redis was down): this call connects, bounded by its
                        // own timeout, and the rest follow in the background.
                        let conn = self.connect_standalone(client, config).await?;
                        conns[start % conns.len()].store(Some(Arc::new(conn.clone())));
                        self.fill_in_background();
                        conn
                    }
                };
                limiter.run(&mut conn, groups, Keys::Declared).await
            }
            Connections::Cluster {
                client,
                conn,
                masters,
                ..
            } => {
                let mut conn = match conn.load_full() {
                    Some(c) => (*c).clone(),
                    None => {
                        let c = self.connect_cluster(client).await?;
                        conn.store(Some(Arc::new(c.clone())));
                        c
                    }
                };
                match lane {
                    Lane::Slot(_) => limiter.run(&mut conn, groups, Keys::Declared).await,
                    Lane::Master(number) => {
                        let address = masters
                            .load()
                            .as_ref()
                            .and_then(|m| m.address(number).cloned());
                        let Some((host, port)) = address else {
                            return Err(redis::RedisError::from((
                                redis::ErrorKind::Client,
                                "the cluster's masters are being read again",
                            )));
                        };
                        let mut to_master = ToNode {
                            conn: &mut conn,
                            host,
                            port,
                        };
                        limiter.run(&mut to_master, groups, Keys::Undeclared).await
                    }
                }
            }
        }
    }

    /// One call carrying `groups`: each one's outcome.
    async fn invoke_all(
        self: &Arc<Self>,
        limiter: &Limiter,
        groups: &[Group],
        lane: Lane,
    ) -> Vec<GroupOutcome> {
        match self.invoke(limiter, groups, lane).await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(self.failure(&e)); groups.len()],
        }
    }

    /// What a failed call means for its groups; a connection that broke (or a master demoted
    /// to a replica, READONLY: a Sentinel failover) is dropped, and new connections find the
    /// new master.
    fn failure(self: &Arc<Self>, e: &redis::RedisError) -> CallFailure {
        if e.is_timeout() {
            // The client's own response timeout.
            return CallFailure::Timeout;
        }
        if e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        {
            self.reset();
        }
        CallFailure::Failed(RedisFailure::of(e).0)
    }
}

/// A node's heartbeat: while Redis answers, each node puts itself in one sorted set (scored by
/// its clock, members older than the time to live dropped, the key itself expiring with them),
/// and reads how many are live. When Redis is lost, `failure_mode: local` enforces this node's
/// share of each limit over the fleet it last saw (see `fallback`).
pub struct FleetBeat {
    pool: Arc<Pool>,
    key: Vec<u8>,
    member: String,
    timeout: Duration,
}

impl FleetBeat {
    /// Announces this node at `now_ms` for `ttl_ms`; the live nodes counted (this one too).
    /// None while no connection is made yet (requests make them; a beat never waits on one).
    pub async fn beat(&self, now_ms: u64, ttl_ms: u64) -> Result<Option<u64>, StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD")
            .arg(&self.key)
            .arg(now_ms)
            .arg(&self.member)
            .ignore()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&self.key)
            .arg("-inf")
            .arg(format!("({}", now_ms.saturating_sub(ttl_ms)))
            .ignore()
            .cmd("PEXPIRE")
            .arg(&self.key)
            .arg(ttl_ms)
            .ignore()
            .cmd("ZCARD")
            .arg(&self.key);
        // On a connection already made, if any: a beat never waits on connecting.
        let call = async {
            match &self.pool.conns {
                Connections::Standalone { conns, .. } => {
                    match conns.iter().find_map(|c| c.load_full()) {
                        Some(conn) => live_count(&pipe, (*conn).clone()).await,
                        None => Ok(None),
                    }
                }
                Connections::Cluster { conn, .. } => match conn.load_full() {
                    Some(conn) => live_count(&pipe, (*conn).clone()).await,
                    None => Ok(None),
                },
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(live)) => Ok(live),
            Ok(Err(e)) => Err(StoreError::unavailable(e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}

/// Runs the heartbeat's pipeline on `conn`: the live nodes its last command counted.
async fn live_count(
    pipe: &redis::Pipeline,
    mut conn: impl redis::aio::ConnectionLike,
) -> redis::RedisResult<Option<u64>> {
    let (live,): (u64,) = pipe.query_async(&mut conn).await?;
    Ok(Some(live))
}

fn connect_timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to Redis timed out",
    ))
}

pub struct RedisStore {
    pool: Arc<Pool>,
    limiter: Arc<Limiter>,
    /// Requests' groups leave together (see `batcher`).
    queues: Queues,
    prefix: Vec<u8>,
    timeout: Duration,
    /// Tests only: a time for the script instead of Redis `TIME`.
    pinned: Option<Arc<dyn Clock>>,
    /// The clock calendar limits' windows are sent around (see `push_check`): the system's, or
    /// in tests the pinned clock or one set off from it.
    node_clock: Arc<dyn Clock>,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisConfigError {
    #[error(
        "--redis-key-prefix must not contain '{{' or '}}' (they would change the key's cluster slot)"
    )]
    BracesInPrefix,
    #[error("invalid Redis URL: {0}")]
    Url(String),
    #[error("invalid Redis Sentinel URL: {0}")]
    Sentinel(#[from] sentinel::SentinelUrlError),
}

impl RedisStore {
    /// No connection is made here (see [`RedisStore::connect_ahead`]), so sluice starts while
    /// Redis is down.
    pub fn new(options: &RedisOptions) -> Result<Self, RedisConfigError> {
        // rediss:// needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if options.key_prefix.contains(['{', '}']) {
            return Err(RedisConfigError::BracesInPrefix);
        }
        let url_error = |e: redis::RedisError| RedisConfigError::Url(redact(&e.to_string()));
        let conns = match &options.topology {
            Topology::Standalone(url) => Connections::Standalone {
                client: if sentinel::is_sentinel_url(url) {
                    Target::Sentinel(sentinel::Sentinels::parse(url)?)
                } else {
                    Target::Server(redis::Client::open(url.as_str()).map_err(url_error)?)
                },
                config: ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(options.connect_timeout))
                    // The client's own default cuts every call at 500 ms, whatever
                    // `--redis-timeout` says; ours bounds the call, the same figure here.
                    .set_response_timeout(Some(options.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(std::time::Duration::from_millis(100)),
                conns: (0..options.pool_size.max(1))
                    .map(|_| ArcSwapOption::empty())
                    .collect(),
                next: AtomicUsize::new(0),
            },
            Topology::Cluster(urls) => Connections::Cluster {
                client: ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(options.connect_timeout)
                    .response_timeout(options.timeout)
                    // The client's defaults retry 16 times with waits from 1.28 s: a call to a
                    // dead master would retry its address long past `--redis-timeout`, and the
                    // error that makes the pool reconnect (and learn the new topology from a
                    // live node) would never surface. Two quick retries still follow a MOVED or
                    // an ASK during a slot migration.
                    .retries(2)
                    .min_retry_wait(1)
                    .max_retry_wait(10)
                    .build()
                    .map_err(url_error)?,
                conn: ArcSwapOption::empty(),
                masters: ArcSwapOption::empty(),
                mapping: AtomicBool::new(false),
            },
        };
        let pool = Arc::new(Pool {
            conns,
            filling: AtomicBool::new(false),
            reached: AtomicBool::new(false),
            connect_timeout: options.connect_timeout,
        });
        let limiter = Arc::new(Limiter::default());
        let queues = match &pool.conns {
            // One call in flight per connection, each carrying what queued meanwhile.
            Connections::Standalone { conns, .. } => Queues::new(1, conns.len(), 0),
            Connections::Cluster { .. } => Queues::new(SLOTS, 1, MASTER_LANES),
        };
        Ok(Self {
            pool,
            limiter,
            queues,
            prefix: options.key_prefix.as_bytes().to_vec(),
            timeout: options.timeout,
            pinned: None,
            node_clock: Arc::new(crate::clock::SystemClock),
        })
    }

    /// This node's heartbeat in the fleet set (see [`FleetBeat`]), as `member`.
    pub fn fleet_beat(&self, member: String) -> FleetBeat {
        let mut key = self.prefix.clone();
        key.extend_from_slice(b"{fleet}");
        FleetBeat {
            pool: self.pool.clone(),
            key,
            member,
            timeout: self.timeout.max(Duration::from_millis(100)),
        }
    }

    /// Whether Redis has been reached, for the upkeep (readiness).
    pub fn reached(&self) -> Reached {
        Reached(self.pool.clone())
    }

    /// Makes the connections in the background now (on the current Tokio runtime; without one,
    /// the first calls make them).
    pub fn connect_ahead(&self) {
        self.pool.fill_in_background();
    }

    /// Tests only: the scripts use this clock instead of Redis `TIME`, so a run can be replayed
    /// against the memory store at the same times.
    pub fn with_pinned_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.node_clock = clock.clone();
        self.pinned = Some(clock);
        self
    }

    /// Whether a cluster's masters are known (so groups leave by master); when not, starts
    /// reading them if a connection is made. Tests wait on it; false for a standalone server.
    pub fn masters_known(&self) -> bool {
        self.pool.with_masters(|_| ()).is_some()
    }

    /// Tests only: this node's clock as calendar limits read it, apart from the script's (a
    /// node a little off Redis at a window's edge).
    pub fn with_node_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.node_clock = clock;
        self
    }

    fn redis_key(&self, check: &Check<'_>) -> (Vec<u8>, u16) {
        redis_key(&self.prefix, check.tag, check.key, check.limit.algorithm)
    }

    /// Runs the script for the checks `indices` (one slot) and returns
    /// (allowed, one verdict per index).
    async fn run_group(
        &self,
        slot: u16,
        keys: Vec<Vec<u8>>,
        checks: &[Check<'_>],
        indices: &[usize],
        now: Option<u64>,
        node_now_us: u64,
    ) -> Result<GroupReply, StoreError> {
        let mut group = Group {
            keys,
            now,
            args: Vec::with_capacity(8 * indices.len()),
        };
        for &i in indices {
            let c = &checks[i];
            let kind = match c.kind {
                CheckKind::Enforce => 1,
                CheckKind::Shadow => 2,
                CheckKind::Refund => 3,
            };
            push_check(&mut group.args, kind, c, node_now_us);
        }
        let call = async {
            let answer = match self.lane(slot) {
                lane @ Lane::Slot(_) => self.batcher(lane).call(group).await,
                lane @ Lane::Master(_) => {
                    let again = group.clone();
                    let answer = self.batcher(lane).call(group).await;
                    // The master did not serve its slot, or the call to it failed (the map may
                    // be stale, a master gone): by its slot, whose calls follow the cluster's
                    // redirections, and the map is read again.
                    let goes_again = match &answer {
                        Ok(Err(text)) => script::is_not_served(text),
                        Err(failure) => matches!(failure, CallFailure::Failed(_)),
                        Ok(Ok(_)) => false,
                    };
                    if goes_again {
                        self.pool.forget_masters();
                        self.batcher(Lane::Slot(slot)).call(again).await
                    } else {
                        answer
                    }
                }
            };
            match answer {
                Ok(Ok(reply)) => Ok(group_reply(reply, checks, indices)),
                // The group's own error (its neighbours in the call were answered).
                Ok(Err(text)) => Err(StoreError::unavailable(RedisFailure(text))),
                Err(CallFailure::Timeout) => Err(StoreError::Timeout(self.timeout)),
                Err(CallFailure::Failed(text)) => Err(StoreError::unavailable(RedisFailure(text))),
                Err(CallFailure::Stopped) => Err(StoreError::unavailable(RedisFailure(
                    "the Redis batcher stopped (its runtime shut down)".into(),
                ))),
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// Where a group of `slot` leaves: its master's calls where the cluster's masters are known,
    /// else its slot's (a standalone server's one queue is slot 0's).
    fn lane(&self, slot: u16) -> Lane {
        match self.pool.with_masters(|m| m.of(slot)).flatten() {
            Some(master) if usize::from(master) < self.queues.by_master.len() => {
                Lane::Master(master)
            }
            _ => Lane::Slot(slot),
        }
    }

    /// The queue of `lane`, made on first use with its worker spawned on that call's runtime (a
    /// store can be made outside one).
    fn batcher(&self, lane: Lane) -> &Batcher {
        let Queues {
            by_slot,
            in_flight,
            by_master,
        } = &self.queues;
        let (cell, in_flight) = match lane {
            Lane::Slot(slot) => (&by_slot[usize::from(slot) % by_slot.len()], *in_flight),
            Lane::Master(m) => (&by_master[usize::from(m)], MASTER_IN_FLIGHT),
        };
        cell.get_or_init(|| {
            let (batcher, worker) = batcher_of(&self.pool, &self.limiter, in_flight, lane);
            tokio::spawn(worker);
            batcher
        })
    }
}

/// Where requests' groups queue (see `batcher`). A standalone server (or Sentinel's master):
/// one queue, a call in flight per connection. A cluster: a queue per master, two calls in
/// flight, once its masters are known (`masters`), and a queue per slot, one call in flight,
/// before that and for a group a master refused. The keys a call declares must share a slot (a
/// cluster refuses others, `allow-cross-slot-keys` or not), so a master's call declares none: it
/// goes to the master's address with every group's keys after its numbers, and the master
/// checks each access (the library is flagged `allow-cross-slot-keys`); a group it refuses (its
/// slot moved or is moving) goes again on its slot's queue, whose calls declare their keys and
/// follow MOVED and ASK, and the masters are read again. A master that stops answering holds up
/// only its own queue.
struct Queues {
    by_slot: Box<[std::sync::OnceLock<Batcher>]>,
    in_flight: usize,
    /// A cluster's masters' queues, by their number in the map (see `masters`).
    by_master: Box<[std::sync::OnceLock<Batcher>]>,
}

impl Queues {
    fn new(queues: usize, in_flight: usize, masters: usize) -> Self {
        let cells = |n| (0..n).map(|_| std::sync::OnceLock::new()).collect();
        Self {
            by_slot: cells(queues),
            in_flight,
            by_master: cells(masters),
        }
    }
}

/// The most masters whose groups leave together; a cluster's further masters' groups leave by
/// slot.
const MASTER_LANES: usize = 256;

/// Calls out at once to one master (each carrying up to `MAX_GROUPS_PER_CALL` groups; the
/// second only while a whole call waits, see `batcher`).
const MASTER_IN_FLIGHT: usize = 2;

/// After a failed read of the cluster's masters, how long before the next.
const MASTERS_RETRY: Duration = Duration::from_secs(1);

/// A batcher whose calls go through `pool` to `lane`, `in_flight` at once.
fn batcher_of(
    pool: &Arc<Pool>,
    limiter: &Arc<Limiter>,
    in_flight: usize,
    lane: Lane,
) -> (Batcher, Worker) {
    let (pool, limiter) = (pool.clone(), limiter.clone());
    let send: batcher::SendCall = Box::new(move |groups: Vec<Group>| {
        let (pool, limiter) = (pool.clone(), limiter.clone());
        Box::pin(async move { pool.invoke_all(&limiter, &groups, lane).await })
    });
    Batcher::pair(send, in_flight, MAX_GROUPS_PER_CALL)
}

/// The most groups one call carries: a call of 64 fixed-window groups holds Redis ~0.2 ms.
const MAX_GROUPS_PER_CALL: usize = 64;

/// One check's arguments as `batch.lua` reads them: a head (algorithm + 8 × kind + 32 × how
/// many optional fields follow + 256 for a calendar limit), hits, requests, period, then burst,
/// tick, cap and until with the trailing zeros left off (burst and tick are sent only to the
/// algorithms that read them), then a calendar limit's windows around `node_now_us`: Redis picks
/// the one its own clock is in, so decisions stay on Redis `TIME`.
fn push_check(args: &mut Vec<u64>, kind: u64, check: &Check<'_>, node_now_us: u64) {
    let limit = &check.limit;
    let algorithm = limit.algorithm;
    let optional = [
        if algorithm.has_burst() {
            limit.burst
        } else {
            0
        },
        if algorithm.has_ticks() {
            limit.tick_us
        } else {
            0
        },
        limit.overdraft_cap(),
        check.until_us,
    ];
    let extra = optional
        .iter()
        .rposition(|&v| v != 0)
        .map_or(0, |last| last + 1);
    const {
        assert!(
            Algorithm::MAX_ID < 8,
            "batch.lua reads the algorithm from the head's low 3 bits"
        )
    };
    // Past the calendar's range (the year 9999) the limit falls back to the aligned period,
    // as `Limit::window_at` does.
    let windows = limit.calendar.and_then(|c| c.around(node_now_us).ok());
    let head = u64::from(algorithm.id())
        + 8 * kind
        + 32 * extra as u64
        + if windows.is_some() { 256 } else { 0 };
    args.extend([head, check.hits, limit.requests, limit.period_us]);
    args.extend_from_slice(&optional[..extra]);
    if let Some(windows) = windows {
        args.extend(windows);
    }
}

/// What one script run answered.
struct GroupReply {
    allowed: bool,
    /// Redis's clock when it decided.
    now_us: u64,
    verdicts: Vec<Verdict>,
}

/// A group's answer (4 integers per check, counted by `script::answers`) as verdicts; the group
/// was allowed when each of its enforced checks was.
fn group_reply(
    (now_us, values): (i64, Vec<i64>),
    checks: &[Check<'_>],
    indices: &[usize],
) -> GroupReply {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let verdicts: Vec<Verdict> = values
        .chunks_exact(4)
        .map(|v| Verdict {
            allowed: v[0] == 1,
            remaining: n(v[1]),
            reset_after_us: n(v[2]),
            retry_after_us: n(v[3]),
        })
        .collect();
    let allowed = indices
        .iter()
        .zip(&verdicts)
        .all(|(&i, v)| v.allowed || checks[i].kind != CheckKind::Enforce);
    GroupReply {
        allowed,
        now_us: n(now_us),
        verdicts,
    }
}

/// Whether a connection to Redis has succeeded since the start, for the upkeep's report.
#[derive(Clone)]
pub struct Reached(Arc<Pool>);

impl Reached {
    pub fn get(&self) -> bool {
        self.0.reached.load(Ordering::Acquire)
    }
}

impl Store for RedisStore {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let now = self.pinned.as_ref().map(|c| c.now_micros());
        // Only calendar limits read it (to send their windows around it).
        let node_now_us = if checks.iter().any(|c| c.limit.calendar.is_some()) {
            self.node_clock.now_micros()
        } else {
            0
        };
        // Standalone: one group for everything. Cluster: one per slot. Each with its keys.
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut group_keys: Vec<Vec<Vec<u8>>> = Vec::new();
        for (i, check) in checks.iter().enumerate() {
            let (key, slot) = self.redis_key(check);
            let slot = match self.pool.conns {
                Connections::Standalone { .. } => 0,
                Connections::Cluster { .. } => slot,
            };
            match groups.iter().position(|(s, _)| *s == slot) {
                Some(g) => {
                    groups[g].1.push(i);
                    group_keys[g].push(key);
                }
                None => {
                    groups.push((slot, vec![i]));
                    group_keys.push(vec![key]);
                }
            }
        }
        let results = if groups.len() == 1 {
            // Standalone, or one slot: the one group, without join_all's bookkeeping.
            let (slot, members) = &groups[0];
            let keys = group_keys.pop().unwrap_or_default();
            vec![
                self.run_group(*slot, keys, checks, members, now, node_now_us)
                    .await,
            ]
        } else {
            futures_util::future::join_all(groups.iter().zip(group_keys).map(
                |((slot, members), keys)| {
                    self.run_group(*slot, keys, checks, members, now, node_now_us)
                },
            ))
            .await
        };

        let mut verdicts = vec![Verdict::default(); checks.len()];
        let mut backend_now_us = vec![0; checks.len()];
        let mut allowed = true;
        let mut failed = false;
        for ((_, members), result) in groups.iter().zip(&results) {
            match result {
                Ok(reply) => {
                    allowed &= reply.allowed;
                    for (&i, v) in members.iter().zip(&reply.verdicts) {
                        verdicts[i] = *v;
                        backend_now_us[i] = reply.now_us;
                    }
                }
                Err(_) => failed = true,
            }
        }
        if failed || !allowed {
            // Give back what the allowed groups consumed, then look again at the group's own
            // refunds (a zero refund reports the state), so they report the final state.
            let consumed_groups = groups
                .iter()
                .zip(&results)
                .filter(|(_, r)| matches!(r, Ok(reply) if reply.allowed))
                .map(|((slot, members), _)| (*slot, members));
            for (slot, members) in consumed_groups {
                let rollback = Rollback::of(checks, &verdicts, members.iter().copied());
                if rollback.is_empty() {
                    continue;
                }
                let refunds: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&i| checks[i].kind == CheckKind::Refund)
                    .collect();
                let undone = rollback.indices().len();
                let sent: Vec<Check<'_>> = rollback
                    .refunds(checks)
                    .chain(refunds.iter().map(|&i| checks[i].again()))
                    .collect();
                let sent_keys: Vec<Vec<u8>> = sent.iter().map(|c| self.redis_key(c).0).collect();
                let all: Vec<usize> = (0..sent.len()).collect();
                match self
                    .run_group(slot, sent_keys, &sent, &all, now, node_now_us)
                    .await
                {
                    Ok(reply) => {
                        for (&i, v) in refunds.iter().zip(&reply.verdicts[undone..]) {
                            verdicts[i] = *v;
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not refund a rolled-back group"),
                }
                rollback.report(checks, &mut verdicts);
            }
        }
        // Any group's error means Redis failed the request; the last one is reported.
        if let Some(e) = results.into_iter().filter_map(Result::err).last() {
            return Err(e);
        }
        Ok(Outcome {
            allowed,
            verdicts,
            by_policy: false,
            backend_now_us,
        })
    }
}

/// The Redis key of a counter and its cluster slot: `prefix{tag}key`, and for a fixed window
/// `prefix{tag}key#` (a hash of its window's count, see fixed_window.lua; the form before it
/// was a string under `prefix{tag}key`, which a rollout's old nodes still write).
pub fn redis_key(prefix: &[u8], tag: &[u8], key: &[u8], algorithm: Algorithm) -> (Vec<u8>, u16) {
    // 8 hex digits choose the slot well enough; a shared tag only co-locates keys (the encoded
    // key after it keeps them distinct), and every byte counts per key in Redis.
    let h = fnv1a(tag);
    let h = (h ^ (h >> 32)) as u32;
    let tag: [u8; 8] =
        std::array::from_fn(|i| b"0123456789abcdef"[(h >> (28 - 4 * i)) as usize & 0xf]);
    let mut out = Vec::with_capacity(prefix.len() + 10 + key.len());
    out.extend_from_slice(prefix);
    out.push(b'{');
    out.extend_from_slice(&tag);
    out.push(b'}');
    out.extend_from_slice(key);
    if algorithm == Algorithm::FixedWindow {
        out.push(b'#');
    }
    (out, crc16(&tag) % 16_384)
}

/// FNV-1a, 64 bits: a fixed hash (every node must compute the same tag).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Redis Cluster's key slot hash (CRC16-XMODEM), a byte at a time from a table: every request's
/// key is hashed, and bit by bit it cost ~350 instructions a key.
fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// CRC16-XMODEM of each byte value (polynomial 0x1021), made at compile time.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// Hides the password of any `scheme://user:password@host` in a message.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("://") {
        let (head, tail) = rest.split_at(start + 3);
        out.push_str(head);
        let end = tail.find(['/', ' ', ',', '"']).unwrap_or(tail.len());
        match tail[..end].rfind('@') {
            Some(at) => {
                let credentials = &tail[..at];
                match credentials.find(':') {
                    Some(colon) => {
                        out.push_str(&credentials[..colon]);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                out.push_str(&tail[at..end]);
            }
            None => out.push_str(&tail[..end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_redis() {
        // Redis's own test vector: CLUSTER KEYSLOT 123456789 is 12739.
        assert_eq!(crc16(b"123456789") % 16_384, 12_739);
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("cannot connect to redis://user:s3cret@10.0.0.1:6379/0: refused"),
            "cannot connect to redis://user:***@10.0.0.1:6379/0: refused"
        );
        assert_eq!(
            redact("redis://:pw@h:1,redis://h2:2"),
            "redis://:***@h:1,redis://h2:2"
        );
        assert_eq!(redact("rediss://token@h"), "rediss://***@h");
        assert_eq!(redact("no url here"), "no url here");
    }
}
