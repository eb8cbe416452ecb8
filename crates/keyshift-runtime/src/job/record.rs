//! Records and their keys.
//!
//! A [`Record`] is 40 bytes: a [`RecordKey`] (24 bytes), a value and an event timestamp. The key
//! caches its Java `hashCode`, so finding a record's key group is a constant-time murmur mix even
//! for string keys. A string of up to 16 bytes is held inline in the key (cloning it copies 24
//! bytes, and reading it touches no other memory: a state encoder or a hash-map probe follows no
//! pointer); a longer one lives in a shared `Arc<str>`, so cloning it is a reference-count
//! increment (the generator builds its key strings once).
//!
//! [`encode_record`] / [`decode_record`] are a compact wire form for the shuffle between
//! subtasks; the key part is the same as in state blocks (see [`super::state_codec`]).

use keyshift_core::keygroup::{self, Key, KeyType};
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
    pub fn view(&self) -> KeyRef<'_> {
        match &self.0 {
            Repr::Long(v) => KeyRef::Long(*v),
            Repr::Int(v) => KeyRef::Int(*v),
            Repr::Short { len, bytes, .. } => KeyRef::Str(short_str(bytes, *len)),
            Repr::Str { text, .. } => KeyRef::Str(text),
        }
    }

    /// The key's type.
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

/// One record of a keyed job: its key, the aggregated numeric value and its event time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key the record is grouped by.
    pub key: RecordKey,
    /// The numeric field that `sum`, `min` and `max` read (`count` ignores it).
    pub value: i64,
    /// Event time in milliseconds.
    pub ts: i64,
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

/// Errors decoding a record or key from bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The input ended inside a value.
    #[error("truncated input: needed {needed} more bytes at offset {offset}")]
    Truncated { offset: usize, needed: usize },
    /// An unknown key type tag.
    #[error("unknown key type tag {tag} at offset {offset}")]
    BadKeyTag { offset: usize, tag: u8 },
    /// A string key is not valid UTF-8.
    #[error("string key at offset {offset} is not valid UTF-8")]
    BadUtf8 { offset: usize },
    /// A length prefix is malformed or too large.
    #[error("malformed length at offset {offset}")]
    BadLength { offset: usize },
}

/// Key type tags in the binary encodings.
pub(crate) const TAG_STRING: u8 = 0;
pub(crate) const TAG_LONG: u8 = 1;
pub(crate) const TAG_INT: u8 = 2;

/// Appends an unsigned LEB128 varint.
#[inline]
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A bounds-checked reader over a byte slice; every read returns a typed error instead of
/// panicking on short input.
pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.remaining() < n {
            return Err(WireError::Truncated {
                offset: self.pos,
                needed: n - self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let s = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    #[inline]
    pub(crate) fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    #[inline]
    pub(crate) fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    #[inline]
    pub(crate) fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    #[inline]
    pub(crate) fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    #[inline]
    pub(crate) fn i64(&mut self) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    #[inline]
    pub(crate) fn i32(&mut self) -> Result<i32, WireError> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    pub(crate) fn varint(&mut self) -> Result<u64, WireError> {
        let start = self.pos;
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                if shift == 63 && b > 1 {
                    return Err(WireError::BadLength { offset: start });
                }
                return Ok(v);
            }
        }
        Err(WireError::BadLength { offset: start })
    }

    /// A varint length that must fit in the remaining input.
    pub(crate) fn len(&mut self) -> Result<usize, WireError> {
        let start = self.pos;
        let n = self.varint()?;
        if n > self.remaining() as u64 {
            return Err(WireError::Truncated {
                offset: start,
                needed: (n - self.remaining() as u64).min(usize::MAX as u64) as usize,
            });
        }
        Ok(n as usize)
    }
}

