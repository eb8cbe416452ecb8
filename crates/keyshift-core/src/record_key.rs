//! The key of a record as the operators hold it: a long, an int or a string, with the
//! string's Java `hashCode` cached, so that finding a key's group is a constant-time murmur mix
//! and a hash-map probe hashes nothing. A string of up to 16 bytes is held inline (cloning it
//! copies 24 bytes, and reading it touches no other memory); a longer one lives in a shared
//! `Arc<str>`. The built-in aggregations and the SDK's heap state both key their tables by it.

use crate::keygroup::{self, Key, KeyType};
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The key of a record: a long, an int or a string, with the string's Java hash cached.
///
/// Equality and ordering are those of the value (longs, then ints, then strings, like
/// [`Key`]); two keys of different types are never equal, even when numerically equal.
#[derive(Clone)]
pub struct RecordKey(Repr);

#[derive(Clone)]
enum Repr {
    Long(i64),
    Int(i32),
    /// A string of at most [`INLINE`] bytes, zero-padded (always this form when it fits, so
    /// that equal strings have equal representations).
    Short {
        hash: i32,
        len: u8,
        bytes: [u8; INLINE],
    },
    /// A longer string.
    Str {
        hash: i32,
        text: Arc<str>,
    },
}

/// The longest string held inline in a [`RecordKey`].
const INLINE: usize = 16;

// The inline form keeps a key at 24 bytes (and a record at 40).
const _: () = assert!(std::mem::size_of::<RecordKey>() == 24);

/// The text of an inline string (valid UTF-8 by construction: a whole `&str` was copied).
#[inline]
fn short_str(bytes: &[u8; INLINE], len: u8) -> &str {
    std::str::from_utf8(&bytes[..usize::from(len)]).unwrap_or_default()
}

/// A borrowed view of a [`RecordKey`], for matching on its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRef<'a> {
    /// A 64-bit key.
    Long(i64),
    /// A 32-bit key.
    Int(i32),
    /// A string key.
    Str(&'a str),
}

impl RecordKey {
    /// A 64-bit key (hashed like `java.lang.Long`).
    pub fn long(v: i64) -> Self {
        RecordKey(Repr::Long(v))
    }

    /// A 32-bit key (hashed like `java.lang.Integer`).
    pub fn int(v: i32) -> Self {
        RecordKey(Repr::Int(v))
    }

    /// A string key (hashed like `java.lang.String`); computes the hash once. Strings of up to
    /// 16 bytes are copied into the key; longer ones are shared (`text.into()`).
    pub fn string(text: impl AsRef<str> + Into<Arc<str>>) -> Self {
        let s = text.as_ref();
        let hash = keygroup::java_string_hash(s);
        if s.len() <= INLINE {
            let mut bytes = [0u8; INLINE];
            bytes[..s.len()].copy_from_slice(s.as_bytes());
            return RecordKey(Repr::Short {
                hash,
                len: s.len() as u8,
                bytes,
            });
        }
        RecordKey(Repr::Str {
            hash,
            text: text.into(),
        })
    }

    /// A string key's UTF-8 bytes (`None` for number keys).
    #[inline]
    fn str_bytes(&self) -> Option<&[u8]> {
        match &self.0 {
            Repr::Short { len, bytes, .. } => Some(&bytes[..usize::from(*len)]),
            Repr::Str { text, .. } => Some(text.as_bytes()),
            _ => None,
        }
    }

    /// A borrowed view for matching.
    #[inline]
    pub fn view(&self) -> KeyRef<'_> {
        match &self.0 {
            Repr::Long(v) => KeyRef::Long(*v),
            Repr::Int(v) => KeyRef::Int(*v),
            Repr::Short { len, bytes, .. } => KeyRef::Str(short_str(bytes, *len)),
            Repr::Str { text, .. } => KeyRef::Str(text),
        }
    }

    /// The key's type.
    #[inline]
    pub fn key_type(&self) -> KeyType {
        match &self.0 {
            Repr::Long(_) => KeyType::Long,
            Repr::Int(_) => KeyType::Int,
            Repr::Short { .. } | Repr::Str { .. } => KeyType::String,
        }
    }

    /// The key's Java `hashCode` (cached for strings).
    #[inline]
    pub fn java_hash(&self) -> i32 {
        match &self.0 {
            Repr::Long(v) => keygroup::java_long_hash(*v),
            Repr::Int(v) => keygroup::java_int_hash(*v),
            Repr::Short { hash, .. } | Repr::Str { hash, .. } => *hash,
        }
    }

    /// The key's group under `max_parallelism` groups (Flink-exact), in constant time.
    #[inline]
    pub fn key_group(&self, max_parallelism: u32) -> u32 {
        keygroup::key_group_for_hash(self.java_hash(), max_parallelism)
    }

    /// The key as the crate-wide [`Key`] (allocates for strings).
    pub fn to_key(&self) -> Key {
        match &self.0 {
            Repr::Long(v) => Key::Long(*v),
            Repr::Int(v) => Key::Int(*v),
            Repr::Short { len, bytes, .. } => Key::String(short_str(bytes, *len).to_owned()),
            Repr::Str { text, .. } => Key::String(text.to_string()),
        }
    }

    /// A 64-bit summary used by the in-memory hash maps of the operator (not persisted).
    #[inline]
    fn map_hash(&self) -> u64 {
        match &self.0 {
            Repr::Long(v) => *v as u64,
            Repr::Int(v) => (*v as u32 as u64) | (1 << 40),
            Repr::Short { hash, .. } | Repr::Str { hash, .. } => (*hash as u32 as u64) | (2 << 40),
        }
    }
}

