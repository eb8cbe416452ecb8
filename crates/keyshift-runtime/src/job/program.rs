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
use keyshift_sdk::block::EncodedBlock;
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
    /// The snapshot's operator state cannot be given to this subtask: damaged, declared
    /// otherwise, or a rescale its redistribution refuses.
    #[error("program {program:?}, operator state: {source}")]
    OperatorState {
        program: String,
        #[source]
        source: BlockError,
    },
    /// The step declares its state inconsistently.
    #[error("program {program:?}: {message}")]
    Declaration { program: String, message: String },
}

impl ProgramError {
    /// Whether the step cannot take the snapshot's state as the job stands (a state
    /// declaration, the uid or the key type changed; [`BlockError::refuses_the_job`]), rather
    /// than a damaged block or a failure of the function.
    pub fn refuses_the_job(&self) -> bool {
        match self {
            ProgramError::Block { source, .. } | ProgramError::OperatorState { source, .. } => {
                source.refuses_the_job()
            }
            ProgramError::Declaration { .. } => true,
            ProgramError::Step { .. } => false,
        }
    }
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

    /// State entries (timers included): a pass over every key (see [`Self::counted_entries`]).
    pub fn entries(&self) -> usize {
        self.step.entries()
    }

    /// State entries (timers included) as counted at each group's last encode, restore or
    /// catch-up ([`Self::encoded_group_entries`] summed): exact right after a checkpoint's cut,
    /// a restore or a catch-up, and without a pass over the keys (for a metric kept while
    /// records flow, and the counts a start reports inside a rescale's pause).
    pub fn counted_entries(&self) -> usize {
        self.range()
            .iter()
            .map(|g| self.step.encoded_group_entries(g))
            .sum()
    }

    /// State entries of `group` (timers included).
    pub fn group_entries(&self, group: u32) -> u64 {
        self.step.group_entries(group) as u64
    }

    /// State entries of `group` as of its last encode (exact right after
    /// [`Self::encode_group`]; no pass over its keys).
    pub fn encoded_group_entries(&self, group: u32) -> u64 {
        self.step.encoded_group_entries(group) as u64
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
    ) -> Result<Option<EncodedBlock>, ProgramError> {
        let r = self.step.encode_group(group, mode);
        r.map_err(|e| self.step_error(e))
    }

    /// Replaces `group`'s state with a snapshot's chain (a full block, then its deltas), every
    /// block checked before anything is installed.
    pub fn restore_group(&mut self, group: u32, chain: &[&[u8]]) -> Result<(), ProgramError> {
        let r = self.step.restore_group(group, chain);
        r.map_err(|e| self.block_error(group, e))
    }

    /// Applies delta blocks written after the state it holds for `group` onto it (a
    /// pre-staged group catching up: the work is the deltas'); with `replace`, the blocks
    /// replace the group (the first is a full block).
    pub fn apply_blocks(
        &mut self,
        group: u32,
        blocks: &[&[u8]],
        replace: bool,
    ) -> Result<(), ProgramError> {
        let r = if replace {
            self.step.restore_group(group, blocks)
        } else {
            self.step.apply_deltas(group, blocks)
        };
        r.map_err(|e| self.block_error(group, e))
    }

    /// Drops `group`'s state and timers.
    pub fn clear_group(&mut self, group: u32) -> Result<(), ProgramError> {
        self.step
            .clear_group(group)
            .map_err(|e| self.step_error(e.into()))
    }

    /// The step's operator-state section as `subtask` of `parallelism` (`None`: it declares
    /// no operator state).
    pub fn encode_operator_state(&self, subtask: u32, parallelism: u32) -> Option<Vec<u8>> {
        self.step.encode_operator_state(subtask, parallelism)
    }

    /// Replaces the step's operator state with `subtask`'s share (of `parallelism`) of a
    /// snapshot's sections; nothing is replaced on an error (a changed declaration or a
    /// rescale the state's redistribution refuses: [`ProgramError::refuses_the_job`]).
    pub fn restore_operator_state(
        &mut self,
        sections: &[&[u8]],
        subtask: u32,
        parallelism: u32,
    ) -> Result<(), ProgramError> {
        self.step
            .restore_operator_state(sections, subtask, parallelism)
            .map_err(|source| ProgramError::OperatorState {
                program: self.name.clone(),
                source,
            })
    }

