//! A job's dataflow, written with types and kept without them: a source of JSON lines,
//! stateless steps (`map`, `filter`, `flat_map`), keyed steps (`key_by` then `process`: a
//! shuffle by key group, then a [`KeyedProcessFunction`](crate::KeyedProcessFunction)), and a JSON-lines sink.
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
type WindowOf = Box<dyn Fn(&Value) -> Result<i64> + Send + Sync>;
type Merge = Box<dyn Fn(&mut Value, Value) -> Result<()> + Send + Sync>;
/// Where [`Program::drain_combined`] hands each partial: key, event time, serialized form, how
/// many records it stands for.
pub type CombinedOut<'a> = dyn FnMut(RecordKey, i64, &[u8], u32) + 'a;

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
    /// How values of one key may be combined before the shuffle, if they may.
    pub(crate) combine: Option<CombineSpec>,
}

/// How a keyed stage's values combine before the shuffle: two values of one key and one
/// window (`window`) merge into one (`merge`, the second into the first).
pub(crate) struct CombineSpec {
    pub(crate) window: WindowOf,
    pub(crate) merge: Merge,
}

/// A source task's combining before the shuffle, for a program whose keyed step combines
/// ([`Program::combines`]): the values of one key and window in a batch, merged, in the order
/// their keys first came ([`Program::ingest_combining`], [`Program::drain_combined`]).
/// Exact with no state of its own, as long as a batch never spans a checkpoint barrier (the
/// runtime's batches do not).
#[derive(Default)]
pub struct Combiner {
    index: std::collections::HashMap<
        (RecordKey, i64),
        usize,
        keyshift_core::record_key::KeyBuildHasher,
    >,
    /// Key, latest event time, merged value, how many values it stands for.
    entries: Vec<(RecordKey, i64, Value, u32)>,
    inputs: usize,
    pacing: keyshift_core::combining::Pacing,
}

