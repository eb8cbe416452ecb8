//! `keyshift bench checkpoint --program`: what a program's incremental checkpoint writes after a
//! share of its keys changed, against a full one, and how long its cut holds records (a
//! program's changed groups are encoded at the barrier). The program ([`super::map_program`])
//! is a keyed step with map state (per key, `--fields` entries of field -> payload), run as the
//! worker runs it (`ProgramStep`, records ingested from JSON lines), `--parallelism` subtasks
//! writing their state files concurrently on `file://`.

use super::CheckpointBench;
use super::measure::*;
use anyhow::{Result, bail};
use keyshift_core::keygroup::Assignment;
use keyshift_runtime::job::{EncodedRecords, GroupMode, Keyed, ProgramStep, Programs};
use keyshift_runtime::runtime::checkpoint;
use keyshift_runtime::runtime::incremental::{Base, ChainPolicy};
use keyshift_runtime::runtime::restore::{self, RestoreOptions};
use keyshift_runtime::snapshot::{self, SnapshotKind, SnapshotWriter};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::map_program::{self, NAME as PROGRAM};

fn programs(fields: u32, payload: usize) -> Result<Programs> {
    Ok(Programs::new().with(PROGRAM, map_program::job(fields, payload))?)
}

/// Feeds `user`'s field `field` (a payload of `payload` bytes, varied by `round`) to the
/// subtask owning the user's key group.
struct Feeder {
    program: Arc<keyshift_sdk::dataflow::Program>,
    assignment: Assignment,
    fields: u32,
    batches: Vec<EncodedRecords>,
    line: String,
}

impl Feeder {
    fn push(&mut self, user: u64, field: u32, round: u32) -> Result<()> {
        use std::fmt::Write as _;
        self.line.clear();
        write!(
            self.line,
            r#"{{"key":"user-{user:012}","value":{},"ts":0}}"#,
            map_program::value(field, round, self.fields)
        )?;
        let max = self.assignment.max_parallelism();
        let (assignment, batches) = (self.assignment, &mut self.batches);
        self.program.ingest(self.line.as_bytes(), &mut |k, ts, r| {
            let owner = assignment.owner(k.key_group(max)) as usize;
            batches[owner].push(k, ts, r);
        })?;
        Ok(())
    }

    /// Hands every subtask its records (in batches, as the shuffle does).
    fn flush(&mut self, steps: &mut [ProgramStep], at: usize) -> Result<()> {
        for (step, batch) in steps.iter_mut().zip(&mut self.batches) {
            if !batch.is_empty() && batch.len() >= at {
                step.process(batch)?;
                batch.clear();
            }
        }
        Ok(())
    }
}

/// One subtask's checkpoint as the worker takes it: the cut (its groups encoded at the barrier,
/// records held), then the upload.
async fn checkpoint_subtask(
    store: Arc<dyn snapshot::ObjectStore>,
    dir: snapshot::Path,
    assignment: Assignment,
    subtask: u32,
    step: &mut ProgramStep,
    base: Option<&Base>,
) -> Result<(Duration, Duration, snapshot::SubtaskSnapshot, u32)> {
    let writer = SnapshotWriter::new(store.clone(), &dir, assignment, subtask)?;
    let started = Instant::now();
    let cut = step.cut();
    let taken = checkpoint::take_program_cut(step, base, (subtask, assignment.parallelism()))?;
    let held = started.elapsed();
    let ack = checkpoint::upload_cut(
        taken.into_upload(),
        writer,
        base,
        ChainPolicy::default().for_checkpoint(false, assignment.max_parallelism()),
        store.as_ref(),
        &dir,
    )
    .await?;
    Ok((held, started.elapsed(), ack, cut))
}

