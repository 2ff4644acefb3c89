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
    /// None while no connection is made yet.
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
        let live: Option<(u64,)> = self.on_made_connection(&pipe).await?;
        Ok(live.map(|(n,)| n))
    }

    /// Takes this node out of the fleet set, so the others' shares grow at their next beat
    /// rather than when this node's heartbeat would expire.
    pub async fn leave(&self) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZREM").arg(&self.key).arg(&self.member).ignore();
        self.on_made_connection::<()>(&pipe).await.map(drop)
    }

    /// Runs `pipe` on a connection already made, within the timeout: a beat or a leave never
    /// waits on connecting (requests make the connections). None while none is made.
    async fn on_made_connection<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<Option<T>, StoreError> {
        let call = async {
            match &self.pool.conns {
                Connections::Standalone { conns, .. } => {
                    match conns.iter().find_map(|c| c.load_full()) {
                        Some(conn) => pipe.query_async(&mut (*conn).clone()).await.map(Some),
                        None => Ok(None),
                    }
                }
                Connections::Cluster { conn, .. } => match conn.load_full() {
                    Some(conn) => pipe.query_async(&mut (*conn).clone()).await.map(Some),
                    None => Ok(None),
                },
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(StoreError::unavailable(e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}
