//! Sinks, as logic: the exactly-once staging of object-store output (the JSON lines it carries
//! are [`super::result`]'s).
//!
//! # Exactly once by commit-on-checkpoint ([`StagingSink`])
//!
//! The runtime writes objects and the coordinator publishes them ([`crate::sink`]); this type
//! decides *what* each subtask (a *writer*) stages at a barrier:
//!
//! 1. Rows a writer emits between two barriers are kept in memory ([`StagingSink::emit`],
//!    [`StagingSink::emit_lines`]).
//! 2. At barrier `N` the trigger says which snapshot of the job last committed, `C`
//!    ([`Committed`]). [`StagingSink::on_barrier`]`(N, C)` forgets what was staged for barriers
//!    `<= C` (it is published, or will be, with `C` or before), seals the rows since the last
//!    barrier as barrier `N`'s, and returns the [`Output`] to stage for `N`: **every row since
//!    `C`**, oldest first. The runtime writes it to
//!    `<sink url>/_staging/snap-N/part-<subtask>-of-<parallelism>.jsonl` before it acknowledges
//!    `N`, so a committed snapshot's staged output is durable.
//! 3. Once `N` is committed the coordinator publishes `_staging/snap-N/` to `snap-N/`
//!    (create-only copies: idempotent). A snapshot that never commits never publishes, and its
//!    rows ride with the next barrier's output instead, because the next trigger still names
//!    `C`. Nothing is published twice: the output of `N` holds exactly the rows sealed at
//!    barriers in `(C, N]`, and after `N` commits the next trigger names `N`.
//! 4. After a failure the job restarts from its last committed snapshot `R` (whose staged output
//!    the coordinator publishes again if the crash came between commit and publish); rows after
//!    `R` are produced again by the replay, under new snapshot ids. A restored writer starts
//!    empty: nothing of its output is part of the keyed state.
//!
//! Two requirements fall on the runtime and the coordinator: snapshot ids are never reused (not
//! even after a restore from an older snapshot), and `C` is exact: a snapshot whose commit is in
//! doubt must be resolved (committed or certainly not) before the next trigger names `C`.
//!
//! # Memory
//!
//! A writer keeps the rows since the last committed snapshot: normally one checkpoint
//! interval's output (as much as a sink without carry-over buffers), more while checkpoints
//! fail. Past [`MAX_UNCOMMITTED_BYTES`] (or the limit given to [`StagingSink::with_limit`])
//! [`StagingSink::on_barrier`] fails with [`SinkError::Backlog`]; the runtime then stops the
//! worker, the job restarts from its last committed snapshot and the replay produces those rows
//! again, instead of the worker growing without bound.

use super::result::{ResultRow, format_json_line};
use bytes::Bytes;
use std::collections::BTreeMap;

/// The writer a staging sink belongs to: the subtask and the parallelism it runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterId {
    /// Subtask index.
    pub subtask: u32,
    /// Parallelism of the job run the subtask belongs to.
    pub parallelism: u32,
}

/// The folder below the sink URL where output waits for its snapshot to commit.
pub const STAGING_DIR: &str = "_staging";

/// The folder of snapshot `id`'s output, below [`STAGING_DIR`] while staged and below the sink
/// URL once published: `snap-<id>`.
pub fn snapshot_dir_name(id: u64) -> String {
    format!("snap-{id}")
}

/// The snapshot id of a [`snapshot_dir_name`], if `name` is one.
pub fn parse_snapshot_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("snap-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The name of a writer's part in a snapshot's output: `part-<subtask>-of-<parallelism>.jsonl`.
pub fn part_name(writer: WriterId) -> String {
    format!("part-{}-of-{}.jsonl", writer.subtask, writer.parallelism)
}

/// Bytes of output a writer keeps while the snapshots covering it do not commit, by default
/// (see [the module documentation](self#memory)).
pub const MAX_UNCOMMITTED_BYTES: usize = 256 * 1024 * 1024;

/// What a barrier's trigger says about the job's commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The newest committed snapshot of the job is this id (0: none yet); no snapshot above it
    /// has committed. Output staged for barriers above it rides with the next output.
    Through(u64),
    /// Not said (a coordinator from before carry-over): every earlier barrier counts as
    /// committed, so an output holds only the rows since the previous barrier.
    Unknown,
}

