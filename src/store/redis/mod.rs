//! Redis and Redis Cluster: one Lua script per request per cluster slot, all or nothing.
//!
//! Each check's key is `prefix{tag}encoded-key`: the tag is 8 hex digits of a hash of the
//! descriptor (domain and matched entries), so every tier of one descriptor lands in one slot
//! and is decided by one script, and no byte of a descriptor value can move a key or make two
//! descriptors collide (the encoded key is length-prefixed). Checks are grouped by slot; the
//! groups run concurrently, one EVALSHA each (with a NOSCRIPT fallback). When one group denies,
//! the groups that consumed are refunded, so a denied request consumes nothing in the end; a
//! concurrent request may see those hits for the length of one round trip (under-admission,
//! never over-admission).

mod script;

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::{Check, CheckKind, Outcome, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::Verdict;

pub use script::LIMITER_SCRIPT;

/// Where the counters live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// `redis://[user:pass@]host:port[/db]` (or `rediss://`).
    Standalone(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub topology: Topology,
    /// Standalone: how many multiplexed connections requests are spread over.
    pub pool_size: usize,
    /// Per call, connection included.
    pub timeout: Duration,
    pub key_prefix: String,
}

/// Connections, made on first use (so sluice starts while Redis is down) and dropped when one
/// fails at the connection level (so the next call connects afresh: Redis restarted means every
/// connection is dead). Each is multiplexed: concurrent calls share it without waiting, so no
/// checkout — and no health-check round trip per call, as a generic pool adds — is needed.
enum Connections {
    Standalone {
        client: redis::Client,
        config: ConnectionManagerConfig,
        conns: Vec<ArcSwapOption<ConnectionManager>>,
        next: AtomicUsize,
    },
    Cluster {
        client: ClusterClient,
        conn: ArcSwapOption<ClusterConnection>,
    },
}

impl Connections {
    /// Forgets every connection after a connection-level failure.
    fn reset(&self) {
        match self {
            Connections::Standalone { conns, .. } => conns.iter().for_each(|c| c.store(None)),
            Connections::Cluster { conn, .. } => conn.store(None),
        }
    }

    async fn invoke(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> redis::RedisResult<Vec<i64>> {
        match self {
            Connections::Standalone {
                client,
                config,
                conns,
                next,
            } => {
                let slot = &conns[next.fetch_add(1, Ordering::Relaxed) % conns.len()];
                let mut conn = match slot.load_full() {
                    Some(conn) => (*conn).clone(),
                    None => {
                        let conn =
                            ConnectionManager::new_with_config(client.clone(), config.clone())
                                .await?;
                        slot.store(Some(Arc::new(conn.clone())));
                        conn
                    }
                };
                invocation.invoke_async(&mut conn).await
            }
            Connections::Cluster { client, conn } => {
                let mut conn = match conn.load_full() {
                    Some(c) => (*c).clone(),
                    None => {
                        let c = client.get_async_connection().await?;
                        conn.store(Some(Arc::new(c.clone())));
                        c
                    }
                };
                invocation.invoke_async(&mut conn).await
            }
        }
    }
}

pub struct RedisStore {
    conns: Connections,
    script: redis::Script,
    prefix: Vec<u8>,
    timeout: Duration,
    /// Tests only: a time for the script instead of Redis `TIME`.
    pinned: Option<Arc<dyn Clock>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisConfigError {
    #[error(
        "--redis-key-prefix must not contain '{{' or '}}' (they would change the key's cluster slot)"
    )]
    BracesInPrefix,
    #[error("invalid Redis URL: {0}")]
    Url(String),
}

impl RedisStore {
    /// Connections are made on first use, so sluice starts while Redis is down.
    pub fn new(options: &RedisOptions) -> Result<Self, RedisConfigError> {
        // rediss:// needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if options.key_prefix.contains(['{', '}']) {
            return Err(RedisConfigError::BracesInPrefix);
        }
        let url_error = |e: redis::RedisError| RedisConfigError::Url(redact(&e.to_string()));
        let conns = match &options.topology {
            Topology::Standalone(url) => Connections::Standalone {
                client: redis::Client::open(url.as_str()).map_err(url_error)?,
                config: ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(options.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(std::time::Duration::from_millis(100)),
                conns: (0..options.pool_size.max(1))
                    .map(|_| ArcSwapOption::empty())
                    .collect(),
                next: AtomicUsize::new(0),
            },
            Topology::Cluster(urls) => Connections::Cluster {
                client: ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(options.timeout)
                    .response_timeout(options.timeout)
                    .build()
                    .map_err(url_error)?,
                conn: ArcSwapOption::empty(),
            },
        };
        Ok(Self {
            conns,
            script: redis::Script::new(LIMITER_SCRIPT),
            prefix: options.key_prefix.as_bytes().to_vec(),
            timeout: options.timeout,
            pinned: None,
        })
    }

    /// Tests only: the scripts use this clock instead of Redis `TIME`, so a run can be replayed
    /// against the memory store at the same times.
    pub fn with_pinned_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.pinned = Some(clock);
        self
    }

    fn redis_key(&self, check: &Check<'_>) -> (Vec<u8>, u16) {
        redis_key(&self.prefix, check.tag, check.key)
    }

    /// Runs the script for the checks `indices` (one slot) and returns
    /// (allowed, one verdict per index).
    async fn run_group(
        &self,
        keys: &[Vec<u8>],
        checks: &[Check<'_>],
        indices: &[usize],
        now: &str,
        refund_all: bool,
    ) -> Result<GroupReply, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        invocation.arg(now);
        for &i in indices {
            let c = &checks[i];
            let kind = match (refund_all, c.kind) {
                (true, _) | (false, CheckKind::Refund) => 3,
                (false, CheckKind::Enforce) => 1,
                (false, CheckKind::Shadow) => 2,
            };
            invocation
                .key(&keys[i][..])
                .arg(kind)
                .arg(c.limit.algorithm.id())
                .arg(c.hits)
                .arg(c.limit.requests)
                .arg(c.limit.period_us)
                .arg(c.limit.burst)
                .arg(c.limit.tick_us)
                .arg(c.until_us);
        }
        let call = async {
            let reply = self.conns.invoke(&invocation).await.map_err(|e| {
                if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                    self.conns.reset();
                }
                unavailable(e)
            })?;
            parse_reply(&reply, indices.len())
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Unavailable(format!(
                "Redis did not answer within {:?}",
                self.timeout
            ))),
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(redact(&e.to_string()))
}

