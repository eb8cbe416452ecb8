//! `keyshift bench keyed`: the keyed operator alone, on one thread with no I/O: records/s of the
//! built-in count (`KeyedAggregator`) against the same count written on the SDK (a
//! `KeyedProcessFunction` with a value state), over the same keys and records, alternating, in
//! the same run. The SDK's target is 0.9x (bring-your-own-job issue: within 10% of the built-in).

use super::KeyedBench;
use super::measure::context_line;
use anyhow::{Result, bail};
use keyshift_core::keygroup::KeyGroupRange;
use keyshift_core::spec::AggregateFunction;
use keyshift_runtime::job::generator::splitmix64;
use keyshift_runtime::job::{AggConfig, KeyedAggregator, Record, RecordKey};
use keyshift_sdk::key::StreamKey;
use keyshift_sdk::operator::READ_AHEAD;
use keyshift_sdk::prelude::*;
use keyshift_state_disk::{DiskBackend, DiskConfig};
use std::time::{Duration, Instant};

const GROUPS: u32 = 128;
const BATCH: usize = 2048;

/// A keyed count on the SDK: one value state per key.
struct Count;

impl KeyedProcessFunction for Count {
    type Key = String;
    type In = i64;
    type Out = i64;
    type State = ValueHandle<i64>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.value(ValueStateDescriptor::new("count"))
    }

    fn process(
        &mut self,
        _: i64,
        count: &Self::State,
        ctx: &mut Context<'_, String, i64>,
    ) -> keyshift_sdk::Result<()> {
        let n = ctx.value(count).get()?.unwrap_or(0) + 1;
        Ok(ctx.value(count).set(n)?)
    }
}

/// The key index of record `i`: the first `keys` records visit every key once (the warm-up
/// puts each in state), the rest are spread at random.
fn key_index(i: u64, keys: u64) -> usize {
    if i < keys {
        i as usize
    } else {
        (splitmix64(i) % keys) as usize
    }
}

fn builtin(keys: &[RecordKey], records: u64, first: u64) -> Result<(Duration, usize)> {
    let range = KeyGroupRange {
        start: 0,
        end: GROUPS - 1,
    };
    let config = AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: GROUPS,
        state_payload_bytes: 0,
    };
    let mut agg = KeyedAggregator::new(config, range)?;
    let n = keys.len() as u64;
    let mut batch = Vec::with_capacity(BATCH);
    let mut run = |agg: &mut KeyedAggregator, from: u64, count: u64| -> Result<()> {
        for i in from..from + count {
            batch.push(Record {
                key: keys[key_index(i, n)].clone(),
                value: 1,
                ts: 0,
            });
            if batch.len() == BATCH {
                agg.process_batch(&batch)?;
                batch.clear();
            }
        }
        agg.process_batch(&batch)?;
        batch.clear();
        Ok(())
    };
    // Warm-up: every key in state.
    run(&mut agg, 0, n)?;
    let t = Instant::now();
    run(&mut agg, first, records)?;
    Ok((t.elapsed(), agg.key_count()))
}

/// The SDK side gets each record's key group and [`RecordKey`] with it, as the shuffle routes it
/// (the built-in's keys carry their hash the same way), in batches of the same size as the
/// built-in's, each read ahead [`READ_AHEAD`] records at a time ([`KeyedOperator::prefetch`])
/// as the runtime's step does.
fn sdk(keys: &[(String, u32, RecordKey)], records: u64, first: u64) -> Result<(Duration, usize)> {
    let range = KeyGroupRange {
        start: 0,
        end: GROUPS - 1,
    };
    let mut op = KeyedOperator::new("count", Count, GROUPS, range)?;
    sdk_on(&mut op, keys, records, first)
}

/// Runs [`sdk`]'s records through `op` (on either backend): the warm-up, then the measured
/// records; their time, and the state's entries after them.
fn sdk_on(
    op: &mut KeyedOperator<Count>,
    keys: &[(String, u32, RecordKey)],
    records: u64,
    first: u64,
) -> Result<(Duration, usize)> {
    let n = keys.len() as u64;
    let mut batch: Vec<(u32, RecordKey, &String)> = Vec::with_capacity(BATCH);
    let mut run = |op: &mut KeyedOperator<Count>, from: u64, count: u64| -> Result<()> {
        for i in from..from + count {
            let (key, group, rk) = &keys[key_index(i, n)];
            batch.push((*group, rk.clone(), key));
            if batch.len() == BATCH {
                flush(op, &mut batch)?;
            }
        }
        flush(op, &mut batch)?;
        Ok(())
    };
    run(op, 0, n)?;
    let t = Instant::now();
    run(op, first, records)?;
    Ok((t.elapsed(), op.entries()))
}

/// Processes a batch as the runtime's step does: [`READ_AHEAD`] records read ahead, then
/// processed.
fn flush(
    op: &mut KeyedOperator<Count>,
    batch: &mut Vec<(u32, RecordKey, &String)>,
) -> keyshift_sdk::Result<()> {
    for chunk in batch.chunks(READ_AHEAD) {
        for (group, rk, _) in chunk {
            op.prefetch(*group, rk);
        }
        for (group, rk, key) in chunk {
            op.process_routed(*group, rk, key, 0, 1)?;
        }
    }
    batch.clear();
    Ok(())
}

