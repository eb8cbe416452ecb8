//! The key-group block of an SDK job's state: what a snapshot stores per key group, and a
//! restore, the savepoint tools and the key-group rewrite read.
//!
//! It shares the container of every keyshift state block (magic, format version, schema id,
//! CRC-32 trailer), so a tool tells an SDK block from a built-in aggregation's by its schema id.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "KSKG"
//! 4       2     format version, u16 LE (= 1)
//! 6       1     schema id length n
//! 7       n     schema id, ASCII ("keyshift.sdk.v1")
//! +0      1     kind: 0 full, 1 delta (the changes since the block before it in the chain)
//! +1      4     max parallelism the block was written under, u32 LE
//! +5      4     key group, u32 LE
//! +9      1     key type: 0 string, 1 long, 2 int
//! then    LEB128 length + UTF-8: the operator's uid
//! then    LEB128 state count s, then s x state:
//!           id u16 LE, LEB128 length + UTF-8 name, kind u8 (0 value, 1 map, 2 list,
//!           3 reducing, 4 aggregating), version u32 LE, LEB128 length + UTF-8 serializer,
//!           TTL u8 (0 none, 1 event time, 2 processing time) then, with one, ms i64 LE
//! then    entry count u64 LE, then entries:
//!           LEB128 length + entry key (key byte form | state id u16 BE | user key),
//!           u8 1 + LEB128 length + value (written), or u8 0 (deleted; deltas only)
//! last 4  CRC-32 (IEEE) of every byte before it, u32 LE
//! ```
//!
//! Timers are entries too (state ids 65535, event time, and 65534, processing time; the user
//! key is the timestamp, order-preserving), so they move, restore and re-hash with their key.
//! Every decoding path returns a typed [`BlockError`] on corrupt input; none panics.

use crate::error::BlockError;
use crate::key::{get_varint, put_varint};
use crate::state::{Declaration, StateId, StateKind, TimeDomain, Ttl};
use keyshift_core::keygroup::KeyType;
use std::collections::BTreeMap;

/// The magic bytes every keyshift state block starts with.
pub const BLOCK_MAGIC: [u8; 4] = *b"KSKG";
/// The container format version.
pub const FORMAT_VERSION: u16 = 1;
/// The schema id of an SDK job's blocks.
pub const SDK_SCHEMA: &str = "keyshift.sdk.v1";

/// Whether a block holds a whole group or the changes since the block before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Full,
    Delta,
}

/// What a block says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    pub kind: BlockKind,
    pub max_parallelism: u32,
    pub key_group: u32,
    pub key_type: KeyType,
    /// The keyed step's uid.
    pub operator: String,
    /// The states the writer declared, with the ids its entries use.
    pub states: Vec<(StateId, Declaration)>,
}

/// A decoded block: its header and entries (`None`: deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub header: BlockHeader,
    pub entries: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

pub(crate) fn crc(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32IsoHdlc, data) as u32
}