impl Committed {
    /// The wire form of [`crate::runtime::protocol::CheckpointRequest::last_committed`].
    pub fn from_wire(last_committed: Option<u64>) -> Self {
        last_committed.map_or(Committed::Unknown, Committed::Through)
    }
}

/// What a writer stages at a barrier: every row it emitted since the job's last committed
/// snapshot, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The barrier (snapshot id) this output is staged for.
    pub checkpoint_id: u64,
    /// Who writes it.
    pub writer: WriterId,
    /// Result rows in it.
    pub rows: u64,
    /// The JSON lines, in chunks (one per barrier, oldest first) so that nothing is copied.
    pub chunks: Vec<Bytes>,
    /// Earlier barriers whose rows ride in this output (their snapshots did not commit).
    pub carried: Vec<u64>,
}

impl Output {
    /// Bytes in the output.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// Whether the output holds no byte.
    pub fn is_empty(&self) -> bool {
        self.chunks.iter().all(Bytes::is_empty)
    }

    /// The JSON lines as one buffer (a copy).
    pub fn body(&self) -> Vec<u8> {
        self.chunks.concat()
    }
}

/// Errors of the staging sink.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    #[error("checkpoint barrier {got} is not above the previous barrier {previous}")]
    BarrierOrder { previous: u64, got: u64 },
    #[error(
        "{bytes} bytes of sink output are waiting for a snapshot to commit (oldest from barrier {oldest}), more than the {limit} a worker keeps: the job must restart from its last committed snapshot"
    )]
    Backlog {
        bytes: usize,
        limit: usize,
        oldest: u64,
    },
}

/// Rows sealed at one barrier.
#[derive(Debug, Clone)]
struct Sealed {
    rows: u64,
    body: Bytes,
}

/// A writer's object-store output since the job's last committed snapshot (see [the module
/// documentation](self)).
#[derive(Debug, Clone)]
pub struct StagingSink {
    writer: WriterId,
    current: Vec<u8>,
    current_rows: u64,
    last_barrier: Option<u64>,
    /// Rows sealed at barriers not known to be committed, by barrier id.
    uncommitted: BTreeMap<u64, Sealed>,
    uncommitted_bytes: usize,
    limit: usize,
}

impl StagingSink {
    /// An empty sink for `writer` that keeps up to [`MAX_UNCOMMITTED_BYTES`].
    pub fn new(writer: WriterId) -> Self {
        StagingSink {
            writer,
            current: Vec::new(),
            current_rows: 0,
            last_barrier: None,
            uncommitted: BTreeMap::new(),
            uncommitted_bytes: 0,
            limit: MAX_UNCOMMITTED_BYTES,
        }
    }