    /// Entries of the step's operator state.
    pub fn operator_state_entries(&self) -> usize {
        self.step.operator_states().entries()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::RecordKey;
    use keyshift_sdk::prelude::*;
    use keyshift_sdk::state::TimeDomain;

    #[derive(serde::Serialize, serde::Deserialize, Clone)]
    struct Ping {
        user: String,
        ts: i64,
    }

    /// Counts each user's pings; says so when event time passes a ping by 10 ms, and when
    /// processing time reaches 1000.
    struct Pings;

    impl KeyedProcessFunction for Pings {
        type Key = String;
        type In = Ping;
        type Out = String;
        type State = ValueHandle<u64>;

        fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
            s.value(ValueStateDescriptor::new("n"))
        }

        fn process(
            &mut self,
            p: Ping,
            n: &Self::State,
            ctx: &mut Context<'_, String, String>,
        ) -> keyshift_sdk::Result<()> {
            let v = ctx.value(n).get()?.unwrap_or(0) + 1;
            ctx.value(n).set(v)?;
            ctx.register_event_time_timer(p.ts + 10)?;
            ctx.register_processing_time_timer(1_000)?;
            Ok(())
        }

        fn on_timer(
            &mut self,
            timer: Timer,
            n: &Self::State,
            ctx: &mut Context<'_, String, String>,
        ) -> keyshift_sdk::Result<()> {
            let v = ctx.value(n).get()?.unwrap_or(0);
            let clock = match timer.domain {
                TimeDomain::EventTime => "event",
                TimeDomain::ProcessingTime => "processing",
            };
            ctx.emit(format!("{}:{clock}:{v}", ctx.key()));
            Ok(())
        }
    }

    fn programs() -> Programs {
        Programs::new()
            .with(
                "pings",
                Job::json_lines::<Ping>("pings", "in", |p| p.ts)
                    .key_by(|p| p.user.clone())
                    .process("pings", || Pings)
                    .to_json_lines("out"),
            )
            .unwrap()
    }

    const RANGE: KeyGroupRange = KeyGroupRange { start: 0, end: 127 };

    fn batch(program: &Program, lines: &[&str]) -> EncodedRecords {
        let mut b = EncodedRecords::default();
        for l in lines {
            program
                .ingest(l.as_bytes(), &mut |k, ts, r| b.push(k, ts, r))
                .unwrap();
        }
        b
    }

