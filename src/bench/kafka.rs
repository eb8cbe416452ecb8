//! `keyshift bench kafka`: Kafka -> keyed count -> Kafka (exactly once) through worker processes
//! against a real broker, as ratios to the broker's own perf tools measured in the same run on
//! the same topic and machine, and the rescale pause of a job with a Kafka source.
//!
//! 1. A topic of `--partitions` partitions gets `--records` JSON records `{"user":"user-<i>"}`
//!    (`--keys` users) from Kafka's `ProducerPerformance` (`hack/kafka.sh tool`): its
//!    records/s is the produce baseline.
//! 2. Kafka's `ConsumerPerformance` reads them all: its records/s (fetch time only, without
//!    the group join) is the consume baseline.
//! 3. For each `--parallelism`: a fresh job (own output topic, own storage) reads the topic
//!    from its start, counts per user and writes the counts to its output topic exactly once.
//!    Measured from the launch of its workers to the commit and publish of a checkpoint taken
//!    once every record was read: records/s = records / that time.
//! 4. The first job (at the first parallelism) is then rescaled to the next: the pause (savepoint
//!    trigger until every new subtask runs) and its steps.
//!
//! Results and how to reproduce them: `docs/benchmarks.md`. Build with `--release`.

use super::measure::{context_line, loadavg};
use crate::crd::StreamJob;
use crate::local::LocalJob;
use anyhow::{Context as _, Result, bail};
use clap::Args;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct KafkaBench {
    /// The broker (default: KEYSHIFT_KAFKA_BOOTSTRAP, as `hack/kafka.sh start` exports it).
    #[arg(long)]
    pub bootstrap: Option<String>,
    /// `hack/kafka.sh`, which runs the broker's perf tools (`tool CLASS ...`).
    #[arg(long, default_value = "hack/kafka.sh")]
    pub kafka_sh: PathBuf,
    /// Records produced to the input topic.
    #[arg(long, default_value_t = 2_000_000)]
    pub records: u64,
    /// Partitions of the input (and output) topics.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Distinct users (keys).
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Parallelism of each run (comma-separated); the first run is rescaled to the second.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub parallelism: Vec<u32>,
    /// Directory for snapshots and worker logs (created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
}

/// One job run.
struct Run {
    parallelism: u32,
    /// Launch to every record read.
    read: Duration,
    /// Launch to the checkpoint after that committed and published.
    total: Duration,
    /// Records the workers read.
    records_in: u64,
}

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("ks-bench-{tag}-{}-{nanos}", std::process::id())
}

async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .context("Kafka admin client")?;
    for r in admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .context("creating a topic")?
    {
        r.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
    }
    Ok(())
}

/// Runs `hack/kafka.sh tool CLASS ARGS` and returns its standard output.
fn tool(kafka_sh: &Path, class: &str, args: &[String]) -> Result<String> {
    let out = std::process::Command::new("bash")
        .arg(kafka_sh)
        .arg("tool")
        .arg(class)
        .args(args)
        .output()
        .with_context(|| format!("running {} tool {class}", kafka_sh.display()))?;
    if !out.status.success() {
        bail!(
            "{class} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The records/s of ProducerPerformance's summary line
/// (`N records sent, R records/sec (M MB/sec), ...`).
pub fn producer_rate(output: &str) -> Option<f64> {
    let line = output.lines().rev().find(|l| l.contains("records sent"))?;
    let (before, _) = line.split_once(" records/sec")?;
    before.rsplit([',', ' ']).next()?.trim().parse().ok()
}

/// ConsumerPerformance's columns by header name, from its header and data lines.
pub fn consumer_columns(output: &str) -> Option<std::collections::BTreeMap<String, f64>> {
    let mut lines = output.lines().filter(|l| !l.trim().is_empty());
    let header = lines.find(|l| l.contains("nMsg.sec"))?;
    let data = lines.next()?;
    let names = header.split(',').map(|h| h.trim().to_owned());
    let values = data.split(',').map(|v| v.trim().parse::<f64>().ok());
    Some(
        names
            .zip(values)
            .filter_map(|(n, v)| v.map(|v| (n, v)))
            .collect(),
    )
}

fn job(name: &str, bootstrap: &str, input: &str, output: &str, p: u32) -> Result<StreamJob> {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: bench}}
spec:
  replicas: {p}
  maxParallelism: 128
  job:
    source:
      kafka: {{bootstrapServers: '{bootstrap}', topics: [{input}], startingPosition: earliest}}
    key: {{field: user, type: string}}
    aggregation: {{function: count}}
    sink:
      type: kafka
      kafka: {{bootstrapServers: '{bootstrap}', topic: {output}}}
  state:
    checkpointInterval: 1h
"
    ))
    .context("the bench manifest")
}

