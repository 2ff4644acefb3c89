//! Redis Sentinel: the master is wherever the sentinels say it is now. Every connection first
//! asks a sentinel for the master's address (`SENTINEL get-master-addr-by-name`), then asks
//! that server itself (`ROLE`), because right after a failover a sentinel may still name the
//! old master, now a replica. When the master changes, writes to the old one fail (a refused
//! connection, or `READONLY` from a demoted master), the pool drops its connections, and the
//! next ones are located afresh.
//!
//! The URL: `redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]`
//! (`rediss+sentinel://` reaches the master over TLS). The credentials are the master's; the
//! sentinels are asked without any.

use std::time::Duration;

use redis::{AsyncConnectionConfig, Client, RedisError, RedisResult};

/// What is wrong with a `redis+sentinel://` URL.
#[derive(Debug, thiserror::Error)]
pub enum SentinelUrlError {
    #[error("a sentinel URL starts with redis+sentinel:// or rediss+sentinel://")]
    Scheme,
    #[error(
        "a sentinel URL names the master after the hosts: redis+sentinel://host:port/master-name"
    )]
    NoMaster,
    #[error("'{0}' is not a database number")]
    Database(String),
    #[error("the sentinel URL names no sentinel")]
    NoSentinel,
    #[error("sentinel '{host}': {reason}")]
    Host { host: String, reason: String },
}

/// How to find the master.
#[derive(Debug)]
pub struct Sentinels {
    sentinels: Vec<Client>,
    master: String,
    /// `redis` or `rediss`.
    scheme: &'static str,
    /// `user:password@`, or empty.
    auth: String,
    /// `/db`, or empty.
    db: String,
}

/// Whether `url` names sentinels rather than a server.
pub fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

impl Sentinels {
    pub fn parse(url: &str) -> Result<Self, SentinelUrlError> {
        let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            ("redis", rest)
        } else if let Some(rest) = url.strip_prefix("rediss+sentinel://") {
            ("rediss", rest)
        } else {
            return Err(SentinelUrlError::Scheme);
        };
        let (hosts, path) = rest.split_once('/').ok_or(SentinelUrlError::NoMaster)?;
        let (auth, hosts) = match hosts.rsplit_once('@') {
            Some((auth, hosts)) => (format!("{auth}@"), hosts),
            None => (String::new(), hosts),
        };
        let (master, db) = match path.split_once('/') {
            Some((master, db)) => (master, db),
            None => (path, ""),
        };
        if master.is_empty() {
            return Err(SentinelUrlError::NoMaster);
        }
        if !db.is_empty() && db.parse::<u32>().is_err() {
            return Err(SentinelUrlError::Database(db.to_owned()));
        }
        let sentinels = hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .map(|h| {
                Client::open(format!("redis://{h}")).map_err(|e| SentinelUrlError::Host {
                    host: h.to_owned(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if sentinels.is_empty() {
            return Err(SentinelUrlError::NoSentinel);
        }
        Ok(Self {
            sentinels,
            master: master.to_owned(),
            scheme,
            auth,
            db: if db.is_empty() {
                String::new()
            } else {
                format!("/{db}")
            },
        })
    }

    /// A client for the master now, from the first sentinel that knows it; each step is
    /// bounded by `timeout`.
    pub async fn locate(&self, timeout: Duration) -> RedisResult<Client> {
        let mut last = None;
        for sentinel in &self.sentinels {
            match self.ask(sentinel, timeout).await {
                Ok(client) => return Ok(client),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| failure("no sentinel to ask".into())))
    }

    async fn ask(&self, sentinel: &Client, timeout: Duration) -> RedisResult<Client> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut conn = sentinel
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master)
            .query_async(&mut conn)
            .await?;
        let (host, port) =
            addr.ok_or_else(|| failure(format!("no master named '{}'", self.master)))?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let url = format!("{}://{}{host}:{port}{}", self.scheme, self.auth, self.db);
        let client = Client::open(url)?;
        let mut master = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut master).await?;
        match role.first() {
            Some(redis::Value::BulkString(r)) if r == b"master" => Ok(client),
            _ => Err(failure(format!(
                "{host}:{port}, named master of '{}', is not one (yet)",
                self.master
            ))),
        }
    }
}

/// A failure that makes the pool try again later.
fn failure(message: String) -> RedisError {
    RedisError::from(std::io::Error::other(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_master_auth_and_database() {
        let s = Sentinels::parse("redis+sentinel://:pw@a:26379, b:26380/mymaster/2").unwrap();
        assert_eq!(s.sentinels.len(), 2);
        assert_eq!((s.master.as_str(), s.scheme), ("mymaster", "redis"));
        assert_eq!((s.auth.as_str(), s.db.as_str()), (":pw@", "/2"));
        let s = Sentinels::parse("rediss+sentinel://a:1/m").unwrap();
        assert_eq!(
            (s.scheme, s.db.as_str(), s.auth.as_str()),
            ("rediss", "", "")
        );
        let err = |url| Sentinels::parse(url).unwrap_err();
        assert!(matches!(err("redis://a:1/m"), SentinelUrlError::Scheme));
        assert!(matches!(
            err("redis+sentinel://a:1"),
            SentinelUrlError::NoMaster
        ));
        assert!(matches!(
            err("redis+sentinel://a:1/"),
            SentinelUrlError::NoMaster
        ));
        assert!(matches!(
            err("redis+sentinel:///m"),
            SentinelUrlError::NoSentinel
        ));
        assert!(matches!(
            err("redis+sentinel://a:1/m/x"),
            SentinelUrlError::Database(_)
        ));
    }
}
