//! A Redis Cluster's masters and the slots each serves, as `CLUSTER SLOTS` last said: so that
//! the groups of many slots on one master can leave in one call (see `Queues` in the parent).
//!
//! Why it may be stale and still right: the map only chooses which groups travel together. A
//! call to a master carries its keys undeclared, and the master checks each access against the
//! slots it serves at that moment, refusing a key it does not hold (a slot moved away, or one
//! still migrating whose key is gone already). A refused group goes again on its slot, where the
//! client follows MOVED and ASK. So a move costs a round trip and a refresh of this map, never a
//! count on the wrong node. (What a group refused part way had counted: docs/redis.md, "Redis
//! and Redis Cluster". The Redis client keeps its own map to itself.)

use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisFuture, Value};

/// Slots in a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// No master is known for the slot.
const NONE: u16 = u16::MAX;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MastersError {
    #[error("CLUSTER SLOTS answered {0}")]
    Unexpected(String),
}

/// Each slot's master, by number, and each master's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Masters {
    of_slot: Box<[u16]>,
    addresses: Vec<(String, u16)>,
}

impl Masters {
    /// The map `CLUSTER SLOTS` describes: per range, its start, its end and its master's
    /// `[host, port, ...]` (then its replicas, which calls here never go to).
    pub fn parse(reply: &Value) -> Result<Self, MastersError> {
        let unexpected = |what: &Value| MastersError::Unexpected(format!("{what:?}"));
        let Value::Array(ranges) = reply else {
            return Err(unexpected(reply));
        };
        let mut of_slot = vec![NONE; SLOTS].into_boxed_slice();
        let mut addresses: Vec<(String, u16)> = Vec::new();
        for range in ranges {
            let Value::Array(fields) = range else {
                return Err(unexpected(range));
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(unexpected(range));
            };
            let host = match master.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => return Err(unexpected(range)),
            };
            let port = match master.get(1) {
                Some(Value::Int(port)) => u16::try_from(*port).map_err(|_| unexpected(range))?,
                _ => return Err(unexpected(range)),
            };
            let (start, end) = match (usize::try_from(*start), usize::try_from(*end)) {
                (Ok(s), Ok(e)) if s <= e && e < SLOTS => (s, e),
                _ => return Err(unexpected(range)),
            };
            let number = match addresses.iter().position(|(h, p)| *h == host && *p == port) {
                Some(n) => n,
                None => {
                    addresses.push((host, port));
                    addresses.len() - 1
                }
            };
            let number = u16::try_from(number).map_err(|_| unexpected(range))?;
            of_slot[start..=end].fill(number);
        }
        Ok(Self { of_slot, addresses })
    }

    /// The number of the master serving `slot`, if one is known.
    pub fn of(&self, slot: u16) -> Option<u16> {
        self.of_slot
            .get(usize::from(slot))
            .copied()
            .filter(|&n| n != NONE)
    }

    /// Master `number`'s address.
    pub fn address(&self, number: u16) -> Option<&(String, u16)> {
        self.addresses.get(usize::from(number))
    }
}

/// A cluster connection whose every command goes to one node, by address: no redirection is
/// followed, so the node that refuses a key says so (see the module's doc).
pub struct ToNode<'a> {
    pub conn: &'a mut ClusterConnection,
    pub host: String,
    pub port: u16,
}

impl ConnectionLike for ToNode<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        });
        Box::pin(self.conn.route_command(cmd.clone(), routing))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(host.into()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
            Value::Array(vec![
                Value::BulkString(b"replica".to_vec()),
                Value::Int(7000),
            ]),
        ])
    }

    #[test]
    fn each_slot_has_its_ranges_master() {
        let reply = Value::Array(vec![
            range(0, 5460, "10.0.0.1", 6379),
            range(10923, 16383, "10.0.0.3", 6379),
            range(5461, 10922, "10.0.0.2", 6380),
        ]);
        let m = Masters::parse(&reply).unwrap();
        let at = |slot| m.address(m.of(slot).unwrap()).unwrap().clone();
        assert_eq!(at(0), ("10.0.0.1".into(), 6379));
        assert_eq!(at(5460), ("10.0.0.1".into(), 6379));
        assert_eq!(at(5461), ("10.0.0.2".into(), 6380));
        assert_eq!(at(16383), ("10.0.0.3".into(), 6379));
        assert_ne!(m.of(0), m.of(16383));
    }

    #[test]
    fn slots_no_range_covers_have_no_master() {
        let m = Masters::parse(&Value::Array(vec![range(0, 10, "h", 1)])).unwrap();
        assert!(m.of(10).is_some());
        assert_eq!(m.of(11), None);
        assert_eq!(m.of(u16::MAX), None);
    }

    #[test]
    fn a_reply_of_another_shape_is_an_error() {
        for reply in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1)])]),
            Value::Array(vec![range(5, 4, "h", 1)]),
            Value::Array(vec![range(0, 16384, "h", 1)]),
            Value::Array(vec![range(0, 1, "h", 70_000)]),
        ] {
            assert!(Masters::parse(&reply).is_err(), "{reply:?}");
        }
    }
}
