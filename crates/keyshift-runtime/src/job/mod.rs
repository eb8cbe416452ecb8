//! The dataflow of a keyed job, pure and deterministic: records, sources, the keyed aggregation
//! operator with its per-key-group state encoding, watermarks, sink logic and an oracle.
//!
//! Nothing here touches the network or the object store (the file source reads local files).
//! The worker runtime drives it:
//!
//! ```text
//! source (per partition, position u64) --fill/read_batch--> Record --key_group--> shuffle
//!   --> KeyedAggregator (per key group state) --advance_watermark/results--> sink
//!                         \--encode_group/restore_group--> snapshot layer (opaque blocks)
//! ```
//!
//! [`compile`] turns a [`JobSpec`] into the pieces; see the submodules for the contracts.
//!
//! # What a snapshot of a subtask must hold (for the runtime)
//!
//! * per owned key group: [`KeyedAggregator::encode_group`]'s block (opaque; self-describing);
//! * per source partition: the position (sequence number or byte offset), for a file source the
//!   partition's name ([`CompiledJob::current_partitions`]; a restore lays positions onto the
//!   current partitions with [`remap_positions`]), and [`PartitionWatermark::max_ts`], restored
//!   with [`PartitionWatermark::set_max_ts`];
//! * the operator watermark ([`KeyedAggregator::watermark`]). After a rescale, restore every new
//!   subtask with the minimum over the old subtasks ([`KeyedAggregator::restore_watermark`]):
//!   windows an old subtask already fired are no longer in its blocks, and windows still in the
//!   blocks end after that subtask's watermark, so nothing fires twice or is lost;
//! * nothing of the object-store sink: a writer's output is staged (durable) before it
//!   acknowledges a snapshot, and a restored writer starts empty (see [`sink`]).

pub mod aggregate;
pub mod combine;
pub mod file_source;
pub mod generator;
pub mod kafka;
pub mod keyed;
pub mod object_files;
pub mod oracle;
pub mod program;
pub use keyshift_core::positions;
pub mod record;
pub mod result;
pub mod staging;
pub mod state_codec;
pub mod watermark;

pub use aggregate::{
    AggConfig, AggregateError, Captured, DecodedGroupState, DeferredGroup, EncodedGroup,
    FrozenGroup, GroupDecoder, GroupMode, GroupSnapshot, KeyedAggregator,
};
pub use file_source::{FieldMapping, FileBatch, FileSourceError, FileSourceReader};
pub use generator::{Generator, GeneratorError};
pub use keyed::{GroupModes, Keyed};
pub use oracle::{Expected, expected_results};
pub use positions::{
    CurrentPartitions, GonePartition, MatchedBy, NewPartition, PositionRemap, PositionsError,
    remap_positions,
};
pub use program::{PROGRAM_SCHEMA, ProgramError, ProgramStep, Programs};
pub use record::{EncodedRecords, KeyRef, Record, RecordKey};
pub use result::{LogSink, ResultRow, Window, format_json_line, format_json_row};
pub use staging::{Output, SinkError, StagingSink, WriterId};
pub use state_codec::{
    AGG_SCHEMA, AccValue, BlockHeader, BlockInfo, CodecError, DecodedGroup, SharedEntries,
    StateValue, decode_group, decode_header, encode_entries, shared_entries,
};
pub use watermark::{PartitionWatermark, WatermarkTracker};

use keyshift_core::duration::parse_duration;
use keyshift_core::keygroup::{KeyGroupRange, KeyType, UPPER_BOUND_MAX_PARALLELISM};
use keyshift_core::spec::{AggregateFunction, JobLogic, JobSpec, SinkSpec};
use std::collections::BTreeMap;

/// Runtime options that are not part of the StreamJob spec (set by the runtime or a benchmark).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobOptions {
    /// Opaque bytes kept with every key's state and carried through snapshots, to make state
    /// large for benchmarks. 0 (default) for none.
    pub state_payload_bytes: usize,
}

