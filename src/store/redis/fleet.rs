//! The fleet heartbeat: how `failure_mode: local` knows how many nodes share a limit.

use std::sync::Arc;
use std::time::Duration;

use super::pool::{Connections, Pool};
use crate::store::StoreError;

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
    pub(super) fn new(pool: Arc<Pool>, key: Vec<u8>, member: String, timeout: Duration) -> Self {
        Self {
            pool,
            key,
            member,
            timeout,
        }
    }

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

impl FleetBeat {
    /// Takes this node out of the fleet set, so the others' shares grow at their next beat
    /// rather than when this node's heartbeat would expire. On a connection already made.
    pub async fn leave(&self) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(&self.key).arg(&self.member);
        let conn = match &self.pool.conns {
            Connections::Standalone { conns, .. } => conns
                .iter()
                .find_map(|c| c.load_full())
                .map(|c| Conn::Standalone((*c).clone())),
            Connections::Cluster { conn, .. } => {
                conn.load_full().map(|c| Conn::Cluster((*c).clone()))
            }
        };
        let call = async {
            match conn {
                Some(Conn::Standalone(mut c)) => cmd.query_async::<()>(&mut c).await,
                Some(Conn::Cluster(mut c)) => cmd.query_async::<()>(&mut c).await,
                None => Ok(()),
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::unavailable(e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}

/// A connection already made, of either kind.
enum Conn {
    Standalone(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// Runs the heartbeat's pipeline on `conn`: the live nodes its last command counted.
async fn live_count(
    pipe: &redis::Pipeline,
    mut conn: impl redis::aio::ConnectionLike,
) -> redis::RedisResult<Option<u64>> {
    let (live,): (u64,) = pipe.query_async(&mut conn).await?;
    Ok(Some(live))
}
