//! The connections to Redis and the lanes calls leave by: a standalone server's (or Sentinel's
//! master's) multiplexed connections, or a cluster's one connection with its masters' map; a
//! queue (`batcher`) per lane; what a failed call means for its groups.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

pub(super) use super::batcher::CallFailure;
use super::batcher::{self, Batcher, GroupOutcome, Worker};
use super::masters::{Masters, SLOTS, ToNode};
use super::options::{RedisConfigError, RedisOptions, Topology, redact};
use super::script::{self, Group, GroupAnswer, Keys, Limiter};
use super::sentinel;

/// A Redis failure, its message with any password hidden.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RedisFailure(pub(super) String);

impl RedisFailure {
    pub(super) fn of(e: &redis::RedisError) -> Self {
        RedisFailure(redact(&e.to_string()))
    }
}

/// The pool, the limiter's code and the queues: where a group's call leaves from.
pub(super) struct Lanes {
    pool: Arc<Pool>,
    limiter: Arc<Limiter>,
    queues: Queues,
}

impl Lanes {
    /// No connection is made here, so sluice starts while Redis is down.
    pub(super) fn new(options: &RedisOptions) -> Result<Self, RedisConfigError> {
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
        let limiter = Arc::new(Limiter::new(options.read_string_windows));
        let queues = match &pool.conns {
            // One call in flight per connection, each carrying what queued meanwhile.
            Connections::Standalone { conns, .. } => Queues::new(1, conns.len(), 0),
            Connections::Cluster { .. } => Queues::new(SLOTS, 1, MASTER_LANES),
        };
        Ok(Self {
            pool,
            limiter,
            queues,
        })
    }

    pub(super) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Whether every group goes in one call (a standalone server), or by cluster slot.
    pub(super) fn by_slot(&self) -> bool {
        matches!(self.pool.conns, Connections::Cluster { .. })
    }

    /// A group of `slot` in the next call of its lane: its master's where the cluster's
    /// masters are known, else its slot's; `Timeout` by `deadline` (both tries in all).
    pub(super) async fn call(&self, slot: u16, group: Group, deadline: Instant) -> GroupOutcome {
        match self.lane(slot) {
            lane @ Lane::Slot(_) => self.batcher(lane).call(group, deadline).await,
            lane @ Lane::Master(_) => {
                let again = group.clone();
                let answer = self.batcher(lane).call(group, deadline).await;
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
                    self.batcher(Lane::Slot(slot)).call(again, deadline).await
                } else {
                    answer
                }
            }
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

/// Connections, made ahead in the background (so sluice starts while Redis is down, and no
/// request waits for a handshake) and dropped when one fails at the connection level (so they
/// are made afresh: Redis restarted means every connection is dead). Each is multiplexed:
/// concurrent calls share it without waiting, so no checkout — and no health-check round trip
/// per call, as a generic pool adds — is needed.
pub(super) struct Pool {
    pub(super) conns: Connections,
    /// A background task is making the missing connections.
    filling: AtomicBool,
    /// A connection has been made at least once (until then the node is not healthy, as the
    /// reference service is not before it reaches Redis).
    pub(super) reached: AtomicBool,
    connect_timeout: Duration,
}

pub(super) enum Connections {
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
pub(super) enum Target {
    Server(redis::Client),
    /// The master the sentinels name at the time of connecting.
    Sentinel(sentinel::Sentinels),
}

impl Pool {
    /// Forgets every connection after a connection-level failure, and makes new ones in the
    /// background.
    pub(super) fn reset(self: &Arc<Self>) {
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
    pub(super) fn with_masters<T>(self: &Arc<Self>, look: impl FnOnce(&Masters) -> T) -> Option<T> {
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
    pub(super) fn fill_in_background(self: &Arc<Self>) {
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

fn connect_timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to Redis timed out",
    ))
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
        let span = crate::trace::redis_call(
            groups.iter().map(|g| g.trace.as_deref().cloned()),
            groups.len(),
        );
        Box::pin(async move { pool.invoke_all(&limiter, &groups, lane).await }.instrument(span))
    });
    Batcher::pair(send, in_flight, MAX_GROUPS_PER_CALL)
}

/// The most groups one call carries: a call of 64 fixed-window groups holds Redis ~0.2 ms.
const MAX_GROUPS_PER_CALL: usize = 64;

/// Whether a connection to Redis has succeeded since the start, for the upkeep's report.
#[derive(Clone)]
pub struct Reached(Arc<Pool>);

impl Reached {
    pub(super) fn of(pool: &Arc<Pool>) -> Self {
        Self(pool.clone())
    }

    pub fn get(&self) -> bool {
        self.0.reached.load(Ordering::Acquire)
    }
}
