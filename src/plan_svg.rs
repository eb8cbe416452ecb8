//! `keyshift plan -o svg`: the key-group assignment (and a rescale) as an SVG picture.
//!
//! Drawn with the shared writer of [`crate::svg`]. Pure: the picture is drawn from [`Assignment`] and [`RescalePlan`] (crates/keyshift-core/src/keygroup.rs owns all the
//! math; nothing here derives a range or a move on its own) into a `String`. The output is
//! deterministic (fixed decimals, no clock), so the committed pictures under `docs/` can be checked
//! against what the binary renders now.
//!
//! Every drawn range and move carries `data-*` attributes (strip, subtask, first and last group,
//! group count) so tests and readers can check the picture against the plan without measuring it.

use crate::svg::{self, escape, plural};
use keyshift_core::keygroup::{Assignment, KeyGroupRange, RescalePlan};
use std::fmt::Write as _;

/// Width of the whole picture.
const WIDTH: f64 = 960.0;
/// Left and right margin around the strips.
const MARGIN: f64 = svg::MARGIN;
/// Height of one strip of key groups.
const STRIP_H: f64 = 44.0;
/// Height of the tallest bar of the groups-per-subtask chart.
const BAR_H: f64 = 60.0;
/// Rough width of one character at the label font size, to decide whether a label fits.
const CHAR_W: f64 = 6.6;

/// Fill colours of subtask ranges, by subtask index (cycled). Neighbours always differ.
const PALETTE: [&str; 10] = [
    "#8fb8de", "#f4b183", "#a9d18e", "#ffd966", "#c5a3d9", "#9dd5d0", "#f4a3b4", "#c9c9c9",
    "#d6c28b", "#b4c7e7",
];

/// The SVG picture of `to`'s assignment; with `rescale` (the assignment it starts from and the
/// plan between them) the old strip is drawn above the new one and the groups that change owner
/// are marked on the new strip.
pub fn plan_svg(to: &Assignment, rescale: Option<(&Assignment, &RescalePlan)>) -> String {
    let g = to.max_parallelism();
    let strip_w = WIDTH - 2.0 * MARGIN;
    let scale = strip_w / f64::from(g);
    let x_of = |group: u32| MARGIN + f64::from(group) * scale;

    let mut body = String::new();
    let mut y = 20.0;

    // Title.
    let title = match rescale {
        Some((_, plan)) => format!(
            "Rescale {} -> {} subtasks over {} key groups: {} groups ({:.1}%) change owner",
            plan.from_parallelism,
            plan.to_parallelism,
            g,
            plan.moved_groups,
            plan.moved_fraction * 100.0
        ),
        None => format!(
            "{} key group{} over {} subtask{}",
            g,
            plural(g),
            to.parallelism(),
            plural(to.parallelism())
        ),
    };
    y += 12.0;
    let _ = writeln!(
        body,
        r##"  <text x="{MARGIN}" y="{y}" font-size="16" font-weight="bold">{}</text>"##,
        escape(&title)
    );
    y += 20.0;
    let _ = writeln!(
        body,
        r##"  <text x="{MARGIN}" y="{y}" fill="#555">Each subtask owns one contiguous range of key groups (Flink's KeyGroupRangeAssignment); a key's group never changes.</text>"##
    );
    y += 14.0;

    // The old strip, above the new one.
    if let Some((from, _)) = rescale {
        y += 16.0;
        let _ = writeln!(
            body,
            r##"  <text x="{MARGIN}" y="{y}" font-weight="bold">before: parallelism {}</text>"##,
            from.parallelism()
        );
        y += 6.0;
        strip(&mut body, "old", &from.ranges(), y, &x_of, scale);
        y += STRIP_H;
    }

    // The new strip.
    y += 20.0;
    let label = if rescale.is_some() {
        "after: parallelism"
    } else {
        "parallelism"
    };
    let _ = writeln!(
        body,
        r##"  <text x="{MARGIN}" y="{y}" font-weight="bold">{label} {}</text>"##,
        to.parallelism()
    );
    y += 6.0;
    let strip_top = y;
    strip(&mut body, "new", &to.ranges(), y, &x_of, scale);
    y += STRIP_H;

    // Axis: the first and last group.
    y += 14.0;
    let _ = writeln!(
        body,
        r##"  <text x="{MARGIN}" y="{y}" fill="#555">group 0</text>"##
    );
    let _ = writeln!(
        body,
        r##"  <text x="{}" y="{y}" fill="#555" text-anchor="end">group {}</text>"##,
        WIDTH - MARGIN,
        g - 1
    );

    // Groups that change owner: every read of a new subtask from an old subtask other than the
    // one it is paired with (RescalePlan's one-to-one pairing).
    if let Some((_, plan)) = rescale {
        for st in &plan.subtasks {
            for read in st.reads.iter().filter(|r| Some(r.from) != st.paired_with) {
                let r = read.key_groups;
                let _ = writeln!(
                    body,
                    r##"  <rect class="moved" data-strip="new" data-subtask="{}" data-from="{}" data-start="{}" data-end="{}" data-groups="{}" x="{:.2}" y="{:.2}" width="{:.2}" height="{STRIP_H}" fill="url(#moved)" stroke="#c0392b" stroke-width="1"><title>groups {} move from old subtask {} to new subtask {}</title></rect>"##,
                    st.index,
                    read.from,
                    r.start,
                    r.end,
                    read.count,
                    x_of(r.start),
                    strip_top,
                    f64::from(r.len()) * scale,
                    r,
                    read.from,
                    st.index
                );
            }
        }
        y += 20.0;
        let _ = writeln!(
            body,
            r##"  <rect x="{MARGIN}" y="{:.2}" width="14" height="10" fill="url(#moved)" stroke="#c0392b"/>"##,
            y - 9.0
        );
        let _ = writeln!(
            body,
            r##"  <text x="{}" y="{y}">changes owner: {} of {} key groups, when each new subtask replaces the old subtask it overlaps most</text>"##,
            MARGIN + 20.0,
            plan.moved_groups,
            g
        );
    }

    // Skew: groups per subtask as bars.
    let skew = to.skew();
    y += 28.0;
    let _ = writeln!(
        body,
        r##"  <text x="{MARGIN}" y="{y}" font-weight="bold">key groups per subtask (parallelism {})</text>"##,
        to.parallelism()
    );
    // Room for the count labels above the tallest bars.
    y += 18.0;
    let bar_w = strip_w / f64::from(to.parallelism());
    let gap = if bar_w > 6.0 { 2.0 } else { 0.0 };
    let base = y + BAR_H;
    for (i, r) in to.ranges().iter().enumerate() {
        let h = BAR_H * f64::from(r.len()) / f64::from(skew.max_groups.max(1));
        let x = MARGIN + i as f64 * bar_w;
        let _ = writeln!(
            body,
            r##"  <rect class="bar" data-subtask="{i}" data-groups="{}" x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}" fill="{}"><title>subtask {i}: {} group{}</title></rect>"##,
            r.len(),
            x + gap / 2.0,
            base - h,
            bar_w - gap,
            h,
            colour(i),
            r.len(),
            plural(r.len())
        );
        let count = r.len().to_string();
        if label_fits(&count, bar_w) {
            let _ = writeln!(
                body,
                r##"  <text x="{:.2}" y="{:.2}" text-anchor="middle" font-size="11">{count}</text>"##,
                x + bar_w / 2.0,
                base - h - 3.0
            );
        }
    }
    y = base + 20.0;
    let _ = writeln!(
        body,
        r##"  <text class="skew" x="{MARGIN}" y="{y}">skew: {}</text>"##,
        escape(&skew.summary())
    );
    y += 16.0;

    svg::document(
        WIDTH,
        y,
        &title,
        "",
        r##"<pattern id="moved" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff" fill-opacity="0.15"/><line x1="0" y1="0" x2="0" y2="6" stroke="#c0392b" stroke-width="2.5" stroke-opacity="0.6"/></pattern>"##,
        &body,
    )
}

