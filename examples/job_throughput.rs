//! Single-threaded throughput of the job core: generator, aggregator and state codec.
//!
//! Run in release mode: `cargo run --release --example job_throughput [keys] [state MiB]`.
//! Prints measured numbers; it asserts nothing about speed.

use keyshift::crd::{AggregateFunction, GeneratorSource, KeyDistribution};
use keyshift::job::{AggConfig, Generator, KeyedAggregator, Record, decode_group};
use keyshift::keygroup::{KeyGroupRange, KeyType};
use std::hint::black_box;
use std::time::Instant;

const MAXP: u32 = 128;

fn generator(keys: i64, kt: KeyType, dist: KeyDistribution) -> Generator {
    let spec = GeneratorSource {
        partitions: 4,
        keys,
        seed: 1,
        distribution: dist,
        zipf_exponent: Some(1.0),
        records_per_second: None,
        records_per_partition: None,
    };
    match Generator::new(&spec, kt) {
        Ok(g) => g,
        Err(e) => panic!("generator: {e}"),
    }
}

fn bench_generator(label: &str, g: &Generator, total: u64) {
    let mut buf: Vec<Record> = Vec::with_capacity(4096);
    let mut checksum = 0i64;
    let start = Instant::now();
    let mut seq = 0u64;
    while seq < total {
        buf.clear();
        let n = g.fill(0, seq, &mut buf, 4096);
        for r in &buf {
            checksum = checksum.wrapping_add(r.value ^ i64::from(r.key.java_hash()));
        }
        seq += n as u64;
    }
    black_box(checksum);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "generator {label:<28} {:>7.1} M records/s",
        total as f64 / secs / 1e6
    );
}

fn all_groups(config: AggConfig) -> KeyedAggregator {
    match KeyedAggregator::new(
        config,
        KeyGroupRange {
            start: 0,
            end: MAXP - 1,
        },
    ) {
        Ok(op) => op,
        Err(e) => panic!("aggregator: {e}"),
    }
}

fn bench_aggregator(label: &str, g: &Generator, window_size_ms: Option<i64>) {
    let mut batch = Vec::new();
    g.fill(0, 0, &mut batch, 2_000_000);
    let mut op = all_groups(AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms,
        max_parallelism: MAXP,
        state_payload_bytes: 0,
    });
    // Warm the state (all keys present), then time steady-state updates.
    op.process_batch(&batch).unwrap_or_else(|e| panic!("{e}"));
    let rounds = 5;
    let start = Instant::now();
    for _ in 0..rounds {
        op.process_batch(&batch).unwrap_or_else(|e| panic!("{e}"));
    }
    let secs = start.elapsed().as_secs_f64();
    black_box(op.key_count());
    println!(
        "aggregator {label:<27} {:>7.1} M records/s ({} keys in state)",
        (rounds * batch.len()) as f64 / secs / 1e6,
        op.key_count()
    );
}

/// Tumbling 1 s windows over a paced stream (1M records per event-time second, so each key gets
/// about `1M / keys` records per window); the watermark advances every 4096 records and windows
/// fire as they would in a running job. Records are generated before timing.
fn bench_windowed(keys: i64) {
    let spec = GeneratorSource {
        partitions: 1,
        keys,
        seed: 1,
        distribution: KeyDistribution::Uniform,
        zipf_exponent: None,
        records_per_second: Some(1_000_000),
        records_per_partition: None,
    };
    let g = Generator::new(&spec, KeyType::Long).unwrap_or_else(|e| panic!("{e}"));
    let mut records = Vec::new();
    g.fill(0, 0, &mut records, 8_000_000);
    let mut op = all_groups(AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms: Some(1_000),
        max_parallelism: MAXP,
        state_payload_bytes: 0,
    });
    let mut fired = 0usize;
    let start = Instant::now();
    for chunk in records.chunks(4096) {
        op.process_batch(chunk).unwrap_or_else(|e| panic!("{e}"));
        if let Some(last) = chunk.last() {
            fired += op.advance_watermark(last.ts).len();
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "aggregator {:<27} {:>7.1} M records/s ({fired} window results fired)",
        "sum, long, 1s windows",
        records.len() as f64 / secs / 1e6
    );
}

fn bench_codec(keys: i64, payload: usize) {
    let g = generator(keys, KeyType::String, KeyDistribution::Uniform);
    let config = AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms: None,
        max_parallelism: MAXP,
        state_payload_bytes: payload,
    };
    let mut op = all_groups(config);
    for i in 0..keys as u64 {
        let r = Record {
            key: g.key_for_index(i),
            value: i as i64,
            ts: 0,
        };
        op.process(&r).unwrap_or_else(|e| panic!("{e}"));
    }
    let start = Instant::now();
    let mut blocks = Vec::with_capacity(MAXP as usize);
    for group in 0..MAXP {
        let (block, _) = op.encode_group(group).unwrap_or_else(|e| panic!("{e}"));
        blocks.push(block);
    }
    let enc = start.elapsed().as_secs_f64();
    let bytes: usize = blocks.iter().map(Vec::len).sum();
    let mib = bytes as f64 / (1 << 20) as f64;
    drop(op);

    let start = Instant::now();
    let mut entries = 0;
    for b in &blocks {
        entries += decode_group(b)
            .unwrap_or_else(|e| panic!("{e}"))
            .entries
            .len();
    }
    let dec = start.elapsed().as_secs_f64();

    let mut restored = all_groups(config);
    let start = Instant::now();
    for (group, b) in blocks.iter().enumerate() {
        restored
            .restore_group(group as u32, b)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let res = start.elapsed().as_secs_f64();
    assert_eq!(entries as i64, keys);
    assert_eq!(restored.key_count() as i64, keys);
    println!(
        "state codec {keys} string keys x {payload} B payload = {mib:.0} MiB: encode {:.0} MiB/s, decode_group {:.0} MiB/s, restore_group {:.0} MiB/s",
        mib / enc,
        mib / dec,
        mib / res
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let keys: i64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let state_mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256);
    let total = 50_000_000;
    if cfg!(debug_assertions) {
        println!("(debug build: numbers are not meaningful; use --release)");
    }
    let long_uniform = generator(keys, KeyType::Long, KeyDistribution::Uniform);
    let string_uniform = generator(keys, KeyType::String, KeyDistribution::Uniform);
    let long_zipf = generator(keys, KeyType::Long, KeyDistribution::Zipf);
    bench_generator("long keys, uniform", &long_uniform, total);
    bench_generator("string keys, uniform", &string_uniform, total);
    bench_generator("long keys, zipf s=1", &long_zipf, total);
    bench_aggregator("sum, long, uniform", &long_uniform, None);
    bench_aggregator("sum, string, uniform", &string_uniform, None);
    bench_aggregator("sum, long, zipf", &long_zipf, None);
    bench_windowed(keys);
    // ~400 B of state per key, as in the 1 GiB / 2.7M keys target.
    let payload = 360;
    let codec_keys = (state_mib << 20) / 400;
    bench_codec(codec_keys as i64, payload);
}
