//! How a Redis store is configured: where the counters live and how calls to them are bounded,
//! and what a wrong setting is refused with. A URL may carry a password; [`redact`] hides it
//! wherever one is logged.

use std::time::Duration;

use super::sentinel;

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
    /// Reads a fixed window's count also from the form builds before December 2026 wrote (a
    /// string `start_us count` under the key without its `#`), on the window's first hit: for a
    /// rolling upgrade from such a build, so what its nodes counted in the current windows is
    /// kept. Costs Redis a read on every window's first hit.
    pub read_string_windows: bool,
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