/// A job spec that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("spec.job.source must set exactly one of generator, file or kafka")]
    SourceOneOf,
    #[error(
        "spec.job.source.kafka: this keyshift binary was built without Kafka support (cargo feature `kafka`); use an image built with it"
    )]
    KafkaNotBuilt,
    #[error(
        "spec.job.sink.kafka: this keyshift binary was built without Kafka support (cargo feature `kafka`); use an image built with it"
    )]
    KafkaSinkNotBuilt,
    #[error(
        "the oracle cannot replay a Kafka source: compute expected results from the records produced"
    )]
    OracleKafka,
    #[cfg(feature = "kafka")]
    #[error(transparent)]
    Kafka(#[from] kafka::source::KafkaSourceError),
    #[error("spec.job.window.size {0:?} is not a positive duration such as 10s, 1m or 1h")]
    WindowSize(String),
    #[error("spec.job.window.maxOutOfOrderness {0:?} is not a duration such as 0s, 500ms or 2s")]
    OutOfOrderness(String),
    #[error(
        "spec.job.aggregation.field is required for sum, min and max with a file source: name the numeric record field"
    )]
    AggregationField,
    #[error(
        "spec.job.source.file.timestampField is required with a window: name the record field holding the event time in ms"
    )]
    TimestampField,
    #[error(
        "spec.job.source.file.path {path:?} must be a local directory (a path or file:///dir) that every worker can read, or an object-store URL (s3://bucket/dir, gs://bucket/dir, az://container/dir): {reason}"
    )]
    FileSourceLocation { path: String, reason: String },
    #[error("max parallelism {0} is outside 1..={UPPER_BOUND_MAX_PARALLELISM}")]
    MaxParallelism(u32),
    #[error(transparent)]
    Generator(#[from] GeneratorError),
    #[error(transparent)]
    File(#[from] FileSourceError),
    #[error(transparent)]
    Aggregate(#[from] AggregateError),
    #[error("{}", keyshift_core::rules::MSG_JOB_LOGIC)]
    Logic,
    #[error(
        "spec.job.program.name {name:?}: this worker image has no such program (it has: {available}); use an image built with it, or one of these"
    )]
    UnknownProgram { name: String, available: String },
    #[error("the job runs the built-in aggregation: its source feeds no program")]
    ProgramSource,
    #[error(
        "generator record {position} of partition {partition} ({line}): program {program:?} refused it: {reason}. Over the generator a program reads JSON objects {{\"key\": string, \"value\": integer, \"ts\": milliseconds}}"
    )]
    GeneratorRecord {
        program: String,
        partition: u32,
        position: u64,
        line: String,
        reason: String,
    },
    #[error("spec.job.program.maxOutOfOrderness {0:?} is not a duration such as 0s, 500ms or 2s")]
    ProgramOutOfOrderness(String),
    #[error("the job runs program {0:?}, not the built-in aggregation")]
    NotAggregate(String),
    #[error(transparent)]
    Program(#[from] ProgramError),
}

impl JobError {
    /// Whether the spec itself cannot run (every start of it fails the same way, and only a
    /// changed spec or image can help) rather than something around it failing for now (a
    /// broker not reachable, a source directory not readable yet).
    pub fn refuses_for_good(&self) -> bool {
        match self {
            #[cfg(feature = "kafka")]
            JobError::Kafka(_) => false,
            JobError::File(_) => false,
            JobError::SourceOneOf
            | JobError::KafkaNotBuilt
            | JobError::KafkaSinkNotBuilt
            | JobError::OracleKafka
            | JobError::WindowSize(_)
            | JobError::OutOfOrderness(_)
            | JobError::AggregationField
            | JobError::TimestampField
            | JobError::FileSourceLocation { .. }
            | JobError::MaxParallelism(_)
            | JobError::Generator(_)
            | JobError::Aggregate(_)
            | JobError::Logic
            | JobError::UnknownProgram { .. }
            | JobError::ProgramSource
            | JobError::GeneratorRecord { .. }
            | JobError::ProgramOutOfOrderness(_)
            | JobError::NotAggregate(_)
            | JobError::Program(_) => true,
        }
    }
}

/// What runs in a compiled job's keyed operator.
#[derive(Debug, Clone)]
pub enum Logic {
    /// The built-in aggregation.
    Aggregate(AggConfig),
    /// A program the worker binary carries.
    Program {
        name: String,
        program: std::sync::Arc<keyshift_sdk::dataflow::Program>,
    },
}

/// The source of a compiled job.
#[derive(Debug, Clone)]
pub enum SourceKind {
    /// The deterministic generator (position = sequence number).
    Generator(Generator),
    /// JSON-lines files (position = byte offset).
    File(FileSourceReader),
    /// Kafka topics (position = the partition's next offset).
    #[cfg(feature = "kafka")]
    Kafka(std::sync::Arc<kafka::source::KafkaSourceReader>),
}

