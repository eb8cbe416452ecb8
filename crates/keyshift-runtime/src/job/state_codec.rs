//! The per-key-group state block: the contract between the keyed operator and the snapshot layer.
//!
//! A block holds the state of one key group and describes itself, so an offline tool can decode
//! any block without the job spec, and can re-hash every key into a different number of groups
//! (keys are stored with their type tag and original bytes).
//!
//! ```text
//! offset  size  field
//! 0       4     magic "KSKG"
//! 4       2     format version, u16 LE (= 1)
//! 6       1     schema id length n
//! 7       n     schema id, ASCII ("keyshift.agg.v1")
//! +0      1     aggregate function: 0 count, 1 sum, 2 min, 3 max
//! +1      1     flags: bit 0 = windowed; other bits 0
//! +2      8     window size in ms, i64 LE (0 when not windowed)
//! +10     4     max parallelism the block was written under, u32 LE
//! +14     4     key group, u32 LE
//! +18     8     entry count, u64 LE
//! then `entry count` entries:
//!         key     tag u8 (0 string, 1 long, 2 int), then string: LEB128 length + UTF-8 bytes,
//!                 long: i64 LE, int: i32 LE
//!         value   not windowed: accumulator i64 LE
//!                 windowed: LEB128 window count w, then w x (window start i64 LE, accumulator
//!                 i64 LE), starts strictly increasing
//!         payload LEB128 length + opaque bytes (benchmark ballast, usually empty)
//! last 4        CRC-32 (IEEE) of every byte before it, u32 LE
//! ```
//!
//! The accumulator is the count (`count`), the wrapping sum (`sum`), or the smallest / largest
//! value seen (`min` / `max`). Entry order is unspecified. Every decoding path returns a typed
//! [`CodecError`] on corrupt input; none panics.

use super::record::{self, KeyRef, Reader, RecordKey, WireError};
use bytes::Bytes;
use keyshift_core::keygroup::Key;
use keyshift_core::spec::AggregateFunction;

/// The magic bytes a block starts with.
pub const BLOCK_MAGIC: [u8; 4] = *b"KSKG";
/// The block format version this code writes (and the only one it reads).
pub const FORMAT_VERSION: u16 = 1;
/// The state schema of the keyed aggregation operator.
pub const AGG_SCHEMA: &str = "keyshift.agg.v1";

const FLAG_WINDOWED: u8 = 1;

/// The block trailer's checksum: CRC-32 (IEEE 802.3, the zlib / gzip polynomial; crc-fast calls it
/// ISO-HDLC). Computed with crc-fast, the crate behind the manifests' CRC-32C
/// (`snapshot::checksum`), so the build has one CRC crate; the algorithm is the one blocks have
/// always carried (crc32fast computed it before), so existing snapshots still verify.
#[inline]
fn block_crc(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32IsoHdlc, data) as u32
}

/// An aggregate's accumulator: one value, or one per open window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccValue {
    /// Aggregation over all time.
    Scalar(i64),
    /// Open tumbling windows as `(window start ms, accumulator)`, starts strictly increasing.
    Windows(Vec<(i64, i64)>),
}

/// The state of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateValue {
    /// The accumulator(s).
    pub acc: AccValue,
    /// Opaque per-key bytes carried along (see `JobOptions::state_payload_bytes`).
    pub payload: Vec<u8>,
}

/// What a block's writer declares about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// The aggregate function of the accumulators.
    pub function: AggregateFunction,
    /// Tumbling window size in ms, if windowed.
    pub window_size_ms: Option<i64>,
    /// The key-group count the block was written under.
    pub max_parallelism: u32,
    /// The key group the block holds.
    pub key_group: u32,
}

/// A decoded block header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    /// Block format version.
    pub format_version: u16,
    /// State schema id, e.g. [`AGG_SCHEMA`].
    pub schema: String,
    /// The writer's declarations.
    pub info: BlockInfo,
    /// Number of entries.
    pub entries: u64,
}

/// A fully decoded block, for tools (dump, inspect, rewrite).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedGroup {
    /// The header.
    pub header: BlockHeader,
    /// Every entry, in block order.
    pub entries: Vec<(Key, StateValue)>,
}