impl From<&Key> for RecordKey {
    fn from(key: &Key) -> Self {
        match key {
            Key::Long(v) => RecordKey::long(*v),
            Key::Int(v) => RecordKey::int(*v),
            Key::String(s) => RecordKey::string(s.as_str()),
        }
    }
}

impl From<Key> for RecordKey {
    fn from(key: Key) -> Self {
        match key {
            Key::Long(v) => RecordKey::long(v),
            Key::Int(v) => RecordKey::int(v),
            Key::String(s) => RecordKey::string(s),
        }
    }
}

impl PartialEq for RecordKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::Long(a), Repr::Long(b)) => a == b,
            (Repr::Int(a), Repr::Int(b)) => a == b,
            (
                Repr::Short {
                    hash: ha,
                    len: la,
                    bytes: a,
                },
                Repr::Short {
                    hash: hb,
                    len: lb,
                    bytes: b,
                },
            ) => ha == hb && la == lb && a == b,
            (Repr::Str { hash: ha, text: a }, Repr::Str { hash: hb, text: b }) => {
                ha == hb && (Arc::ptr_eq(a, b) || a == b)
            }
            _ => false,
        }
    }
}

impl Eq for RecordKey {}

impl Hash for RecordKey {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.map_hash());
    }
}

impl PartialOrd for RecordKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RecordKey {
    fn cmp(&self, other: &Self) -> Ordering {
        fn rank(r: &Repr) -> u8 {
            match r {
                Repr::Long(_) => 0,
                Repr::Int(_) => 1,
                Repr::Short { .. } | Repr::Str { .. } => 2,
            }
        }
        match (&self.0, &other.0) {
            (Repr::Long(a), Repr::Long(b)) => a.cmp(b),
            (Repr::Int(a), Repr::Int(b)) => a.cmp(b),
            (a, b) => match (self.str_bytes(), other.str_bytes()) {
                // Byte order of UTF-8 is code-point order, as `str`'s.
                (Some(x), Some(y)) => x.cmp(y),
                _ => rank(a).cmp(&rank(b)),
            },
        }
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Long(v) => write!(f, "Long({v})"),
            Repr::Int(v) => write!(f, "Int({v})"),
            Repr::Short { len, bytes, .. } => write!(f, "String({:?})", short_str(bytes, *len)),
            Repr::Str { text, .. } => write!(f, "String({text:?})"),
        }
    }
}

impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Long(v) => write!(f, "{v}"),
            Repr::Int(v) => write!(f, "{v}"),
            Repr::Short { len, bytes, .. } => f.write_str(short_str(bytes, *len)),
            Repr::Str { text, .. } => f.write_str(text),
        }
    }
}

/// A fast, deterministic hasher for [`RecordKey`] maps: the key writes one `u64`
/// (see `RecordKey::map_hash`), which is finished with murmur3's 64-bit mixer.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached by types other than RecordKey; a simple FNV-style fold keeps it correct.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.rotate_left(29).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ v;
    }
}

/// `BuildHasher` for [`KeyHasher`].
pub type KeyBuildHasher = std::hash::BuildHasherDefault<KeyHasher>;

/// A hash map keyed by [`RecordKey`] with the fast deterministic hasher.
pub type KeyMap<V> = std::collections::HashMap<RecordKey, V, KeyBuildHasher>;

impl KeyRef<'_> {
    /// The key's Java `hashCode` (computed over the UTF-16 code units for strings).
    pub fn java_hash(&self) -> i32 {
        match self {
            KeyRef::Long(v) => keygroup::java_long_hash(*v),
            KeyRef::Int(v) => keygroup::java_int_hash(*v),
            KeyRef::Str(s) => keygroup::java_string_hash(s),
        }
    }

    /// The key's group under `max_parallelism` groups (Flink-exact).
    pub fn key_group(&self, max_parallelism: u32) -> u32 {
        keygroup::key_group_for_hash(self.java_hash(), max_parallelism)
    }

    /// The key as the crate-wide [`Key`] (allocates for strings).
    pub fn to_key(&self) -> Key {
        match self {
            KeyRef::Long(v) => Key::Long(*v),
            KeyRef::Int(v) => Key::Int(*v),
            KeyRef::Str(s) => Key::String((*s).to_owned()),
        }
    }
}
