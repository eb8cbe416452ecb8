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
    ///
    /// Constant work per call (at most 64 multiplications in GF(2)[x] mod the CRC-32C polynomial,
    /// with the powers `x^(2^k)` precomputed at compile time), instead of building matrices.
    pub fn combine(self, b: Crc32c, b_len: u64) -> Crc32c {
        if b_len == 0 {
            return self;
        }
        // Appending `b_len` bytes multiplies `a`'s CRC by x^(8 * b_len) mod P.
        Crc32c(mul_mod_p(x_pow_8n(b_len), self.0) ^ b.0)
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

/// The CRC-32C polynomial, bit-reflected (bit 31 is the coefficient of x^0).
const POLY_REFLECTED: u32 = 0x82f6_3b78;

/// `a * b` modulo the CRC-32C polynomial, both in the reflected representation.
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m: u32 = 1 << 31;
    let mut p: u32 = 0;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                return p;
            }
        }
        m >>= 1;
        if m == 0 {
            return p;
        }
        b = if b & 1 != 0 {
            (b >> 1) ^ POLY_REFLECTED
        } else {
            b >> 1
        };
    }
}

/// `X_POW_2K[k]` = x^(2^k) mod P, for every power a 64-bit byte count times 8 needs.
const X_POW_2K: [u32; 67] = {
    let mut t = [0u32; 67];
    // x^1: the coefficient of x^1 is bit 30.
    let mut p: u32 = 1 << 30;
    let mut k = 0;
    while k < 67 {
        t[k] = p;
        p = mul_mod_p(p, p);
        k += 1;
    }
    t
};

/// x^(8n) mod P (`n` > 0 bytes of zeros appended to a message multiply its CRC by this).
fn x_pow_8n(mut n: u64) -> u32 {
    // 8n = n * 2^3: start at the table entry for 2^3.
    let mut k = 3;
    let mut p: u32 = 1 << 31; // x^0
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod_p(X_POW_2K[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
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

/// A writer that hashes what it is given (a checksum of a serialization without its bytes).
impl std::io::Write for Crc32cHasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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
    fn combine_matches_crc_fast() {
        let data: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for split in [0usize, 1, 2, 3, 7, 8, 63, 64, 65, 1000, 4095, 4999, 5000] {
            let (a, b) = data.split_at(split);
            let (ca, cb) = (Crc32c::of(a), Crc32c::of(b));
            let ours = ca.combine(cb, b.len() as u64);
            assert_eq!(ours, Crc32c::of(&data), "split {split}");
            let theirs = crc_fast::checksum_combine(
                CrcAlgorithm::Crc32Iscsi,
                u64::from(ca.0),
                u64::from(cb.0),
                b.len() as u64,
            ) as u32;
            assert_eq!(ours.0, theirs, "split {split}");
        }
        // Lengths far beyond anything hashed here (up to 2^64 - 1 bytes).
        for len in [1u64 << 20, 1 << 33, (1 << 40) + 12_345, u64::MAX] {
            for (a, b) in [(0x1234_5678u32, 0x9abc_def0u32), (0, 0), (u32::MAX, 1)] {
                let theirs = crc_fast::checksum_combine(
                    CrcAlgorithm::Crc32Iscsi,
                    u64::from(a),
                    u64::from(b),
                    len,
                ) as u32;
                assert_eq!(Crc32c(a).combine(Crc32c(b), len).0, theirs, "len {len}");
            }
        }
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