/// A block that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("state block too short ({len} bytes): not a keyshift key-group block")]
    TooShort { len: usize },
    #[error("bad magic {found:02x?}: not a keyshift key-group block")]
    BadMagic { found: [u8; 4] },
    #[error(
        "checksum mismatch (stored {stored:08x}, computed {computed:08x}): the block is corrupt"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("unsupported block format version {0} (this build reads version {FORMAT_VERSION})")]
    UnsupportedVersion(u16),
    #[error("unknown state schema {0:?} (this build reads {AGG_SCHEMA:?})")]
    UnknownSchema(String),
    #[error("unknown aggregate function code {0}")]
    BadFunction(u8),
    #[error("unknown block flags {0:#04x}")]
    BadFlags(u8),
    #[error("invalid window size {0} ms in header")]
    BadWindowSize(i64),
    #[error("malformed header: {0}")]
    Header(WireError),
    #[error("entry {entry}: {source}")]
    Entry {
        entry: u64,
        #[source]
        source: WireError,
    },
    #[error("entry {entry}: window starts are not strictly increasing")]
    WindowsNotIncreasing { entry: u64 },
    #[error("{extra} unexpected bytes after the last entry")]
    TrailingBytes { extra: usize },
}

fn function_code(f: AggregateFunction) -> u8 {
    match f {
        AggregateFunction::Count => 0,
        AggregateFunction::Sum => 1,
        AggregateFunction::Min => 2,
        AggregateFunction::Max => 3,
    }
}

fn function_of(code: u8) -> Result<AggregateFunction, CodecError> {
    Ok(match code {
        0 => AggregateFunction::Count,
        1 => AggregateFunction::Sum,
        2 => AggregateFunction::Min,
        3 => AggregateFunction::Max,
        c => return Err(CodecError::BadFunction(c)),
    })
}

/// Writes a block incrementally: header, then entries, then [`BlockWriter::finish`].
pub struct BlockWriter {
    buf: Vec<u8>,
    /// Where the block starts in `buf` (0 unless appending to a buffer with other content).
    start: usize,
    count_at: usize,
    entries: u64,
    windowed: bool,
}

impl BlockWriter {
    /// Starts a block; `capacity_hint` pre-sizes the buffer.
    pub fn new(info: &BlockInfo, capacity_hint: usize) -> Self {
        Self::append_to(Vec::with_capacity(capacity_hint.max(64)), info)
    }

