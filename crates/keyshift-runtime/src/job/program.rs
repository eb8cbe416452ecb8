//! Programs: jobs written with keyshift's SDK ([`keyshift_sdk::dataflow::Job`]) that a worker
//! binary carries by name (`spec.job.program.name`), and one subtask's instance of a program's
//! keyed step as the worker drives it.
//!
//! A program's records cross the shuffle as [`EncodedRecords`] (its key, event time and its
//! own serialized form); its key groups are the SDK's blocks ([`keyshift_sdk::block`], schema
//! [`PROGRAM_SCHEMA`]) in the same snapshots, incremental chains, range restores and pre-staged
//! handovers as the built-in aggregation's; its output is the sink's lines.

use super::record::EncodedRecords;
use crate::job::GroupMode;
use keyshift_core::keygroup::{KeyGroupRange, KeyType};
use keyshift_sdk::dataflow::{Job, JobDefinitionError, Program};
use keyshift_sdk::step::{KeyedStep, Routed};
use keyshift_sdk::{BlockError, block};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The state schema of a program's key-group blocks (in a snapshot's manifest).
pub const PROGRAM_SCHEMA: &str = block::SDK_SCHEMA;

/// The programs a worker binary carries, by name.
#[derive(Clone, Default)]
pub struct Programs(Arc<BTreeMap<String, Arc<Program>>>);

impl fmt::Debug for Programs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

/// A program that cannot be registered.
#[derive(Debug, thiserror::Error)]
pub enum ProgramsError {
    #[error(
        "program name {0:?}: lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"
    )]
    Name(String),
    #[error("two programs are named {0:?}")]
    Duplicate(String),
    #[error("program {name:?}: {source}")]
    Definition {
        name: String,
        #[source]
        source: JobDefinitionError,
    },
}

impl Programs {
    /// No programs.
    pub fn new() -> Self {
        Self::default()
    }

    /// These programs and `job` as `name`, if the worker runtime can run it.
    pub fn with(self, name: &str, job: Job) -> Result<Self, ProgramsError> {
        if !keyshift_core::rules::valid_program_name(name) {
            return Err(ProgramsError::Name(name.to_owned()));
        }
        if self.0.contains_key(name) {
            return Err(ProgramsError::Duplicate(name.to_owned()));
        }
        let program = Program::new(job).map_err(|source| ProgramsError::Definition {
            name: name.to_owned(),
            source,
        })?;
        let mut map = (*self.0).clone();
        map.insert(name.to_owned(), Arc::new(program));
        Ok(Programs(Arc::new(map)))
    }

    /// The program named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Program>> {
        self.0.get(name).cloned()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// A program's step failed, or a block of its state cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    /// The step's function, its state or its output failed: the worker stops and the job
    /// restarts from its last snapshot.
    #[error("program {program:?}, step {step:?}: {source}")]
    Step {
        program: String,
        step: String,
        #[source]
        source: keyshift_sdk::Error,
    },
    /// A block of the step's state does not belong to it or is corrupt: nothing of it is
    /// installed.
    #[error("program {program:?}, key group {group}: {source}")]
    Block {
        program: String,
        group: u32,
        #[source]
        source: BlockError,
    },
    /// The step declares its state inconsistently.
    #[error("program {program:?}: {message}")]
    Declaration { program: String, message: String },
}

/// One subtask's instance of a program's keyed step, with the output it emitted not yet
/// taken.
pub struct ProgramStep {
    name: String,
    program: Arc<Program>,
    step: Box<dyn KeyedStep>,
    max_parallelism: u32,
    records: u64,
    late: u64,
}

impl fmt::Debug for ProgramStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProgramStep")
            .field("program", &self.name)
            .field("step", &self.step.uid())
            .field("range", &self.step.range())
            .finish()
    }
}

impl ProgramStep {
    /// Program `name`'s step for the subtask owning `range` of `max_parallelism` groups.
    pub fn new(
        name: &str,
        program: Arc<Program>,
        max_parallelism: u32,
        range: KeyGroupRange,
    ) -> Result<Self, ProgramError> {
        let step = program
            .step(max_parallelism, range)
            .map_err(|e| ProgramError::Declaration {
                program: name.to_owned(),
                message: e.to_string(),
            })?;
        Ok(ProgramStep {
            name: name.to_owned(),
            program,
            step,
            max_parallelism,
            records: 0,
            late: 0,
        })
    }

    fn step_error(&self, source: keyshift_sdk::Error) -> ProgramError {
        ProgramError::Step {
            program: self.name.clone(),
            step: self.step.uid().to_owned(),
            source,
        }
    }

    fn block_error(&self, group: u32, source: BlockError) -> ProgramError {
        ProgramError::Block {
            program: self.name.clone(),
            group,
            source,
        }
    }

    /// The program's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The keyed step's uid (its state's name in snapshots).
    pub fn uid(&self) -> &str {
        self.step.uid()
    }

    /// How its keys hash.
    pub fn key_type(&self) -> KeyType {
        self.program.key_type()
    }

    /// The key groups it owns.
    pub fn range(&self) -> KeyGroupRange {
        self.step.range()
    }