/// Appends a key: a type tag, then the original bytes (string: varint length + UTF-8; long: 8
/// bytes little-endian; int: 4 bytes little-endian).
#[inline]
pub fn encode_key(key: &RecordKey, out: &mut Vec<u8>) {
    match &key.0 {
        Repr::Long(v) => {
            out.push(TAG_LONG);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Repr::Int(v) => {
            out.push(TAG_INT);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Repr::Short { len, bytes, .. } => {
            out.push(TAG_STRING);
            // At most 16: a one-byte varint.
            out.push(*len);
            out.extend_from_slice(&bytes[..usize::from(*len)]);
        }
        Repr::Str { text, .. } => {
            out.push(TAG_STRING);
            put_varint(out, text.len() as u64);
            out.extend_from_slice(text.as_bytes());
        }
    }
}

/// Appends a crate-wide [`Key`] in the same form as [`encode_key`].
pub fn encode_plain_key(key: &Key, out: &mut Vec<u8>) {
    match key {
        Key::Long(v) => {
            out.push(TAG_LONG);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Key::Int(v) => {
            out.push(TAG_INT);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Key::String(s) => {
            out.push(TAG_STRING);
            put_varint(out, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
    }
}

pub(crate) fn read_key(r: &mut Reader<'_>) -> Result<RecordKey, WireError> {
    let at = r.pos;
    match r.u8()? {
        TAG_LONG => Ok(RecordKey::long(r.i64()?)),
        TAG_INT => Ok(RecordKey::int(r.i32()?)),
        TAG_STRING => {
            let n = r.len()?;
            let start = r.pos;
            let bytes = r.bytes(n)?;
            let text =
                std::str::from_utf8(bytes).map_err(|_| WireError::BadUtf8 { offset: start })?;
            Ok(RecordKey::string(text))
        }
        tag => Err(WireError::BadKeyTag { offset: at, tag }),
    }
}

/// Reads a key without allocating: strings are borrowed from the input.
pub(crate) fn read_key_ref<'a>(r: &mut Reader<'a>) -> Result<KeyRef<'a>, WireError> {
    let at = r.pos;
    match r.u8()? {
        TAG_LONG => Ok(KeyRef::Long(r.i64()?)),
        TAG_INT => Ok(KeyRef::Int(r.i32()?)),
        TAG_STRING => {
            let n = r.len()?;
            let start = r.pos;
            let bytes = r.bytes(n)?;
            let text =
                std::str::from_utf8(bytes).map_err(|_| WireError::BadUtf8 { offset: start })?;
            Ok(KeyRef::Str(text))
        }
        tag => Err(WireError::BadKeyTag { offset: at, tag }),
    }
}

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

pub(crate) fn read_plain_key(r: &mut Reader<'_>) -> Result<Key, WireError> {
    let at = r.pos;
    match r.u8()? {
        TAG_LONG => Ok(Key::Long(r.i64()?)),
        TAG_INT => Ok(Key::Int(r.i32()?)),
        TAG_STRING => {
            let n = r.len()?;
            let start = r.pos;
            let bytes = r.bytes(n)?;
            let text =
                std::str::from_utf8(bytes).map_err(|_| WireError::BadUtf8 { offset: start })?;
            Ok(Key::String(text.to_owned()))
        }
        tag => Err(WireError::BadKeyTag { offset: at, tag }),
    }
}

/// Appends a record in the shuffle wire form: key (see [`encode_key`]), value and timestamp as
/// 8 bytes little-endian each.
pub fn encode_record(record: &Record, out: &mut Vec<u8>) {
    encode_key(&record.key, out);
    out.extend_from_slice(&record.value.to_le_bytes());
    out.extend_from_slice(&record.ts.to_le_bytes());
}

/// Reads one record written by [`encode_record`] from the front of `buf`; returns it and the
/// number of bytes it took.
pub fn decode_record(buf: &[u8]) -> Result<(Record, usize), WireError> {
    let mut r = Reader::new(buf);
    let key = read_key(&mut r)?;
    let value = r.i64()?;
    let ts = r.i64()?;
    Ok((Record { key, value, ts }, r.pos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_is_compact() {
        assert_eq!(std::mem::size_of::<RecordKey>(), 24);
        assert_eq!(std::mem::size_of::<Record>(), 40);
    }

    #[test]
    fn key_group_matches_the_core() {
        for key in [
            Key::String("key-17".into()),
            Key::String(String::new()),
            Key::String("grüße \u{1F600}".into()),
            Key::Long(-5),
            Key::Long(1 << 40),
            Key::Int(i32::MIN),
        ] {
            let rk = RecordKey::from(&key);
            for maxp in [1, 7, 128, 32768] {
                assert_eq!(rk.key_group(maxp), keygroup::key_group_for_key(&key, maxp));
            }
            assert_eq!(rk.to_key(), key);
            assert_eq!(rk.key_type(), key.key_type());
        }
    }

    #[test]
    fn types_never_compare_equal() {
        assert_ne!(RecordKey::long(5), RecordKey::int(5));
        assert_ne!(RecordKey::string("5"), RecordKey::long(5));
        assert_eq!(
            RecordKey::string("ab"),
            RecordKey::string(String::from("ab"))
        );
        // Ordering follows Key's derived order: longs, ints, strings.
        let mut keys = [
            RecordKey::string("a"),
            RecordKey::int(1),
            RecordKey::long(2),
        ];
        keys.sort();
        let plain: Vec<Key> = keys.iter().map(RecordKey::to_key).collect();
        let mut sorted = plain.clone();
        sorted.sort();
        assert_eq!(plain, sorted);
    }

    /// Strings on both sides of the inline limit (16 bytes) behave the same: text, hash, order,
    /// equality, encoding.
    #[test]
    fn short_and_long_strings_agree() {
        let texts = [
            "",
            "a",
            "key-2684353",
            "0123456789abcdef",
            "0123456789abcdefg",
            "grüße grüße!",
            "ключ-ключ-ключ",
            "\u{1F600}\u{1F600}\u{1F600}\u{1F600}",
            "\u{1F600}\u{1F600}\u{1F600}\u{1F600}x",
        ];
        let keys: Vec<RecordKey> = texts.iter().map(|t| RecordKey::string(*t)).collect();
        for (t, k) in texts.iter().zip(&keys) {
            assert_eq!(k.to_string(), *t);
            assert_eq!(k.view(), KeyRef::Str(t));
            assert_eq!(k.java_hash(), keygroup::java_string_hash(t));
            assert_eq!(format!("{k:?}"), format!("String({t:?})"));
            assert_eq!(*k, RecordKey::string(Arc::<str>::from(*t)));
            assert_eq!(*k, RecordKey::string(t.to_string()));
            let mut enc = Vec::new();
            encode_key(k, &mut enc);
            let mut expected = vec![TAG_STRING];
            put_varint(&mut expected, t.len() as u64);
            expected.extend_from_slice(t.as_bytes());
            assert_eq!(enc, expected);
            let mut r = Reader::new(&enc);
            assert_eq!(read_key(&mut r).unwrap(), *k);
        }
        for (a, ka) in texts.iter().zip(&keys) {
            for (b, kb) in texts.iter().zip(&keys) {
                assert_eq!(ka.cmp(kb), a.cmp(b), "{a:?} vs {b:?}");
                assert_eq!(ka == kb, a == b, "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn record_wire_round_trip_and_truncation() {
        let recs = [
            Record {
                key: RecordKey::string("héllo"),
                value: -3,
                ts: 99,
            },
            Record {
                key: RecordKey::long(i64::MIN),
                value: i64::MAX,
                ts: -1,
            },
            Record {
                key: RecordKey::int(7),
                value: 0,
                ts: 0,
            },
        ];
        let mut buf = Vec::new();
        for r in &recs {
            encode_record(r, &mut buf);
        }
        let mut at = 0;
        for r in &recs {
            let (d, n) = decode_record(&buf[at..]).unwrap();
            assert_eq!(&d, r);
            at += n;
        }
        assert_eq!(at, buf.len());
        // Every strict prefix of the first record is a typed error.
        let mut one = Vec::new();
        encode_record(&recs[0], &mut one);
        for cut in 0..one.len() {
            assert!(decode_record(&one[..cut]).is_err(), "prefix {cut}");
        }
        assert!(matches!(
            decode_record(&[9, 0, 0]),
            Err(WireError::BadKeyTag { tag: 9, .. })
        ));
    }
}
