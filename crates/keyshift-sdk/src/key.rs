//! The keys a job can be keyed by, and their stable byte form.
//!
//! A key is one of the three types whose Java `hashCode` keyshift computes bit for bit as Flink
//! does (`i64` like `Long`, `i32` like `Integer`, `String` like `String`), so a key's group is the
//! one Flink would give it ([`keyshift_core::keygroup`]). In state, a key is written with its type
//! tag and its bytes ([`encode_key`]), which is what lets an offline rewrite re-hash every entry
//! into another key-group count without the job's code.

use keyshift_core::keygroup::{self, Key, KeyType};
pub use keyshift_core::record_key::{KeyRef, RecordKey};
use std::fmt;
use std::hash::Hash;

/// A type a stream can be keyed by (`key_by`): `i64`, `i32` or `String`.
pub trait StreamKey: Clone + Eq + Hash + fmt::Debug + Send + 'static {
    /// The key type recorded in snapshots (a restore under another key type is refused).
    const KEY_TYPE: KeyType;
    /// Whether [`Self::from_record_key`] gives `Some` for every [`RecordKey`] of
    /// [`Self::KEY_TYPE`]'s kind (true for `i64`, `i32` and `String`). A step then builds a
    /// record's key only when its function asks for it ([`crate::function::Context::key`]): a
    /// function that never does pays no allocation per record for a `String` key. A type of
    /// your own whose conversion may refuse such a key must leave it `false` (its key is built,
    /// and checked, before each call).
    const BUILT_ON_DEMAND: bool = false;
    /// The key as keyshift's key value.
    fn to_key(&self) -> Key;
    /// The key back from keyshift's key value (`None`: another type).
    fn from_key(key: &Key) -> Option<Self>;

    /// The key of a [`RecordKey`] (a record that crossed the shuffle), if it is of this type.
    /// The three key types read it directly (no [`Key`] built).
    fn from_record_key(key: &RecordKey) -> Option<Self> {
        Self::from_key(&key.to_key())
    }

    /// The key as the operators' tables hold it (its Java hash cached, a short string inline).
    /// The three key types build it directly (no [`Key`] built, no string copied to the heap).
    fn record_key(&self) -> RecordKey {
        RecordKey::from(self.to_key())
    }
    /// The key's group under `max_parallelism` groups (Flink's assignment of its Java
    /// `hashCode`).
    fn key_group(&self, max_parallelism: u32) -> u32 {
        keygroup::key_group_for_key(&self.to_key(), max_parallelism)
    }
}

impl StreamKey for i64 {
    const KEY_TYPE: KeyType = KeyType::Long;
    const BUILT_ON_DEMAND: bool = true;
    fn record_key(&self) -> RecordKey {
        RecordKey::long(*self)
    }
    fn from_record_key(key: &RecordKey) -> Option<Self> {
        match key.view() {
            KeyRef::Long(v) => Some(v),
            _ => None,
        }
    }
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
    const BUILT_ON_DEMAND: bool = true;
    fn record_key(&self) -> RecordKey {
        RecordKey::int(*self)
    }
    fn from_record_key(key: &RecordKey) -> Option<Self> {
        match key.view() {
            KeyRef::Int(v) => Some(v),
            _ => None,
        }
    }
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
    const BUILT_ON_DEMAND: bool = true;
    fn record_key(&self) -> RecordKey {
        RecordKey::string(self.as_str())
    }
    fn from_record_key(key: &RecordKey) -> Option<Self> {
        match key.view() {
            KeyRef::Str(s) => Some(s.to_owned()),
            _ => None,
        }
    }
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
        Key::String(s) => put_string(out, s),
        Key::Long(v) => put_long(out, *v),
        Key::Int(v) => put_int(out, *v),
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    let mut head = [TAG_STRING; 11];
    let mut len = s.len() as u64;
    let mut n = 1;
    while len >= 0x80 {
        head[n] = (len as u8) | 0x80;
        len >>= 7;
        n += 1;
    }
    head[n] = len as u8;
    out.extend_from_slice(&head[..=n]);
    out.extend_from_slice(s.as_bytes());
}

fn put_long(out: &mut Vec<u8>, v: i64) {
    let mut b = [TAG_LONG; 9];
    b[1..].copy_from_slice(&v.to_be_bytes());
    out.extend_from_slice(&b);
}

fn put_int(out: &mut Vec<u8>, v: i32) {
    let mut b = [TAG_INT; 5];
    b[1..].copy_from_slice(&v.to_be_bytes());
    out.extend_from_slice(&b);
}

/// Appends `key`'s byte form: the same bytes as [`encode_key`] of its [`Key`], without building
/// one.
pub fn encode_record_key(key: &RecordKey, out: &mut Vec<u8>) {
    match key.view() {
        KeyRef::Str(s) => put_string(out, s),
        KeyRef::Long(v) => put_long(out, v),
        KeyRef::Int(v) => put_int(out, v),
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
        fn each_key_type_writes_the_byte_form_of_its_key(s in ".{0,200}", l in any::<i64>(), i in any::<i32>()) {
            fn both<K: StreamKey>(k: &K) -> (Vec<u8>, Vec<u8>) {
                let mut general = Vec::new();
                encode_key(&k.to_key(), &mut general);
                let mut typed = Vec::new();
                encode_record_key(&k.record_key(), &mut typed);
                assert_eq!(k.record_key(), RecordKey::from(k.to_key()));
                assert_eq!(K::from_record_key(&k.record_key()).as_ref(), Some(k));
                assert_eq!(k.record_key().key_group(128), k.key_group(128));
                (typed, general)
            }
            let (typed, general) = both(&s);
            prop_assert_eq!(typed, general);
            let (typed, general) = both(&l);
            prop_assert_eq!(typed, general);
            let (typed, general) = both(&i);
            prop_assert_eq!(typed, general);
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