/// What one source read returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceBatch {
    /// Records appended.
    pub records: usize,
    /// The partition's position after them.
    pub next_position: u64,
    /// No more records are available now.
    pub at_end: bool,
    /// No more records will ever come (a bounded generator partition at its end). A file
    /// partition is never finished: it may grow.
    pub finished: bool,
}

/// A job spec turned into runnable pieces.
#[derive(Debug, Clone)]
pub struct CompiledJob {
    /// The source.
    pub source: SourceKind,
    /// The key type.
    pub key_type: KeyType,
    /// What runs in the keyed operator.
    pub logic: Logic,
    /// Tumbling window size, if any.
    pub window_size_ms: Option<i64>,
    /// Bounded out-of-orderness of the per-partition watermarks.
    pub max_out_of_orderness_ms: i64,
    /// The sink.
    pub sink: SinkSpec,
    /// Whether the sources combine records before the shuffle: the built-in aggregation's
    /// (`spec.job.aggregation.combine`), or a program's whose keyed step can
    /// (`spec.job.program.combine`).
    pub combine: bool,
}

fn duration_ms(text: &str) -> Option<i64> {
    parse_duration(text).and_then(|d| i64::try_from(d.as_millis()).ok())
}

/// Checks a job spec and builds its source and operator configuration for `max_parallelism`
/// key groups (a job of the built-in aggregation: a program needs [`compile_for`] with the
/// worker's programs).
pub fn compile(
    spec: &JobSpec,
    max_parallelism: u32,
    options: &JobOptions,
) -> Result<CompiledJob, JobError> {
    compile_for(spec, max_parallelism, options, "", "", &Programs::new())
}

