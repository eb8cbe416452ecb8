//! Sinks, as logic: formatting results, and the exactly-once staging of object-store output.
//!
//! Results are JSON lines: `{"key":"key-7","value":42}` or, windowed,
//! `{"key":7,"window":{"start":0,"end":10000},"value":42}` (string keys as JSON strings, long
//! and int keys as numbers).
//!
//! # Exactly once by commit-on-checkpoint ([`StagingSink`])
//!
//! The runtime writes objects; this type decides *what* and *when*:
//!
//! 1. Rows a subtask emits between barrier `N-1` and barrier `N` are staged in memory
//!    ([`StagingSink::emit`]).
//! 2. At barrier `N` the runtime calls [`StagingSink::on_barrier`]`(N)`, which seals them as the
//!    pending output of checkpoint `N`, and stores [`StagingSink::snapshot`] in the subtask's
//!    snapshot for `N`: pending output is part of the snapshot.
//! 3. When checkpoint `N` completes, [`StagingSink::on_checkpoint_complete`]`(N)` hands back every
//!    pending output of checkpoints `<= N` (an aborted checkpoint's output rides with the next
//!    one); the runtime writes each to `<sink url>/<Output::object>`.
//! 4. On restore from checkpoint `N`, [`StagingSink::restore`] returns the outputs pending in
//!    that snapshot: they belong to checkpoints `<= N`, which completed, so the runtime writes
//!    them again (they may or may not have been written before the failure). Rows staged after
//!    the restored barrier are gone and are produced again by the replay from `N`'s positions.
//!
//! Writes are idempotent because an object's name is fixed by its checkpoint id and the writer
//! (`chk-<id>/part-<subtask>-of-<parallelism>.jsonl`) and its bytes are in the snapshot: a
//! create-only put that finds the object already there has nothing left to do. Two
//! requirements fall on the runtime: checkpoint ids must never be reused, not even after a
//! restore from an older snapshot (use ids above any id ever attempted); and on a rescale each
//! old subtask's sink snapshot must be restored by exactly one new subtask (or committed by the
//! coordinator), since this state is per writer, not per key group.

use super::aggregate::{ResultRow, Window};
use super::record::{KeyRef, Reader, RecordKey, WireError, put_varint};
use std::collections::BTreeMap;

/// Appends a result as one JSON line (with the trailing newline).
pub fn format_json_line(row: &ResultRow, out: &mut Vec<u8>) {
    format_json_row(&row.key, row.window, row.value, out);
}

/// Appends one result, given by its parts, as one JSON line (with the trailing newline): the
/// same bytes as [`format_json_line`], without building a [`ResultRow`]. Numbers are formatted
/// without `fmt`, and a string key that needs no escaping is copied as is.
#[inline]
pub fn format_json_row(key: &RecordKey, window: Option<Window>, value: i64, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"key\":");
    match key.view() {
        KeyRef::Long(v) => put_i64(out, v),
        KeyRef::Int(v) => put_i64(out, i64::from(v)),
        KeyRef::Str(s) => put_json_str(out, s),
    }
    if let Some(w) = window {
        out.extend_from_slice(b",\"window\":{\"start\":");
        put_i64(out, w.start);
        out.extend_from_slice(b",\"end\":");
        put_i64(out, w.end);
        out.push(b'}');
    }
    out.extend_from_slice(b",\"value\":");
    put_i64(out, value);
    out.extend_from_slice(b"}\n");
}

