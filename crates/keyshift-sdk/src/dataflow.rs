//! A job's dataflow, written with types and kept without them: a source of JSON lines,
//! stateless steps (`map`, `filter`, `flat_map`), keyed steps (`key_by` then `process`: a
//! shuffle by key group, then a [`KeyedProcessFunction`]), and a JSON-lines sink.
//!
//! ```
//! use keyshift_sdk::dataflow::Job;
//! # use keyshift_sdk::prelude::*;
//! # #[derive(serde::Serialize, serde::Deserialize, Clone)]
//! # struct Click { user: String, ts: i64 }
//! # struct CountClicks;
//! # impl KeyedProcessFunction for CountClicks {
//! #     type Key = String; type In = Click; type Out = (String, u64); type State = ValueHandle<u64>;
//! #     fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> { s.value(ValueStateDescriptor::new("n")) }
//! #     fn process(&mut self, c: Click, n: &Self::State, ctx: &mut Context<'_, String, (String, u64)>) -> keyshift_sdk::Result<()> {
//! #         let v = ctx.value(n).get()?.unwrap_or(0) + 1; ctx.value(n).set(v)?; ctx.emit((c.user, v)); Ok(())
//! #     }
//! # }
//! let job = Job::json_lines::<Click>("clicks", "in", |c| c.ts)
//!     .filter(|c| !c.user.is_empty())
//!     .key_by(|c| c.user.clone())
//!     .process("count-clicks", || CountClicks)
//!     .to_json_lines("out");
//! assert_eq!(job.steps(), vec!["count-clicks"]);
//! ```
//!
//! Records keep their event time through every step; a keyed step's output carries the time
//! its function emitted it with.

use crate::error::{Error, Result};
use crate::key::RecordKey;
use crate::key::StreamKey;
use crate::state::DeclarationError;
use crate::step::{self, StepFactory, Value};
use keyshift_core::keygroup::{KeyGroupRange, KeyType};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

type Decode = Box<dyn Fn(&[u8]) -> Result<(i64, Value)> + Send + Sync>;
type Stateless = Box<dyn Fn(i64, Value, &mut Vec<(i64, Value)>) -> Result<()> + Send + Sync>;
type KeyOf = Box<dyn Fn(&Value) -> Result<RecordKey> + Send + Sync>;
type Encode = Box<dyn Fn(&Value, &mut Vec<u8>) -> Result<()> + Send + Sync>;

/// A record that does not parse as the source's type, or a value of an unexpected type
/// between two steps (a bug of the job's wiring).
#[derive(Debug, thiserror::Error)]
pub enum DataflowError {
    #[error("source {source_name:?}: a line is not a record of the job's input type: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("{0}: a value of another type reached it")]
    Type(&'static str),
    #[error("{what}: {message}")]
    Serialize { what: &'static str, message: String },
}

/// The JSON-lines source of a job.
pub(crate) struct SourceSpec {
    pub(crate) name: String,
    pub(crate) decode: Decode,
}

/// A keyed stage: the shuffle (key and serialized record) and the step behind it.
pub(crate) struct KeyedStage {
    pub(crate) uid: String,
    pub(crate) key_type: KeyType,
    pub(crate) key_of: KeyOf,
    pub(crate) encode: Encode,
    pub(crate) factory: StepFactory,
}

/// One stage after the source.
pub(crate) enum Stage {
    Stateless(Stateless),
    Keyed(KeyedStage),
}

/// The JSON-lines sink of a job.
pub(crate) struct SinkSpec {
    pub(crate) name: String,
    pub(crate) encode: Encode,
}

/// A whole job: source, stages, sink.
pub struct Job {
    pub(crate) name: String,
    pub(crate) source: SourceSpec,
    pub(crate) stages: Vec<Stage>,
    pub(crate) sink: SinkSpec,
}

/// A job defined twice over the same uid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobDefinitionError {
    #[error(
        "two keyed steps of job {job:?} have the uid {uid:?}: a uid names a step's state in snapshots, so each needs its own"
    )]
    DuplicateUid { job: String, uid: String },
    #[error("job {0:?} has no keyed step: keyshift runs keyed jobs")]
    NoKeyedStep(String),
    #[error(
        "job {job:?} has {steps} keyed steps: the worker runtime runs jobs with one keyed step (stateless steps may come before and after it)"
    )]
    KeyedSteps { job: String, steps: usize },
}

/// Applies the stateless stages `stages` (all of them stateless) to `items`.
pub(crate) fn stateless(
    stages: &[Stage],
    mut items: Vec<(i64, Value)>,
) -> Result<Vec<(i64, Value)>> {
    for stage in stages {
        if let Stage::Stateless(f) = stage {
            let mut next = Vec::with_capacity(items.len());
            for (ts, v) in items {
                f(ts, v, &mut next)?;
            }
            items = next;
        }
    }
    Ok(items)
}