    /// Starts a block at the end of `buf`, keeping what is already there (so many blocks can be
    /// laid out in one buffer). [`finish`](Self::finish) returns the whole buffer; the block is its
    /// tail from the length `buf` had here.
    pub fn append_to(mut buf: Vec<u8>, info: &BlockInfo) -> Self {
        let start = buf.len();
        buf.extend_from_slice(&BLOCK_MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.push(AGG_SCHEMA.len() as u8);
        buf.extend_from_slice(AGG_SCHEMA.as_bytes());
        buf.push(function_code(info.function));
        buf.push(if info.window_size_ms.is_some() {
            FLAG_WINDOWED
        } else {
            0
        });
        buf.extend_from_slice(&info.window_size_ms.unwrap_or(0).to_le_bytes());
        buf.extend_from_slice(&info.max_parallelism.to_le_bytes());
        buf.extend_from_slice(&info.key_group.to_le_bytes());
        let count_at = buf.len();
        buf.extend_from_slice(&0u64.to_le_bytes());
        BlockWriter {
            buf,
            start,
            count_at,
            entries: 0,
            windowed: info.window_size_ms.is_some(),
        }
    }

    /// The length of a block header with this build's schema (what a block of no entries takes
    /// before its 4-byte checksum).
    pub const HEADER_LEN: usize = 4 + 2 + 1 + AGG_SCHEMA.len() + 1 + 1 + 8 + 4 + 4 + 8;

    #[inline]
    fn value(&mut self, acc: &AccValue, payload: &[u8]) {
        let buf = &mut self.buf;
        match acc {
            AccValue::Scalar(v) if !self.windowed => buf.extend_from_slice(&v.to_le_bytes()),
            AccValue::Windows(ws) if self.windowed => {
                record::put_varint(buf, ws.len() as u64);
                for (start, v) in ws {
                    buf.extend_from_slice(&start.to_le_bytes());
                    buf.extend_from_slice(&v.to_le_bytes());
                }
            }
            // A value of the other shape: written as the block's shape so the block stays
            // decodable (a scalar becomes no windows, windows fold to nothing). Callers in this
            // crate never mix shapes.
            AccValue::Scalar(_) => record::put_varint(buf, 0),
            AccValue::Windows(_) => buf.extend_from_slice(&0i64.to_le_bytes()),
        }
        record::put_varint(buf, payload.len() as u64);
        buf.extend_from_slice(payload);
        self.entries += 1;
    }

    /// Appends an entry with a record key.
    #[inline]
    pub fn push(&mut self, key: &RecordKey, acc: &AccValue, payload: &[u8]) {
        record::encode_key(key, &mut self.buf);
        self.value(acc, payload);
    }

    /// Appends an entry with a crate-wide key.
    pub fn push_plain(&mut self, key: &Key, value: &StateValue) {
        record::encode_plain_key(key, &mut self.buf);
        self.value(&value.acc, &value.payload);
    }

    /// Appends one entry exactly as encoded in another block (key, value and payload bytes, as
    /// handed out by [`for_each_raw_entry`]). The source block must have the same shape
    /// (windowed or not) as this one; the entry is not re-checked.
    #[inline]
    pub fn push_raw(&mut self, entry: &[u8]) {
        self.buf.extend_from_slice(entry);
        self.entries += 1;
    }

    /// Patches the entry count, appends the checksum and returns `(block, entries)`.
    pub fn finish(mut self) -> (Vec<u8>, u64) {
        self.buf[self.count_at..self.count_at + 8].copy_from_slice(&self.entries.to_le_bytes());
        let crc = block_crc(&self.buf[self.start..]);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        (self.buf, self.entries)
    }
}

/// Encodes arbitrary entries as one block (for tools that re-bucket keys). Keys are not checked
/// against `info.key_group`.
pub fn encode_entries<'a>(
    info: &BlockInfo,
    entries: impl IntoIterator<Item = (&'a Key, &'a StateValue)>,
) -> (Vec<u8>, u64) {
    let mut w = BlockWriter::new(info, 4096);
    for (k, v) in entries {
        w.push_plain(k, v);
    }
    w.finish()
}

/// Verifies the checksum and reads the header; returns it and a reader positioned at the first
/// entry (over the block without its checksum).
fn open(block: &[u8]) -> Result<(BlockHeader, Reader<'_>), CodecError> {
    if block.len() < 8 {
        return Err(CodecError::TooShort { len: block.len() });
    }
    let mut found = [0u8; 4];
    found.copy_from_slice(&block[..4]);
    if found != BLOCK_MAGIC {
        return Err(CodecError::BadMagic { found });
    }
    let (body, crc) = block.split_at(block.len() - 4);
    let mut stored = [0u8; 4];
    stored.copy_from_slice(crc);
    let stored = u32::from_le_bytes(stored);
    let computed = block_crc(body);
    if stored != computed {
        return Err(CodecError::Checksum { stored, computed });
    }
    let mut r = Reader::new(body);
    r.pos = 4;
    let version = r.u16().map_err(CodecError::Header)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion(version));
    }
    let n = r.u8().map_err(CodecError::Header)? as usize;
    let schema_bytes = r.bytes(n).map_err(CodecError::Header)?;
    let schema = String::from_utf8_lossy(schema_bytes).into_owned();
    if schema != AGG_SCHEMA {
        return Err(CodecError::UnknownSchema(schema));
    }
    let function = function_of(r.u8().map_err(CodecError::Header)?)?;
    let flags = r.u8().map_err(CodecError::Header)?;
    if flags & !FLAG_WINDOWED != 0 {
        return Err(CodecError::BadFlags(flags));
    }
    let size = r.i64().map_err(CodecError::Header)?;
    let window_size_ms = if flags & FLAG_WINDOWED != 0 {
        if size <= 0 {
            return Err(CodecError::BadWindowSize(size));
        }
        Some(size)
    } else {
        None
    };
    let max_parallelism = r.u32().map_err(CodecError::Header)?;
    let key_group = r.u32().map_err(CodecError::Header)?;
    let entries = r.u64().map_err(CodecError::Header)?;
    Ok((
        BlockHeader {
            format_version: version,
            schema,
            info: BlockInfo {
                function,
                window_size_ms,
                max_parallelism,
                key_group,
            },
            entries,
        },
        r,
    ))
}

