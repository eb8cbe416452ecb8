//! `keyshift job status`: one screen of a live StreamJob, built from the object alone (pure), so
//! what the command prints is tested without a cluster.

use crate::crd::{SnapshotRef, SourceLagStatus, StateDistribution, StreamJob, StreamJobSnapshot};
use k8s_openapi::jiff::Timestamp;
use keyshift_core::text;
use serde::Serialize;
use std::fmt::Write as _;

/// What `status` shows of a job: its own fields where the CRD has them, picked and joined.
/// Its JSON (and YAML) form is the `-o json` document.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct JobView<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    /// status.phase (`Pending` until the operator has seen the job).
    pub phase: String,
    /// spec.replicas.
    pub replicas: i32,
    /// status.replicas: the parallelism that runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub running: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_parallelism: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_parallelism_origin: Option<&'a str>,
    pub suspend: bool,
    /// The step of the transition in progress, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    pub conditions: Vec<ConditionView<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<&'a SnapshotRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_savepoint: Option<&'a SnapshotRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rescale: Option<RescaleView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'a StateDistribution>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lag: Option<&'a SourceLagStatus>,
    /// The job's StreamJobSnapshots, newest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<SnapshotView<'a>>,
}

/// One StreamJobSnapshot of the job.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotView<'a> {
    pub name: &'a str,
    /// Pending, Ready or Failed.
    pub phase: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_use: Option<bool>,
    /// Seconds since it was created.
    pub age_seconds: u64,
}

/// How many snapshots the screen lists (the JSON document has them all).
const SNAPSHOT_LINES: usize = 5;

/// One condition: type, status, reason, message and how long it has held.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConditionView<'a> {
    #[serde(rename = "type")]
    pub type_: &'a str,
    pub status: &'a str,
    pub reason: &'a str,
    pub message: &'a str,
    /// Seconds since its last transition.
    pub for_seconds: i64,
}

/// The rescale or upgrade in progress, or the last one.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RescaleView {
    pub from: i32,
    pub to: i32,
    pub step: String,
    pub started: String,
    /// The time its finished steps took, summed.
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups_moved: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prestaged: Option<bool>,
}

