//! The rescale timeline: the steps of one real rescale and their seconds, as a Gantt-like bar
//! chart, drawn from a [`RescaleRecord`] (what `keyshift bench rescale --record FILE` writes;
//! `docs/data/rescale-timeline.json` is the committed one).
//!
//! The steps run one after another, so each bar starts where the one before ended; the restore
//! inside each new worker (range reads, checksums, decoding) is drawn under the Restoring step,
//! and the raw baseline measured in the same run (a write + fsync and a read of the same bytes)
//! is drawn on the same time axis for comparison.

use crate::svg::{self, Svg};
use keyshift_core::step::Step;
use serde::{Deserialize, Serialize};

/// One rescale as measured: its steps with their seconds and the raw baseline of the same run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RescaleRecord {
    /// The command that measured it.
    pub command: String,
    /// When it was measured (RFC 3339).
    pub recorded_at: String,
    /// The machine it ran on (CPUs, kernel, load average), as the bench prints it.
    pub machine: String,
    /// Whether the binary was a release build (a debug build is several times slower).
    pub release_build: bool,
    /// Parallelism before.
    pub from: u32,
    /// Parallelism after.
    pub to: u32,
    /// Key-group count.
    pub max_parallelism: u32,
    /// Key groups that changed owner.
    pub groups_moved: u32,
    /// Bytes of state in the savepoint.
    pub state_bytes: u64,
    /// Bytes the new subtasks read.
    pub bytes_read: u64,
    /// Keys the new subtasks restored.
    pub keys: u64,
    /// The steps in the order they ran.
    pub steps: Vec<StepTime>,
    /// Seconds each new subtask spent restoring its key groups (inside the Restoring step).
    pub restore_seconds_per_subtask: Vec<f64>,
    /// Raw baseline: a sequential write + fsync of the same bytes on the same disk (best of N).
    pub raw_write_seconds: f64,
    /// Raw baseline: a read of the same bytes (best of N).
    pub raw_read_seconds: f64,
}

/// One step and the seconds it took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StepTime {
    pub step: Step,
    pub seconds: f64,
}

impl RescaleRecord {
    /// From the savepoint trigger until every new subtask ran: the sum of the steps.
    pub fn pause_seconds(&self) -> f64 {
        self.steps.iter().map(|s| s.seconds).sum()
    }

    /// The raw baseline: write + fsync + read of the same bytes.
    pub fn raw_seconds(&self) -> f64 {
        self.raw_write_seconds + self.raw_read_seconds
    }
}

const WIDTH: f64 = 960.0;
const LEFT: f64 = 330.0;
const RIGHT: f64 = 70.0;
const ROW: f64 = 30.0;
const BAR: f64 = 20.0;

/// Colour of a step's bar.
fn step_colour(step: Step) -> &'static str {
    match step {
        Step::Prestaging => "#9dc3c1",
        Step::Savepointing => "#8fb8de",
        Step::Verifying => "#a9d18e",
        Step::Stopping => "#f4b183",
        Step::Rewriting => "#ffd966",
        Step::VerifyingRewrite => "#c5e0b4",
        Step::Restoring => "#c5a3d9",
        Step::Done | Step::Abandoned | Step::RolledBack => "#c9c9c9",
    }
}

/// What a step does, in a few words.
fn step_words(step: Step) -> &'static str {
    match step {
        Step::Prestaging => "load the new workers beside the running job",
        Step::Savepointing => "stop the sources with a savepoint",
        Step::Verifying => "check every file of the savepoint",
        Step::Stopping => "remove the old workers",
        Step::Rewriting => "rewrite the savepoint to the new key groups",
        Step::VerifyingRewrite => "check every key of the rewritten savepoint",
        Step::Restoring => "start the new workers, restore their groups",
        Step::Done => "done",
        Step::Abandoned => "given up",
        Step::RolledBack => "rolled back",
    }
}

