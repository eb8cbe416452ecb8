//! A harness that runs one keyed step the way keyshift runs it, in one process: several
//! subtasks over their key-group ranges, a replayable input with a bounded-out-of-orderness
//! watermark, incremental checkpoints (full blocks and deltas per key group), output that is
//! committed only with a checkpoint (as the exactly-once sinks do), a killed run restored from
//! its last checkpoint, and rescales to another parallelism through a savepoint. A job's tests
//! drive their function through it against an oracle.

use crate::error::{BlockError, Result};
use crate::function::KeyedProcessFunction;
use crate::key::key_group;
use crate::operator::{KeyedOperator, MIN_WATERMARK};
use crate::state::DeclarationError;
use crate::state::backend::{GroupMode, SortedBackend};
use keyshift_core::keygroup::{Assignment, BoundsError};
use std::collections::BTreeMap;
use std::rc::Rc;

/// A harness that cannot be built or restored.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(transparent)]
    Bounds(#[from] BoundsError),
    #[error(transparent)]
    Declaration(#[from] DeclarationError),
    #[error("restoring key group {group}: {source}")]
    Restore {
        group: u32,
        #[source]
        source: BlockError,
    },
    #[error("restoring the operator state: {source}")]
    OperatorState {
        #[source]
        source: BlockError,
    },
    #[error("no checkpoint has been taken yet")]
    NoCheckpoint,
}

/// A snapshot of the whole step: every key group's chain of blocks (a full block, then deltas),
/// the input position, and the clocks.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub max_parallelism: u32,
    /// Per key group: its full block and the deltas over it, in order.
    pub groups: BTreeMap<u32, Vec<Vec<u8>>>,
    /// Input records consumed.
    pub position: usize,
    /// The lowest watermark over the subtasks.
    pub watermark: i64,
    pub processing_time: i64,
    /// Bytes this checkpoint wrote (blocks of unchanged groups are reused, not written).
    pub bytes_written: u64,
    /// Bytes of every group's chain (what a restore reads).
    pub bytes_total: u64,
    /// Each subtask's operator-state section, in subtask order (empty: the step declares no
    /// operator state).
    pub operator: Vec<Vec<u8>>,
}

/// A delta chain longer than this is written in full at the next checkpoint.
pub const MAX_CHAIN: usize = 8;

/// One keyed step running on `parallelism` subtasks in this process.
pub struct Harness<F: KeyedProcessFunction> {
    uid: String,
    factory: Rc<dyn Fn() -> F>,
    assignment: Assignment,
    subtasks: Vec<KeyedOperator<F>>,
    input: Vec<(F::Key, i64, F::In)>,
    position: usize,
    max_out_of_orderness: i64,
    max_ts: i64,
    processing_time: i64,
    /// Output of completed checkpoints (what a reader of the sink sees).
    committed: Vec<(i64, F::Out)>,
    /// Output since the last checkpoint (lost with a killed run, produced again by its replay).
    pending: Vec<(i64, F::Out)>,
    /// The last checkpoint, and each subtask's cut it was taken at (for deltas over it).
    last: Option<(Snapshot, Vec<u32>)>,
    /// State in [`SortedBackend`]s (byte-addressed, a disk engine's shape) instead of the heap.
    sorted: bool,
}

/// A subtask's operator, state in the heap or in a [`SortedBackend`].
fn operator<F: KeyedProcessFunction>(
    uid: &str,
    function: F,
    max_parallelism: u32,
    range: keyshift_core::keygroup::KeyGroupRange,
    sorted: bool,
) -> Result<KeyedOperator<F>, DeclarationError> {
    if sorted {
        let backend = Box::new(SortedBackend::new(range.len() as usize));
        KeyedOperator::with_backend(uid, function, max_parallelism, range, backend)
    } else {
        KeyedOperator::new(uid, function, max_parallelism, range)
    }
}