    /// Records processed.
    pub fn records_processed(&self) -> u64 {
        self.records
    }

    /// Records behind the watermark when they arrived (they are processed all the same: an
    /// event-time timer they set in the past fires at the next watermark).
    pub fn late_records(&self) -> u64 {
        self.late
    }

    /// State entries (timers included).
    pub fn entries(&self) -> usize {
        self.step.entries()
    }

    /// State entries of `group` (timers included).
    pub fn group_entries(&self, group: u32) -> u64 {
        self.step.group_entries(group) as u64
    }

    /// Handles a batch of records routed to this subtask, in order.
    pub fn process(&mut self, batch: &EncodedRecords) -> Result<(), ProgramError> {
        let watermark = self.step.watermark();
        let maxp = self.max_parallelism;
        let routed: Vec<Routed<'_>> = batch
            .iter()
            .map(|(key, ts, record)| Routed {
                group: key.key_group(maxp),
                key: key.clone(),
                timestamp: ts,
                record,
            })
            .collect();
        self.late += routed.iter().filter(|r| r.timestamp < watermark).count() as u64;
        self.records += routed.len() as u64;
        let r = self.step.process_batch(&routed);
        r.map_err(|e| self.step_error(e))
    }

    /// Advances event time to `watermark`: its timers up to it fire.
    pub fn advance_watermark(&mut self, watermark: i64) -> Result<(), ProgramError> {
        let r = self.step.advance_watermark(watermark);
        r.map_err(|e| self.step_error(e))
    }

    /// Advances processing time to `now` (ms since the epoch): its timers up to it fire.
    pub fn advance_processing_time(&mut self, now: i64) -> Result<(), ProgramError> {
        let r = self.step.advance_processing_time(now);
        r.map_err(|e| self.step_error(e))
    }

    /// The event-time watermark.
    pub fn watermark(&self) -> i64 {
        self.step.watermark()
    }

    /// Restores the watermark a snapshot recorded (its timers at or before it have fired).
    pub fn restore_watermark(&mut self, watermark: i64) {
        self.step.restore_watermark(watermark);
    }

    /// What it emitted since the last call, carried through the steps after it to the sink's
    /// lines, appended to `out`; returns how many lines.
    pub fn take_lines(&mut self, out: &mut Vec<u8>) -> Result<u64, ProgramError> {
        let output = self.step.take_output();
        if output.is_empty() {
            return Ok(0);
        }
        let r = self.program.emit(output, out);
        r.map_err(|e| self.step_error(e))
    }

    /// Ends the current cut epoch at a snapshot's barrier.
    pub fn cut(&mut self) -> u32 {
        self.step.cut()
    }

    /// How a snapshot building on the one taken at cut `since` must write `group`.
    pub fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        self.step.group_mode(group, since)
    }

    /// `group` as `mode` says: a full block, a delta, or nothing if unchanged; with its entry
    /// count.
    pub fn encode_group(
        &mut self,
        group: u32,
        mode: GroupMode,
    ) -> Result<Option<(Vec<u8>, u64)>, ProgramError> {
        let r = self.step.encode_group(group, mode);
        let block = r.map_err(|e| self.step_error(e))?;
        match block {
            None => Ok(None),
            Some(b) => {
                let entries = block::entry_count(&b).map_err(|e| self.block_error(group, e))?;
                Ok(Some((b, entries)))
            }
        }
    }

    /// Replaces `group`'s state with a snapshot's chain (a full block, then its deltas), every
    /// block checked before anything is installed.
    pub fn restore_group(&mut self, group: u32, chain: &[&[u8]]) -> Result<(), ProgramError> {
        let r = self.step.restore_group(group, chain);
        r.map_err(|e| self.block_error(group, e))
    }

    /// Applies delta blocks written after the state it holds for `group` (a pre-staged group
    /// catching up); with `replace`, the blocks replace the group (the first is a full block).
    pub fn apply_blocks(
        &mut self,
        group: u32,
        blocks: &[&[u8]],
        replace: bool,
    ) -> Result<(), ProgramError> {
        if replace {
            return self.restore_group(group, blocks);
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let current = self.encode_group(group, GroupMode::Full)?;
        let mut chain: Vec<&[u8]> = Vec::with_capacity(blocks.len() + 1);
        chain.extend(current.as_ref().map(|(b, _)| b.as_slice()));
        chain.extend_from_slice(blocks);
        self.restore_group(group, &chain)
    }

    /// Drops `group`'s state and timers.
    pub fn clear_group(&mut self, group: u32) {
        self.step.clear_group(group);
    }
}

/// Compacts a group's chain of a program's blocks into one full block: its bytes and entries.
pub fn compact_chain(
    group: u32,
    first: &[u8],
    deltas: &[bytes::Bytes],
) -> Result<(Vec<u8>, u64), BlockError> {
    let mut chain: Vec<&[u8]> = Vec::with_capacity(deltas.len() + 1);
    chain.push(first);
    chain.extend(deltas.iter().map(|d| d.as_ref()));
    block::compact(group, &chain)
}