/// [`compile`] for the job `namespace/name` (a Kafka source's default consumer group names it)
/// in a worker carrying `programs`. A Kafka source connects to its brokers and lists its
/// partitions here (blocking).
pub fn compile_for(
    spec: &JobSpec,
    max_parallelism: u32,
    options: &JobOptions,
    namespace: &str,
    name: &str,
    programs: &Programs,
) -> Result<CompiledJob, JobError> {
    if !(1..=UPPER_BOUND_MAX_PARALLELISM).contains(&max_parallelism) {
        return Err(JobError::MaxParallelism(max_parallelism));
    }
    if spec.sink.sink_type == keyshift_core::spec::SinkType::Kafka && !cfg!(feature = "kafka") {
        return Err(JobError::KafkaSinkNotBuilt);
    }
    if spec.source.kafka.is_some()
        && (spec.source.generator.is_some() || spec.source.file.is_some())
    {
        return Err(JobError::SourceOneOf);
    }
    let (key, aggregation, window) = match spec.logic().ok_or(JobError::Logic)? {
        JobLogic::Builtin {
            key,
            aggregation,
            window,
        } => (key, aggregation, window),
        JobLogic::Program(p) => {
            let program = programs
                .get(&p.name)
                .ok_or_else(|| JobError::UnknownProgram {
                    name: p.name.clone(),
                    available: match programs.names() {
                        names if names.is_empty() => "none".to_owned(),
                        names => names.join(", "),
                    },
                })?;
            let source = match (
                &spec.source.generator,
                &spec.source.file,
                &spec.source.kafka,
            ) {
                (Some(g), None, None) => {
                    let generator = Generator::new(g, KeyType::String)?;
                    probe_generator(&p.name, &program, &generator)?;
                    SourceKind::Generator(generator)
                }
                (None, Some(f), None) => SourceKind::File(open_file_source(f, None)?),
                #[cfg(feature = "kafka")]
                (None, None, Some(k)) => {
                    let job = kafka::source::JobIdentity {
                        namespace: namespace.to_owned(),
                        name: name.to_owned(),
                    };
                    SourceKind::Kafka(std::sync::Arc::new(kafka::source::KafkaSourceReader::open(
                        k, None, &job,
                    )?))
                }
                #[cfg(not(feature = "kafka"))]
                (None, None, Some(_)) => return Err(JobError::KafkaNotBuilt),
                _ => return Err(JobError::ProgramSource),
            };
            let max_out_of_orderness_ms = match &p.max_out_of_orderness {
                None => 0,
                Some(t) => {
                    duration_ms(t).ok_or_else(|| JobError::ProgramOutOfOrderness(t.clone()))?
                }
            };
            return Ok(CompiledJob {
                source,
                key_type: program.key_type(),
                logic: Logic::Program {
                    name: p.name.clone(),
                    program,
                },
                window_size_ms: None,
                max_out_of_orderness_ms,
                sink: spec.sink.clone(),
                combine: p.combines(),
            });
        }
    };
    let (window_size_ms, max_out_of_orderness_ms) = match window {
        None => (None, 0),
        Some(w) => {
            let size = duration_ms(&w.size)
                .filter(|s| *s > 0)
                .ok_or_else(|| JobError::WindowSize(w.size.clone()))?;
            let ooo = match &w.max_out_of_orderness {
                None => 0,
                Some(t) => duration_ms(t).ok_or_else(|| JobError::OutOfOrderness(t.clone()))?,
            };
            (Some(size), ooo)
        }
    };
    let key_type = key.key_type;
    let needs_value = aggregation.function != AggregateFunction::Count;
    let logic = Logic::Aggregate(AggConfig {
        function: aggregation.function,
        window_size_ms,
        max_parallelism,
        state_payload_bytes: options.state_payload_bytes,
    });
    if let Some(k) = &spec.source.kafka {
        if needs_value && aggregation.field.is_none() {
            return Err(JobError::AggregationField);
        }
        #[cfg(feature = "kafka")]
        {
            let fields = kafka::source::KafkaFields {
                key_from: k.key_from,
                key_field: key.field.clone(),
                key_type,
                value_field: if needs_value {
                    aggregation.field.clone()
                } else {
                    None
                },
                timestamp_field: k.timestamp_field.clone(),
            };
            let job = kafka::source::JobIdentity {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            };
            let reader = kafka::source::KafkaSourceReader::open(k, Some(fields), &job)?;
            return Ok(CompiledJob {
                source: SourceKind::Kafka(std::sync::Arc::new(reader)),
                key_type,
                logic,
                window_size_ms,
                max_out_of_orderness_ms,
                sink: spec.sink.clone(),
                combine: aggregation.combines(),
            });
        }
        #[cfg(not(feature = "kafka"))]
        {
            let _ = (k, namespace, name);
            return Err(JobError::KafkaNotBuilt);
        }
    }
    let source = match (&spec.source.generator, &spec.source.file) {
        (Some(g), None) => SourceKind::Generator(Generator::new(g, key_type)?),
        (None, Some(f)) => {
            if needs_value && aggregation.field.is_none() {
                return Err(JobError::AggregationField);
            }
            if window_size_ms.is_some() && f.timestamp_field.is_none() {
                return Err(JobError::TimestampField);
            }
            let fields = FieldMapping {
                key_field: key.field.clone(),
                key_type,
                value_field: if needs_value {
                    aggregation.field.clone()
                } else {
                    None
                },
                timestamp_field: f.timestamp_field.clone(),
            };
            SourceKind::File(open_file_source(f, Some(fields))?)
        }
        _ => return Err(JobError::SourceOneOf),
    };
    Ok(CompiledJob {
        source,
        key_type,
        logic,
        window_size_ms,
        max_out_of_orderness_ms,
        sink: spec.sink.clone(),
        combine: aggregation.combines(),
    })
}

/// A file source's partitions: a local directory (a path or a `file://` URL) or the objects
/// under an object-store URL.
fn open_file_source(
    f: &keyshift_core::spec::FileSource,
    fields: Option<FieldMapping>,
) -> Result<FileSourceReader, JobError> {
    let dir = f.path.strip_prefix("file://").unwrap_or(&f.path);
    if !dir.contains("://") {
        return Ok(FileSourceReader::open(dir, fields)?);
    }
    FileSourceReader::open_objects(&f.path, fields).map_err(|e| match e {
        file_source::OpenObjectsError::Url(reason) => JobError::FileSourceLocation {
            path: f.path.clone(),
            reason,
        },
        file_source::OpenObjectsError::Read(e) => JobError::File(e),
    })
}

/// Refuses a program that cannot read the generator's records (its first record, as the JSON
/// object the program is given), before any worker starts: the same record would fail every
/// run of the job.
fn probe_generator(
    name: &str,
    program: &keyshift_sdk::dataflow::Program,
    generator: &Generator,
) -> Result<(), JobError> {
    // Not `fill`: it would build the key table, a cost in every start's pause.
    let first = [generator.sample(0, 0)];
    feed_generated(name, 0, 0, &first, &mut |line| {
        program
            .ingest(line, &mut |_, _, _| {})
            .map_err(|e| e.to_string())
    })
}

