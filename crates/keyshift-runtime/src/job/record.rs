//! Records and their keys.
//!
//! A [`Record`] is 40 bytes: a [`RecordKey`] (24 bytes, [`keyshift_core::record_key`]: the Java
//! `hashCode` cached, short strings inline), a value and an event timestamp.
//!
//! [`encode_record`] / [`decode_record`] are a compact wire form for the shuffle between
//! subtasks; the key part is the same as in state blocks (see [`super::state_codec`]).

use keyshift_core::keygroup::Key;

pub use keyshift_core::record_key::{KeyBuildHasher, KeyHasher, KeyMap, KeyRef, RecordKey};

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
    match key.view() {
        KeyRef::Long(v) => {
            out.push(TAG_LONG);
            out.extend_from_slice(&v.to_le_bytes());
        }
        KeyRef::Int(v) => {
            out.push(TAG_INT);
            out.extend_from_slice(&v.to_le_bytes());
        }
        KeyRef::Str(text) => {
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

/// Records of a program (a job written with keyshift's SDK) as they cross the shuffle: each
/// one's key, event time and serialized form (the program's own), the forms end to end in one
/// buffer so that a batch is two allocations, not one per record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedRecords {
    /// Key, event time and the end of its form in `bytes`.
    records: Vec<(RecordKey, i64, u32)>,
    bytes: Vec<u8>,
    /// How many source records each stands for (a program's values combined before the
    /// shuffle), one per record; `None` while every one stands for one.
    weights: Option<Vec<u32>>,
}

impl EncodedRecords {
    /// Room for `records` records.
    pub fn with_capacity(records: usize) -> Self {
        EncodedRecords {
            records: Vec::with_capacity(records),
            bytes: Vec::with_capacity(records * 32),
            weights: None,
        }
    }

    /// Appends a record.
    pub fn push(&mut self, key: RecordKey, ts: i64, record: &[u8]) {
        self.push_weighted(key, ts, record, 1);
    }

    /// Appends a record standing for `weight` source records (values combined into one).
    pub fn push_weighted(&mut self, key: RecordKey, ts: i64, record: &[u8], weight: u32) {
        match &mut self.weights {
            Some(weights) => weights.push(weight),
            None if weight != 1 => {
                let mut weights = vec![1; self.records.len()];
                weights.push(weight);
                self.weights = Some(weights);
            }
            None => {}
        }
        self.bytes.extend_from_slice(record);
        self.records.push((key, ts, self.bytes.len() as u32));
    }

    /// Whether some record stands for more than one source record.
    pub fn is_weighted(&self) -> bool {
        self.weights.is_some()
    }

    /// How many source records the batch stands for.
    pub fn inputs(&self) -> u64 {
        match &self.weights {
            None => self.records.len() as u64,
            Some(weights) => weights.iter().map(|w| u64::from(*w)).sum(),
        }
    }

    /// Each record's weight, in order.
    pub fn weights(&self) -> impl Iterator<Item = u32> + '_ {
        let ones = match &self.weights {
            None => self.records.len(),
            Some(_) => 0,
        };
        (0..ones)
            .map(|_| 1)
            .chain(self.weights.iter().flatten().copied())
    }

    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Empties it, keeping its memory.
    pub fn clear(&mut self) {
        self.records.clear();
        self.bytes.clear();
        self.weights = None;
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Bytes of the records' forms.
    pub fn bytes_len(&self) -> usize {
        self.bytes.len()
    }

    /// The records in order: key, event time, serialized form.
    pub fn iter(&self) -> impl Iterator<Item = (&RecordKey, i64, &[u8])> {
        let mut start = 0usize;
        self.records.iter().map(move |(key, ts, end)| {
            let end = *end as usize;
            let record = &self.bytes[start..end];
            start = end;
            (key, *ts, record)
        })
    }
}

/// Appends a batch of [`EncodedRecords`] in the shuffle wire form: `u32` count, then each
/// record's key ([`encode_key`]), event time (8 bytes little-endian), and its form (varint
/// length, bytes); a weighted batch ([`EncodedRecords::is_weighted`]) follows each record with
/// its weight (varint).
pub fn encode_encoded(batch: &EncodedRecords, out: &mut Vec<u8>) {
    out.extend_from_slice(&(batch.len() as u32).to_le_bytes());
    let weighted = batch.is_weighted();
    for ((key, ts, record), weight) in batch.iter().zip(batch.weights()) {
        encode_key(key, out);
        out.extend_from_slice(&ts.to_le_bytes());
        put_varint(out, record.len() as u64);
        out.extend_from_slice(record);
        if weighted {
            put_varint(out, u64::from(weight));
        }
    }
}

/// Reads a batch written by [`encode_encoded`] (the whole of `buf`), `weighted` or not.
pub fn decode_encoded(buf: &[u8], weighted: bool) -> Result<EncodedRecords, WireError> {
    let mut r = Reader::new(buf);
    let count = r.u32()? as usize;
    // Sized by what the input can hold (a record is at least 11 bytes), never by the count alone.
    let mut batch = EncodedRecords::with_capacity(count.min(buf.len() / 11));
    for _ in 0..count {
        let key = read_key(&mut r)?;
        let ts = r.i64()?;
        let n = r.len()?;
        let record = r.bytes(n)?;
        let weight = match weighted {
            true => {
                let at = r.pos;
                u32::try_from(r.varint()?).map_err(|_| WireError::BadLength { offset: at })?
            }
            false => 1,
        };
        batch.push_weighted(key, ts, record, weight);
    }
    if r.remaining() != 0 {
        return Err(WireError::BadLength { offset: r.pos });
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyshift_core::keygroup;
    use std::sync::Arc;

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

    #[test]
    fn encoded_records_round_trip_and_a_bad_frame_is_an_error() {
        let mut batch = EncodedRecords::with_capacity(2);
        batch.push(RecordKey::string("user-1"), 7, b"\x01\x02");
        batch.push(RecordKey::long(-3), -9, b"");
        batch.push(RecordKey::int(5), 11, b"xyz");
        let mut out = Vec::new();
        encode_encoded(&batch, &mut out);
        let back = decode_encoded(&out, false).unwrap();
        assert_eq!(back, batch);
        assert!(!back.is_weighted());
        assert_eq!(back.inputs(), 3);
        let got: Vec<_> = back
            .iter()
            .map(|(k, ts, r)| (k.clone(), ts, r.to_vec()))
            .collect();
        assert_eq!(
            got,
            vec![
                (RecordKey::string("user-1"), 7, b"\x01\x02".to_vec()),
                (RecordKey::long(-3), -9, Vec::new()),
                (RecordKey::int(5), 11, b"xyz".to_vec()),
            ]
        );
        for cut in 0..out.len() {
            assert!(decode_encoded(&out[..cut], false).is_err(), "cut at {cut}");
        }
        let mut longer = out.clone();
        longer.push(0);
        assert!(decode_encoded(&longer, false).is_err());

        // Weighted: records combined before the shuffle carry how many they stand for.
        batch.push_weighted(RecordKey::string("hot"), 12, b"acc", 614);
        assert!(batch.is_weighted());
        assert_eq!(batch.weights().collect::<Vec<_>>(), vec![1, 1, 1, 614]);
        assert_eq!(batch.inputs(), 617);
        let mut out = Vec::new();
        encode_encoded(&batch, &mut out);
        let back = decode_encoded(&out, true).unwrap();
        assert_eq!(back, batch);
        assert_eq!(back.inputs(), 617);
        for cut in 0..out.len() {
            assert!(decode_encoded(&out[..cut], true).is_err(), "cut at {cut}");
        }
        batch.clear();
        assert!(!batch.is_weighted());
        // A first record that stands for several.
        batch.push_weighted(RecordKey::string("hot"), 1, b"acc", 7);
        batch.push(RecordKey::string("cold"), 2, b"one");
        assert_eq!(batch.weights().collect::<Vec<_>>(), vec![7, 1]);
        assert_eq!(batch.inputs(), 8);
    }
}
