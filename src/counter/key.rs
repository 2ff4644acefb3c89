//! Counter identities. A key is an unambiguous encoding of (domain, each matched entry's key and
//! value — or pattern, with share_threshold —, the limit's algorithm, unit and multiplier).
//! Every string is netstring-style length-prefixed (`5:hello`), so no two different descriptors
//! encode alike whatever bytes their values hold, and a key stays readable in `redis-cli`:
//! `4:edgev14:remote_address8:10.0.0.1#11*1` (fixed window, per second, × 1). The limit's numbers are not part of the key, so
//! a changed limit keeps its counter; a changed algorithm or unit starts a new one. A calendar
//! limit's key ends in its zone (`#14*1@13:Europe/Berlin`): its windows are not the aligned
//! ones, nor another zone's.

use super::{KeyPart, Unit};
use crate::limiter::Algorithm;

const TAG_VALUE: u8 = b'v';
const TAG_PATTERN: u8 = b'p';
const TAG_LIMIT: u8 = b'#';
const TAG_CALENDAR: u8 = b'@';

/// A reusable buffer holding one request's keys back to back.
#[derive(Debug, Default, Clone)]
pub struct KeyBuf {
    bytes: Vec<u8>,
}

impl KeyBuf {
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(bytes),
        }
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn truncate(&mut self, len: usize) {
        self.bytes.truncate(len);
    }

    pub fn slice(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.bytes[range]
    }

    /// Appends a copy of `range` (a descriptor prefix shared by several tiers).
    pub fn repeat(&mut self, range: std::ops::Range<usize>) {
        self.bytes.extend_from_within(range);
    }

    fn number(&mut self, mut n: u64) {
        // Most lengths are one or two digits.
        if n < 10 {
            self.bytes.push(b'0' + n as u8);
            return;
        }
        if n < 100 {
            self.bytes
                .extend_from_slice(&[b'0' + (n / 10) as u8, b'0' + (n % 10) as u8]);
            return;
        }
        let start = self.bytes.len();
        loop {
            self.bytes.push(b'0' + (n % 10) as u8);
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.bytes[start..].reverse();
    }

    fn string(&mut self, s: &str) {
        self.number(s.len() as u64);
        self.bytes.push(b':');
        self.bytes.extend_from_slice(s.as_bytes());
    }

    pub fn domain(&mut self, domain: &str) {
        self.string(domain);
    }

    pub fn entry(&mut self, key: &str, part: KeyPart<'_>) {
        let (tag, value) = match part {
            KeyPart::Value(v) => (TAG_VALUE, v),
            KeyPart::Pattern(p) => (TAG_PATTERN, p),
        };
        self.bytes.push(tag);
        self.string(key);
        self.string(value);
    }

    /// `calendar`: the zone of a calendar limit's windows.
    pub fn limit(
        &mut self,
        algorithm: Algorithm,
        unit: Unit,
        multiplier: u32,
        calendar: Option<&str>,
    ) {
        self.bytes.push(TAG_LIMIT);
        self.bytes.push(b'0' + algorithm.id());
        self.bytes.push(b'0' + unit.id());
        self.bytes.push(b'*');
        self.number(u64::from(multiplier));
        if let Some(zone) = calendar {
            self.bytes.push(TAG_CALENDAR);
            self.string(zone);
        }
    }
}

/// FNV-1a, 64 bits: a fixed hash, so every node computes the same one (a counter's Redis slot
/// tag, a request's slot number).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The slot number of a request under a concurrency limit, from its id (see
/// `limiter::concurrency`): 53 bits of [`fnv1a`] (so the Lua twin holds it exactly in a double),
/// never 0 (0 names no slot). Two live requests of one counter share a slot only if their ids
/// collide in 53 bits; ids are the proxy's own (`x-request-id`), not the client's.
pub fn slot_id(request_id: &[u8]) -> u64 {
    (fnv1a(request_id) & ((1 << 53) - 1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(domain: &str, entries: &[(&str, KeyPart<'_>)]) -> Vec<u8> {
        let mut k = KeyBuf::default();
        k.domain(domain);
        for (key, part) in entries {
            k.entry(key, *part);
        }
        k.limit(Algorithm::FixedWindow, Unit::Second, 1, None);
        k.slice(0..k.len()).to_vec()
    }

    #[test]
    fn a_calendar_limit_has_its_own_key() {
        let mut k = KeyBuf::default();
        k.domain("d");
        k.limit(
            Algorithm::FixedWindow,
            Unit::Month,
            1,
            Some("Europe/Berlin"),
        );
        assert_eq!(k.slice(0..k.len()), b"1:d#16*1@13:Europe/Berlin");
    }

    #[test]
    fn readable() {
        let k = key("edge", &[("remote_address", KeyPart::Value("10.0.0.1"))]);
        assert_eq!(
            String::from_utf8(k).unwrap(),
            "4:edgev14:remote_address8:10.0.0.1#11*1"
        );
    }

    #[test]
    fn no_ambiguous_joins() {
        use KeyPart::*;
        assert_ne!(
            key("d", &[("a", Value("b_c"))]),
            key("d", &[("a_b", Value("c"))])
        );
        assert_ne!(
            key("d_a", &[("b", Value("c"))]),
            key("d", &[("a_b", Value("c"))])
        );
        assert_ne!(
            key("d", &[("a", Value("x*"))]),
            key("d", &[("a", Pattern("x*"))])
        );
        assert_ne!(
            key("d", &[("a", Value("b")), ("c", Value("d"))]),
            key("d", &[("a", Value("1:bv1:c1:d"))])
        );
        assert_ne!(
            key("d", &[("a", Value("12"))]),
            key("d", &[("a", Value("1")), ("2", Value(""))])
        );
    }
}