/// The timeline picture of `record`.
pub fn timeline_svg(record: &RescaleRecord) -> String {
    let pause = record.pause_seconds();
    let raw = record.raw_seconds();
    let span = pause.max(raw).max(1e-9);
    let axis_w = WIDTH - LEFT - RIGHT;
    let x_of = |t: f64| LEFT + axis_w * t / span;
    let title = format!(
        "Rescale {} -> {} of {} key groups with {:.0} MiB of state: paused {:.2} s, {:.2}x a raw write + read of the same bytes",
        record.from,
        record.to,
        record.max_parallelism,
        record.state_bytes as f64 / f64::from(1u32 << 20),
        pause,
        pause / raw.max(1e-9)
    );
    let mut s = Svg::new(WIDTH);
    let mut y = 32.0;
    s.text(
        svg::MARGIN,
        y,
        &title,
        "font-size=\"15\" font-weight=\"bold\"",
    );
    y += 20.0;
    s.text(
        svg::MARGIN,
        y,
        &format!(
            "{} of {} groups moved, {} keys restored, {:.3} of the state's bytes read; {}",
            record.groups_moved,
            record.max_parallelism,
            record.keys,
            record.bytes_read as f64 / record.state_bytes.max(1) as f64,
            if record.release_build {
                "release build"
            } else {
                "debug build"
            }
        ),
        "fill=\"#555\"",
    );
    y += 16.0;
    s.text(
        svg::MARGIN,
        y,
        &format!("measured by: {}", record.command),
        "fill=\"#555\" font-size=\"11\"",
    );
    y += 14.0;
    for (i, part) in record.machine.split("; ").enumerate() {
        let line = if i == 0 {
            format!("{} · {part}", record.recorded_at)
        } else {
            part.to_owned()
        };
        s.text(svg::MARGIN, y, &line, "fill=\"#555\" font-size=\"11\"");
        y += 14.0;
    }
    y += 8.0;

    // Grid: a line every `tick` seconds.
    let tick = nice_tick(span);
    let grid_top = y;
    let rows = record.steps.len() + record.restore_seconds_per_subtask.len() + 3;
    let grid_bottom = grid_top + ROW * rows as f64;
    let ticks = (span / tick + 1e-9).floor() as u32;
    for k in 0..=ticks {
        let t = f64::from(k) * tick;
        let x = x_of(t);
        s.line(x, grid_top, x, grid_bottom, "stroke=\"#e3e3e3\"");
        s.text(
            x,
            grid_bottom + 14.0,
            &format!("{t:.1} s"),
            "fill=\"#555\" font-size=\"11\" text-anchor=\"middle\"",
        );
    }

    // The steps, one after another.
    let mut start = 0.0;
    let mut restoring_at = None;
    for st in &record.steps {
        let label = format!("{} ({})", st.step, step_words(st.step));
        s.text(svg::MARGIN, y + 15.0, &label, "font-size=\"11\"");
        let (x0, x1) = (x_of(start), x_of(start + st.seconds));
        s.rect_titled(
            x0,
            y + (ROW - BAR) / 2.0 - 2.0,
            (x1 - x0).max(1.0),
            BAR,
            &format!(
                "class=\"step\" data-step=\"{}\" data-start=\"{start:.3}\" data-seconds=\"{:.3}\" fill=\"{}\" stroke=\"#555\" stroke-width=\"0.5\"",
                st.step,
                st.seconds,
                step_colour(st.step)
            ),
            &format!("{}: {:.3} s, from {start:.3} s", st.step, st.seconds),
        );
        s.text(
            x1 + 4.0,
            y + 15.0,
            &format!("{:.2} s", st.seconds),
            "font-size=\"11\"",
        );
        if st.step == Step::Restoring {
            restoring_at = Some(start);
        }
        start += st.seconds;
        y += ROW;
    }

    // Inside Restoring: each new subtask's own restore.
    let inner = restoring_at.unwrap_or(start);
    for (i, secs) in record.restore_seconds_per_subtask.iter().enumerate() {
        s.text(
            svg::MARGIN + 16.0,
            y + 15.0,
            &format!("new subtask {i}: read + check + decode"),
            "font-size=\"11\" fill=\"#555\"",
        );
        let (x0, x1) = (x_of(inner), x_of(inner + secs));
        s.rect_titled(
            x0,
            y + (ROW - BAR) / 2.0 + 1.0,
            (x1 - x0).max(1.0),
            BAR - 6.0,
            &format!(
                "class=\"restore\" data-subtask=\"{i}\" data-seconds=\"{secs:.3}\" fill=\"{}\" fill-opacity=\"0.55\"",
                step_colour(Step::Restoring)
            ),
            &format!("new subtask {i} restored its key groups in {secs:.3} s"),
        );
        s.text(
            x1 + 4.0,
            y + 15.0,
            &format!("{secs:.2} s"),
            "font-size=\"11\" fill=\"#555\"",
        );
        y += ROW;
    }

    // The pause, and the raw baseline on the same axis.
    y += 4.0;
    for (label, secs, class, fill) in [
        ("pause (sum of the steps)", pause, "pause", "#5b7fb3"),
        ("raw baseline: write + fsync + read", raw, "raw", "#9e9e9e"),
    ] {
        s.text(
            svg::MARGIN,
            y + 15.0,
            label,
            "font-size=\"11\" font-weight=\"bold\"",
        );
        let w = x_of(secs) - x_of(0.0);
        s.rect_titled(
            x_of(0.0),
            y + (ROW - BAR) / 2.0 - 2.0,
            w.max(1.0),
            BAR,
            &format!("class=\"{class}\" data-seconds=\"{secs:.3}\" fill=\"{fill}\""),
            &format!("{label}: {secs:.3} s"),
        );
        s.text(
            x_of(secs) + 4.0,
            y + 15.0,
            &format!("{secs:.2} s"),
            "font-size=\"11\" font-weight=\"bold\"",
        );
        y += ROW;
    }
    y = grid_bottom + 34.0;
    s.text(
        svg::MARGIN,
        y,
        &format!(
            "raw baseline in the same run, same disk: write + fsync {:.2} s, read {:.2} s of the same {} bytes",
            record.raw_write_seconds, record.raw_read_seconds, record.state_bytes
        ),
        "fill=\"#555\" font-size=\"11\"",
    );
    s.finish(y + 16.0, &title, "")
}