fn key_type_code(t: KeyType) -> u8 {
    match t {
        KeyType::String => 0,
        KeyType::Long => 1,
        KeyType::Int => 2,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// A block as written, with the number of entries it holds (so a caller never re-reads a block
/// it has just written to count them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedBlock {
    /// The block's bytes, checksum included.
    pub bytes: Vec<u8>,
    /// Its entries (deletions included, in a delta).
    pub entries: u64,
}

/// One group's chain as [`compact`] and [`KeyedOperator::restore_group`] take it: its first
/// (full) block, then its deltas in order.
///
/// [`KeyedOperator::restore_group`]: crate::operator::KeyedOperator::restore_group
pub fn chain<'a, D: AsRef<[u8]>>(first: &'a [u8], deltas: &'a [D]) -> Vec<&'a [u8]> {
    let mut chain = Vec::with_capacity(deltas.len() + 1);
    chain.push(first);
    chain.extend(deltas.iter().map(AsRef::as_ref));
    chain
}

/// Writes a block: [`BlockWriter::new`], then entries, then [`BlockWriter::finish`].
pub struct BlockWriter {
    buf: Vec<u8>,
    count_at: usize,
    entries: u64,
}

impl BlockWriter {
    /// Starts a block with `header`.
    pub fn new(header: &BlockHeader) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&BLOCK_MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.push(SDK_SCHEMA.len() as u8);
        buf.extend_from_slice(SDK_SCHEMA.as_bytes());
        buf.push(match header.kind {
            BlockKind::Full => 0,
            BlockKind::Delta => 1,
        });
        buf.extend_from_slice(&header.max_parallelism.to_le_bytes());
        buf.extend_from_slice(&header.key_group.to_le_bytes());
        buf.push(key_type_code(header.key_type));
        put_str(&mut buf, &header.operator);
        put_varint(&mut buf, header.states.len() as u64);
        for (id, d) in &header.states {
            buf.extend_from_slice(&id.to_le_bytes());
            put_str(&mut buf, &d.name);
            buf.push(d.kind.code());
            buf.extend_from_slice(&d.version.to_le_bytes());
            put_str(&mut buf, &d.serializer);
            match d.ttl {
                None => buf.push(0),
                Some(t) => {
                    buf.push(match t.domain {
                        TimeDomain::EventTime => 1,
                        TimeDomain::ProcessingTime => 2,
                    });
                    buf.extend_from_slice(&t.after_ms.to_le_bytes());
                }
            }
        }
        let count_at = buf.len();
        buf.extend_from_slice(&0u64.to_le_bytes());
        BlockWriter {
            buf,
            count_at,
            entries: 0,
        }
    }

    /// Appends a written entry.
    pub fn put(&mut self, key: &[u8], value: &[u8]) {
        put_varint(&mut self.buf, key.len() as u64);
        self.buf.extend_from_slice(key);
        self.buf.push(1);
        put_varint(&mut self.buf, value.len() as u64);
        self.buf.extend_from_slice(value);
        self.entries += 1;
    }

    /// Appends a deletion (deltas only).
    pub fn delete(&mut self, key: &[u8]) {
        put_varint(&mut self.buf, key.len() as u64);
        self.buf.extend_from_slice(key);
        self.buf.push(0);
        self.entries += 1;
    }

    /// Entries so far.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// The finished block.
    pub fn finish(self) -> Vec<u8> {
        self.finish_counted().bytes
    }

    /// The finished block, with its entry count.
    pub fn finish_counted(mut self) -> EncodedBlock {
        self.buf[self.count_at..self.count_at + 8].copy_from_slice(&self.entries.to_le_bytes());
        let c = crc(&self.buf);
        self.buf.extend_from_slice(&c.to_le_bytes());
        EncodedBlock {
            bytes: self.buf,
            entries: self.entries,
        }
    }
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Whether every byte was read.
    pub(crate) fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }
    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], BlockError> {
        let end = self.pos.checked_add(n).ok_or(BlockError::Malformed(what))?;
        let b = self
            .buf
            .get(self.pos..end)
            .ok_or(BlockError::Malformed(what))?;
        self.pos = end;
        Ok(b)
    }
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, BlockError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], BlockError> {
        self.take(N, what)?
            .try_into()
            .map_err(|_| BlockError::Malformed(what))
    }
    pub(crate) fn varint(&mut self, what: &'static str) -> Result<u64, BlockError> {
        let rest = self
            .buf
            .get(self.pos..)
            .ok_or(BlockError::Malformed(what))?;
        let (v, n) = get_varint(rest).ok_or(BlockError::Malformed(what))?;
        self.pos += n;
        Ok(v)
    }
    pub(crate) fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], BlockError> {
        let n = usize::try_from(self.varint(what)?).map_err(|_| BlockError::Malformed(what))?;
        self.take(n, what)
    }
    pub(crate) fn string(&mut self, what: &'static str) -> Result<String, BlockError> {
        std::str::from_utf8(self.bytes(what)?)
            .map(str::to_owned)
            .map_err(|_| BlockError::Malformed(what))
    }
}

/// The SDK's container, as its blocks and operator-state sections share it: at least `min`
/// bytes, `magic` first and a CRC-32 of the rest last. Returns a reader of the body after the
/// magic (the trailer left out).
pub(crate) fn checked(bytes: &[u8], magic: [u8; 4], min: usize) -> Result<Reader<'_>, BlockError> {
    if bytes.len() < min.max(8) {
        return Err(BlockError::TooShort { len: bytes.len() });
    }
    let mut found = [0u8; 4];
    found.copy_from_slice(&bytes[..4]);
    if found != magic {
        return Err(BlockError::BadMagic { found });
    }
    let (body, trailer) = bytes.split_at(bytes.len() - 4);
    let mut stored = [0u8; 4];
    stored.copy_from_slice(trailer);
    let stored = u32::from_le_bytes(stored);
    let computed = crc(body);
    if stored != computed {
        return Err(BlockError::Checksum { stored, computed });
    }
    Ok(Reader { buf: body, pos: 4 })
}