/// Reads only the header (after verifying the checksum).
pub fn decode_header(block: &[u8]) -> Result<BlockHeader, CodecError> {
    open(block).map(|(h, _)| h)
}

fn read_acc(r: &mut Reader<'_>, windowed: bool, entry: u64) -> Result<AccValue, CodecError> {
    let e = |source| CodecError::Entry { entry, source };
    Ok(if windowed {
        let n = r.varint().map_err(e)?;
        // Each window takes 16 bytes: bound the allocation by what the input can hold.
        if n > (r.remaining() / 16) as u64 {
            return Err(e(WireError::BadLength { offset: r.pos }));
        }
        let mut ws = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let start = r.i64().map_err(e)?;
            let v = r.i64().map_err(e)?;
            if ws.last().is_some_and(|(s, _)| *s >= start) {
                return Err(CodecError::WindowsNotIncreasing { entry });
            }
            ws.push((start, v));
        }
        AccValue::Windows(ws)
    } else {
        AccValue::Scalar(r.i64().map_err(e)?)
    })
}

/// Reads a payload's length and skips it; returns where it lies in the input.
fn read_payload(r: &mut Reader<'_>, entry: u64) -> Result<std::ops::Range<usize>, CodecError> {
    let e = |source| CodecError::Entry { entry, source };
    let n = r.len().map_err(e)?;
    let start = r.pos;
    r.bytes(n).map_err(e)?;
    Ok(start..start + n)
}

fn read_value(r: &mut Reader<'_>, windowed: bool, entry: u64) -> Result<StateValue, CodecError> {
    let acc = read_acc(r, windowed, entry)?;
    let at = read_payload(r, entry)?;
    Ok(StateValue {
        acc,
        payload: r.buf[at].to_vec(),
    })
}

/// A block opened for decoding with shared payloads: checksum verified and header read once
/// ([`SharedEntries::header`]), entries decoded by [`SharedEntries::for_each`].
pub struct SharedEntries<'a> {
    header: BlockHeader,
    block: &'a Bytes,
    reader: Reader<'a>,
}

/// Opens a block held in shared memory: verifies its checksum and reads its header.
pub fn shared_entries(block: &Bytes) -> Result<SharedEntries<'_>, CodecError> {
    let (header, reader) = open(block)?;
    Ok(SharedEntries {
        header,
        block,
        reader,
    })
}

impl SharedEntries<'_> {
    /// The block's header.
    pub fn header(&self) -> &BlockHeader {
        &self.header
    }

    /// Decodes every entry like [`for_each_entry`], calling `f` with each key, accumulator and
    /// payload; the payload is a slice of the block (no copy; empty payloads hold no memory).
    pub fn for_each(
        mut self,
        mut f: impl FnMut(RecordKey, AccValue, Bytes) -> Result<(), CodecError>,
    ) -> Result<BlockHeader, CodecError> {
        let windowed = self.header.info.window_size_ms.is_some();
        let r = &mut self.reader;
        for entry in 0..self.header.entries {
            let key = record::read_key(r).map_err(|source| CodecError::Entry { entry, source })?;
            let acc = read_acc(r, windowed, entry)?;
            let at = read_payload(r, entry)?;
            let payload = if at.is_empty() {
                Bytes::new()
            } else {
                self.block.slice(at)
            };
            f(key, acc, payload)?;
        }
        if r.remaining() != 0 {
            return Err(CodecError::TrailingBytes {
                extra: r.remaining(),
            });
        }
        Ok(self.header)
    }
}