/// A job as the worker runtime runs it: its one keyed step, what comes before it (the source's
/// lines decoded and carried through the stateless steps to the key-group shuffle, keyed and
/// serialized) and what comes after it (the step's output carried through the stateless steps
/// after it to the sink's lines).
pub struct Program {
    job: Job,
    /// The index of the keyed stage in `job.stages`.
    keyed: usize,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program")
            .field("job", &self.job.name)
            .field("step", &self.uid())
            .finish()
    }
}

impl Program {
    /// The job, if the worker runtime can run it: a valid definition with one keyed step.
    pub fn new(job: Job) -> Result<Program, JobDefinitionError> {
        job.check()?;
        let keyed: Vec<usize> = job
            .stages
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, Stage::Keyed(_)))
            .map(|(i, _)| i)
            .collect();
        match keyed[..] {
            [keyed] => Ok(Program { job, keyed }),
            _ => Err(JobDefinitionError::KeyedSteps {
                job: job.name.clone(),
                steps: keyed.len(),
            }),
        }
    }

    /// The job.
    pub fn job(&self) -> &Job {
        &self.job
    }

    fn stage(&self) -> &KeyedStage {
        match &self.job.stages[self.keyed] {
            Stage::Keyed(k) => k,
            Stage::Stateless(_) => unreachable!("Program::new found a keyed stage here"),
        }
    }

    /// The keyed step's uid: its name in snapshots.
    pub fn uid(&self) -> &str {
        &self.stage().uid
    }

    /// How the keyed step's keys hash (the type `key_by` returns).
    pub fn key_type(&self) -> KeyType {
        self.stage().key_type
    }

    /// Decodes one line of the source and carries it to the shuffle: `out(key, event time,
    /// serialized record)` for every record the stateless steps before the keyed step make of
    /// it (none if a filter drops it, several after a `flat_map`).
    pub fn ingest(&self, line: &[u8], out: &mut dyn FnMut(RecordKey, i64, &[u8])) -> Result<()> {
        thread_local! {
            /// The serialized record's buffer, reused from record to record on each thread.
            static BYTES: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
        }
        let first = (self.job.source.decode)(line)?;
        let stage = self.stage();
        // Taken, not borrowed: `out` may ingest too (it then gets a buffer of its own).
        let mut bytes = BYTES.take();
        let mut one = |(ts, v): (i64, Value)| -> Result<()> {
            let key = (stage.key_of)(&v)?;
            bytes.clear();
            (stage.encode)(&v, &mut bytes)?;
            out(key, ts, &bytes);
            Ok(())
        };
        // With no stateless step before the shuffle, the record goes straight to it.
        let result = if self.keyed == 0 {
            one(first)
        } else {
            stateless(&self.job.stages[..self.keyed], vec![first])
                .and_then(|items| items.into_iter().try_for_each(&mut one))
        };
        BYTES.set(bytes);
        result
    }

    /// The keyed step's instance for a subtask owning `range` of `max_parallelism` groups.
    pub fn step(
        &self,
        max_parallelism: u32,
        range: KeyGroupRange,
    ) -> Result<Box<dyn step::KeyedStep>, DeclarationError> {
        (self.stage().factory)(max_parallelism, range)
    }

    /// Carries the keyed step's output through the stateless steps after it to the sink:
    /// appends one line per record to `out`, returns how many.
    pub fn emit(&self, output: Vec<(i64, Value)>, out: &mut Vec<u8>) -> Result<u64> {
        let items = stateless(&self.job.stages[self.keyed + 1..], output)?;
        for (_, v) in &items {
            (self.job.sink.encode)(v, out)?;
        }
        Ok(items.len() as u64)
    }
}