/// Checks the container (length, magic, checksum, version, schema) and reads the header;
/// returns it and a reader at the entry count.
fn open(block: &[u8]) -> Result<(BlockHeader, Reader<'_>), BlockError> {
    let mut r = checked(block, BLOCK_MAGIC, 12)?;
    let version = u16::from_le_bytes(r.array("format version")?);
    if version != FORMAT_VERSION {
        return Err(BlockError::UnsupportedVersion(version));
    }
    let n = usize::from(r.u8("schema")?);
    let schema = String::from_utf8_lossy(r.take(n, "schema")?).into_owned();
    if schema != SDK_SCHEMA {
        return Err(BlockError::UnknownSchema(schema));
    }
    let kind = match r.u8("kind")? {
        0 => BlockKind::Full,
        1 => BlockKind::Delta,
        _ => return Err(BlockError::Malformed("block kind")),
    };
    let max_parallelism = u32::from_le_bytes(r.array("max parallelism")?);
    let key_group = u32::from_le_bytes(r.array("key group")?);
    let key_type = match r.u8("key type")? {
        0 => KeyType::String,
        1 => KeyType::Long,
        2 => KeyType::Int,
        _ => return Err(BlockError::Malformed("key type")),
    };
    let operator = r.string("operator uid")?;
    let count = r.varint("state count")?;
    let mut states = Vec::new();
    for _ in 0..count {
        let id = u16::from_le_bytes(r.array("state id")?);
        let name = r.string("state name")?;
        let kind =
            StateKind::from_code(r.u8("state kind")?).ok_or(BlockError::Malformed("state kind"))?;
        let version = u32::from_le_bytes(r.array("state version")?);
        let serializer = r.string("state serializer")?;
        let ttl = match r.u8("state TTL")? {
            0 => None,
            d @ (1 | 2) => Some(Ttl {
                after_ms: i64::from_le_bytes(r.array("state TTL")?),
                domain: if d == 1 {
                    TimeDomain::EventTime
                } else {
                    TimeDomain::ProcessingTime
                },
            }),
            _ => return Err(BlockError::Malformed("state TTL")),
        };
        states.push((
            id,
            Declaration {
                name,
                kind,
                version,
                serializer,
                ttl,
            },
        ));
    }
    Ok((
        BlockHeader {
            kind,
            max_parallelism,
            key_group,
            key_type,
            operator,
            states,
        },
        r,
    ))
}

/// Reads only a block's header (after checking its checksum).
pub fn decode_header(block: &[u8]) -> Result<BlockHeader, BlockError> {
    open(block).map(|(h, _)| h)
}

/// One entry of a block as a person reads it (what `keyshift savepoint dump` prints): its key,
/// the state it belongs to by its declared name (or the timers of a clock), and its value.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryView {
    /// The key it belongs to.
    pub key: keyshift_core::keygroup::Key,
    /// The state's declared name; `timers` for a timer.
    pub state: String,
    /// `value`, `map`, `list`, `reducing`, `aggregating`; a timer's clock: `event-time` or
    /// `processing-time`.
    pub kind: String,
    /// A timer's time (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timer: Option<i64>,
    /// A map entry's key or a list element's position, as stored (hex).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_key: Option<String>,
    /// When the entry expires (its state's TTL; ms on the TTL's clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// The value, for a state serialized as JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// The value as stored (hex), for any other serializer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value_hex: Option<String>,
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A value as JSON, when its serializer wrote JSON (else the tools show it in hex).
pub(crate) fn as_json(serializer: &str, bytes: &[u8]) -> Option<serde_json::Value> {
    (serializer == "json")
        .then(|| serde_json::from_slice(bytes).ok())
        .flatten()
}