/// Decodes every entry of a block, calling `f` with each key (as a [`RecordKey`]) and value.
pub fn for_each_entry(
    block: &[u8],
    mut f: impl FnMut(RecordKey, StateValue) -> Result<(), CodecError>,
) -> Result<BlockHeader, CodecError> {
    let (header, mut r) = open(block)?;
    let windowed = header.info.window_size_ms.is_some();
    for entry in 0..header.entries {
        let key = record::read_key(&mut r).map_err(|source| CodecError::Entry { entry, source })?;
        let value = read_value(&mut r, windowed, entry)?;
        f(key, value)?;
    }
    if r.remaining() != 0 {
        return Err(CodecError::TrailingBytes {
            extra: r.remaining(),
        });
    }
    Ok(header)
}

/// Skips one entry's value and payload, checking them like [`read_value`] does.
fn skip_value(r: &mut Reader<'_>, windowed: bool, entry: u64) -> Result<(), CodecError> {
    let e = |source| CodecError::Entry { entry, source };
    if windowed {
        let n = r.varint().map_err(e)?;
        if n > (r.remaining() / 16) as u64 {
            return Err(e(WireError::BadLength { offset: r.pos }));
        }
        let mut last: Option<i64> = None;
        for _ in 0..n {
            let start = r.i64().map_err(e)?;
            r.bytes(8).map_err(e)?;
            if last.is_some_and(|s| s >= start) {
                return Err(CodecError::WindowsNotIncreasing { entry });
            }
            last = Some(start);
        }
    } else {
        r.bytes(8).map_err(e)?;
    }
    let n = r.len().map_err(e)?;
    r.bytes(n).map_err(e)?;
    Ok(())
}

/// Walks every entry of a block without allocating: calls `f` with each key (strings borrowed
/// from the block) and the entry's encoded bytes (key, value and payload exactly as stored), which
/// [`BlockWriter::push_raw`] appends to another block unchanged — how tools move entries between
/// key groups without re-encoding them. Checks the block like [`for_each_entry`].
pub fn for_each_raw_entry<'a>(
    block: &'a [u8],
    mut f: impl FnMut(KeyRef<'a>, &'a [u8]) -> Result<(), CodecError>,
) -> Result<BlockHeader, CodecError> {
    let (header, mut r) = open(block)?;
    let windowed = header.info.window_size_ms.is_some();
    for entry in 0..header.entries {
        let start = r.pos;
        let key =
            record::read_key_ref(&mut r).map_err(|source| CodecError::Entry { entry, source })?;
        skip_value(&mut r, windowed, entry)?;
        f(key, &r.buf[start..r.pos])?;
    }
    if r.remaining() != 0 {
        return Err(CodecError::TrailingBytes {
            extra: r.remaining(),
        });
    }
    Ok(header)
}

/// The whole state of a group whose blocks are a chain (incremental checkpoints): `base`, then
/// each of `deltas` in order, a key in a later block replacing the same key's state (and a
/// windowed key with no windows left removing it), encoded as one block with `base`'s header.
/// For tools, which then treat the group like any other; returns `(block, entries)`.
pub fn merge_chain(base: &[u8], deltas: &[Bytes]) -> Result<(Vec<u8>, u64), CodecError> {
    let first = decode_group(base)?;
    let info = first.header.info;
    let mut index: std::collections::HashMap<Key, usize> =
        std::collections::HashMap::with_capacity(first.entries.len());
    let mut entries: Vec<Option<(Key, StateValue)>> = Vec::with_capacity(first.entries.len());
    let mut overlay = |entries: &mut Vec<Option<(Key, StateValue)>>, k: Key, v: StateValue| {
        let gone = matches!(&v.acc, AccValue::Windows(ws) if ws.is_empty());
        match index.get(&k) {
            Some(&i) if gone => entries[i] = None,
            Some(&i) => entries[i] = Some((k, v)),
            None if gone => {}
            None => {
                index.insert(k.clone(), entries.len());
                entries.push(Some((k, v)));
            }
        }
    };
    for (k, v) in first.entries {
        overlay(&mut entries, k, v);
    }
    for d in deltas {
        for (k, v) in decode_group(d)?.entries {
            overlay(&mut entries, k, v);
        }
    }
    Ok(encode_entries(
        &info,
        entries.iter().flatten().map(|(k, v)| (k, v)),
    ))
}

