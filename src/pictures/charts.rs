//! Bar charts of the benchmark results, ours beside the baseline measured in the same run,
//! drawn from `docs/data/benchmarks.json` ([`BenchData`]: the numbers of `docs/benchmarks.md`),
//! which also holds the summary table that opens `docs/benchmarks.md` ([`summary_table`]).

use crate::svg::{self, Svg};
use serde::{Deserialize, Serialize};

/// The numbers: the summary table's rows and the charts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BenchData {
    pub summary: Vec<SummaryRow>,
    pub charts: Vec<Chart>,
}

/// A row of the summary table: what was measured, ours, the baseline of the same run, the
/// ratio, the target, and the command that measures it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SummaryRow {
    pub what: String,
    pub ours: String,
    pub baseline: String,
    pub ratio: String,
    pub target: String,
    pub command: String,
}

/// One chart: groups of bars on one axis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Chart {
    /// The SVG's file name under `docs/`.
    pub file: String,
    pub title: String,
    /// Unit of every value (`s`, `MB/s`, `M records/s`).
    pub unit: String,
    /// Whether a shorter bar is better (time) or a longer one (throughput).
    pub lower_is_better: bool,
    /// The command that measures it.
    pub command: String,
    /// Where in `docs/benchmarks.md` the numbers come from.
    pub source: String,
    pub groups: Vec<Group>,
}

/// Bars measured together (one run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Group {
    pub label: String,
    pub bars: Vec<Bar>,
}

/// One measured value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Bar {
    pub label: String,
    pub value: f64,
    /// keyshift's own number (else a baseline).
    pub ours: bool,
}

const WIDTH: f64 = 960.0;
const LABEL_W: f64 = 300.0;
const BAR_H: f64 = 18.0;
const OURS: &str = "#5b7fb3";
const BASELINE: &str = "#b0b0b0";

/// The chart as SVG.
pub fn chart_svg(chart: &Chart) -> String {
    let max = chart
        .groups
        .iter()
        .flat_map(|g| g.bars.iter().map(|b| b.value))
        .fold(0.0_f64, f64::max)
        .max(1e-9);
    let left = svg::MARGIN + LABEL_W;
    let axis_w = WIDTH - left - 230.0;
    let mut s = Svg::new(WIDTH);
    let mut y = 32.0;
    s.text(
        svg::MARGIN,
        y,
        &chart.title,
        r#"font-size="15" font-weight="bold""#,
    );
    y += 20.0;
    s.text(
        svg::MARGIN,
        y,
        &format!(
            "{} ({}); each group was measured in one run, on the same machine and disk",
            if chart.lower_is_better {
                "shorter is better"
            } else {
                "longer is better"
            },
            chart.unit
        ),
        r##"fill="#555""##,
    );
    y += 16.0;
    // Legend.
    s.rect(
        svg::MARGIN,
        y - 9.0,
        14.0,
        10.0,
        &format!(r#"fill="{OURS}""#),
    );
    s.text(svg::MARGIN + 20.0, y, "keyshift", r#"font-size="11""#);
    s.rect(
        svg::MARGIN + 90.0,
        y - 9.0,
        14.0,
        10.0,
        &format!(r#"fill="{BASELINE}""#),
    );
    s.text(
        svg::MARGIN + 110.0,
        y,
        "baseline, same run",
        r#"font-size="11""#,
    );
    y += 14.0;
    for g in &chart.groups {
        y += 18.0;
        s.text(
            svg::MARGIN,
            y,
            &g.label,
            r#"font-weight="bold" font-size="12""#,
        );
        y += 6.0;
        // The group's baseline, for each of ours as a ratio to it.
        let baseline = g.bars.iter().find(|b| !b.ours).map(|b| b.value);
        for b in &g.bars {
            let w = axis_w * b.value / max;
            s.text(
                left - 8.0,
                y + 13.0,
                &b.label,
                r#"font-size="11" text-anchor="end""#,
            );
            s.rect_titled(
                left,
                y,
                w.max(1.0),
                BAR_H,
                &format!(
                    r#"class="bar" data-ours="{}" data-value="{}" fill="{}""#,
                    b.ours,
                    b.value,
                    if b.ours { OURS } else { BASELINE }
                ),
                &format!("{}: {} {}", b.label, b.value, chart.unit),
            );
            let ratio = match baseline {
                Some(base) if b.ours && base > 0.0 => {
                    format!(" ({:.2}x the baseline)", b.value / base)
                }
                _ => String::new(),
            };
            s.text(
                left + w + 5.0,
                y + 13.0,
                &format!("{} {}{ratio}", b.value, chart.unit),
                r#"font-size="11""#,
            );
            y += BAR_H + 4.0;
        }
    }
    y += 20.0;
    s.text(
        svg::MARGIN,
        y,
        &format!("measured by: {}", chart.command),
        r##"fill="#555" font-size="11""##,
    );
    y += 14.0;
    s.text(
        svg::MARGIN,
        y,
        &format!("numbers from docs/benchmarks.md: {}", chart.source),
        r##"fill="#555" font-size="11""##,
    );
    s.finish(y + 14.0, &chart.title, "")
}

/// The summary table (Markdown) that opens `docs/benchmarks.md`.
pub fn summary_table(data: &BenchData) -> String {
    let mut out = String::from(
        "| what | keyshift | baseline, same run | ratio | target | command |\n| --- | --- | --- | --- | --- | --- |\n",
    );
    for r in &data.summary {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | `{}` |\n",
            r.what, r.ours, r.baseline, r.ratio, r.target, r.command
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> Chart {
        Chart {
            file: "x.svg".into(),
            title: "T".into(),
            unit: "s".into(),
            lower_is_better: true,
            command: "keyshift bench rescale".into(),
            source: "here".into(),
            groups: vec![Group {
                label: "run 1".into(),
                bars: vec![
                    Bar {
                        label: "pause".into(),
                        value: 4.0,
                        ours: true,
                    },
                    Bar {
                        label: "raw".into(),
                        value: 2.0,
                        ours: false,
                    },
                ],
            }],
        }
    }

    #[test]
    fn bars_are_proportional_to_their_values() {
        let svg = chart_svg(&chart());
        let width = |value: &str| -> f64 {
            let at = svg.find(&format!(r#"data-value="{value}""#)).unwrap();
            let rect = &svg[svg[..at].rfind("<rect").unwrap()..at];
            let w = rect.split("width=\"").nth(1).unwrap();
            w[..w.find('"').unwrap()].parse().unwrap()
        };
        assert!((width("4") - 2.0 * width("2")).abs() < 0.02, "{svg}");
        assert!(svg.contains(r#"data-ours="true" data-value="4""#));
        assert!(svg.contains(r#"data-ours="false" data-value="2""#));
        assert!(svg.contains(">4 s (2.00x the baseline)</text>"), "{svg}");
    }

    #[test]
    fn the_summary_has_a_row_per_entry() {
        let data = BenchData {
            summary: vec![SummaryRow {
                what: "w".into(),
                ours: "1 s".into(),
                baseline: "2 s".into(),
                ratio: "0.5".into(),
                target: "-".into(),
                command: "keyshift bench x".into(),
            }],
            charts: vec![chart()],
        };
        let t = summary_table(&data);
        assert_eq!(t.lines().count(), 3);
        assert!(
            t.ends_with("| w | 1 s | 2 s | 0.5 | - | `keyshift bench x` |\n"),
            "{t}"
        );
    }
}