impl<F> Harness<F>
where
    F: KeyedProcessFunction,
    F::In: Clone,
{
    /// Step `uid` built by `factory` on `parallelism` of `max_parallelism` key groups, reading
    /// `input` (key, event time, record) with a watermark `max_out_of_orderness` ms behind the
    /// latest event time read.
    pub fn new(
        uid: &str,
        factory: impl Fn() -> F + 'static,
        parallelism: u32,
        max_parallelism: u32,
        input: Vec<(F::Key, i64, F::In)>,
        max_out_of_orderness: i64,
    ) -> Result<Self, HarnessError> {
        let assignment = Assignment::new(i64::from(parallelism), i64::from(max_parallelism))?;
        let subtasks = (0..parallelism)
            .map(|s| operator(uid, factory(), max_parallelism, assignment.range(s), false))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Harness {
            uid: uid.to_owned(),
            factory: Rc::new(factory),
            assignment,
            subtasks,
            input,
            position: 0,
            max_out_of_orderness,
            max_ts: MIN_WATERMARK,
            processing_time: 0,
            committed: Vec::new(),
            pending: Vec::new(),
            last: None,
            sorted: false,
        })
    }

    /// The same run with its state in byte-addressed [`SortedBackend`]s (the layout a disk
    /// engine keeps) instead of the heap; from now on, restores included.
    pub fn sorted_backend(mut self) -> Result<Self, HarnessError> {
        self.sorted = true;
        let p = self.assignment.parallelism();
        let max = self.assignment.max_parallelism();
        self.subtasks = (0..p)
            .map(|s| {
                operator(
                    &self.uid,
                    (self.factory)(),
                    max,
                    self.assignment.range(s),
                    true,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self)
    }

    /// The subtasks.
    pub fn subtasks(&self) -> &[KeyedOperator<F>] {
        &self.subtasks
    }

    /// Input records consumed.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Whether every input record has been read.
    pub fn at_end(&self) -> bool {
        self.position >= self.input.len()
    }

    fn collect(&mut self) {
        for s in &mut self.subtasks {
            self.pending.extend(s.take_output());
        }
    }

    /// Reads up to `n` more input records (each to the subtask owning its key's group), then
    /// advances every subtask's watermark.
    pub fn step(&mut self, n: usize) -> Result<()> {
        let end = self.position.saturating_add(n).min(self.input.len());
        for i in self.position..end {
            let (key, ts, value) = self.input[i].clone();
            let owner = self
                .assignment
                .owner(key_group(&key, self.assignment.max_parallelism()));
            self.subtasks[owner as usize].process(&key, ts, value)?;
            self.max_ts = self.max_ts.max(ts);
        }
        self.position = end;
        let wm = self.max_ts.saturating_sub(self.max_out_of_orderness);
        self.advance_watermark(wm)
    }

    /// Raises every subtask's watermark to `watermark`, firing their event-time timers.
    pub fn advance_watermark(&mut self, watermark: i64) -> Result<()> {
        for s in &mut self.subtasks {
            s.advance_watermark(watermark)?;
        }
        self.collect();
        Ok(())
    }

    /// Sets every subtask's clock to `now`, firing their processing-time timers.
    pub fn advance_processing_time(&mut self, now: i64) -> Result<()> {
        self.processing_time = self.processing_time.max(now);
        for s in &mut self.subtasks {
            s.advance_processing_time(now)?;
        }
        self.collect();
        Ok(())
    }

    /// Reads the rest of the input, then ends event time (every event-time timer fires).
    pub fn finish(&mut self) -> Result<()> {
        while !self.at_end() {
            self.step(1024)?;
        }
        self.advance_watermark(i64::MAX)
    }

    /// Takes a checkpoint: each group written as a delta over the last checkpoint where it
    /// can be, in full where it must (or its chain is [`MAX_CHAIN`] long), not at all where
    /// it did not change. The output since the last checkpoint is committed with it.
    pub fn checkpoint(&mut self) -> Result<Snapshot> {
        self.collect();
        let mut groups = BTreeMap::new();
        let mut cuts = Vec::with_capacity(self.subtasks.len());
        let mut bytes_written = 0u64;
        let mut watermark = i64::MAX;
        let parallelism = self.assignment.parallelism();
        let mut operator = Vec::new();
        for (i, s) in self.subtasks.iter_mut().enumerate() {
            operator.extend(s.encode_operator_state(i as u32, parallelism));
            let cut = s.cut();
            let since = self
                .last
                .as_ref()
                .and_then(|(_, c)| c.get(cuts.len()).copied());
            cuts.push(cut);
            watermark = watermark.min(s.watermark());
            for g in s.range().iter() {
                let base = self.last.as_ref().and_then(|(snap, _)| snap.groups.get(&g));
                let mode = match (since, base) {
                    (Some(since), Some(chain)) if chain.len() < MAX_CHAIN => s.group_mode(g, since),
                    _ => GroupMode::Full,
                };
                let block = s.encode_group(g, mode)?.map(|b| b.bytes);
                let chain = match (mode, block, base) {
                    (GroupMode::Unchanged, _, Some(chain)) => chain.clone(),
                    (GroupMode::Delta { .. }, Some(b), Some(chain)) => {
                        bytes_written += b.len() as u64;
                        let mut c = chain.clone();
                        c.push(b);
                        c
                    }
                    (_, Some(b), _) => {
                        bytes_written += b.len() as u64;
                        vec![b]
                    }
                    (_, None, _) => Vec::new(),
                };
                groups.insert(g, chain);
            }
        }
        let bytes_total = groups.values().flatten().map(|b| b.len() as u64).sum();
        let snap = Snapshot {
            max_parallelism: self.assignment.max_parallelism(),
            groups,
            position: self.position,
            watermark,
            processing_time: self.processing_time,
            bytes_written,
            bytes_total,
            operator,
        };
        self.committed.append(&mut self.pending);
        self.last = Some((snap.clone(), cuts));
        Ok(snap)
    }

    /// Builds a run of `parallelism` subtasks from `snapshot`: each restores exactly the groups
    /// it owns. Its next checkpoint builds on `snapshot`.
    fn restored(&self, snapshot: &Snapshot, parallelism: u32) -> Result<Self, HarnessError> {
        let assignment =
            Assignment::new(i64::from(parallelism), i64::from(snapshot.max_parallelism))?;
        let mut subtasks = Vec::with_capacity(parallelism as usize);
        for s in 0..parallelism {
            let mut op = operator(
                &self.uid,
                (self.factory)(),
                snapshot.max_parallelism,
                assignment.range(s),
                self.sorted,
            )?;
            for g in assignment.range(s).iter() {
                if let Some(chain) = snapshot.groups.get(&g).filter(|c| !c.is_empty()) {
                    let blocks: Vec<&[u8]> = chain.iter().map(Vec::as_slice).collect();
                    op.restore_group(g, &blocks)
                        .map_err(|source| HarnessError::Restore { group: g, source })?;
                }
            }
            let sections: Vec<&[u8]> = snapshot.operator.iter().map(Vec::as_slice).collect();
            op.restore_operator_state(&sections, s, parallelism)
                .map_err(|source| HarnessError::OperatorState { source })?;
            op.restore_watermark(snapshot.watermark);
            op.restore_processing_time(snapshot.processing_time);
            subtasks.push(op);
        }
        let cuts = vec![0; parallelism as usize];
        Ok(Harness {
            uid: self.uid.clone(),
            factory: self.factory.clone(),
            assignment,
            subtasks,
            input: Vec::new(),
            position: snapshot.position,
            max_out_of_orderness: self.max_out_of_orderness,
            max_ts: snapshot.watermark.saturating_add(self.max_out_of_orderness),
            processing_time: snapshot.processing_time,
            committed: Vec::new(),
            pending: Vec::new(),
            last: Some((snapshot.clone(), cuts)),
            sorted: self.sorted,
        })
    }

    fn replace_with(&mut self, mut run: Self) {
        run.input = std::mem::take(&mut self.input);
        run.committed = std::mem::take(&mut self.committed);
        *self = run;
    }

    /// Kills every subtask and restores the step from its last checkpoint at the same
    /// parallelism: the output since is lost and the input since is read again.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        let (snap, _) = self.last.clone().ok_or(HarnessError::NoCheckpoint)?;
        let run = self.restored(&snap, self.assignment.parallelism())?;
        self.replace_with(run);
        Ok(())
    }

    /// Stops the step with a savepoint and starts it again from that savepoint on
    /// `parallelism` subtasks (a rescale, or a stop and resume at the same parallelism).
    pub fn rescale(&mut self, parallelism: u32) -> Result<Snapshot, HarnessError> {
        let snap = self.checkpoint().map_err(|_| HarnessError::NoCheckpoint)?;
        let run = self.restored(&snap, parallelism)?;
        self.replace_with(run);
        Ok(snap)
    }

    /// Stops the step with a savepoint, rewrites it to `max_parallelism` key groups (the
    /// managed ceiling change) and starts it from the rewritten savepoint on `parallelism`
    /// subtasks.
    pub fn change_ceiling(
        &mut self,
        max_parallelism: u32,
        parallelism: u32,
    ) -> Result<Snapshot, HarnessError> {
        let snap = self.checkpoint().map_err(|_| HarnessError::NoCheckpoint)?;
        let chains = snap
            .groups
            .iter()
            .filter(|(_, c)| !c.is_empty())
            .map(|(g, c)| (*g, c.iter().map(Vec::as_slice).collect()));
        let rewritten = crate::block::rewrite(chains, max_parallelism)
            .map_err(|source| HarnessError::Restore { group: 0, source })?;
        let bytes_total = rewritten.values().map(|b| b.bytes.len() as u64).sum();
        let rewritten = Snapshot {
            max_parallelism,
            groups: rewritten
                .into_iter()
                .map(|(g, b)| (g, vec![b.bytes]))
                .collect(),
            bytes_written: bytes_total,
            bytes_total,
            ..snap
        };
        let run = self.restored(&rewritten, parallelism)?;
        self.replace_with(run);
        Ok(rewritten)
    }

    /// The committed output, in commit order.
    pub fn committed(&self) -> &[(i64, F::Out)] {
        &self.committed
    }

    /// Total state entries (timers included) over every subtask.
    pub fn entries(&self) -> usize {
        self.subtasks.iter().map(KeyedOperator::entries).sum()
    }
}