/// Decodes a whole block without any job spec.
pub fn decode_group(block: &[u8]) -> Result<DecodedGroup, CodecError> {
    let (header, mut r) = open(block)?;
    let windowed = header.info.window_size_ms.is_some();
    // Each entry takes at least 10 bytes: bound the pre-allocation by the input size.
    let cap = header.entries.min((r.remaining() / 10) as u64) as usize;
    let mut entries = Vec::with_capacity(cap);
    for entry in 0..header.entries {
        let key =
            record::read_plain_key(&mut r).map_err(|source| CodecError::Entry { entry, source })?;
        let value = read_value(&mut r, windowed, entry)?;
        entries.push((key, value));
    }
    if r.remaining() != 0 {
        return Err(CodecError::TrailingBytes {
            extra: r.remaining(),
        });
    }
    Ok(DecodedGroup { header, entries })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info(windowed: bool) -> BlockInfo {
        BlockInfo {
            function: AggregateFunction::Sum,
            window_size_ms: windowed.then_some(10_000),
            max_parallelism: 128,
            key_group: 17,
        }
    }

    fn arb_key() -> impl Strategy<Value = Key> {
        prop_oneof![
            any::<i64>().prop_map(Key::Long),
            any::<i32>().prop_map(Key::Int),
            Just(Key::String(String::new())),
            "\\PC{0,24}".prop_map(Key::String),
            "[a-z0-9ßéü€😀中文-]{0,12}".prop_map(Key::String),
        ]
    }

    fn arb_value(windowed: bool) -> BoxedStrategy<StateValue> {
        let payload = proptest::collection::vec(any::<u8>(), 0..40);
        if windowed {
            (
                proptest::collection::btree_map(any::<i64>(), any::<i64>(), 0..5),
                payload,
            )
                .prop_map(|(ws, payload)| StateValue {
                    acc: AccValue::Windows(ws.into_iter().collect()),
                    payload,
                })
                .boxed()
        } else {
            (any::<i64>(), payload)
                .prop_map(|(v, payload)| StateValue {
                    acc: AccValue::Scalar(v),
                    payload,
                })
                .boxed()
        }
    }

    proptest! {
        #[test]
        fn round_trip_scalar(entries in proptest::collection::vec((arb_key(), arb_value(false)), 0..40)) {
            let (block, n) = encode_entries(&info(false), entries.iter().map(|(k, v)| (k, v)));
            prop_assert_eq!(n, entries.len() as u64);
            let d = decode_group(&block).unwrap();
            prop_assert_eq!(d.header.info, info(false));
            prop_assert_eq!(&d.header.schema, AGG_SCHEMA);
            prop_assert_eq!(d.entries, entries);
        }

        #[test]
        fn round_trip_windowed(entries in proptest::collection::vec((arb_key(), arb_value(true)), 0..40)) {
            let (block, _) = encode_entries(&info(true), entries.iter().map(|(k, v)| (k, v)));
            let d = decode_group(&block).unwrap();
            prop_assert_eq!(d.header.info, info(true));
            prop_assert_eq!(&d.entries, &entries);
            // The record-key path sees the same entries.
            let mut seen = Vec::new();
            for_each_entry(&block, |k, v| { seen.push((k.to_key(), v)); Ok(()) }).unwrap();
            prop_assert_eq!(&seen, &entries);
            // So does the shared-payload path, its payloads slices of the block.
            let shared = Bytes::from(block.clone());
            let opened = shared_entries(&shared).unwrap();
            prop_assert_eq!(opened.header().info, info(true));
            let mut seen = Vec::new();
            opened.for_each(|k, acc, payload| {
                if !payload.is_empty() {
                    let at = payload.as_ptr() as usize - shared.as_ptr() as usize;
                    assert!(at + payload.len() <= shared.len(), "payload outside the block");
                }
                seen.push((k.to_key(), StateValue { acc, payload: payload.to_vec() }));
                Ok(())
            }).unwrap();
            prop_assert_eq!(seen, entries);
        }

        #[test]
        fn corrupt_blocks_never_panic(entries in proptest::collection::vec((arb_key(), arb_value(true)), 1..8),
                                      flip in any::<usize>(), cut in any::<usize>()) {
            let (block, _) = encode_entries(&info(true), entries.iter().map(|(k, v)| (k, v)));
            let mut bad = block.clone();
            let i = flip % bad.len();
            bad[i] ^= 0x5a;
            prop_assert!(decode_group(&bad).is_err());
            prop_assert!(shared_entries(&Bytes::from(bad)).and_then(|o| o.for_each(|_, _, _| Ok(()))).is_err());
            let short = &block[..cut % block.len()];
            prop_assert!(decode_group(short).is_err());
            prop_assert!(shared_entries(&Bytes::copy_from_slice(short)).and_then(|o| o.for_each(|_, _, _| Ok(()))).is_err());
        }
    }

    proptest! {
        /// Raw entries moved into another block decode to the same entries, and the borrowed
        /// keys hash like the owned ones.
        #[test]
        fn raw_entries_round_trip(windowed in any::<bool>(), entries in proptest::collection::vec((arb_key(), arb_value(false)), 0..30)) {
            let entries: Vec<(Key, StateValue)> = if windowed {
                entries.into_iter().enumerate().map(|(i, (k, v))| (k, StateValue { acc: AccValue::Windows(vec![(i as i64, 1), (i as i64 + 5, 2)]), payload: v.payload })).collect()
            } else {
                entries
            };
            let (block, _) = encode_entries(&info(windowed), entries.iter().map(|(k, v)| (k, v)));
            let mut other = info(windowed);
            other.key_group = 3;
            other.max_parallelism = 7;
            let mut w = BlockWriter::new(&other, 0);
            let mut keys = Vec::new();
            let mut hashes = Vec::new();
            let h = for_each_raw_entry(&block, |k, raw| {
                keys.push(k.to_key());
                hashes.push(k.java_hash());
                w.push_raw(raw);
                Ok(())
            });
            prop_assert!(h.is_ok());
            prop_assert_eq!(hashes, keys.iter().map(Key::java_hash).collect::<Vec<_>>());
            let (copy, n) = w.finish();
            prop_assert_eq!(n, entries.len() as u64);
            let d = decode_group(&copy).unwrap();
            prop_assert_eq!(d.header.info, other);
            prop_assert_eq!(d.entries, entries.clone());
            prop_assert_eq!(keys, entries.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
        }

        #[test]
        fn raw_walk_rejects_corrupt_blocks(entries in proptest::collection::vec((arb_key(), arb_value(true)), 1..8), flip in any::<usize>()) {
            let (block, _) = encode_entries(&info(true), entries.iter().map(|(k, v)| (k, v)));
            let mut bad = block.clone();
            let i = flip % bad.len();
            bad[i] ^= 0x5a;
            prop_assert!(for_each_raw_entry(&bad, |_, _| Ok(())).is_err());
        }
    }

    #[test]
    fn blocks_appended_to_one_buffer_decode_on_their_own() {
        let (k, v) = (
            Key::Long(5),
            StateValue {
                acc: AccValue::Scalar(9),
                payload: vec![1, 2],
            },
        );
        let mut buf = b"prefix".to_vec();
        let mut spans = Vec::new();
        for g in [3, 4] {
            let mut i = info(false);
            i.key_group = g;
            let at = buf.len();
            let mut w = BlockWriter::append_to(buf, &i);
            assert_eq!(w.buf.len() - at, BlockWriter::HEADER_LEN);
            w.push_plain(&k, &v);
            let (b, n) = w.finish();
            assert_eq!(n, 1);
            buf = b;
            spans.push((g, at..buf.len()));
        }
        assert!(buf.starts_with(b"prefix"));
        for (g, span) in spans {
            let d = decode_group(&buf[span]).unwrap();
            assert_eq!(d.header.info.key_group, g);
            assert_eq!(d.entries, vec![(k.clone(), v.clone())]);
        }
    }

    /// The trailer is CRC-32 (IEEE): the standard check value, and a block written before the
    /// checksum moved from crc32fast to crc-fast (its bytes built by hand from the layout above,
    /// its trailer computed by zlib's crc32) still decodes.
    #[test]
    fn block_crc_is_crc32_ieee_and_old_blocks_verify() {
        assert_eq!(block_crc(b"123456789"), 0xcbf4_3926);
        assert_eq!(block_crc(b""), 0);
        let hex = "4b534b4701000f6b657973686966742e6167672e76310100000000000000000080000000\
                   05000000010000000000000000016b2a00000000000000004eaf19c8";
        let old: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        assert_eq!(old.len(), 64);
        let d = decode_group(&old).unwrap();
        assert_eq!(d.header.info.key_group, 5);
        assert_eq!(d.header.info.max_parallelism, 128);
        assert_eq!(d.header.info.function, AggregateFunction::Sum);
        assert_eq!(
            d.entries,
            vec![(
                Key::String("k".into()),
                StateValue {
                    acc: AccValue::Scalar(42),
                    payload: vec![]
                }
            )]
        );
        // And this build writes the same bytes for it.
        let (again, n) = encode_entries(&d.header.info, d.entries.iter().map(|(k, v)| (k, v)));
        assert_eq!((again, n), (old, 1));
    }

    /// Re-signs a tampered block so the checks behind the checksum are exercised.
    fn resign(mut body: Vec<u8>) -> Vec<u8> {
        let crc = block_crc(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        body
    }

    #[test]
    fn typed_errors_for_corrupt_blocks() {
        let entries = [(
            Key::String("k".into()),
            StateValue {
                acc: AccValue::Windows(vec![(0, 1), (10_000, 2)]),
                payload: vec![1, 2, 3],
            },
        )];
        let (block, _) = encode_entries(&info(true), entries.iter().map(|(k, v)| (k, v)));
        let body = block[..block.len() - 4].to_vec();
        assert!(matches!(
            decode_group(&[1, 2]),
            Err(CodecError::TooShort { len: 2 })
        ));
        let mut b = block.clone();
        b[0] = b'X';
        assert!(matches!(decode_group(&b), Err(CodecError::BadMagic { .. })));
        let mut b = block.clone();
        let last = b.len() - 6;
        b[last] ^= 1;
        assert!(matches!(decode_group(&b), Err(CodecError::Checksum { .. })));
        // Version 2.
        let mut b = body.clone();
        b[4] = 2;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::UnsupportedVersion(2))
        ));
        // Another schema of the same length.
        let mut b = body.clone();
        b[7] = b'X';
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::UnknownSchema(_))
        ));
        let fn_at = 7 + AGG_SCHEMA.len();
        let mut b = body.clone();
        b[fn_at] = 9;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::BadFunction(9))
        ));
        let mut b = body.clone();
        b[fn_at + 1] = 0x80;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::BadFlags(0x80))
        ));
        // An entry count larger than the entries present.
        let count_at = fn_at + 2 + 8 + 4 + 4;
        let mut b = body.clone();
        b[count_at] = 2;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::Entry { entry: 1, .. })
        ));
        // A bad key tag.
        let mut b = body.clone();
        b[count_at + 8] = 7;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::Entry {
                entry: 0,
                source: WireError::BadKeyTag { tag: 7, .. }
            })
        ));
        // Invalid UTF-8 in the key.
        let mut b = body.clone();
        b[count_at + 10] = 0xff;
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::Entry {
                source: WireError::BadUtf8 { .. },
                ..
            })
        ));
        // Window starts out of order: swap the two starts.
        let mut b = body.clone();
        let w0 = count_at + 8 + 3 + 1;
        let w1 = w0 + 16;
        let (s0, s1) = (b[w0..w0 + 8].to_vec(), b[w1..w1 + 8].to_vec());
        b[w0..w0 + 8].copy_from_slice(&s1);
        b[w1..w1 + 8].copy_from_slice(&s0);
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::WindowsNotIncreasing { entry: 0 })
        ));
        // Trailing garbage.
        let mut b = body.clone();
        b.push(0);
        assert!(matches!(
            decode_group(&resign(b)),
            Err(CodecError::TrailingBytes { extra: 1 })
        ));
        // A huge window count does not allocate or panic.
        let mut b = body.clone();
        b[w0 - 1] = 0xff;
        b.splice(w0..w0, [0xff, 0xff, 0xff, 0x0f]);
        assert!(decode_group(&resign(b)).is_err());
    }
}