async fn records_in(local: &mut LocalJob) -> Result<u64> {
    Ok(local.status().await?.iter().map(|s| s.records_in).sum())
}

/// Launches a job at `p`, waits until it read `records`, checkpoints (its output published).
async fn run_once(
    args: &KafkaBench,
    bootstrap: &str,
    input: &str,
    run: &Path,
    p: u32,
) -> Result<(Run, LocalJob)> {
    let output = unique(&format!("out-p{p}"));
    create_topic(bootstrap, &output, args.partitions).await?;
    let name = format!("kafka-p{p}");
    let spec = job(&name, bootstrap, input, &output, p)?;
    let storage = format!("file://{}", run.join(format!("store-{p}")).display());
    let bin = std::env::current_exe()?;
    let mut local = LocalJob::new(&spec, storage, bin, run.join(format!("logs-{p}"))).await?;
    let t0 = Instant::now();
    local.launch(p, None).await?;
    let read = loop {
        if let Some((i, status)) = local.failed_worker() {
            bail!("worker {i} exited ({status})");
        }
        let n = records_in(&mut local).await?;
        if n >= args.records {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("p={p}: read {n} of {} records in 10 minutes", args.records);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    local.checkpoint().await?;
    let total = t0.elapsed();
    let n = records_in(&mut local).await?;
    Ok((
        Run {
            parallelism: p,
            read,
            total,
            records_in: n,
        },
        local,
    ))
}

pub async fn run(args: KafkaBench) -> Result<()> {
    let bootstrap = match &args.bootstrap {
        Some(b) => b.clone(),
        None => std::env::var("KEYSHIFT_KAFKA_BOOTSTRAP")
            .context("--bootstrap or KEYSHIFT_KAFKA_BOOTSTRAP (eval \"$(hack/kafka.sh start)\")")?,
    };
    if args.parallelism.is_empty() {
        bail!("--parallelism names no run");
    }
    std::fs::create_dir_all(&args.dir)?;
    let run_dir = std::fs::canonicalize(&args.dir)?.join(format!("kafka-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)?;
    println!(
        "keyshift bench kafka: {} records, {} users, {} partitions, broker {bootstrap}",
        args.records, args.keys, args.partitions
    );
    println!("machine: {}", context_line());

    let input = unique("in");
    create_topic(&bootstrap, &input, args.partitions).await?;
    let payloads = run_dir.join("payloads.txt");
    let text: String = (0..args.keys)
        .map(|i| format!("{{\"user\":\"user-{i}\"}}\n"))
        .collect();
    std::fs::write(&payloads, text)?;
    let kafka_sh = args.kafka_sh.clone();
    let produce_args: Vec<String> = [
        "--topic",
        &input,
        "--num-records",
        &args.records.to_string(),
        "--throughput",
        "-1",
        "--payload-file",
        &payloads.display().to_string(),
        "--producer-props",
        &format!("bootstrap.servers={bootstrap}"),
        "acks=all",
        "linger.ms=5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let produced = {
        let k = kafka_sh.clone();
        tokio::task::spawn_blocking(move || {
            tool(
                &k,
                "org.apache.kafka.tools.ProducerPerformance",
                &produce_args,
            )
        })
        .await??
    };
    let produce_rate = producer_rate(&produced)
        .with_context(|| format!("ProducerPerformance's summary: {produced}"))?;
    println!("  ProducerPerformance: {produce_rate:.0} records/s");
    let consume_args: Vec<String> = [
        "--bootstrap-server",
        &bootstrap,
        "--topic",
        &input,
        "--num-records",
        &args.records.to_string(),
        "--timeout",
        "60000",
        "--group",
        &unique("perf-group"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let consumed = {
        let k = kafka_sh.clone();
        tokio::task::spawn_blocking(move || {
            tool(
                &k,
                "org.apache.kafka.tools.ConsumerPerformance",
                &consume_args,
            )
        })
        .await??
    };
    let columns = consumer_columns(&consumed)
        .with_context(|| format!("ConsumerPerformance's columns: {consumed}"))?;
    let consume_rate = columns
        .get("fetch.nMsg.sec")
        .copied()
        .context("ConsumerPerformance's fetch.nMsg.sec")?;
    let consume_with_join = columns.get("nMsg.sec").copied().unwrap_or(0.0);
    println!(
        "  ConsumerPerformance: {consume_rate:.0} records/s fetching ({consume_with_join:.0} with the group join)"
    );

    let mut runs = Vec::new();
    let mut rescale = None;
    for (i, &p) in args.parallelism.iter().enumerate() {
        let (r, mut local) = run_once(&args, &bootstrap, &input, &run_dir, p).await?;
        println!(
            "  keyshift p={p}: {} records read in {:.2} s, checkpoint published at {:.2} s: {:.0} records/s end to end",
            r.records_in,
            r.read.as_secs_f64(),
            r.total.as_secs_f64(),
            args.records as f64 / r.total.as_secs_f64()
        );
        if i == 0
            && let Some(&to) = args.parallelism.get(1)
        {
            let report = local.rescale(to).await?;
            let steps: Vec<String> = report
                .steps
                .iter()
                .map(|(s, d)| format!("{s} {:.2} s", d.as_secs_f64()))
                .collect();
            println!(
                "  rescale {p} -> {to} with the Kafka source: pause {:.2} s ({}), {} bytes of state",
                report.pause.as_secs_f64(),
                steps.join(", "),
                report.state_bytes
            );
            rescale = Some((p, to, report.pause, steps.join(", "), report.state_bytes));
        }
        local.stop().await;
        runs.push(r);
    }
    let _ = std::fs::remove_dir_all(&run_dir);
    println!("machine at the end: load average {}", loadavg());
    println!();
    println!(
        "| run | records/s | / ProducerPerformance | / ConsumerPerformance (fetch) | read all | checkpoint published |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    println!("| ProducerPerformance (acks=all) | {produce_rate:.0} | 1.00 | - | - | - |");
    println!("| ConsumerPerformance | {consume_rate:.0} | - | 1.00 | - | - |");
    for r in &runs {
        let rate = args.records as f64 / r.total.as_secs_f64();
        println!(
            "| keyshift p={} Kafka -> count -> Kafka | {rate:.0} | {:.2} | {:.2} | {:.2} s | {:.2} s |",
            r.parallelism,
            rate / produce_rate,
            rate / consume_rate,
            r.read.as_secs_f64(),
            r.total.as_secs_f64()
        );
    }
    if let Some((from, to, pause, steps, bytes)) = rescale {
        println!();
        println!(
            "rescale {from} -> {to} (Kafka source, {bytes} bytes of state): pause {:.2} s: {steps}",
            pause.as_secs_f64()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_perf_tools_outputs_parse() {
        let produced = "100000 records sent, 49975.0 records/sec (0.92 MB/sec), 500.1 ms avg latency, 900.0 ms max latency.\n2000000 records sent, 412371.134021 records/sec (15.73 MB/sec), 1234.56 ms avg latency, 2000.00 ms max latency, 1100 ms 50th, 1900 ms 95th, 1990 ms 99th, 2000 ms 99.9th.\n";
        assert_eq!(producer_rate(produced), Some(412371.134021));
        assert_eq!(producer_rate("nothing"), None);
        let consumed = "start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec\n2026-12-02 16:00:00:000, 2026-12-02 16:00:05:000, 38.1, 7.62, 2000000, 400000.0, 3000, 2000, 19.05, 1000000.0\n";
        let c = consumer_columns(consumed).expect("columns");
        assert_eq!(c.get("fetch.nMsg.sec"), Some(&1_000_000.0));
        assert_eq!(c.get("nMsg.sec"), Some(&400_000.0));
        assert_eq!(c.get("start.time"), None);
    }
}
