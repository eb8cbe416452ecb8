//! The keys a job can be keyed by, and their stable byte form.
//!
//! A key is one of the three types whose Java `hashCode` keyshift computes bit for bit as Flink
//! does (`i64` like `Long`, `i32` like `Integer`, `String` like `String`), so a key's group is the
//! one Flink would give it ([`keyshift_core::keygroup`]). In state, a key is written with its type
//! tag and its bytes ([`encode_key`]), which is what lets an offline rewrite re-hash every entry
//! into another key-group count without the job's code.

use keyshift_core::keygroup::{self, Key, KeyType};
use std::fmt;
use std::hash::Hash;

/// A type a stream can be keyed by (`key_by`): `i64`, `i32` or `String`.
pub trait StreamKey: Clone + Eq + Hash + fmt::Debug + Send + 'static {
    /// The key type recorded in snapshots (a restore under another key type is refused).
    const KEY_TYPE: KeyType;
    /// The key as keyshift's key value.
    fn to_key(&self) -> Key;
    /// The key back from keyshift's key value (`None`: another type).
    fn from_key(key: &Key) -> Option<Self>;
    /// The key's group under `max_parallelism` groups (Flink's assignment of its Java
    /// `hashCode`).
    fn key_group(&self, max_parallelism: u32) -> u32 {
        keygroup::key_group_for_key(&self.to_key(), max_parallelism)
    }
}

impl StreamKey for i64 {
    const KEY_TYPE: KeyType = KeyType::Long;
    fn to_key(&self) -> Key {
        Key::Long(*self)
    }
    fn from_key(key: &Key) -> Option<Self> {
        match key {
            Key::Long(v) => Some(*v),
            _ => None,
        }
    }
}

impl StreamKey for i32 {
    const KEY_TYPE: KeyType = KeyType::Int;
    fn to_key(&self) -> Key {
        Key::Int(*self)
    }
    fn from_key(key: &Key) -> Option<Self> {
        match key {
            Key::Int(v) => Some(*v),
            _ => None,
        }
    }
}

impl StreamKey for String {
    const KEY_TYPE: KeyType = KeyType::String;
    fn to_key(&self) -> Key {
        Key::String(self.clone())
    }
    fn from_key(key: &Key) -> Option<Self> {
        match key {
            Key::String(s) => Some(s.clone()),
            _ => None,
        }
    }
    fn key_group(&self, max_parallelism: u32) -> u32 {
        keygroup::key_group_for_hash(keygroup::java_string_hash(self), max_parallelism)
    }
}

/// The key group of `key` under `max_parallelism` groups (Flink's assignment).
pub fn key_group<K: StreamKey>(key: &K, max_parallelism: u32) -> u32 {
    key.key_group(max_parallelism)
}

const TAG_STRING: u8 = 0;
const TAG_LONG: u8 = 1;
const TAG_INT: u8 = 2;

/// Appends `key`'s byte form: a type tag (0 string, 1 long, 2 int), then a string's LEB128
/// length and UTF-8 bytes, a long's 8 or an int's 4 bytes big-endian. Prefix-free: no key's
/// form begins another's, so state entries of one key are a contiguous range.
pub fn encode_key(key: &Key, out: &mut Vec<u8>) {
    match key {
        Key::String(s) => {
            out.push(TAG_STRING);
            put_varint(out, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        Key::Long(v) => {
            out.push(TAG_LONG);
            out.extend_from_slice(&v.to_be_bytes());
        }
        Key::Int(v) => {
            out.push(TAG_INT);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

/// A key's byte form that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyDecodeError {
    #[error("key bytes end early")]
    Short,
    #[error("unknown key type tag {0}")]
    Tag(u8),
    #[error("string key is not UTF-8")]
    Utf8,
}

/// Reads a key's byte form from the start of `buf`; returns it and how many bytes it took.
pub fn decode_key(buf: &[u8]) -> Result<(Key, usize), KeyDecodeError> {
    let (&tag, rest) = buf.split_first().ok_or(KeyDecodeError::Short)?;
    match tag {
        TAG_STRING => {
            let (len, n) = get_varint(rest).ok_or(KeyDecodeError::Short)?;
            let len = usize::try_from(len).map_err(|_| KeyDecodeError::Short)?;
            let bytes = rest
                .get(n..n.checked_add(len).ok_or(KeyDecodeError::Short)?)
                .ok_or(KeyDecodeError::Short)?;
            let s = std::str::from_utf8(bytes).map_err(|_| KeyDecodeError::Utf8)?;
            Ok((Key::String(s.to_owned()), 1 + n + len))
        }
        TAG_LONG => {
            let b: [u8; 8] = rest
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or(KeyDecodeError::Short)?;
            Ok((Key::Long(i64::from_be_bytes(b)), 9))
        }
        TAG_INT => {
            let b: [u8; 4] = rest
                .get(..4)
                .and_then(|b| b.try_into().ok())
                .ok_or(KeyDecodeError::Short)?;
            Ok((Key::Int(i32::from_be_bytes(b)), 5))
        }
        t => Err(KeyDecodeError::Tag(t)),
    }
}

/// Appends `v` as LEB128.
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 value from the start of `buf`: the value and its length in bytes.
pub(crate) fn get_varint(buf: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, b) in buf.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_key() -> impl Strategy<Value = Key> {
        prop_oneof![
            any::<i64>().prop_map(Key::Long),
            any::<i32>().prop_map(Key::Int),
            ".{0,40}".prop_map(Key::String),
        ]
    }

    proptest! {
        #[test]
        fn keys_round_trip_and_are_prefix_free(a in any_key(), b in any_key(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut buf = Vec::new();
            encode_key(&a, &mut buf);
            let len = buf.len();
            buf.extend_from_slice(&tail);
            let (back, n) = decode_key(&buf).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, &a);
            prop_assert_eq!(n, len);
            let mut other = Vec::new();
            encode_key(&b, &mut other);
            if a != b {
                prop_assert!(!other.starts_with(&buf[..len]) && !buf[..len].starts_with(&other));
            }
        }

        #[test]
        fn truncated_keys_are_errors_not_panics(a in any_key(), cut in 0usize..16) {
            let mut buf = Vec::new();
            encode_key(&a, &mut buf);
            let cut = cut.min(buf.len().saturating_sub(1));
            prop_assert!(decode_key(&buf[..cut]).is_err());
        }
    }
}
