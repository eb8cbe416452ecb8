//! CRC-32C (Castagnoli, the iSCSI polynomial) checksums, hardware-accelerated through `crc-fast`.
//!
//! Pure: no I/O. In manifests a checksum is written as 8 lowercase hex digits.

use crc_fast::{CrcAlgorithm, Digest};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A CRC-32C value. Serialised as 8 lowercase hex digits, e.g. `"e3069283"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Crc32c(pub u32);

impl Crc32c {
    /// The checksum of an empty byte string (0).
    pub const EMPTY: Crc32c = Crc32c(0);

    /// The checksum of `data`.
    pub fn of(data: &[u8]) -> Crc32c {
        Crc32c(crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32)
    }

    /// The checksum of `a ++ b`, given the checksum of `a` (self), of `b` and `b`'s length.
    pub fn combine(self, b: Crc32c, b_len: u64) -> Crc32c {
        if b_len == 0 {
            return self;
        }
        Crc32c(crc_fast::checksum_combine(
            CrcAlgorithm::Crc32Iscsi,
            u64::from(self.0),
            u64::from(b.0),
            b_len,
        ) as u32)
    }

    /// Parses 8 hex digits (case-insensitive).
    pub fn parse_hex(s: &str) -> Option<Crc32c> {
        if s.len() != 8 {
            return None;
        }
        u32::from_str_radix(s, 16).ok().map(Crc32c)
    }
}

impl fmt::Display for Crc32c {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

impl Serialize for Crc32c {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Crc32c {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Crc32c::parse_hex(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "checksum {s:?} is not a CRC-32C written as 8 hex digits"
            ))
        })
    }
}

/// An incremental CRC-32C over a byte stream.
#[derive(Clone, Copy, Debug)]
pub struct Crc32cHasher {
    digest: Digest,
}

impl Default for Crc32cHasher {
    fn default() -> Self {
        Crc32cHasher {
            digest: Digest::new(CrcAlgorithm::Crc32Iscsi),
        }
    }
}

impl Crc32cHasher {
    /// A hasher over no bytes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds more bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.digest.update(data);
    }

    /// The checksum of everything fed so far.
    pub fn finish(&self) -> Crc32c {
        Crc32c(self.digest.finalize() as u32)
    }

    /// How many bytes were fed.
    pub fn bytes_hashed(&self) -> u64 {
        self.digest.get_amount()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // The CRC-32C check value.
        assert_eq!(Crc32c::of(b"123456789"), Crc32c(0xe306_9283));
        assert_eq!(Crc32c::of(b""), Crc32c::EMPTY);
    }

    #[test]
    fn combine_matches_concatenation() {
        let (a, b) = (b"hello, ".as_slice(), b"key groups".as_slice());
        let whole = [a, b].concat();
        assert_eq!(
            Crc32c::of(a).combine(Crc32c::of(b), b.len() as u64),
            Crc32c::of(&whole)
        );
        assert_eq!(Crc32c::of(a).combine(Crc32c::EMPTY, 0), Crc32c::of(a));
        assert_eq!(
            Crc32c::EMPTY.combine(Crc32c::of(b), b.len() as u64),
            Crc32c::of(b)
        );
        let mut h = Crc32cHasher::new();
        h.update(a);
        h.update(b);
        assert_eq!(h.finish(), Crc32c::of(&whole));
        assert_eq!(h.bytes_hashed(), whole.len() as u64);
    }

    #[test]
    fn hex_round_trip() {
        let c = Crc32c(0x0012_abcd);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, "\"0012abcd\"");
        assert_eq!(serde_json::from_str::<Crc32c>(&json).unwrap(), c);
        assert!(serde_json::from_str::<Crc32c>("\"12abcd\"").is_err());
        assert!(serde_json::from_str::<Crc32c>("\"zzzzzzzz\"").is_err());
    }
}