pub(super) async fn program_checkpoint_bench(args: CheckpointBench) -> Result<()> {
    let ctx_start = context_line();
    let run = prepare_dir(&args.dir, "program-checkpoint")?;
    let root = run.join("store");
    let (store, base) = snapshot::open_store(&format!("file://{}", root.display()))?;
    let job = snapshot::job_dir(&base, "bench", "program-checkpoint");
    let assignment = Assignment::new(i64::from(args.parallelism), i64::from(args.max_parallelism))?;
    let fields = args.fields.max(1);
    let per_field = (args.payload / fields as usize).max(1);
    let keys = keys_for(args.state_mib);
    let stride = (100.0 / args.changed_percent.clamp(0.001, 100.0))
        .round()
        .max(1.0) as u64;
    println!(
        "keyshift bench checkpoint --program: {} MiB target, {keys} string keys x {fields} map entries of {per_field} B, {} key groups, {} subtasks, 1 key in {stride} changes one entry between checkpoints, {} rounds, in {}",
        args.state_mib,
        args.max_parallelism,
        args.parallelism,
        args.rounds,
        run.display()
    );
    println!("machine: {ctx_start}");
    let programs = programs(fields, per_field)?;
    // `programs` lives to the end: the steps share its program.
    let Some(program) = programs.get(PROGRAM) else {
        bail!("the bench's program is missing");
    };
    let mut steps = (0..args.parallelism)
        .map(|i| {
            ProgramStep::new(
                PROGRAM,
                program.clone(),
                args.max_parallelism,
                assignment.range(i),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut feeder = Feeder {
        program,
        assignment,
        fields,
        batches: (0..args.parallelism)
            .map(|_| EncodedRecords::default())
            .collect(),
        line: String::new(),
    };
    let t = Instant::now();
    for k in 0..keys {
        for f in 0..fields {
            feeder.push(k, f, 0)?;
        }
        feeder.flush(&mut steps, 2048)?;
    }
    feeder.flush(&mut steps, 0)?;
    let entries: usize = steps.iter().map(ProgramStep::entries).sum();
    println!("state built in {}: {entries} entries", secs(t.elapsed()));

    let mut bases: Vec<Option<Base>> = vec![None; args.parallelism as usize];
    let mut rows = Vec::new();
    for round in 0..=args.rounds {
        let id = u64::from(round) + 1;
        if round > 0 {
            let mut changed = 0u64;
            for k in (u64::from(round) % stride..keys).step_by(stride as usize) {
                feeder.push(k, round % fields, round)?;
                feeder.flush(&mut steps, 2048)?;
                changed += 1;
            }
            feeder.flush(&mut steps, 0)?;
            println!("round {round}: {changed} keys changed (one entry each)");
        }
        let dir = snapshot::snapshot_dir(&job, SnapshotKind::Checkpoint, id);
        let started = Instant::now();
        // The subtasks' checkpoints run concurrently, as in a job's workers.
        let results = futures::future::join_all(steps.iter_mut().enumerate().map(|(i, step)| {
            checkpoint_subtask(
                store.clone(),
                dir.clone(),
                assignment,
                i as u32,
                step,
                bases[i].as_ref(),
            )
        }))
        .await;
        let wall = started.elapsed();
        let mut done = Vec::new();
        for r in results {
            done.push(r?);
        }
        let held = done.iter().map(|d| d.0).max().unwrap_or_default();
        let write = done.iter().map(|d| d.1).max().unwrap_or_default();
        for (i, d) in done.iter().enumerate() {
            bases[i] = Some(Base::written(id, d.3, &d.2));
        }
        let mut meta = super::state::meta(id);
        meta.state_schema = keyshift_runtime::job::PROGRAM_SCHEMA.to_owned();
        let acks = done.into_iter().map(|d| d.2).collect();
        let (manifest, written) =
            super::state::commit_checkpoint(store.as_ref(), &dir, meta, assignment, acks).await?;
        println!(
            "checkpoint {id} ({}): wrote {written} of {} bytes of state ({:.2}%), records held up {:.1} ms of a {:.1} ms write ({:.1}%), {:.1} ms in all",
            if round == 0 { "full" } else { "incremental" },
            manifest.stats.total_bytes,
            100.0 * written as f64 / manifest.stats.total_bytes.max(1) as f64,
            held.as_secs_f64() * 1e3,
            write.as_secs_f64() * 1e3,
            100.0 * held.as_secs_f64() / write.as_secs_f64().max(1e-9),
            wall.as_secs_f64() * 1e3,
        );
        rows.push((written, manifest.stats.total_bytes, held, write));
        if round == args.rounds {
            // The last checkpoint (a chain of deltas) restores exactly the state written.
            let report = snapshot::verify(store.as_ref(), &dir).await?;
            let t = Instant::now();
            let manifest = Arc::new(manifest);
            let mut read = 0u64;
            for (i, step) in steps.iter_mut().enumerate() {
                let mut keyed = Keyed::Program(ProgramStep::new(
                    PROGRAM,
                    feeder.program.clone(),
                    args.max_parallelism,
                    assignment.range(i as u32),
                )?);
                let r = restore::restore_keyed(
                    &mut keyed,
                    store.as_ref(),
                    &dir,
                    &manifest,
                    RestoreOptions::default(),
                    None,
                )
                .await?;
                read += r.bytes_read;
                let Keyed::Program(mut restored) = keyed else {
                    bail!("a program's step became another kind of keyed operator");
                };
                step.cut();
                restored.cut();
                for g in assignment.range(i as u32).iter() {
                    let sorted = |s: &mut ProgramStep| -> Result<Vec<_>> {
                        let b = s.encode_group(g, GroupMode::Full)?.unwrap_or_default();
                        let mut e = keyshift_sdk::block::decode(&b.bytes)?.entries;
                        e.sort();
                        Ok(e)
                    };
                    if sorted(&mut restored)? != sorted(step)? {
                        bail!(
                            "subtask {i}, group {g}: the restored state differs from the state checkpointed"
                        );
                    }
                }
            }
            println!(
                "checkpoint {id} verified ({} bytes checked) and restored exactly: {read} bytes read in {} (state {} bytes)",
                report.bytes_checked,
                secs(t.elapsed()),
                manifest.stats.total_bytes
            );
        }
    }
    let full = rows.first().map_or(1, |r| r.0).max(1);
    let incr: Vec<_> = rows.iter().skip(1).collect();
    if let (Some(worst_bytes), Some(worst_held)) = (
        incr.iter().map(|r| r.0).max(),
        incr.iter().map(|r| r.2).max(),
    ) {
        println!(
            "summary: a program's incremental checkpoint writes {:.2}% of a full one (worst of {} rounds; target <= 5%); records held up to {:.1} ms (its changed groups encoded at the barrier); the full checkpoint held records {:.1} ms of its {:.1} ms write",
            100.0 * worst_bytes as f64 / full as f64,
            incr.len(),
            worst_held.as_secs_f64() * 1e3,
            rows[0].2.as_secs_f64() * 1e3,
            rows[0].3.as_secs_f64() * 1e3,
        );
    }
    std::fs::remove_dir_all(&run)?;
    println!("machine after: {}", context_line());
    Ok(())
}
