//! `keyshift bench hot-keys`: the built-in keyed count over a Zipf key stream whose hottest key
//! has a given share of the records, with the sources combining before the shuffle
//! (`spec.job.aggregation.combine`, the default) against the same job without, in the same run
//! (which of the two goes first alternates from round to round):
//! worker processes under `LocalJob`, records/s from the first record to the last, and the
//! workers' CPU time.

use super::HotKeysBench;
use super::measure::*;
use super::programs::{Run, run_job, write_lines};
use crate::job::generator::Zipf;
use anyhow::{Result, bail};
use std::io::Write;
use std::path::Path;

/// The Zipf exponent `s` over `keys` ranks whose first rank has probability `share`
/// (`1 / H(keys, s) = share`), by bisection.
pub(crate) fn zipf_exponent(keys: u64, share: f64) -> f64 {
    let first_share = |s: f64| 1.0 / (1..=keys).map(|k| (k as f64).powf(-s)).sum::<f64>();
    let (mut lo, mut hi) = (0.0f64, 16.0f64);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if first_share(mid) < share {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (lo + hi) / 2.0
}

/// The rank (0-based) a uniform 64-bit `x` draws from `zipf`.
fn draw(zipf: &Zipf, x: u64) -> u64 {
    zipf.rank((x >> 11) as f64 / (1u64 << 53) as f64)
}

/// The job's `spec.job` lines: the built-in count, or the `page-views` program (a window
/// aggregate counting per page in 10 s windows), combining or not.
fn job(input: &Path, program: bool, combine: bool) -> String {
    let source = format!("    source:\n      file: {{path: '{}'}}\n", input.display());
    match program {
        false => format!(
            "{source}    key: {{field: key}}\n    aggregation: {{function: count, combine: {combine}}}\n"
        ),
        true => format!("{source}    program: {{name: page-views, combine: {combine}}}\n"),
    }
}

pub(super) async fn hot_keys_bench(args: HotKeysBench) -> Result<()> {
    if !(0.0..1.0).contains(&args.hot_share) || args.keys < 2 {
        bail!("--hot-share must be in [0, 1) and --keys at least 2");
    }
    let run = prepare_dir(&args.dir, "hot-keys")?;
    let s = zipf_exponent(args.keys, args.hot_share);
    let zipf = Zipf::new(args.keys as usize, s);
    println!(
        "keyshift bench hot-keys: {} over {} JSON lines in {} files, {} keys drawn from Zipf(s = {s:.3}): the hottest key {:.1}% of the records, the next {:.1}%; parallelism {}; combining before the shuffle against none, {} rounds alternating",
        if args.program {
            "the page-views program (a window aggregate)"
        } else {
            "the built-in keyed count"
        },
        args.records,
        args.partitions,
        args.keys,
        zipf.share(0) * 100.0,
        zipf.share(1) * 100.0,
        args.parallelism,
        args.rounds
    );
    println!("machine: {}", context_line());
    let input = run.join("input");
    // Read by both jobs: the built-in count keys by `key`, `page-views` by `page`.
    write_lines(&input, args.records, args.partitions, |f, x, i| {
        let k = draw(&zipf, x);
        writeln!(
            f,
            "{{\"key\":\"key-{k}\",\"page\":\"key-{k}\",\"user\":\"u-{}\",\"ts\":{i}}}",
            x % 1000
        )
    })?;
    let mut table: Vec<(u32, Run, Run)> = Vec::new();
    for round in 0..args.rounds {
        let measure = |combine: bool| {
            let name = format!("hot-keys-{}-{round}", if combine { "c" } else { "n" });
            let job = job(&input, args.program, combine);
            let run = run.clone();
            let (parallelism, records) = (args.parallelism, args.records);
            async move {
                let what = if combine {
                    "combining"
                } else {
                    "not combining"
                };
                run_job(&run, &name, parallelism, records, &job, what).await
            }
        };
        // Which job runs first alternates, so that neither side always runs on what the other
        // left behind (memory, caches).
        let (on, off) = if round % 2 == 0 {
            let off = measure(false).await?;
            (measure(true).await?, off)
        } else {
            let on = measure(true).await?;
            (on, measure(false).await?)
        };
        println!(
            "  round {round}: combining {:.2} M records/s ({:.2} CPU-s), not combining {:.2} M records/s ({:.2} CPU-s): {:.2}x",
            on.rate / 1e6,
            on.cpu.as_secs_f64(),
            off.rate / 1e6,
            off.cpu.as_secs_f64(),
            on.rate / off.rate
        );
        // (A program's state is its open windows, which the watermark closes as it comes.)
        if !args.program && on.keys_in_state != off.keys_in_state {
            bail!(
                "the two jobs hold {} and {} keys: not the same result",
                on.keys_in_state,
                off.keys_in_state
            );
        }
        table.push((round, on, off));
    }
    let _ = std::fs::remove_dir_all(&run);
    println!("machine at the end: load average {}", loadavg());
    println!();
    println!(
        "| round | combining records/s | not combining records/s | combining / not | CPU-s combining | CPU-s not | CPU ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (round, on, off) in table {
        println!(
            "| {round} | {:.2} M | {:.2} M | {:.2} | {:.2} | {:.2} | {:.2} |",
            on.rate / 1e6,
            off.rate / 1e6,
            on.rate / off.rate,
            on.cpu.as_secs_f64(),
            off.cpu.as_secs_f64(),
            on.cpu.as_secs_f64() / off.cpu.as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponent_gives_the_hottest_key_its_share() {
        for (keys, share) in [(100_000u64, 0.3), (1_000, 0.5), (10, 0.2)] {
            let s = zipf_exponent(keys, share);
            let zipf = Zipf::new(keys as usize, s);
            assert!(
                (zipf.share(0) - share).abs() < 1e-6,
                "{keys} keys: {}",
                zipf.share(0)
            );
            let total: f64 = (0..keys as usize).map(|r| zipf.share(r)).sum();
            assert!((total - 1.0).abs() < 1e-9);
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let zipf = Zipf::new(1_000, zipf_exponent(1_000, 0.3));
        let mut x: u64 = 1;
        let n = 200_000;
        let hot = (0..n)
            .filter(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                draw(&zipf, x) == 0
            })
            .count();
        let share = hot as f64 / n as f64;
        assert!((share - 0.3).abs() < 0.01, "{share}");
        assert_eq!(draw(&zipf, u64::MAX), 999, "the last rank");
        assert_eq!(draw(&zipf, 0), 0, "the hottest");
    }
}