/// A JSON string: copied between quotes when nothing in it needs escaping (no `"`, `\\` or
/// control character; what `serde_json` escapes), else written by `serde_json`.
#[inline]
fn put_json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing JSON into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// A decimal integer, as `{v}` formats it.
#[inline]
fn put_i64(out: &mut Vec<u8>, v: i64) {
    let mut buf = [0u8; 20];
    let mut n = v.unsigned_abs();
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if v < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

/// The log sink: formats results for the worker's log.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogSink;

impl LogSink {
    /// A result as one JSON line without the newline.
    pub fn format(row: &ResultRow) -> String {
        let mut out = Vec::with_capacity(64);
        format_json_line(row, &mut out);
        out.pop();
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// The writer a staging sink belongs to: the subtask and the parallelism it runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterId {
    /// Subtask index.
    pub subtask: u32,
    /// Parallelism of the job run the subtask belongs to.
    pub parallelism: u32,
}

/// One object to write once its checkpoint has completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The checkpoint whose completion commits it.
    pub checkpoint_id: u64,
    /// Object name relative to the sink URL.
    pub object: String,
    /// Number of result rows in it.
    pub rows: u64,
    /// JSON lines.
    pub body: Vec<u8>,
}

/// Errors of the staging sink.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    #[error("checkpoint barrier {got} is not above the previous barrier {previous}")]
    BarrierOrder { previous: u64, got: u64 },
    #[error("sink snapshot is not a keyshift sink snapshot")]
    BadMagic,
    #[error("sink snapshot checksum mismatch: the snapshot is corrupt")]
    Checksum,
    #[error("unsupported sink snapshot version {0}")]
    UnsupportedVersion(u16),
    #[error("malformed sink snapshot: {0}")]
    Malformed(#[from] WireError),
    #[error("sink snapshot has {extra} unexpected trailing bytes")]
    TrailingBytes { extra: usize },
}

const SINK_MAGIC: [u8; 4] = *b"KSSK";
const SINK_VERSION: u16 = 1;

/// Object-store output staged until the checkpoint covering it completes.
#[derive(Debug, Clone)]
pub struct StagingSink {
    writer: WriterId,
    current: Vec<u8>,
    current_rows: u64,
    last_barrier: Option<u64>,
    pending: BTreeMap<u64, Vec<Output>>,
}

impl StagingSink {
    /// An empty sink for `writer`.
    pub fn new(writer: WriterId) -> Self {
        StagingSink {
            writer,
            current: Vec::new(),
            current_rows: 0,
            last_barrier: None,
            pending: BTreeMap::new(),
        }
    }

    /// The object name of this writer's output for a checkpoint.
    pub fn object_name(writer: WriterId, checkpoint_id: u64) -> String {
        format!(
            "chk-{checkpoint_id:012}/part-{:05}-of-{:05}.jsonl",
            writer.subtask, writer.parallelism
        )
    }

    /// Stages rows for the next barrier.
    pub fn emit(&mut self, rows: &[ResultRow]) {
        for row in rows {
            format_json_line(row, &mut self.current);
        }
        self.current_rows += rows.len() as u64;
    }

    /// Rows staged since the last barrier.
    pub fn staged_rows(&self) -> u64 {
        self.current_rows
    }

    /// Seals the staged rows as checkpoint `checkpoint_id`'s pending output (nothing when no row
    /// was staged). Barrier ids must increase.
    pub fn on_barrier(&mut self, checkpoint_id: u64) -> Result<(), SinkError> {
        if let Some(previous) = self.last_barrier
            && checkpoint_id <= previous
        {
            return Err(SinkError::BarrierOrder {
                previous,
                got: checkpoint_id,
            });
        }
        self.last_barrier = Some(checkpoint_id);
        if self.current_rows > 0 {
            let output = Output {
                checkpoint_id,
                object: Self::object_name(self.writer, checkpoint_id),
                rows: self.current_rows,
                body: std::mem::take(&mut self.current),
            };
            self.pending.entry(checkpoint_id).or_default().push(output);
            self.current_rows = 0;
        }
        Ok(())
    }

    /// Pending outputs not yet handed out for commit.
    pub fn pending(&self) -> impl Iterator<Item = &Output> {
        self.pending.values().flatten()
    }

    /// Hands out every pending output of checkpoints `<= checkpoint_id`, oldest first, for the
    /// runtime to write; they leave the sink's state.
    pub fn on_checkpoint_complete(&mut self, checkpoint_id: u64) -> Vec<Output> {
        let done = match checkpoint_id.checked_add(1) {
            Some(next) => {
                let later = self.pending.split_off(&next);
                std::mem::replace(&mut self.pending, later)
            }
            None => std::mem::take(&mut self.pending),
        };
        done.into_values().flatten().collect()
    }

    /// The pending outputs as bytes, for the subtask's snapshot (call after
    /// [`StagingSink::on_barrier`]). Rows staged after the barrier are not included.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&SINK_MAGIC);
        out.extend_from_slice(&SINK_VERSION.to_le_bytes());
        let outputs: Vec<&Output> = self.pending().collect();
        put_varint(&mut out, outputs.len() as u64);
        for o in outputs {
            out.extend_from_slice(&o.checkpoint_id.to_le_bytes());
            put_varint(&mut out, o.object.len() as u64);
            out.extend_from_slice(o.object.as_bytes());
            out.extend_from_slice(&o.rows.to_le_bytes());
            put_varint(&mut out, o.body.len() as u64);
            out.extend_from_slice(&o.body);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    fn decode(snapshot: &[u8]) -> Result<Vec<Output>, SinkError> {
        if snapshot.len() < 10 || snapshot[..4] != SINK_MAGIC {
            return Err(SinkError::BadMagic);
        }
        let (body, crc) = snapshot.split_at(snapshot.len() - 4);
        let mut stored = [0u8; 4];
        stored.copy_from_slice(crc);
        if u32::from_le_bytes(stored) != crc32fast::hash(body) {
            return Err(SinkError::Checksum);
        }
        let mut r = Reader::new(body);
        r.pos = 4;
        let version = r.u16()?;
        if version != SINK_VERSION {
            return Err(SinkError::UnsupportedVersion(version));
        }
        let n = r.varint()?;
        let mut outputs = Vec::new();
        for _ in 0..n {
            let checkpoint_id = r.u64()?;
            let len = r.len()?;
            let at = r.pos;
            let object = std::str::from_utf8(r.bytes(len)?)
                .map_err(|_| WireError::BadUtf8 { offset: at })?
                .to_owned();
            let rows = r.u64()?;
            let len = r.len()?;
            let body = r.bytes(len)?.to_vec();
            outputs.push(Output {
                checkpoint_id,
                object,
                rows,
                body,
            });
        }
        if r.remaining() != 0 {
            return Err(SinkError::TrailingBytes {
                extra: r.remaining(),
            });
        }
        Ok(outputs)
    }

    /// Restores a sink for `writer` from the sink snapshots of a completed checkpoint (one per
    /// old writer this subtask takes over). Returns the sink (nothing staged or pending) and the
    /// outputs the runtime must (re)write now, oldest first: they belong to completed
    /// checkpoints. Rows staged after that checkpoint's barrier are not in it and will be
    /// produced again by the replay.
    pub fn restore(
        writer: WriterId,
        snapshots: &[&[u8]],
    ) -> Result<(StagingSink, Vec<Output>), SinkError> {
        let mut outputs = Vec::new();
        for s in snapshots {
            outputs.extend(Self::decode(s)?);
        }
        outputs.sort_by(|a, b| {
            a.checkpoint_id
                .cmp(&b.checkpoint_id)
                .then_with(|| a.object.cmp(&b.object))
        });
        Ok((StagingSink::new(writer), outputs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::aggregate::Window;
    use crate::job::record::RecordKey;

    fn row(key: RecordKey, value: i64) -> ResultRow {
        ResultRow {
            key,
            window: None,
            value,
        }
    }

    #[test]
    fn json_lines() {
        assert_eq!(
            LogSink::format(&row(RecordKey::string("a\"b"), 3)),
            r#"{"key":"a\"b","value":3}"#
        );
        let w = ResultRow {
            key: RecordKey::long(-7),
            window: Some(Window { start: 0, end: 10 }),
            value: 1,
        };
        let line = LogSink::format(&w);
        assert_eq!(
            line,
            r#"{"key":-7,"window":{"start":0,"end":10},"value":1}"#
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["window"]["end"], 10);
    }

    /// The reference the fast formatter must match byte for byte: `serde_json` for the key,
    /// `fmt` for the numbers.
    fn reference_line(key: &RecordKey, window: Option<Window>, value: i64) -> Vec<u8> {
        use std::io::Write;
        let mut out = b"{\"key\":".to_vec();
        match key.view() {
            KeyRef::Long(v) => write!(out, "{v}").unwrap(),
            KeyRef::Int(v) => write!(out, "{v}").unwrap(),
            KeyRef::Str(s) => serde_json::to_writer(&mut out, s).unwrap(),
        }
        if let Some(w) = window {
            write!(
                out,
                ",\"window\":{{\"start\":{},\"end\":{}}}",
                w.start, w.end
            )
            .unwrap();
        }
        writeln!(out, ",\"value\":{value}}}").unwrap();
        out
    }

    proptest::proptest! {
        #[test]
        fn fast_lines_match_the_reference(
            text in "\\PC{0,12}|[\\x00-\\x7f]{0,12}|[a-z\"\\\\\\n\\t\\x01\\x1f\\x7fé€😀]{0,8}",
            long in proptest::prelude::any::<i64>(),
            int in proptest::prelude::any::<i32>(),
            value in proptest::prelude::any::<i64>(),
            start in proptest::prelude::any::<i64>(),
            end in proptest::prelude::any::<i64>(),
            windowed in proptest::prelude::any::<bool>(),
        ) {
            let window = windowed.then_some(Window { start, end });
            for key in [RecordKey::string(text.as_str()), RecordKey::long(long), RecordKey::int(int)] {
                let mut fast = Vec::new();
                format_json_row(&key, window, value, &mut fast);
                proptest::prop_assert_eq!(&fast, &reference_line(&key, window, value));
                let line: serde_json::Value = serde_json::from_slice(&fast).unwrap();
                proptest::prop_assert_eq!(&line["value"], &serde_json::json!(value));
            }
        }
    }

    #[test]
    fn number_edges() {
        for v in [
            0,
            1,
            -1,
            9,
            10,
            -10,
            i64::MAX,
            i64::MIN,
            i64::from(i32::MIN),
        ] {
            let mut out = Vec::new();
            put_i64(&mut out, v);
            assert_eq!(out, v.to_string().into_bytes());
        }
    }

    #[test]
    fn commit_on_checkpoint_and_restore() {
        let me = WriterId {
            subtask: 1,
            parallelism: 4,
        };
        let mut sink = StagingSink::new(me);
        sink.emit(&[row(RecordKey::int(1), 10)]);
        sink.on_barrier(1).unwrap();
        sink.emit(&[row(RecordKey::int(2), 20), row(RecordKey::int(3), 30)]);
        sink.on_barrier(2).unwrap();
        sink.on_barrier(3).unwrap(); // empty epoch: no object
        assert_eq!(sink.pending().count(), 2);
        assert!(sink.on_barrier(3).is_err());
        // Checkpoint 1 completes: only its output is committed.
        let done = sink.on_checkpoint_complete(1);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].object, "chk-000000000001/part-00001-of-00004.jsonl");
        assert_eq!(done[0].body, b"{\"key\":1,\"value\":10}\n");
        // Snapshot for checkpoint 2 holds output 2; rows after barrier 3 are not in it.
        sink.emit(&[row(RecordKey::int(9), 90)]);
        let snap = sink.snapshot();
        // Crash. Restore (at another parallelism) from checkpoint 2's snapshot: output 2 is
        // written again with its original name; the staged row after the barrier is gone.
        let (mut restored, redo) = StagingSink::restore(
            WriterId {
                subtask: 0,
                parallelism: 2,
            },
            &[&snap],
        )
        .unwrap();
        assert_eq!(redo.len(), 1);
        assert_eq!(redo[0].checkpoint_id, 2);
        assert_eq!(redo[0].rows, 2);
        assert_eq!(redo[0].object, "chk-000000000002/part-00001-of-00004.jsonl");
        assert_eq!(restored.staged_rows(), 0);
        assert!(restored.on_checkpoint_complete(u64::MAX).is_empty());
        // The original, had it survived, commits 2 on completion of 3 (subsumed).
        let done = sink.on_checkpoint_complete(3);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0], redo[0]);
        // Corrupt snapshots are typed errors.
        let mut bad = snap.clone();
        bad[6] ^= 1;
        assert_eq!(
            StagingSink::restore(me, &[&bad]).unwrap_err(),
            SinkError::Checksum
        );
        assert_eq!(
            StagingSink::restore(me, &[b"nope"]).unwrap_err(),
            SinkError::BadMagic
        );
    }
}