impl Job {
    /// A job named `name` reading JSON lines of `T` from its source `source`, with event time
    /// `timestamp(record)` (ms).
    pub fn json_lines<T>(
        name: &str,
        source: &str,
        timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static,
    ) -> Stream<T>
    where
        T: DeserializeOwned + Send + 'static,
    {
        let source_name = source.to_owned();
        let decode: Decode = Box::new(move |line| {
            let record: T = serde_json::from_slice(line).map_err(|e| {
                Error::user(DataflowError::Parse {
                    source_name: source_name.clone(),
                    message: e.to_string(),
                })
            })?;
            Ok((timestamp(&record), Box::new(record) as Value))
        });
        Stream {
            name: name.to_owned(),
            source: SourceSpec {
                name: source.to_owned(),
                decode,
            },
            stages: Vec::new(),
            _t: PhantomData,
        }
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The source's name.
    pub fn source_name(&self) -> &str {
        &self.source.name
    }

    /// The sink's name.
    pub fn sink_name(&self) -> &str {
        &self.sink.name
    }

    /// The uids of its keyed steps, in order.
    pub fn steps(&self) -> Vec<&str> {
        self.stages
            .iter()
            .filter_map(|s| match s {
                Stage::Keyed(k) => Some(k.uid.as_str()),
                Stage::Stateless(_) => None,
            })
            .collect()
    }

    /// Checks the definition: at least one keyed step, uids unique.
    pub fn check(&self) -> Result<(), JobDefinitionError> {
        let steps = self.steps();
        if steps.is_empty() {
            return Err(JobDefinitionError::NoKeyedStep(self.name.clone()));
        }
        for (i, uid) in steps.iter().enumerate() {
            if steps[..i].contains(uid) {
                return Err(JobDefinitionError::DuplicateUid {
                    job: self.name.clone(),
                    uid: (*uid).to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// A stream of `T` being defined.
pub struct Stream<T> {
    name: String,
    source: SourceSpec,
    stages: Vec<Stage>,
    _t: PhantomData<fn() -> T>,
}

fn downcast<T: 'static>(v: Value, what: &'static str) -> Result<T> {
    v.downcast::<T>()
        .map(|b| *b)
        .map_err(|_| Error::user(DataflowError::Type(what)))
}

impl<T: Send + 'static> Stream<T> {
    fn then<U>(mut self, stage: Stage) -> Stream<U> {
        self.stages.push(stage);
        Stream {
            name: self.name,
            source: self.source,
            stages: self.stages,
            _t: PhantomData,
        }
    }

    /// Each record turned into another.
    pub fn map<U: Send + 'static>(self, f: impl Fn(T) -> U + Send + Sync + 'static) -> Stream<U> {
        self.then(Stage::Stateless(Box::new(move |ts, v, out| {
            out.push((ts, Box::new(f(downcast::<T>(v, "map")?)) as Value));
            Ok(())
        })))
    }

    /// The records `keep` says yes to.
    pub fn filter(self, keep: impl Fn(&T) -> bool + Send + Sync + 'static) -> Stream<T> {
        self.then(Stage::Stateless(Box::new(move |ts, v, out| {
            let r = downcast::<T>(v, "filter")?;
            if keep(&r) {
                out.push((ts, Box::new(r) as Value));
            }
            Ok(())
        })))
    }

    /// Each record turned into any number of others (with its event time).
    pub fn flat_map<U, I>(self, f: impl Fn(T) -> I + Send + Sync + 'static) -> Stream<U>
    where
        U: Send + 'static,
        I: IntoIterator<Item = U>,
    {
        self.then(Stage::Stateless(Box::new(move |ts, v, out| {
            for u in f(downcast::<T>(v, "flat_map")?) {
                out.push((ts, Box::new(u) as Value));
            }
            Ok(())
        })))
    }

    /// Keys the stream by `key(record)`: the records of one key meet in one subtask, the one
    /// owning the key's group.
    pub fn key_by<K: StreamKey>(
        self,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
    ) -> KeyedStream<K, T> {
        KeyedStream {
            stream: self,
            key: Box::new(move |v| {
                let r = v
                    .downcast_ref::<T>()
                    .ok_or_else(|| Error::user(DataflowError::Type("key_by")))?;
                Ok(key(r).record_key())
            }),
            _k: PhantomData,
        }
    }

    /// Ends the job in a JSON-lines sink named `sink`.
    pub fn to_json_lines(self, sink: &str) -> Job
    where
        T: Serialize,
    {
        Job {
            name: self.name,
            source: self.source,
            stages: self.stages,
            sink: SinkSpec {
                name: sink.to_owned(),
                encode: Box::new(|v, out| {
                    let r = v
                        .downcast_ref::<T>()
                        .ok_or_else(|| Error::user(DataflowError::Type("sink")))?;
                    serde_json::to_writer(&mut *out, r).map_err(|e| {
                        Error::user(DataflowError::Serialize {
                            what: "sink",
                            message: e.to_string(),
                        })
                    })?;
                    out.push(b'\n');
                    Ok(())
                }),
            },
        }
    }
}

/// A stream keyed by `K`, waiting for its keyed step.
pub struct KeyedStream<K, T> {
    stream: Stream<T>,
    key: KeyOf,
    _k: PhantomData<fn() -> K>,
}

impl<K: StreamKey, T: Send + 'static> KeyedStream<K, T> {
    /// Runs the keyed step `uid` (its name in snapshots: keep it across releases) with the
    /// functions `factory` builds, one per subtask.
    pub fn process<F>(
        self,
        uid: &str,
        factory: impl Fn() -> F + Send + Sync + 'static,
    ) -> Stream<F::Out>
    where
        F: crate::function::KeyedProcessFunction<Key = K, In = T>,
        T: Serialize + DeserializeOwned,
        F::Out: Send + 'static,
    {
        let stage = KeyedStage {
            uid: uid.to_owned(),
            key_type: K::KEY_TYPE,
            key_of: self.key,
            encode: Box::new(|v, out| {
                let r = v
                    .downcast_ref::<T>()
                    .ok_or_else(|| Error::user(DataflowError::Type("shuffle")))?;
                let bytes = postcard::to_allocvec(r).map_err(|e| {
                    Error::user(DataflowError::Serialize {
                        what: "shuffle",
                        message: e.to_string(),
                    })
                })?;
                out.extend_from_slice(&bytes);
                Ok(())
            }),
            factory: step::factory(uid, factory),
        };
        self.stream.then(Stage::Keyed(stage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prelude::*;
    use crate::step::Routed;

    #[derive(serde::Serialize, serde::Deserialize, Clone)]
    struct Click {
        user: String,
        ts: i64,
    }

    /// Counts each user's clicks; emits the running count, and again when event time passes
    /// a click by 10 ms.
    struct Count;

    impl KeyedProcessFunction for Count {
        type Key = String;
        type In = Click;
        type Out = (String, u64);
        type State = ValueHandle<u64>;

        fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
            s.value(ValueStateDescriptor::new("n"))
        }

        fn process(
            &mut self,
            c: Click,
            n: &Self::State,
            ctx: &mut Context<'_, String, (String, u64)>,
        ) -> crate::Result<()> {
            let v = ctx.value(n).get()?.unwrap_or(0) + 1;
            ctx.value(n).set(v)?;
            ctx.register_event_time_timer(c.ts + 10)?;
            ctx.emit((c.user, v));
            Ok(())
        }

        fn on_timer(
            &mut self,
            _timer: Timer,
            n: &Self::State,
            ctx: &mut Context<'_, String, (String, u64)>,
        ) -> crate::Result<()> {
            let v = ctx.value(n).get()?.unwrap_or(0);
            ctx.emit((ctx.key().clone(), v * 100));
            Ok(())
        }
    }

    fn job() -> Job {
        Job::json_lines::<Click>("clicks", "in", |c| c.ts)
            .filter(|c| !c.user.is_empty())
            .flat_map(|c: Click| [c.clone(), c])
            .key_by(|c| c.user.clone())
            .process("count", || Count)
            .map(|(user, n)| format!("{user}={n}"))
            .to_json_lines("out")
    }

    #[test]
    fn a_program_runs_its_job_as_the_harness_does() {
        let lines = [
            r#"{"user":"a","ts":1}"#,
            r#"{"user":"","ts":2}"#,
            r#"{"user":"b","ts":3}"#,
            r#"{"user":"a","ts":30}"#,
        ];
        let want = crate::testing::run_job(&job(), &lines, 1, 128, 0, lines.len()).unwrap();
        let program = Program::new(job()).unwrap();
        assert_eq!(program.uid(), "count");
        assert_eq!(program.key_type(), KeyType::String);
        let mut step = program
            .step(128, KeyGroupRange { start: 0, end: 127 })
            .unwrap();
        let mut routed = Vec::new();
        for line in lines {
            program
                .ingest(line.as_bytes(), &mut |key, ts, bytes| {
                    routed.push((key, ts, bytes.to_vec()))
                })
                .unwrap();
        }
        assert_eq!(
            routed.len(),
            6,
            "the filter dropped one line, flat_map doubled the rest"
        );
        let batch: Vec<Routed<'_>> = routed
            .iter()
            .map(|(key, ts, bytes)| Routed {
                group: key.key_group(128),
                key: key.clone(),
                timestamp: *ts,
                record: bytes,
            })
            .collect();
        step.process_batch(&batch).unwrap();
        step.advance_watermark(30).unwrap();
        step.advance_watermark(i64::MAX).unwrap();
        let mut out = Vec::new();
        let rows = program.emit(step.take_output(), &mut out).unwrap();
        let got: Vec<String> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(rows as usize, got.len());
        assert_eq!(got, want);
        assert!(got.contains(&"\"b=200\"".to_owned()), "{got:?}");
    }

    #[test]
    fn a_job_of_two_keyed_steps_is_refused_by_name() {
        let two = Job::json_lines::<Click>("two", "in", |c| c.ts)
            .key_by(|c| c.user.clone())
            .process("first", || Count)
            .map(|(user, _)| Click { user, ts: 0 })
            .key_by(|c| c.user.clone())
            .process("second", || Count)
            .to_json_lines("out");
        let err = Program::new(two).err().unwrap();
        assert_eq!(
            err,
            JobDefinitionError::KeyedSteps {
                job: "two".into(),
                steps: 2
            }
        );
        assert!(err.to_string().contains("one keyed step"), "{err}");
    }
}