    fn lines(step: &mut ProgramStep) -> Vec<String> {
        let mut out = Vec::new();
        let n = step.take_lines(&mut out).unwrap();
        let got: Vec<String> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<String>(l).unwrap())
            .collect();
        assert_eq!(n as usize, got.len());
        got
    }

    /// Keeps a per-subtask list of the pings it saw, declaring no redistribution.
    struct Seen;

    impl KeyedProcessFunction for Seen {
        type Key = String;
        type In = Ping;
        type Out = String;
        type State = OperatorListHandle<i64>;

        fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
            s.operator_list(OperatorListStateDescriptor::new("seen"))
        }

        fn process(
            &mut self,
            p: Ping,
            seen: &Self::State,
            ctx: &mut Context<'_, String, String>,
        ) -> keyshift_sdk::Result<()> {
            ctx.operator_list(seen).add(&p.ts)?;
            Ok(())
        }
    }

    #[test]
    fn operator_state_without_a_redistribution_restores_in_place_and_refuses_a_rescale() {
        let programs = Programs::new()
            .with(
                "seen",
                Job::json_lines::<Ping>("seen", "in", |p| p.ts)
                    .key_by(|p| p.user.clone())
                    .process("seen", || Seen)
                    .to_json_lines("out"),
            )
            .unwrap();
        let program = programs.get("seen").unwrap();
        let halves = [
            KeyGroupRange { start: 0, end: 63 },
            KeyGroupRange {
                start: 64,
                end: 127,
            },
        ];
        let mut sections = Vec::new();
        for (i, range) in halves.into_iter().enumerate() {
            let mut step = ProgramStep::new("seen", program.clone(), 128, range).unwrap();
            let user = (0..100)
                .map(|u| format!("u{u}"))
                .find(|u| range.contains(RecordKey::string(u.as_str()).key_group(128)))
                .unwrap();
            let line = format!(r#"{{"user":"{user}","ts":{i}}}"#);
            step.process(&batch(&program, &[&line])).unwrap();
            assert_eq!(step.operator_state_entries(), 1);
            sections.push(step.encode_operator_state(i as u32, 2).unwrap());
        }
        let sections: Vec<&[u8]> = sections.iter().map(Vec::as_slice).collect();
        // The same parallelism: each subtask its own entries.
        let mut again = ProgramStep::new("seen", program.clone(), 128, halves[1]).unwrap();
        again.restore_operator_state(&sections, 1, 2).unwrap();
        assert_eq!(again.operator_state_entries(), 1);
        // Another: refused for good, naming the state and the choices.
        let mut third =
            ProgramStep::new("seen", program, 128, KeyGroupRange { start: 0, end: 42 }).unwrap();
        let e = third.restore_operator_state(&sections, 0, 3).unwrap_err();
        assert!(e.refuses_the_job(), "{e}");
        let msg = e.to_string();
        for word in [
            "\"seen\"",
            "split",
            "union",
            "broadcast",
            "parallelism at 2",
        ] {
            assert!(msg.contains(word), "{msg}");
        }
        assert_eq!(third.operator_state_entries(), 0);
    }

    #[test]
    fn a_program_step_counts_fires_both_clocks_and_restores_its_groups_elsewhere() {
        let programs = programs();
        assert_eq!(programs.names(), ["pings"]);
        let program = programs.get("pings").unwrap();
        let mut step = ProgramStep::new("pings", program.clone(), 128, RANGE).unwrap();
        let b = batch(
            &program,
            &[
                r#"{"user":"a","ts":1}"#,
                r#"{"user":"a","ts":2}"#,
                r#"{"user":"b","ts":5}"#,
            ],
        );
        step.process(&b).unwrap();
        assert_eq!(step.records_processed(), 3);
        assert!(lines(&mut step).is_empty());
        step.advance_watermark(11).unwrap();
        assert_eq!(lines(&mut step), ["a:event:2"]);
        step.advance_processing_time(999).unwrap();
        assert!(lines(&mut step).is_empty());
        step.advance_processing_time(1_000).unwrap();
        let mut fired = lines(&mut step);
        fired.sort();
        assert_eq!(fired, ["a:processing:2", "b:processing:1"]);
        // A late record counts as late, and is processed.
        step.process(&batch(&program, &[r#"{"user":"b","ts":3}"#]))
            .unwrap();
        assert_eq!(step.late_records(), 1);

        // Its groups, written whole, restore into another subtask's step: b's timers at 13 (the
        // late record's) and 15 are still there, and each fires once.
        let g = RecordKey::string("b").key_group(128);
        let EncodedBlock {
            bytes: block,
            entries,
        } = step.encode_group(g, GroupMode::Full).unwrap().unwrap();
        assert_eq!(
            keyshift_sdk::block::check(&block, g, 128),
            Ok(entries),
            "the count returned is the block's"
        );
        assert!(
            entries >= 2,
            "{entries} entries (a value and a timer at least)"
        );
        assert_eq!(step.group_entries(g), entries);
        assert_eq!(step.encoded_group_entries(g), entries);
        let mut other = ProgramStep::new("pings", program.clone(), 128, RANGE).unwrap();
        other.restore_group(g, &[&block]).unwrap();
        // The count a metric reads (no pass over the keys) is the restored group's.
        assert_eq!(other.counted_entries() as u64, entries);
        assert_eq!(other.entries() as u64, entries);
        other.restore_watermark(11);
        other.advance_watermark(20).unwrap();
        assert_eq!(lines(&mut other), ["b:event:2", "b:event:2"]);
        other.advance_watermark(30).unwrap();
        assert!(lines(&mut other).is_empty());

        // A delta applied over the restored group catches it up; a block of another group is
        // refused by name, and a corrupt one too.
        let cut = step.cut();
        step.process(&batch(&program, &[r#"{"user":"b","ts":40}"#]))
            .unwrap();
        let mode = step.group_mode(g, cut);
        assert!(matches!(mode, GroupMode::Delta { .. }), "{mode:?}");
        let delta = step.encode_group(g, mode).unwrap().unwrap().bytes;
        let mut caught_up = ProgramStep::new("pings", program.clone(), 128, RANGE).unwrap();
        caught_up.restore_group(g, &[&block]).unwrap();
        caught_up.apply_blocks(g, &[&delta], false).unwrap();
        let a = caught_up.encode_group(g, GroupMode::Full).unwrap().unwrap();
        let b = step
            .encode_group(g, GroupMode::Full)
            .unwrap()
            .unwrap()
            .bytes;
        assert_eq!(
            a.bytes, b,
            "the caught-up group holds what the original does"
        );
        let compacted = block::compact(g, &block::chain(&block, &[delta])).unwrap();
        assert_eq!(compacted.entries, a.entries);
        let sorted = |bytes: &[u8]| {
            let mut block = keyshift_sdk::block::decode(bytes).unwrap();
            block.entries.sort();
            block
        };
        assert_eq!(
            sorted(&compacted.bytes),
            sorted(&b),
            "a compacted chain holds the group written whole"
        );
        let err = caught_up.restore_group(g + 1, &[&block]).unwrap_err();
        assert!(err.to_string().contains("key group"), "{err}");
        let mut corrupt = block.clone();
        let last = corrupt.len() - 1;
        corrupt[last] ^= 1;
        assert!(caught_up.restore_group(g, &[&corrupt]).is_err());
    }

    #[test]
    fn programs_refuse_a_bad_name_a_duplicate_and_a_job_they_cannot_run() {
        let job = || {
            Job::json_lines::<Ping>("pings", "in", |p| p.ts)
                .key_by(|p| p.user.clone())
                .process("pings", || Pings)
                .to_json_lines("out")
        };
        assert!(matches!(
            Programs::new().with("Pings", job()),
            Err(ProgramsError::Name(_))
        ));
        assert!(matches!(
            programs().with("pings", job()),
            Err(ProgramsError::Duplicate(_))
        ));
        let stateless = Job::json_lines::<Ping>("none", "in", |p| p.ts).to_json_lines("out");
        let err = Programs::new().with("none", stateless).err().unwrap();
        assert!(err.to_string().contains("no keyed step"), "{err}");
    }
}