/// [`sdk`] with the operator's state on disk ([`DiskBackend`]), driven the same way (its
/// read-ahead does nothing: only the heap reads ahead); also the bytes the store takes on disk.
fn sdk_disk(
    keys: &[(String, u32, RecordKey)],
    records: u64,
    first: u64,
    dir: &std::path::Path,
    config: DiskConfig,
) -> Result<(Duration, usize, u64)> {
    let range = KeyGroupRange {
        start: 0,
        end: GROUPS - 1,
    };
    let backend = DiskBackend::open(dir, range.len() as usize, config)?;
    let mut op = KeyedOperator::with_backend("count", Count, GROUPS, range, Box::new(backend))?;
    let (elapsed, entries) = sdk_on(&mut op, keys, records, first)?;
    Ok((elapsed, entries, dir_bytes(dir)))
}

/// Bytes of the files under `dir` (0 if it cannot be read).
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// The SDK's keyed step as the worker runtime drives it: its types erased
/// (`keyshift_sdk::step::KeyedStep`), each record serialized (postcard) as it crosses the shuffle,
/// in batches of [`BATCH`] routed records. On top of [`sdk`], each record is deserialized and its
/// key built from its `RecordKey` (for a `String` key, one allocation).
fn sdk_step(keys: &[RecordKey], records: u64, first: u64) -> Result<(Duration, usize)> {
    use keyshift_sdk::step::{Routed, factory};
    let range = KeyGroupRange {
        start: 0,
        end: GROUPS - 1,
    };
    let mut step = factory("count", || Count)(GROUPS, range)?;
    let mut one = Vec::new();
    Postcard::<i64>::default().serialize(&1, &mut one)?;
    let n = keys.len() as u64;
    let mut batch: Vec<Routed<'_>> = Vec::with_capacity(BATCH);
    let mut run =
        |step: &mut Box<dyn keyshift_sdk::step::KeyedStep>, from: u64, count: u64| -> Result<()> {
            for i in from..from + count {
                let key = keys[key_index(i, n)].clone();
                batch.push(Routed {
                    group: key.key_group(GROUPS),
                    key,
                    timestamp: 0,
                    record: &one,
                });
                if batch.len() == BATCH {
                    step.process_batch(&batch)?;
                    batch.clear();
                }
            }
            step.process_batch(&batch)?;
            batch.clear();
            Ok(())
        };
    run(&mut step, 0, n)?;
    let t = Instant::now();
    run(&mut step, first, records)?;
    Ok((t.elapsed(), step.entries()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(super) fn keyed_bench(args: KeyedBench) -> Result<()> {
    println!("# keyshift bench keyed ({})", context_line());
    println!(
        "| keys | built-in M records/s | SDK M records/s | SDK / built-in | SDK step from bytes M records/s | step / built-in | SDK on disk M records/s | disk / heap | rounds |\n|---|---|---|---|---|---|---|---|---|"
    );
    let disk = args.disk.as_ref().map(|base| {
        let config = DiskConfig {
            cache_bytes: args.disk_cache_mib << 20,
            write_buffer_bytes: args.disk_write_buffer_mib << 20,
            ..DiskConfig::default()
        };
        (
            base.join(format!("keyshift-bench-keyed-{}", std::process::id())),
            config,
        )
    });
    for &n in &args.keys {
        if n == 0 {
            bail!("--keys must be positive");
        }
        let strings: Vec<String> = (0..n).map(|i| format!("key-{i}")).collect();
        let record_keys: Vec<RecordKey> = strings
            .iter()
            .map(|s| RecordKey::string(s.as_str()))
            .collect();
        let sdk_keys: Vec<(String, u32, RecordKey)> = strings
            .iter()
            .map(|s| {
                let rk = s.record_key();
                (s.clone(), rk.key_group(GROUPS), rk)
            })
            .collect();
        let (mut b, mut s, mut e, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.rounds.max(1) {
            let first = 1_000_000_007 * u64::from(round + 1);
            let (tb, kb) = builtin(&record_keys, args.records, first)?;
            let (ts, ks) = sdk(&sdk_keys, args.records, first)?;
            let (te, ke) = sdk_step(&record_keys, args.records, first)?;
            if kb != n as usize || ks != n as usize || ke != n as usize {
                bail!(
                    "state holds {kb} (built-in), {ks} (SDK) and {ke} (SDK step) keys, expected {n}"
                );
            }
            if let Some((dir, config)) = &disk {
                let (td, kd, bytes) = sdk_disk(&sdk_keys, args.records, first, dir, *config)?;
                if kd != n as usize {
                    bail!("state on disk holds {kd} keys, expected {n}");
                }
                eprintln!(
                    "  keys {n}, round {round}: disk store {:.1} MiB",
                    bytes as f64 / (1 << 20) as f64
                );
                d.push(args.records as f64 / td.as_secs_f64() / 1e6);
            }
            b.push(args.records as f64 / tb.as_secs_f64() / 1e6);
            s.push(args.records as f64 / ts.as_secs_f64() / 1e6);
            e.push(args.records as f64 / te.as_secs_f64() / 1e6);
        }
        let (mb, ms, me) = (median(b), median(s), median(e));
        let (disk_rate, disk_ratio) = if d.is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            let md = median(d);
            (format!("{md:.2}"), format!("{:.2}x", md / ms))
        };
        println!(
            "| {n} | {mb:.2} | {ms:.2} | {:.2}x | {me:.2} | {:.2}x | {disk_rate} | {disk_ratio} | {} |",
            ms / mb,
            me / mb,
            args.rounds.max(1)
        );
    }
    Ok(())
}