/// A grid step of 1, 2 or 5 times a power of ten giving about 5-10 lines over `span`.
pub fn nice_tick(span: f64) -> f64 {
    let raw = span / 8.0;
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if raw <= m * mag {
            return m * mag;
        }
    }
    10.0 * mag
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> RescaleRecord {
        RescaleRecord {
            command: "keyshift bench rescale".into(),
            recorded_at: "2026-12-02T00:00:00Z".into(),
            machine: "2 CPUs".into(),
            release_build: true,
            from: 4,
            to: 8,
            max_parallelism: 128,
            groups_moved: 64,
            state_bytes: 1 << 20,
            bytes_read: 1 << 20,
            keys: 10,
            steps: vec![
                StepTime {
                    step: Step::Savepointing,
                    seconds: 1.0,
                },
                StepTime {
                    step: Step::Verifying,
                    seconds: 0.5,
                },
                StepTime {
                    step: Step::Stopping,
                    seconds: 0.25,
                },
                StepTime {
                    step: Step::Restoring,
                    seconds: 2.0,
                },
            ],
            restore_seconds_per_subtask: vec![1.5, 1.75],
            raw_write_seconds: 1.0,
            raw_read_seconds: 0.5,
        }
    }

    #[test]
    fn steps_follow_one_another() {
        let svg = timeline_svg(&record());
        assert!(
            svg.contains(r#"data-step="Savepointing" data-start="0.000" data-seconds="1.000""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"data-step="Verifying" data-start="1.000""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"data-step="Stopping" data-start="1.500""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"data-step="Restoring" data-start="1.750" data-seconds="2.000""#),
            "{svg}"
        );
        assert_eq!(svg.matches(r#"class="restore""#).count(), 2);
        assert!(
            svg.contains(r#"class="pause" data-seconds="3.750""#),
            "{svg}"
        );
        assert!(svg.contains(r#"class="raw" data-seconds="1.500""#), "{svg}");
        assert!(svg.contains("paused 3.75 s, 2.50x"), "{svg}");
    }

    #[test]
    fn the_record_reads_back_and_refuses_unknown_fields() {
        let r = record();
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RescaleRecord>(&json).unwrap(), r);
        let typo = json.replace("\"keys\"", "\"keyz\"");
        assert!(serde_json::from_str::<RescaleRecord>(&typo).is_err());
    }

    #[test]
    fn ticks_are_round() {
        for (span, tick) in [
            (5.0, 1.0),
            (4.0, 0.5),
            (12.0, 2.0),
            (0.7, 0.1),
            (80.0, 10.0),
        ] {
            assert!(
                (nice_tick(span) - tick).abs() < 1e-12,
                "{span}: {}",
                nice_tick(span)
            );
        }
    }
}