/// What one script run answered.
struct GroupReply {
    allowed: bool,
    /// Redis's clock when it decided.
    now_us: u64,
    verdicts: Vec<Verdict>,
}

fn parse_reply(reply: &[i64], checks: usize) -> Result<GroupReply, StoreError> {
    if reply.len() != 2 + 4 * checks {
        return Err(StoreError::Unavailable(format!(
            "unexpected script reply of {} values for {checks} checks",
            reply.len()
        )));
    }
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let verdicts = reply[2..]
        .chunks_exact(4)
        .map(|v| Verdict {
            allowed: v[0] == 1,
            remaining: n(v[1]),
            reset_after_us: n(v[2]),
            retry_after_us: n(v[3]),
        })
        .collect();
    Ok(GroupReply {
        allowed: reply[0] == 1,
        now_us: n(reply[1]),
        verdicts,
    })
}

impl Store for RedisStore {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let now = self
            .pinned
            .as_ref()
            .map(|c| c.now_micros().to_string())
            .unwrap_or_default();
        let (keys, slots): (Vec<Vec<u8>>, Vec<u16>) =
            checks.iter().map(|c| self.redis_key(c)).unzip();
        // Standalone: one script for everything. Cluster: one per slot.
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            let slot = match self.conns {
                Connections::Standalone { .. } => 0,
                Connections::Cluster { .. } => slot,
            };
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let results = futures_util::future::join_all(
            groups
                .iter()
                .map(|(_, members)| self.run_group(&keys, checks, members, &now, false)),
        )
        .await;

        let mut verdicts = vec![Verdict::default(); checks.len()];
        let mut backend_now_us = vec![0; checks.len()];
        let mut allowed = true;
        let mut failure = None;
        let mut consumed_groups = Vec::new();
        for ((_, members), result) in groups.iter().zip(results) {
            match result {
                Ok(reply) => {
                    allowed &= reply.allowed;
                    if reply.allowed {
                        consumed_groups.push(members);
                    }
                    for (&i, v) in members.iter().zip(reply.verdicts) {
                        verdicts[i] = v;
                        backend_now_us[i] = reply.now_us;
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_some() || !allowed {
            // Give back what the allowed groups consumed, then look again at the group's own
            // refunds (a zero refund reports the state), so they report the final state.
            for members in consumed_groups {
                let consumed: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&i| checks[i].kind != CheckKind::Refund && verdicts[i].allowed)
                    .collect();
                if consumed.is_empty() {
                    continue;
                }
                let refunds = members
                    .iter()
                    .copied()
                    .filter(|&i| checks[i].kind == CheckKind::Refund);
                let rollback: Vec<Check<'_>> = consumed
                    .iter()
                    .map(|&i| checks[i])
                    .chain(refunds.clone().map(|i| Check {
                        hits: 0,
                        ..checks[i]
                    }))
                    .collect();
                let rollback_keys: Vec<Vec<u8>> = consumed
                    .iter()
                    .copied()
                    .chain(refunds.clone())
                    .map(|i| keys[i].clone())
                    .collect();
                let all: Vec<usize> = (0..rollback.len()).collect();
                match self
                    .run_group(&rollback_keys, &rollback, &all, &now, true)
                    .await
                {
                    Ok(reply) => {
                        for (i, v) in refunds.zip(&reply.verdicts[consumed.len()..]) {
                            verdicts[i] = *v;
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not refund a rolled-back group"),
                }
                for i in consumed {
                    verdicts[i] = verdicts[i].unconsumed(checks[i].hits);
                }
            }
        }
        if let Some(e) = failure {
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

/// The Redis key of a counter and its cluster slot: `prefix{tag}key`.
pub fn redis_key(prefix: &[u8], tag: &[u8], key: &[u8]) -> (Vec<u8>, u16) {
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

/// Redis Cluster's key slot hash (CRC16-XMODEM).
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

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