/// A block's header and its entries as people read them ([`EntryView`]), in block order.
/// Deletions (in a delta) are left out.
pub fn describe(block: &[u8]) -> Result<(BlockHeader, Vec<EntryView>), BlockError> {
    use crate::state::{EVENT_TIMERS, PROCESSING_TIMERS};
    let b = decode(block)?;
    let states: BTreeMap<StateId, &Declaration> =
        b.header.states.iter().map(|(id, d)| (*id, d)).collect();
    let mut out = Vec::with_capacity(b.entries.len());
    for (n, (entry_key, value)) in b.entries.iter().enumerate() {
        let Some(value) = value else { continue };
        let (key, len) = crate::key::decode_key(entry_key).map_err(|source| BlockError::Key {
            entry: n as u64,
            source,
        })?;
        let id = entry_key
            .get(len..len + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or(BlockError::Malformed("an entry key without its state id"))?;
        let user = &entry_key[len + 2..];
        let view = match id {
            EVENT_TIMERS | PROCESSING_TIMERS => EntryView {
                key,
                state: "timers".into(),
                kind: if id == EVENT_TIMERS {
                    "event-time"
                } else {
                    "processing-time"
                }
                .into(),
                timer: user
                    .try_into()
                    .ok()
                    .map(|b: [u8; 8]| (u64::from_be_bytes(b) ^ (1 << 63)) as i64),
                user_key: None,
                expires_at: None,
                value: None,
                value_hex: None,
            },
            id => {
                let d = states.get(&id).ok_or(BlockError::Malformed(
                    "an entry of a state the block does not declare",
                ))?;
                let (expires_at, bytes) = match d.ttl {
                    Some(_) => {
                        let (e, rest) = value
                            .split_first_chunk::<8>()
                            .ok_or(BlockError::Malformed("an entry too short for its expiry"))?;
                        (Some(i64::from_be_bytes(*e)), rest)
                    }
                    None => (None, value.as_slice()),
                };
                let json = as_json(&d.serializer, bytes);
                EntryView {
                    key,
                    state: d.name.clone(),
                    kind: d.kind.to_string(),
                    timer: None,
                    user_key: (!user.is_empty()).then(|| hex(user)),
                    expires_at,
                    value_hex: json.is_none().then(|| hex(bytes)),
                    value: json,
                }
            }
        };
        out.push(view);
    }
    Ok((b.header, out))
}

/// Checks a block as a snapshot of group `group` under `max_parallelism` groups holds it: it
/// decodes, names that group and count, and every key in it belongs to the group. Returns its
/// entry count. (What a restore checks beyond this is the job's: its step, key type and
/// states.)
pub fn check(block: &[u8], group: u32, max_parallelism: u32) -> Result<u64, BlockError> {
    let b = decode(block)?;
    if b.header.key_group != group {
        return Err(BlockError::WrongGroup {
            block: b.header.key_group,
            expected: group,
        });
    }
    if b.header.max_parallelism != max_parallelism {
        return Err(BlockError::MaxParallelism {
            block: b.header.max_parallelism,
            job: max_parallelism,
        });
    }
    for (n, (key, _)) in b.entries.iter().enumerate() {
        let (k, _) = crate::key::decode_key(key).map_err(|source| BlockError::Key {
            entry: n as u64,
            source,
        })?;
        let actual = keyshift_core::keygroup::key_group_for_key(&k, max_parallelism);
        if actual != group {
            return Err(BlockError::KeyInWrongGroup {
                key: k.to_string(),
                group,
                actual,
            });
        }
    }
    Ok(b.entries.len() as u64)
}

/// Decodes a whole block.
pub fn decode(block: &[u8]) -> Result<Block, BlockError> {
    let (header, mut r) = open(block)?;
    let count = u64::from_le_bytes(r.array("entry count")?);
    let mut entries = Vec::new();
    for _ in 0..count {
        let key = r.bytes("entry key")?.to_vec();
        let value = match r.u8("entry flag")? {
            1 => Some(r.bytes("entry value")?.to_vec()),
            0 if header.kind == BlockKind::Delta => None,
            _ => return Err(BlockError::Malformed("entry flag")),
        };
        entries.push((key, value));
    }
    if r.pos != r.buf.len() {
        return Err(BlockError::Malformed("bytes after the last entry"));
    }
    Ok(Block { header, entries })
}

/// A group's entries by key.
type Entries = BTreeMap<Vec<u8>, Vec<u8>>;

/// One group's chain (a full block, then its deltas in order) merged into its entries, with
/// the header of the chain's first block. Every block is checked: its group, its kind (a delta
/// may not come first) and that the chain agrees on the operator and its states.
fn merge_chain(group: u32, chain: &[&[u8]]) -> Result<(Option<BlockHeader>, Entries), BlockError> {
    let mut header: Option<BlockHeader> = None;
    let mut merged = Entries::new();
    for (i, bytes) in chain.iter().enumerate() {
        let b = decode(bytes)?;
        if b.header.key_group != group {
            return Err(BlockError::WrongGroup {
                block: b.header.key_group,
                expected: group,
            });
        }
        if i == 0 && b.header.kind == BlockKind::Delta {
            return Err(BlockError::DeltaFirst(group));
        }
        match &header {
            None => header = Some(b.header.clone()),
            Some(h) if !h.same_state(&b.header) => {
                return Err(BlockError::Malformed(
                    "the snapshot's blocks disagree on the operator or its states",
                ));
            }
            Some(_) => {}
        }
        for (key, value) in b.entries {
            match value {
                Some(v) => {
                    merged.insert(key, v);
                }
                None => {
                    merged.remove(&key);
                }
            }
        }
    }
    Ok((header, merged))
}

impl BlockHeader {
    /// Whether two blocks hold the same step's state (operator, key type, declared states).
    fn same_state(&self, other: &BlockHeader) -> bool {
        self.operator == other.operator
            && self.key_type == other.key_type
            && self.max_parallelism == other.max_parallelism
            && self.states == other.states
    }
}

fn full_block(header: &BlockHeader, group: u32, entries: &Entries) -> EncodedBlock {
    let mut w = BlockWriter::new(&BlockHeader {
        kind: BlockKind::Full,
        key_group: group,
        ..header.clone()
    });
    for (k, v) in entries {
        w.put(k, v);
    }
    w.finish_counted()
}

/// Compacts one group's chain (a full block, then its deltas in order) into one full block
/// holding what the chain holds ([`chain`] builds one). Every block is checked first.
pub fn compact(group: u32, chain: &[&[u8]]) -> Result<EncodedBlock, BlockError> {
    let (header, entries) = merge_chain(group, chain)?;
    let header = header.ok_or(BlockError::Malformed("an empty chain"))?;
    Ok(full_block(&header, group, &entries))
}

/// Re-buckets a snapshot's key groups into `max_parallelism` groups (the managed key-group
/// ceiling change): every group's chain is merged, every entry (each kind of state, and the
/// timers) goes to the group its key hashes to under the new count, and each new group is one
/// full block. Every block is checked first; a block that fails stops the rewrite.
pub fn rewrite<'a>(
    chains: impl IntoIterator<Item = (u32, Vec<&'a [u8]>)>,
    max_parallelism: u32,
) -> Result<BTreeMap<u32, EncodedBlock>, BlockError> {
    let mut header: Option<BlockHeader> = None;
    let mut groups: BTreeMap<u32, Entries> = BTreeMap::new();
    for (group, chain) in chains {
        let (h, merged) = merge_chain(group, &chain)?;
        match (&header, h) {
            (None, h) => header = h,
            (Some(a), Some(b)) if a.operator != b.operator || a.states != b.states => {
                return Err(BlockError::Malformed(
                    "the snapshot's blocks disagree on the operator or its states",
                ));
            }
            _ => {}
        }
        for (n, (key, value)) in merged.into_iter().enumerate() {
            let (k, _) = crate::key::decode_key(&key).map_err(|source| BlockError::Key {
                entry: n as u64,
                source,
            })?;
            let g = keyshift_core::keygroup::key_group_for_key(&k, max_parallelism);
            groups.entry(g).or_default().insert(key, value);
        }
    }
    let Some(header) = header else {
        return Ok(BTreeMap::new());
    };
    let header = BlockHeader {
        max_parallelism,
        ..header
    };
    Ok(groups
        .into_iter()
        .map(|(g, entries)| (g, full_block(&header, g, &entries)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(kind: BlockKind) -> BlockHeader {
        BlockHeader {
            kind,
            max_parallelism: 128,
            key_group: 7,
            key_type: KeyType::String,
            operator: "dedup".into(),
            states: vec![(
                0,
                Declaration {
                    name: "seen".into(),
                    kind: StateKind::Value,
                    version: 2,
                    serializer: "postcard".into(),
                    ttl: Some(Ttl {
                        after_ms: 60_000,
                        domain: TimeDomain::EventTime,
                    }),
                },
            )],
        }
    }

    proptest! {
        #[test]
        fn blocks_round_trip_and_every_corruption_is_caught(
            entries in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..12), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..12))), 0..20),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let mut w = BlockWriter::new(&header(BlockKind::Delta));
            for (k, v) in &entries {
                match v {
                    Some(v) => w.put(k, v),
                    None => w.delete(k),
                }
            }
            let bytes = w.finish();
            let block = decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&block.header, &header(BlockKind::Delta));
            prop_assert_eq!(&block.entries, &entries);
            let mut bad = bytes.clone();
            let i = flip.index(bad.len());
            bad[i] ^= 1 << bit;
            prop_assert!(decode(&bad).is_err());
            for cut in [0, 5, bytes.len() / 2, bytes.len() - 1] {
                prop_assert!(decode(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn a_full_block_may_not_hold_deletions() {
        let mut w = BlockWriter::new(&header(BlockKind::Full));
        w.delete(b"k");
        assert_eq!(
            decode(&w.finish()),
            Err(BlockError::Malformed("entry flag"))
        );
    }

    #[test]
    fn a_compacted_chain_holds_what_the_chain_holds_and_a_broken_one_is_refused() {
        let block = |kind, entries: &[(&[u8], Option<&[u8]>)]| {
            let mut w = BlockWriter::new(&header(kind));
            for (k, v) in entries {
                match v {
                    Some(v) => w.put(k, v),
                    None => w.delete(k),
                }
            }
            w.finish()
        };
        let full = block(BlockKind::Full, &[(b"a", Some(b"1")), (b"b", Some(b"2"))]);
        let delta = block(
            BlockKind::Delta,
            &[(b"a", None), (b"c", Some(b"3")), (b"b", Some(b"4"))],
        );
        let merged = compact(7, &chain(&full, &[&delta[..]])).unwrap();
        assert_eq!(merged.entries, 2);
        let b = decode(&merged.bytes).unwrap();
        assert_eq!(b.header, header(BlockKind::Full));
        assert_eq!(
            b.entries,
            vec![
                (b"b".to_vec(), Some(b"4".to_vec())),
                (b"c".to_vec(), Some(b"3".to_vec()))
            ]
        );
        assert_eq!(compact(7, &[&delta]), Err(BlockError::DeltaFirst(7)));
        assert!(matches!(
            compact(8, &[&full]),
            Err(BlockError::WrongGroup {
                block: 7,
                expected: 8
            })
        ));
        let mut other = header(BlockKind::Delta);
        other.operator = "other".into();
        let foreign = BlockWriter::new(&other).finish();
        assert!(matches!(
            compact(7, &[&full, &foreign]),
            Err(BlockError::Malformed(_))
        ));
    }

    #[test]
    fn a_check_finds_a_key_outside_its_group_and_a_block_of_another_group_or_count() {
        let key = |text: &str| {
            let mut k = Vec::new();
            crate::key::encode_key(&keyshift_core::keygroup::Key::String(text.into()), &mut k);
            k.extend_from_slice(&0u16.to_be_bytes());
            k
        };
        let group = keyshift_core::keygroup::key_group_for_key(
            &keyshift_core::keygroup::Key::String("a".into()),
            128,
        );
        let other = (0..)
            .map(|i| format!("k{i}"))
            .find(|t| {
                keyshift_core::keygroup::key_group_for_key(
                    &keyshift_core::keygroup::Key::String(t.clone()),
                    128,
                ) != group
            })
            .unwrap();
        let block = |keys: &[&str]| {
            let mut w = BlockWriter::new(&BlockHeader {
                key_group: group,
                ..header(BlockKind::Full)
            });
            for k in keys {
                w.put(&key(k), b"v");
            }
            w.finish()
        };
        assert_eq!(check(&block(&["a"]), group, 128), Ok(1));
        assert!(matches!(
            check(&block(&["a", &other]), group, 128),
            Err(BlockError::KeyInWrongGroup { .. })
        ));
        assert!(matches!(
            check(&block(&["a"]), group + 1, 128),
            Err(BlockError::WrongGroup { .. })
        ));
        assert!(matches!(
            check(&block(&["a"]), group, 256),
            Err(BlockError::MaxParallelism { .. })
        ));
    }
}