impl<'a> JobView<'a> {
    /// The view of `job` as of `now`.
    pub fn new(job: &'a StreamJob, now: Timestamp) -> JobView<'a> {
        let status = job.status.as_ref();
        let conditions = status
            .map(|s| {
                s.conditions
                    .iter()
                    .map(|c| ConditionView {
                        type_: &c.type_,
                        status: &c.status,
                        reason: &c.reason,
                        message: &c.message,
                        for_seconds: now.duration_since(c.last_transition_time.0).as_secs(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        JobView {
            namespace: job.metadata.namespace.as_deref().unwrap_or_default(),
            name: job.metadata.name.as_deref().unwrap_or_default(),
            phase: status
                .and_then(|s| s.phase)
                .map_or_else(|| "Pending".to_owned(), |p| format!("{p:?}")),
            replicas: job.spec.replicas,
            running: status.and_then(|s| s.replicas),
            max_parallelism: status.and_then(|s| s.max_parallelism),
            max_parallelism_origin: status.and_then(|s| s.max_parallelism_origin.as_deref()),
            suspend: job.spec.suspend,
            step: status.and_then(|s| s.step).map(|s| s.to_string()),
            conditions,
            last_checkpoint: status.and_then(|s| s.last_checkpoint.as_ref()),
            last_savepoint: status.and_then(|s| s.last_savepoint.as_ref()),
            rescale: status
                .and_then(|s| s.rescale.as_ref())
                .map(|r| RescaleView {
                    from: r.from,
                    to: r.to,
                    step: r.step.to_string(),
                    started: r.started.clone(),
                    seconds: r.step_seconds.values().sum(),
                    groups_moved: r.groups_moved,
                    rolled_back: r.rolled_back.clone(),
                    prestaged: r.prestaged().map(|_| true),
                }),
            state: status.and_then(|s| s.state_distribution.as_ref()),
            lag: status
                .and_then(|s| s.source.as_ref())
                .and_then(|s| s.lag.as_ref()),
            snapshots: Vec::new(),
        }
    }

    /// With the job's StreamJobSnapshots among `snapshots` (those of other jobs are left out),
    /// newest first.
    pub fn with_snapshots(mut self, snapshots: &'a [StreamJobSnapshot], now: Timestamp) -> Self {
        let mut mine: Vec<&StreamJobSnapshot> = snapshots
            .iter()
            .filter(|s| s.spec.job_name == self.name)
            .collect();
        mine.sort_by(|a, b| {
            b.metadata
                .creation_timestamp
                .cmp(&a.metadata.creation_timestamp)
        });
        self.snapshots = mine
            .into_iter()
            .map(|s| {
                let st = s.status.as_ref();
                SnapshotView {
                    name: s.metadata.name.as_deref().unwrap_or_default(),
                    phase: st
                        .and_then(|st| st.phase)
                        .map_or_else(|| "Pending".to_owned(), |p| p.to_string()),
                    path: st.and_then(|st| st.path.as_deref()),
                    size_bytes: st.and_then(|st| st.size_bytes),
                    in_use: st.and_then(|st| st.in_use),
                    age_seconds: s
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .map_or(0, |t| now.duration_since(t.0).as_secs().max(0) as u64),
                }
            })
            .collect();
        self
    }

    /// The screen people read.
    pub fn text(&self, now: Timestamp) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{} (namespace {})", self.name, self.namespace);
        let workers = match self.running {
            Some(n) if n == self.replicas => format!("{} running", text::count(n as u64, "worker")),
            Some(n) => format!("{n} of {} workers running", self.replicas),
            None => format!("none of {} workers running", self.replicas),
        };
        let ceiling = match (self.max_parallelism, self.max_parallelism_origin) {
            (Some(g), Some(origin)) => format!("; {g} key groups ({origin})"),
            (Some(g), None) => format!("; {g} key groups"),
            _ => String::new(),
        };
        let suspend = if self.suspend {
            " (spec.suspend is set)"
        } else {
            ""
        };
        line(
            &mut s,
            "Phase",
            &format!("{}{suspend}: {workers}{ceiling}", self.phase),
        );
        if let Some(step) = &self.step {
            line(&mut s, "Step", step);
        }
        for c in &self.conditions {
            let mut v = format!("{} {} for {}", c.status, c.reason, age(c.for_seconds));
            if !c.message.is_empty() {
                let _ = write!(v, ": {}", c.message);
            }
            line(&mut s, c.type_, &v);
        }
        for (label, snapshot) in [
            ("Checkpoint", self.last_checkpoint),
            ("Savepoint", self.last_savepoint),
        ] {
            let v = snapshot.map_or_else(|| "none yet".to_owned(), |r| snapshot_line(r, now));
            line(&mut s, label, &v);
        }
        for (i, snap) in self.snapshots.iter().take(SNAPSHOT_LINES).enumerate() {
            let mut v = format!("{} {}", snap.name, snap.phase);
            if let Some(b) = snap.size_bytes {
                let _ = write!(v, ", {}", text::bytes(b.max(0) as u64));
            }
            if snap.in_use == Some(true) {
                v.push_str(", in use");
            }
            let _ = write!(v, ", created {} ago", age(snap.age_seconds as i64));
            if let Some(p) = snap.path {
                let _ = write!(v, ": {p}");
            }
            line(&mut s, if i == 0 { "Snapshots" } else { "" }, &v);
        }
        if self.snapshots.len() > SNAPSHOT_LINES {
            line(
                &mut s,
                "",
                &format!(
                    "and {} more (kubectl get streamjobsnapshots)",
                    self.snapshots.len() - SNAPSHOT_LINES
                ),
            );
        }
        if let Some(r) = &self.rescale {
            let mut v = format!("{} -> {}, {}", r.from, r.to, r.step);
            if let Some(g) = r.groups_moved {
                let _ = write!(v, ", {} moved", text::count(g.max(0) as u64, "key group"));
            }
            if r.seconds > 0.0 {
                let _ = write!(v, ", {:.1} s in its steps", r.seconds);
            }
            if r.prestaged == Some(true) {
                v.push_str(", pre-staged");
            }
            let _ = write!(v, " (started {})", r.started);
            if let Some(why) = &r.rolled_back {
                let _ = write!(v, "; rolled back: {why}");
            }
            line(&mut s, "Rescale", &v);
        }
        if let Some(d) = self.state {
            line(&mut s, "State", &d.summary);
        }
        if let Some(l) = self.lag {
            let measured = l.measured.parse::<Timestamp>().map_or_else(
                |_| l.measured.clone(),
                |t| format!("{} ago", age(now.duration_since(t).as_secs())),
            );
            line(
                &mut s,
                "Source lag",
                &format!("{} (measured {measured})", l.summary),
            );
        }
        s
    }
}

/// The jobs of a namespace, a line each (`status` without a name): what `status NAME` shows
/// first, in columns.
pub fn jobs_table(views: &[JobView<'_>], now: Timestamp) -> String {
    let mut rows = vec![[
        "NAME".to_owned(),
        "PHASE".to_owned(),
        "WORKERS".to_owned(),
        "STEP".to_owned(),
        "READY".to_owned(),
        "CHECKPOINT".to_owned(),
        "LAG".to_owned(),
    ]];
    for v in views {
        let ready = v
            .conditions
            .iter()
            .find(|c| c.type_ == crate::orchestrator::status::READY)
            .map_or("Unknown", |c| c.status);
        let checkpoint = v
            .last_checkpoint
            .and_then(|r| r.time.parse::<Timestamp>().ok())
            .map_or_else(
                || "-".to_owned(),
                |t| format!("{} ago", age(now.duration_since(t).as_secs())),
            );
        rows.push([
            v.name.to_owned(),
            v.phase.clone(),
            format!("{}/{}", v.running.unwrap_or(0), v.replicas),
            v.step.clone().unwrap_or_else(|| "-".to_owned()),
            ready.to_owned(),
            checkpoint,
            v.lag.map_or_else(
                || "-".to_owned(),
                |l| text::count(l.records.max(0) as u64, "record"),
            ),
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut s = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(s, "{}", line.join("  ").trim_end());
    }
    s
}

/// `  Label:  value`, labels in one column.
/// `  Label:            value`; an empty label continues the line above.
fn line(s: &mut String, label: &str, value: &str) {
    let label = if label.is_empty() {
        String::new()
    } else {
        format!("{label}:")
    };
    let _ = writeln!(s, "  {label:<19}{value}");
}

/// `chk-12 s3://b/j/checkpoints/chk-12, 4 subtasks, 1.2 MiB, 7 s ago`.
fn snapshot_line(r: &SnapshotRef, now: Timestamp) -> String {
    let mut v = format!(
        "{}, {}",
        r.path,
        text::count(r.parallelism.max(0) as u64, "subtask")
    );
    if let Some(b) = r.size_bytes {
        let _ = write!(v, ", {}", text::bytes(b.max(0) as u64));
    }
    match r.time.parse::<Timestamp>() {
        Ok(t) => {
            let _ = write!(v, ", {} ago", age(now.duration_since(t).as_secs()));
        }
        Err(_) => {
            let _ = write!(v, ", at {}", r.time);
        }
    }
    v
}

/// `42 s`, `3 min`, `5 h`, `2 d` (whole units, rounded down; negative as 0).
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..120 => format!("{s} s"),
        120..7200 => format!("{} min", s / 60),
        7200..172_800 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(yaml: &str) -> StreamJob {
        serde_yaml::from_str(yaml).unwrap()
    }

    const RUNNING: &str = r#"
apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {name: clicks, namespace: team-a}
spec:
  replicas: 4
  job:
    source: {generator: {partitions: 4, keys: 10}}
    key: {field: key}
    aggregation: {function: count}
    sink: {type: log}
status:
  phase: Running
  replicas: 4
  maxParallelism: 128
  maxParallelismOrigin: spec.maxParallelism
  lastCheckpoint: {id: 12, path: "s3://b/j/checkpoints/chk-12", time: "2026-12-07T10:00:00+00:00", parallelism: 4, sizeBytes: 1572864}
  rescale: {from: 2, to: 4, step: Done, started: "2026-12-07T09:59:00Z", groupsMoved: 64, stepSeconds: {Savepointing: 1.5, Restoring: 2.0}}
  source: {lag: {records: 1234, seconds: 5, partitions: 8, partitionsBehind: 3, furthestBehind: "t/3", measured: "2026-12-07T10:00:05Z", summary: "1234 records behind over 3 of 8 partitions, up to 5 s; furthest behind: t/3 (900)"}}
  conditions:
  - {type: Ready, status: "True", reason: Running, message: "running at parallelism 4", lastTransitionTime: "2026-12-07T09:50:00Z"}
  - {type: Stalled, status: "False", reason: Running, message: "", lastTransitionTime: "2026-12-07T09:00:00Z"}
"#;

    fn now() -> Timestamp {
        "2026-12-07T10:00:07Z".parse().unwrap()
    }

    #[test]
    fn a_running_job_shows_its_workers_conditions_snapshots_rescale_and_lag() {
        let j = job(RUNNING);
        let v = JobView::new(&j, now());
        assert_eq!(v.phase, "Running");
        assert_eq!(v.conditions[0].for_seconds, 607);
        assert_eq!(v.rescale.as_ref().map(|r| r.seconds), Some(3.5));
        let t = v.text(now());
        for want in [
            "clicks (namespace team-a)",
            "Phase:             Running: 4 workers running; 128 key groups (spec.maxParallelism)",
            "Ready:             True Running for 10 min: running at parallelism 4",
            "Stalled:           False Running for 60 min\n",
            "Checkpoint:        s3://b/j/checkpoints/chk-12, 4 subtasks, 1.5 MiB, 7 s ago",
            "Savepoint:         none yet",
            "Rescale:           2 -> 4, Done, 64 key groups moved, 3.5 s in its steps (started 2026-12-07T09:59:00Z)",
            "Source lag:        1234 records behind over 3 of 8 partitions, up to 5 s; furthest behind: t/3 (900) (measured 2 s ago)",
        ] {
            assert!(t.contains(want), "missing {want:?} in\n{t}");
        }
        assert!(!t.contains("Step:"), "no step while none runs:\n{t}");
    }

    #[test]
    fn the_jobs_snapshots_are_listed_newest_first() {
        let j = job(RUNNING);
        let snap = |name: &str, job: &str, created: &str, status: &str| -> StreamJobSnapshot {
            serde_yaml::from_str(&format!(
                "apiVersion: keyshift.dev/v1alpha1\nkind: StreamJobSnapshot\nmetadata: {{name: {name}, creationTimestamp: '{created}'}}\nspec: {{jobName: {job}}}\nstatus: {status}\n"
            ))
            .unwrap()
        };
        let all = [
            snap(
                "old",
                "clicks",
                "2026-12-07T09:00:07Z",
                "{phase: Ready, path: 's3://b/j/savepoints/sp-3', sizeBytes: 2048, inUse: false}",
            ),
            snap(
                "other-job",
                "sessions",
                "2026-12-07T09:59:07Z",
                "{phase: Ready}",
            ),
            snap("new", "clicks", "2026-12-07T09:59:07Z", "{}"),
        ];
        let v = JobView::new(&j, now()).with_snapshots(&all, now());
        let names: Vec<&str> = v.snapshots.iter().map(|s| s.name).collect();
        assert_eq!(names, ["new", "old"]);
        let t = v.text(now());
        assert!(
            t.contains(
                "  Snapshots:         new Pending, created 60 s ago\n                     old Ready, 2.0 KiB, created 60 min ago: s3://b/j/savepoints/sp-3\n"
            ),
            "{t}"
        );
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["snapshots"][1]["sizeBytes"], 2048);
    }

    #[test]
    fn a_new_job_is_pending_with_no_worker_running() {
        let mut j = job(RUNNING);
        j.status = None;
        j.spec.suspend = true;
        let v = JobView::new(&j, now());
        let t = v.text(now());
        assert!(
            t.contains(
                "Phase:             Pending (spec.suspend is set): none of 4 workers running\n"
            ),
            "{t}"
        );
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["phase"], "Pending");
        assert!(json.get("lastCheckpoint").is_none(), "{json}");
    }

    #[test]
    fn the_json_document_carries_the_status_fields_by_their_crd_names() {
        let j = job(RUNNING);
        let json = serde_json::to_value(JobView::new(&j, now())).unwrap();
        assert_eq!(
            json["lastCheckpoint"]["path"],
            "s3://b/j/checkpoints/chk-12"
        );
        assert_eq!(json["lag"]["partitionsBehind"], 3);
        assert_eq!(json["conditions"][0]["type"], "Ready");
        assert_eq!(json["rescale"]["groupsMoved"], 64);
        assert_eq!(json["running"], 4);
    }

    #[test]
    fn the_namespace_table_has_a_line_per_job() {
        let running = job(RUNNING);
        let mut new = job(RUNNING);
        new.metadata.name = Some("sessions".into());
        new.status = None;
        let views = [JobView::new(&running, now()), JobView::new(&new, now())];
        assert_eq!(
            jobs_table(&views, now()),
            "NAME      PHASE    WORKERS  STEP  READY    CHECKPOINT  LAG\n\
             clicks    Running  4/4      -     True     7 s ago     1234 records\n\
             sessions  Pending  0/4      -     Unknown  -           -\n"
        );
    }

    #[test]
    fn ages_in_whole_units() {
        assert_eq!(age(-3), "0 s");
        assert_eq!(age(119), "119 s");
        assert_eq!(age(120), "2 min");
        assert_eq!(age(7199), "119 min");
        assert_eq!(age(7200), "2 h");
        assert_eq!(age(172_800), "2 d");
    }
}
