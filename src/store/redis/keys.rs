//! A counter's Redis key and its Redis Cluster slot: `prefix{tag}key`, where the tag is 8 hex
//! digits of a hash of the descriptor (domain and matched entries), so every tier of one
//! descriptor lands in one slot and is decided by one script, and no byte of a descriptor value
//! can move a key or make two descriptors collide (the encoded key is length-prefixed).

use crate::counter::fnv1a;
use crate::limiter::Algorithm;

/// The Redis key of a counter and its cluster slot: `prefix{tag}key`, and for a fixed window
/// `prefix{tag}key#` (a hash of its window's count, see fixed_window.lua).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_redis() {
        // Redis's own test vector: CLUSTER KEYSLOT 123456789 is 12739.
        assert_eq!(crc16(b"123456789") % 16_384, 12_739);
    }
}