/// Hands generated `records` (of `partition`, from `position`) to program `name` through
/// `each`, each as the JSON object a program reads from the generator
/// ([`result::format_record_json`]); a record it refuses is [`JobError::GeneratorRecord`].
fn feed_generated(
    name: &str,
    partition: u32,
    position: u64,
    records: &[Record],
    each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> Result<(), JobError> {
    let mut line = Vec::with_capacity(64);
    for (i, r) in records.iter().enumerate() {
        line.clear();
        result::format_record_json(&r.key, r.value, r.ts, &mut line);
        each(&line).map_err(|reason| JobError::GeneratorRecord {
            program: name.to_owned(),
            partition,
            position: position + i as u64,
            line: String::from_utf8_lossy(&line).into_owned(),
            reason,
        })?;
    }
    Ok(())
}

impl CompiledJob {
    /// The sources' combiner, for a built-in aggregation that combines (see [`combine`]).
    pub fn combiner(&self) -> Option<combine::Combiner> {
        match &self.logic {
            Logic::Aggregate(config) if self.combine => Some(combine::Combiner::new(
                config.function,
                config.window_size_ms,
            )),
            _ => None,
        }
    }

    /// Number of source partitions.
    pub fn partitions(&self) -> u32 {
        match &self.source {
            SourceKind::Generator(g) => g.partitions(),
            SourceKind::File(f) => f.partitions(),
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(k) => k.partitions(),
        }
    }

    /// The partitions as they are now, with their identity: names for a file source, indexes for
    /// the generator.
    pub fn current_partitions(&self) -> CurrentPartitions<'_> {
        match &self.source {
            SourceKind::Generator(g) => CurrentPartitions::Indexed(g.partitions()),
            SourceKind::File(f) => CurrentPartitions::Named(f.names()),
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(k) => CurrentPartitions::Named(k.names()),
        }
    }

    /// The names of `partitions` (file source), for a snapshot to record beside their
    /// positions; empty for the generator, whose partitions are their indexes.
    pub fn partition_names(&self, partitions: &[u32]) -> BTreeMap<u32, String> {
        match self.current_partitions() {
            CurrentPartitions::Indexed(_) => BTreeMap::new(),
            CurrentPartitions::Named(names) => partitions
                .iter()
                .filter_map(|p| names.get(*p as usize).map(|n| (*p, n.clone())))
                .collect(),
        }
    }

    /// Checks that `partition` can be read from a restored `position`: a file source refuses a
    /// file shorter than it ([`FileSourceError::Shrunk`]).
    pub fn check_position(&self, partition: u32, position: u64) -> Result<(), JobError> {
        match &self.source {
            SourceKind::Generator(_) => Ok(()),
            SourceKind::File(f) => Ok(f.check_position(partition, position)?),
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(_) => Ok(()),
        }
    }

    /// Reads up to `max` records of `partition` from `position` into `out`.
    pub fn read(
        &self,
        partition: u32,
        position: u64,
        out: &mut Vec<Record>,
        max: usize,
    ) -> Result<SourceBatch, JobError> {
        match &self.source {
            SourceKind::Generator(g) => {
                let n = g.fill(partition, position, out, max);
                let next = position + n as u64;
                let finished = partition >= g.partitions() || g.end().is_some_and(|e| next >= e);
                Ok(SourceBatch {
                    records: n,
                    next_position: next,
                    at_end: finished,
                    finished,
                })
            }
            SourceKind::File(f) => {
                let b = f.read_batch(partition, position, out, max)?;
                Ok(SourceBatch {
                    records: b.records,
                    next_position: b.next_offset,
                    at_end: b.at_end,
                    finished: false,
                })
            }
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(k) => {
                let (records, next_position, at_end) = k.read(partition, position, out, max)?;
                Ok(SourceBatch {
                    records,
                    next_position,
                    at_end,
                    finished: false,
                })
            }
        }
    }

    /// The program's combiner, when its keyed step combines before the shuffle
    /// ([`keyshift_sdk::dataflow::Program::combines`]): one per source task.
    pub fn program_combiner(&self) -> Option<keyshift_sdk::dataflow::Combiner> {
        match &self.logic {
            Logic::Program { program, .. } if self.combine && program.combines() => {
                Some(Default::default())
            }
            _ => None,
        }
    }

    /// Reads up to `max` lines of `partition` from `position` through the job's program (its
    /// source's decoding and the stateless steps before its keyed step): every record they
    /// make is appended to `out`, or, with a `combiner`, combined there per key and window and
    /// then appended with how many records each stands for. A line the program refuses is a
    /// malformed record at its offset.
    pub fn read_program(
        &self,
        partition: u32,
        position: u64,
        out: &mut EncodedRecords,
        max: usize,
        mut combiner: Option<&mut keyshift_sdk::dataflow::Combiner>,
    ) -> Result<SourceBatch, JobError> {
        let Logic::Program { program, name } = &self.logic else {
            return Err(JobError::ProgramSource);
        };
        let batch = {
            let mut each = |line: &[u8]| {
                match combiner.as_deref_mut() {
                    Some(c) => program.ingest_combining(line, c),
                    None => program.ingest(line, &mut |key, ts, record| out.push(key, ts, record)),
                }
                .map_err(|e| e.to_string())
            };
            self.read_lines_of(name, partition, position, max, &mut each)?
        };
        if let Some(c) = combiner {
            program
                .drain_combined(c, &mut |key, ts, record, weight| {
                    out.push_weighted(key, ts, record, weight)
                })
                .map_err(|e| {
                    JobError::Program(program::ProgramError::Step {
                        program: name.clone(),
                        step: program.uid().to_owned(),
                        source: e,
                    })
                })?;
        }
        Ok(batch)
    }

    /// Reads up to `max` lines of `partition` from `position`, each handed to `each` (the
    /// generator's records as JSON lines, as the program `name` reads them).
    fn read_lines_of(
        &self,
        name: &str,
        partition: u32,
        position: u64,
        max: usize,
        each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<SourceBatch, JobError> {
        match &self.source {
            SourceKind::File(f) => {
                let b = f.read_lines(partition, position, max, each)?;
                Ok(SourceBatch {
                    records: b.records,
                    next_position: b.next_offset,
                    at_end: b.at_end,
                    finished: false,
                })
            }
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(k) => {
                let (records, next_position, at_end) =
                    k.read_payloads(partition, position, max, each)?;
                Ok(SourceBatch {
                    records,
                    next_position,
                    at_end,
                    finished: false,
                })
            }
            SourceKind::Generator(_) => {
                // The generator's records as the built-in job reads them, handed to the program.
                let mut records = Vec::with_capacity(max.min(4096));
                let batch = self.read(partition, position, &mut records, max)?;
                feed_generated(name, partition, position, &records, each)?;
                Ok(batch)
            }
        }
    }

    /// How long a source partition may go without records before it stops holding the
    /// watermark back (Kafka's idleTimeout); None: never.
    pub fn idle_timeout(&self) -> Option<std::time::Duration> {
        match &self.source {
            #[cfg(feature = "kafka")]
            SourceKind::Kafka(k) => Some(k.idle_timeout()),
            _ => None,
        }
    }

    /// A keyed aggregation operator for the groups in `range` (a job of the built-in
    /// aggregation).
    pub fn new_aggregator(&self, range: KeyGroupRange) -> Result<KeyedAggregator, JobError> {
        match &self.logic {
            Logic::Aggregate(config) => Ok(KeyedAggregator::new(*config, range)?),
            Logic::Program { name, .. } => Err(JobError::NotAggregate(name.clone())),
        }
    }

    /// The keyed operator for the groups in `range` of `max_parallelism`.
    pub fn new_keyed(&self, max_parallelism: u32, range: KeyGroupRange) -> Result<Keyed, JobError> {
        match &self.logic {
            Logic::Aggregate(config) => Ok(Keyed::Aggregate(KeyedAggregator::new(*config, range)?)),
            Logic::Program { name, program } => Ok(Keyed::Program(ProgramStep::new(
                name,
                program.clone(),
                max_parallelism,
                range,
            )?)),
        }
    }

    /// The program it runs, if any.
    pub fn program(&self) -> Option<&keyshift_sdk::dataflow::Program> {
        match &self.logic {
            Logic::Program { program, .. } => Some(program),
            Logic::Aggregate(_) => None,
        }
    }

    /// A fresh watermark generator for one source partition.
    pub fn partition_watermark(&self) -> PartitionWatermark {
        PartitionWatermark::new(self.max_out_of_orderness_ms)
    }
}

#[cfg(test)]
mod tests;