impl<F: KeyedProcessFunction> std::fmt::Debug for Harness<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("uid", &self.uid)
            .field("parallelism", &self.assignment.parallelism())
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

/// A whole job that failed to run in [`run_job`].
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Definition(#[from] crate::dataflow::JobDefinitionError),
    #[error(transparent)]
    Bounds(#[from] BoundsError),
    #[error(transparent)]
    Declaration(#[from] DeclarationError),
    #[error(transparent)]
    Job(#[from] crate::error::Error),
}

/// Runs a whole `job` over the JSON `lines` of its source in this process: every keyed step on
/// `parallelism` subtasks of `max_parallelism` key groups, each record shuffled to the subtask
/// owning its key's group in its serialized form, the watermark `max_out_of_orderness` ms behind
/// the latest event time after every `batch` lines, and event time ended after the last.
/// Returns the sink's lines. (No checkpoints: see [`Harness`] for a step's state through
/// restores and rescales.)
pub fn run_job(
    job: &crate::dataflow::Job,
    lines: &[&str],
    parallelism: u32,
    max_parallelism: u32,
    max_out_of_orderness: i64,
    batch: usize,
) -> Result<Vec<String>, RunError> {
    use crate::dataflow::Stage;
    use crate::step::{KeyedStep, Routed, Value};
    job.check()?;
    let assignment = Assignment::new(i64::from(parallelism), i64::from(max_parallelism))?;
    let mut steps: Vec<Vec<Box<dyn KeyedStep>>> = Vec::new();
    for stage in &job.stages {
        if let Stage::Keyed(k) = stage {
            steps.push(
                (0..parallelism)
                    .map(|s| (k.factory)(max_parallelism, assignment.range(s)))
                    .collect::<Result<_, _>>()?,
            );
        }
    }
    let mut out = Vec::new();
    // Pushes values through the stages from `from` (a stage index) on: stateless stages apply,
    // the first keyed stage takes them in, or the sink writes them.
    let flow = |from: usize,
                mut items: Vec<(i64, Value)>,
                steps: &mut Vec<Vec<Box<dyn KeyedStep>>>,
                out: &mut Vec<u8>|
     -> Result<(), crate::error::Error> {
        let keyed = job.stages[..from]
            .iter()
            .filter(|s| matches!(s, Stage::Keyed(_)))
            .count();
        for (i, stage) in job.stages.iter().enumerate().skip(from) {
            match stage {
                Stage::Stateless(_) => {
                    items = crate::dataflow::stateless(&job.stages[i..=i], items)?;
                }
                Stage::Keyed(k) => {
                    let mut bytes = Vec::new();
                    for (ts, v) in items {
                        let key = (k.key_of)(&v)?;
                        bytes.clear();
                        (k.encode)(&v, &mut bytes)?;
                        let group = key.key_group(assignment.max_parallelism());
                        steps[keyed][assignment.owner(group) as usize].process_batch(&[
                            Routed {
                                key,
                                group,
                                timestamp: ts,
                                record: &bytes,
                            },
                        ])?;
                    }
                    return Ok(());
                }
            }
        }
        for (_, v) in items {
            (job.sink.encode)(&v, out)?;
        }
        Ok(())
    };
    // The stage index after each keyed stage.
    let after: Vec<usize> = job
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, Stage::Keyed(_)))
        .map(|(i, _)| i + 1)
        .collect();
    let mut max_ts = MIN_WATERMARK;
    let drain = |watermark: Option<i64>,
                 steps: &mut Vec<Vec<Box<dyn KeyedStep>>>,
                 out: &mut Vec<u8>|
     -> Result<(), crate::error::Error> {
        for (i, next) in after.iter().enumerate() {
            let mut emitted = Vec::new();
            for s in steps[i].iter_mut() {
                if let Some(w) = watermark {
                    s.advance_watermark(w)?;
                }
                emitted.extend(s.take_output());
            }
            flow(*next, emitted, steps, out)?;
        }
        Ok(())
    };
    for chunk in lines.chunks(batch.max(1)) {
        let mut items = Vec::with_capacity(chunk.len());
        for line in chunk {
            let (ts, v) = (job.source.decode)(line.as_bytes())?;
            max_ts = max_ts.max(ts);
            items.push((ts, v));
        }
        flow(0, items, &mut steps, &mut out)?;
        drain(
            Some(max_ts.saturating_sub(max_out_of_orderness)),
            &mut steps,
            &mut out,
        )?;
    }
    drain(Some(i64::MAX), &mut steps, &mut out)?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_owned)
        .collect())
}