    /// The same sink keeping up to `bytes` of output sealed at uncommitted barriers.
    pub fn with_limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }

    /// The writer.
    pub fn writer(&self) -> WriterId {
        self.writer
    }

    /// Adds rows for the next barrier.
    pub fn emit(&mut self, rows: &[ResultRow]) {
        for row in rows {
            format_json_line(row, &mut self.current);
        }
        self.current_rows += rows.len() as u64;
    }

    /// Adds `rows` rows already formatted as JSON lines (taken without a copy when nothing is
    /// waiting for the next barrier yet).
    pub fn emit_lines(&mut self, lines: Vec<u8>, rows: u64) {
        if self.current.is_empty() {
            self.current = lines;
        } else {
            self.current.extend_from_slice(&lines);
        }
        self.current_rows += rows;
    }

    /// Rows emitted since the last barrier.
    pub fn staged_rows(&self) -> u64 {
        self.current_rows
    }

    /// Bytes sealed at barriers not known to be committed.
    pub fn uncommitted_bytes(&self) -> usize {
        self.uncommitted_bytes
    }

    /// Forgets the output sealed at barriers `<= id`: snapshot `id` committed, so what was
    /// staged for it (and, carried in it, for the uncommitted barriers before it) is published
    /// with it.
    pub fn committed(&mut self, id: u64) {
        let later = match id.checked_add(1) {
            Some(next) => self.uncommitted.split_off(&next),
            None => BTreeMap::new(),
        };
        self.uncommitted = later;
        self.uncommitted_bytes = self.uncommitted.values().map(|s| s.body.len()).sum();
    }

    /// Barrier `checkpoint_id`: applies what the trigger says about commits, seals the rows since
    /// the last barrier as this barrier's, and returns the output to stage for it (every row
    /// since the last committed snapshot; it may be empty). Barrier ids must increase.
    pub fn on_barrier(
        &mut self,
        checkpoint_id: u64,
        committed: Committed,
    ) -> Result<Output, SinkError> {
        self.seal(checkpoint_id, committed)?;
        Ok(self.output(checkpoint_id))
    }

    /// The first half of [`on_barrier`](Self::on_barrier): applies what the trigger says about
    /// commits and seals the rows since the last barrier as this barrier's. Rows of the same
    /// barrier drained later (a cut copied after its barrier) are added with
    /// [`add_sealed`](Self::add_sealed), and the output taken with [`output`](Self::output).
    pub fn seal(&mut self, checkpoint_id: u64, committed: Committed) -> Result<(), SinkError> {
        if let Some(previous) = self.last_barrier
            && checkpoint_id <= previous
        {
            return Err(SinkError::BarrierOrder {
                previous,
                got: checkpoint_id,
            });
        }
        self.last_barrier = Some(checkpoint_id);
        match committed {
            Committed::Through(id) => self.committed(id),
            Committed::Unknown => self.committed(u64::MAX),
        }
        if self.current_rows > 0 || !self.current.is_empty() {
            let body = Bytes::from(std::mem::take(&mut self.current));
            self.uncommitted_bytes += body.len();
            self.uncommitted.insert(
                checkpoint_id,
                Sealed {
                    rows: std::mem::take(&mut self.current_rows),
                    body,
                },
            );
        }
        self.check_backlog(checkpoint_id)
    }

    /// Adds `rows` rows, formatted as JSON lines, to what barrier `checkpoint_id` (the last one
    /// sealed) sealed: results of its cut drained after the barrier.
    pub fn add_sealed(
        &mut self,
        checkpoint_id: u64,
        lines: &[u8],
        rows: u64,
    ) -> Result<(), SinkError> {
        if self.last_barrier != Some(checkpoint_id) {
            return Err(SinkError::BarrierOrder {
                previous: self.last_barrier.unwrap_or(0),
                got: checkpoint_id,
            });
        }
        if rows == 0 && lines.is_empty() {
            return Ok(());
        }
        let sealed = self.uncommitted.entry(checkpoint_id).or_insert(Sealed {
            rows: 0,
            body: Bytes::new(),
        });
        let mut body = Vec::with_capacity(sealed.body.len() + lines.len());
        body.extend_from_slice(&sealed.body);
        body.extend_from_slice(lines);
        sealed.rows += rows;
        sealed.body = Bytes::from(body);
        self.uncommitted_bytes += lines.len();
        self.check_backlog(checkpoint_id)
    }

    fn check_backlog(&self, checkpoint_id: u64) -> Result<(), SinkError> {
        if self.uncommitted_bytes > self.limit {
            return Err(SinkError::Backlog {
                bytes: self.uncommitted_bytes,
                limit: self.limit,
                oldest: self
                    .uncommitted
                    .keys()
                    .next()
                    .copied()
                    .unwrap_or(checkpoint_id),
            });
        }
        Ok(())
    }

    /// The output to stage for barrier `checkpoint_id` (the last one sealed): every row since
    /// the last committed snapshot.
    pub fn output(&self, checkpoint_id: u64) -> Output {
        Output {
            checkpoint_id,
            writer: self.writer,
            rows: self.uncommitted.values().map(|s| s.rows).sum(),
            chunks: self.uncommitted.values().map(|s| s.body.clone()).collect(),
            carried: self
                .uncommitted
                .keys()
                .copied()
                .filter(|id| *id != checkpoint_id)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::record::RecordKey;
    use crate::job::result::tests::row;

    fn writer() -> WriterId {
        WriterId {
            subtask: 1,
            parallelism: 4,
        }
    }

    fn lines(out: &Output) -> Vec<String> {
        String::from_utf8(out.body())
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn names() {
        assert_eq!(snapshot_dir_name(12), "snap-12");
        assert_eq!(parse_snapshot_dir_name("snap-12"), Some(12));
        for bad in ["snap-", "snap-1a", "snap--1", "chk-1", "snap-+1"] {
            assert_eq!(parse_snapshot_dir_name(bad), None, "{bad}");
        }
        assert_eq!(part_name(writer()), "part-1-of-4.jsonl");
    }

    #[test]
    fn a_committed_barrier_is_never_staged_again() {
        let mut sink = StagingSink::new(writer());
        sink.emit(&[row(RecordKey::int(1), 10)]);
        let out = sink.on_barrier(1, Committed::Through(0)).unwrap();
        assert_eq!(lines(&out), [r#"{"key":1,"value":10}"#]);
        assert_eq!((out.rows, out.carried.clone()), (1, vec![]));
        // 1 committed: barrier 2 stages only its own rows.
        sink.emit(&[row(RecordKey::int(2), 20), row(RecordKey::int(3), 30)]);
        let out = sink.on_barrier(2, Committed::Through(1)).unwrap();
        assert_eq!(out.rows, 2);
        assert_eq!(
            lines(&out),
            [r#"{"key":2,"value":20}"#, r#"{"key":3,"value":30}"#]
        );
        assert!(out.carried.is_empty());
        // An empty epoch after a commit: an empty output (the part is still written).
        let out = sink.on_barrier(3, Committed::Through(2)).unwrap();
        assert!(out.is_empty() && out.rows == 0 && out.chunks.is_empty());
        assert_eq!(sink.uncommitted_bytes(), 0);
        assert_eq!(
            sink.on_barrier(3, Committed::Through(2)).unwrap_err(),
            SinkError::BarrierOrder {
                previous: 3,
                got: 3
            }
        );
    }

    #[test]
    fn output_of_a_failed_checkpoint_rides_with_the_next_one() {
        let mut sink = StagingSink::new(writer());
        sink.emit(&[row(RecordKey::int(1), 10)]);
        let first = sink.on_barrier(5, Committed::Through(4)).unwrap();
        // Checkpoint 5 fails elsewhere: the trigger of 6 still names 4.
        sink.emit(&[row(RecordKey::int(2), 20)]);
        let second = sink.on_barrier(6, Committed::Through(4)).unwrap();
        assert_eq!(second.carried, [5]);
        assert_eq!(second.rows, 2);
        assert_eq!(
            lines(&second),
            [r#"{"key":1,"value":10}"#, r#"{"key":2,"value":20}"#]
        );
        assert_eq!(second.chunks[0], first.chunks[0], "carried without a copy");
        // An epoch without rows between failures carries the older ones all the same.
        let third = sink.on_barrier(7, Committed::Through(4)).unwrap();
        assert_eq!((third.rows, third.carried.clone()), (2, vec![5, 6]));
        // 7 committed: 8 holds only what came after it.
        sink.emit_lines(b"{\"key\":3,\"value\":30}\n".to_vec(), 1);
        let fourth = sink.on_barrier(8, Committed::Through(7)).unwrap();
        assert_eq!(lines(&fourth), [r#"{"key":3,"value":30}"#]);
        assert!(fourth.carried.is_empty());
    }

    /// Rows a cut drained after its barrier join that barrier's output (and ride with the next
    /// one if it does not commit); rows emitted after the barrier do not.
    #[test]
    fn rows_drained_after_a_barrier_are_sealed_with_it() {
        let mut sink = StagingSink::new(writer());
        sink.emit(&[row(RecordKey::int(1), 10)]);
        sink.seal(5, Committed::Through(4)).unwrap();
        sink.emit(&[row(RecordKey::int(9), 90)]);
        sink.add_sealed(5, b"{\"key\":2,\"value\":20}\n", 1)
            .unwrap();
        let five = sink.output(5);
        assert_eq!(five.rows, 2);
        assert_eq!(
            lines(&five),
            [r#"{"key":1,"value":10}"#, r#"{"key":2,"value":20}"#]
        );
        // Only to the last barrier sealed.
        assert!(sink.add_sealed(4, b"x\n", 1).is_err());
        // A barrier without rows of its own until its cut drained some.
        let six_rows = sink.on_barrier(6, Committed::Through(4)).unwrap();
        assert_eq!(lines(&six_rows).len(), 3, "5 carried, and the row after it");
        sink.seal(7, Committed::Through(6)).unwrap();
        sink.add_sealed(7, b"{\"key\":3,\"value\":30}\n", 1)
            .unwrap();
        let seven = sink.output(7);
        assert_eq!(lines(&seven), [r#"{"key":3,"value":30}"#]);
        assert!(seven.carried.is_empty());
        assert_eq!(sink.uncommitted_bytes(), seven.len());
    }

    #[test]
    fn an_older_coordinator_stages_only_the_rows_since_the_previous_barrier() {
        let mut sink = StagingSink::new(writer());
        sink.emit(&[row(RecordKey::int(1), 10)]);
        sink.on_barrier(1, Committed::from_wire(None)).unwrap();
        sink.emit(&[row(RecordKey::int(2), 20)]);
        let out = sink.on_barrier(2, Committed::from_wire(None)).unwrap();
        assert_eq!(lines(&out), [r#"{"key":2,"value":20}"#]);
        assert_eq!(Committed::from_wire(Some(3)), Committed::Through(3));
    }

    #[test]
    fn uncommitted_output_is_bounded() {
        let mut sink = StagingSink::new(writer()).with_limit(64);
        sink.emit(&[row(RecordKey::int(1), 10), row(RecordKey::int(2), 20)]);
        sink.on_barrier(1, Committed::Through(0)).unwrap();
        sink.emit(&[row(RecordKey::int(3), 30), row(RecordKey::int(4), 40)]);
        let e = sink.on_barrier(2, Committed::Through(0)).unwrap_err();
        assert!(
            matches!(e, SinkError::Backlog { limit: 64, oldest: 1, bytes } if bytes > 64),
            "{e}"
        );
        // A commit releases it.
        sink.emit(&[row(RecordKey::int(5), 50)]);
        let out = sink.on_barrier(3, Committed::Through(2)).unwrap();
        assert_eq!(out.rows, 1);
        assert!(sink.uncommitted_bytes() < 64);
    }

    proptest::proptest! {
        /// Whatever checkpoints fail, the outputs of the committed ones, in order, hold every
        /// row emitted before the last committed barrier exactly once, in emission order.
        #[test]
        fn committed_outputs_hold_every_row_once(
            epochs in proptest::collection::vec((0u8..4, proptest::prelude::any::<bool>()), 1..40),
        ) {
            let mut sink = StagingSink::new(writer());
            let mut emitted: Vec<i64> = Vec::new();
            let mut through_last_commit = 0;
            let mut published: Vec<i64> = Vec::new();
            let mut last_committed = 0u64;
            for (i, (rows, commits)) in epochs.iter().enumerate() {
                let id = i as u64 + 1;
                let batch: Vec<ResultRow> = (0..*rows)
                    .map(|_| {
                        let v = emitted.len() as i64;
                        emitted.push(v);
                        row(RecordKey::long(v), v)
                    })
                    .collect();
                sink.emit(&batch);
                let out = sink.on_barrier(id, Committed::Through(last_committed)).unwrap();
                if *commits {
                    for line in String::from_utf8(out.body()).unwrap().lines() {
                        let v: serde_json::Value = serde_json::from_str(line).unwrap();
                        published.push(v["value"].as_i64().unwrap());
                    }
                    last_committed = id;
                    through_last_commit = emitted.len();
                }
            }
            proptest::prop_assert_eq!(&published[..], &emitted[..through_last_commit]);
        }
    }
}