/// One strip: a rect per subtask's range, labelled with the subtask and its groups where it fits.
fn strip(
    body: &mut String,
    name: &str,
    ranges: &[KeyGroupRange],
    y: f64,
    x_of: &impl Fn(u32) -> f64,
    scale: f64,
) {
    for (i, r) in ranges.iter().enumerate() {
        let (x, w) = (x_of(r.start), f64::from(r.len()) * scale);
        let _ = writeln!(
            body,
            r##"  <rect class="range" data-strip="{name}" data-subtask="{i}" data-start="{}" data-end="{}" data-groups="{}" x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{STRIP_H}" fill="{}" stroke="#ffffff" stroke-width="1"><title>subtask {i}: groups {r} ({} group{})</title></rect>"##,
            r.start,
            r.end,
            r.len(),
            colour(i),
            r.len(),
            plural(r.len())
        );
        let index = format!("#{i}");
        let groups = r.to_string();
        let cx = x + w / 2.0;
        if label_fits(&groups, w) && label_fits(&index, w) {
            let _ = writeln!(
                body,
                r##"  <text x="{cx:.2}" y="{:.2}" text-anchor="middle" font-weight="bold">{index}</text>"##,
                y + 18.0
            );
            let _ = writeln!(
                body,
                r##"  <text x="{cx:.2}" y="{:.2}" text-anchor="middle" font-size="11">{groups}</text>"##,
                y + 34.0
            );
        } else if label_fits(&index, w) {
            let _ = writeln!(
                body,
                r##"  <text x="{cx:.2}" y="{:.2}" text-anchor="middle" font-weight="bold">{index}</text>"##,
                y + 27.0
            );
        }
    }
}

fn label_fits(text: &str, width: f64) -> bool {
    text.chars().count() as f64 * CHAR_W + 4.0 <= width
}

fn colour(subtask: usize) -> &'static str {
    PALETTE[subtask % PALETTE.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyshift_core::keygroup::rescale_plan;

    #[test]
    fn one_range_rect_per_subtask_and_no_moves_without_a_rescale() {
        let to = Assignment::new(3, 128).unwrap();
        let svg = plan_svg(&to, None);
        assert_eq!(svg.matches(r##"class="range""##).count(), 3);
        assert_eq!(svg.matches(r##"class="moved""##).count(), 0);
        assert!(svg.contains(r##"data-start="43" data-end="85""##), "{svg}");
    }

    #[test]
    fn the_same_parallelism_marks_nothing() {
        let a = Assignment::new(7, 128).unwrap();
        let plan = rescale_plan(a, a).unwrap();
        let svg = plan_svg(&a, Some((&a, &plan)));
        assert_eq!(svg.matches(r##"class="range""##).count(), 14);
        assert_eq!(svg.matches(r##"class="moved""##).count(), 0);
    }
}