impl Combiner {
    /// Whether to combine the next batch ([`keyshift_core::combining::Pacing`]); a batch not
    /// combined is ingested as it is ([`Program::ingest`]).
    pub fn attempt(&mut self) -> bool {
        self.pacing.attempt()
    }
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
        let stage = self.stage();
        // Taken, not borrowed: `out` may ingest too (it then gets a buffer of its own).
        let mut bytes = BYTES.take();
        let result = self.before_shuffle(line, &mut |(ts, v)| {
            let key = (stage.key_of)(&v)?;
            bytes.clear();
            (stage.encode)(&v, &mut bytes)?;
            out(key, ts, &bytes);
            Ok(())
        });
        BYTES.set(bytes);
        result
    }

    /// Decodes one line of the source and hands `one` every value the stateless steps before
    /// the keyed step make of it, with its event time.
    fn before_shuffle(
        &self,
        line: &[u8],
        one: &mut dyn FnMut((i64, Value)) -> Result<()>,
    ) -> Result<()> {
        let first = (self.job.source.decode)(line)?;
        // With no stateless step before the shuffle, the record goes straight to it.
        if self.keyed == 0 {
            one(first)
        } else {
            stateless(&self.job.stages[..self.keyed], vec![first])
                .and_then(|items| items.into_iter().try_for_each(one))
        }
    }

    /// Whether the keyed step's values combine before the shuffle (a
    /// [`KeyedStream::window_aggregate`]): the runtime then ingests a batch with
    /// [`Program::ingest_combining`] and [`Program::drain_combined`].
    pub fn combines(&self) -> bool {
        self.stage().combine.is_some()
    }

    /// Decodes one line of the source and carries it to the shuffle as [`Program::ingest`]
    /// does, but into `combiner`: a value of a key and window it already holds is merged there.
    /// [`Program::drain_combined`] hands them on.
    pub fn ingest_combining(&self, line: &[u8], combiner: &mut Combiner) -> Result<()> {
        let stage = self.stage();
        let Some(combine) = &stage.combine else {
            return Err(Error::user(DataflowError::Type("combining ingest")));
        };
        self.before_shuffle(line, &mut |(ts, v)| {
            let key = (stage.key_of)(&v)?;
            let window = (combine.window)(&v)?;
            combiner.inputs += 1;
            match combiner.index.entry((key.clone(), window)) {
                std::collections::hash_map::Entry::Occupied(at) => {
                    let entry = &mut combiner.entries[*at.get()];
                    (combine.merge)(&mut entry.2, v)?;
                    entry.1 = entry.1.max(ts);
                    entry.3 = entry.3.saturating_add(1);
                }
                std::collections::hash_map::Entry::Vacant(at) => {
                    at.insert(combiner.entries.len());
                    combiner.entries.push((key, ts, v, 1));
                }
            }
            Ok(())
        })
    }

    /// Hands on what `combiner` holds, emptying it: `out(key, event time, serialized value,
    /// how many values it stands for)` for each key and window, in the order they first came.
    pub fn drain_combined(&self, combiner: &mut Combiner, out: &mut CombinedOut<'_>) -> Result<()> {
        let stage = self.stage();
        combiner.index.clear();
        let inputs = std::mem::take(&mut combiner.inputs);
        combiner.pacing.judge(inputs, combiner.entries.len());
        let mut bytes = Vec::new();
        let mut result = Ok(());
        for (key, ts, v, weight) in combiner.entries.drain(..) {
            if result.is_ok() {
                bytes.clear();
                result = (stage.encode)(&v, &mut bytes);
                if result.is_ok() {
                    out(key, ts, &bytes, weight);
                }
            }
        }
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

/// Appends `r`'s form as it crosses the key-group shuffle (`postcard`).
fn to_shuffle<T: Serialize>(r: &T, out: &mut Vec<u8>) -> Result<()> {
    let bytes = postcard::to_allocvec(r).map_err(|e| {
        Error::user(DataflowError::Serialize {
            what: "shuffle",
            message: e.to_string(),
        })
    })?;
    out.extend_from_slice(&bytes);
    Ok(())
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
                to_shuffle(r, out)
            }),
            factory: step::factory(uid, factory),
            combine: None,
        };
        self.stream.then(Stage::Keyed(stage))
    }

    /// Tumbling event-time windows of `size` over each key's records, folded with `agg`
    /// ([`crate::windows::TumblingWindows`], its state `windows`): each window's result once,
    /// when the watermark passes its end. Combined before the shuffle: the records of one key
    /// and window in a batch a source reads cross it as one accumulator, so a hot key costs
    /// its subtask one merge per batch, not one per record (exact through checkpoints,
    /// rescales and failures: a batch never spans a barrier). `agg` must be associative and
    /// commutative ([`MergingAggregate`](crate::windows::MergingAggregate)).
    pub fn window_aggregate<A>(
        self,
        uid: &str,
        size: std::time::Duration,
        agg: A,
    ) -> Stream<crate::windows::WindowResult<K, A::Out>>
    where
        K: Clone,
        A: crate::windows::MergingAggregate<In = T>,
        A::Acc: Clone + Send + Serialize + DeserializeOwned + 'static,
        A::Out: Send + 'static,
    {
        use crate::windows::{Partial, TumblingWindows, window_start};
        /// What crosses from the stateless part to the shuffle: the record's key and its
        /// partial.
        type Item<Acc> = (RecordKey, Partial<Acc>);
        let agg = std::sync::Arc::new(agg);
        let windows = TumblingWindows::<K, A>::new(size, agg.clone());
        let size_ms = windows.size_ms();
        let key = self.key;
        let fold = agg.clone();
        // Before the shuffle: each record as the partial of its window alone.
        let to_partial: Stateless = Box::new(move |ts, v, out| {
            let k = key(&v)?;
            let record = downcast::<T>(v, "window_aggregate")?;
            let partial = Partial {
                start: window_start(ts, size_ms),
                acc: fold.add(record, fold.create()),
            };
            out.push((ts, Box::new((k, partial)) as Value));
            Ok(())
        });
        fn item<Acc: 'static>(v: &Value) -> Result<&Item<Acc>> {
            v.downcast_ref::<Item<Acc>>()
                .ok_or_else(|| Error::user(DataflowError::Type("window_aggregate")))
        }
        let merge_with = agg;
        let stage = KeyedStage {
            uid: uid.to_owned(),
            key_type: K::KEY_TYPE,
            key_of: Box::new(|v| Ok(item::<A::Acc>(v)?.0.clone())),
            encode: Box::new(|v, out| to_shuffle(&item::<A::Acc>(v)?.1, out)),
            factory: step::factory(uid, move || windows.clone()),
            combine: Some(CombineSpec {
                window: Box::new(|v| Ok(item::<A::Acc>(v)?.1.start)),
                merge: Box::new(move |into, from| {
                    let from = downcast::<Item<A::Acc>>(from, "window_aggregate")?;
                    let into = into
                        .downcast_mut::<Item<A::Acc>>()
                        .ok_or_else(|| Error::user(DataflowError::Type("window_aggregate")))?;
                    let acc = std::mem::replace(&mut into.1.acc, merge_with.create());
                    into.1.acc = merge_with.merge(acc, from.1.acc);
                    Ok(())
                }),
            }),
        };
        self.stream
            .then::<Item<A::Acc>>(Stage::Stateless(to_partial))
            .then(Stage::Keyed(stage))
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

    /// Counts records.
    struct Clicks;

    impl AggregateFunction for Clicks {
        type In = Click;
        type Acc = u64;
        type Out = u64;
        fn create(&self) -> u64 {
            0
        }
        fn add(&self, _: Click, acc: u64) -> u64 {
            acc + 1
        }
        fn result(&self, acc: &u64) -> u64 {
            *acc
        }
    }

    impl crate::windows::MergingAggregate for Clicks {
        fn merge(&self, a: u64, b: u64) -> u64 {
            a + b
        }
    }

    fn windowed() -> Job {
        Job::json_lines::<Click>("windowed", "in", |c| c.ts)
            .filter(|c| !c.user.is_empty())
            .key_by(|c| c.user.clone())
            .window_aggregate("clicks", std::time::Duration::from_millis(10), Clicks)
            .map(|w| format!("{}@{}={}", w.key, w.start, w.result))
            .to_json_lines("out")
    }

    /// Runs `lines` through a fresh step of `program` (one subtask), combined before the
    /// shuffle or not; the sink's lines (sorted) and the records that crossed the shuffle with
    /// their weights.
    fn through(program: &Program, lines: &[String], combine: bool) -> (Vec<String>, Vec<u32>) {
        let mut step = program
            .step(128, KeyGroupRange { start: 0, end: 127 })
            .unwrap();
        let mut routed = Vec::new();
        if combine {
            let mut c = Combiner::default();
            assert!(c.attempt());
            for line in lines {
                program.ingest_combining(line.as_bytes(), &mut c).unwrap();
            }
            program
                .drain_combined(&mut c, &mut |key, ts, bytes, w| {
                    routed.push((key, ts, bytes.to_vec(), w))
                })
                .unwrap();
        } else {
            for line in lines {
                program
                    .ingest(line.as_bytes(), &mut |key, ts, bytes| {
                        routed.push((key, ts, bytes.to_vec(), 1))
                    })
                    .unwrap();
            }
        }
        let batch: Vec<Routed<'_>> = routed
            .iter()
            .map(|(key, ts, bytes, _)| Routed {
                group: key.key_group(128),
                key: key.clone(),
                timestamp: *ts,
                record: bytes,
            })
            .collect();
        step.process_batch(&batch).unwrap();
        step.advance_watermark(i64::MAX).unwrap();
        let mut out = Vec::new();
        program.emit(step.take_output(), &mut out).unwrap();
        let mut got: Vec<String> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        got.sort();
        (got, routed.iter().map(|r| r.3).collect())
    }

    #[test]
    fn a_window_aggregate_combined_before_the_shuffle_gives_what_it_gives_uncombined() {
        let program = Program::new(windowed()).unwrap();
        assert!(program.combines());
        assert!(!Program::new(job()).unwrap().combines());
        // A hot user among others, over three windows; one line filtered out.
        let lines: Vec<String> = (0..60)
            .map(|i| {
                let user = match i % 3 {
                    0 | 1 => "hot".to_owned(),
                    _ if i == 5 => String::new(),
                    _ => format!("u{}", i % 4),
                };
                format!(r#"{{"user":"{user}","ts":{}}}"#, i / 2)
            })
            .collect();
        let (plain, plain_weights) = through(&program, &lines, false);
        let (combined, weights) = through(&program, &lines, true);
        assert_eq!(combined, plain);
        assert!(plain.contains(&"\"hot@0=14\"".to_owned()), "{plain:?}");
        assert_eq!(plain_weights.len(), 59);
        assert_eq!(
            weights.iter().sum::<u32>(),
            59,
            "every record is counted once"
        );
        // One partial per key and window: 5 users over 3 windows.
        assert_eq!(weights.len(), 15);
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let mut harness = crate::testing::run_job(&windowed(), &refs, 2, 128, 0, 7).unwrap();
        harness.sort();
        assert_eq!(
            harness, plain,
            "the harness (records uncombined, 2 subtasks) agrees"
        );
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
