//! `keyshift savepoint dump`: every key's state as JSON lines.
//!
//! One line per key, in key-group order (block order within a group):
//!
//! ```text
//! {"key":"key-17","keyType":"string","keyGroup":42,"value":1234}
//! {"key":17,"keyType":"long","keyGroup":9,"windows":[{"start":0,"end":10000,"value":3}]}
//! ```
//!
//! `key` is typed as stored (a JSON string, or a number for `long` and `int` keys; `keyType` tells
//! the two number types apart). A job without a window has `value` (the accumulator); a windowed
//! job has `windows`, one accumulator per open window. `payloadBytes` appears when the key
//! carries benchmark ballast. Blocks are streamed and checked (checksums, headers, key groups)
//! as they are read.
//!
//! A program's snapshot (schema `keyshift.sdk.v1`) has one line per entry: a state's value (or
//! a map entry, a list element) under the state's declared name, or a timer:
//!
//! ```text
//! {"keyGroup":42,"key":"device-7","state":"last-heartbeat","kind":"value","valueHex":"c0b802"}
//! {"keyGroup":42,"key":"device-7","state":"timers","kind":"event-time","timer":1700000030000}
//! ```
//!
//! A state serialized as JSON shows its `value` as JSON; any other, `valueHex` as stored.

use super::blocks::{self, Block, Shape, WINDOW_BYTES};
use super::error::{Result, ToolError};
use super::location::SnapshotLocation;
use crate::job::RecordKey;
use crate::job::state_codec::{self, AccValue, StateValue};
use crate::snapshot::{Manifest, read_manifest};
use keyshift_core::keygroup::{Key, KeyGroupRange, KeyType};
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;

/// One window's accumulator in a dump line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WindowValue {
    /// Inclusive start (ms).
    pub start: i64,
    /// Exclusive end (ms).
    pub end: i64,
    /// The accumulator.
    pub value: i64,
}

/// One line of `dump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpLine {
    /// The key, typed as stored.
    pub key: Key,
    /// `string`, `long` or `int`.
    pub key_type: KeyType,
    /// Its key group.
    pub key_group: u32,
    /// The accumulator (jobs without a window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<i64>,
    /// The open windows' accumulators (windowed jobs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows: Option<Vec<WindowValue>>,
    /// Bytes of opaque payload kept with the key, when there are any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_bytes: Option<usize>,
}

impl DumpLine {
    /// The line of one entry.
    pub fn new(key: &RecordKey, group: u32, v: &StateValue, window_size_ms: Option<i64>) -> Self {
        let (value, windows) = match &v.acc {
            AccValue::Scalar(x) => (Some(*x), None),
            AccValue::Windows(ws) => (
                None,
                Some(
                    ws.iter()
                        .map(|(start, value)| WindowValue {
                            start: *start,
                            end: start.saturating_add(window_size_ms.unwrap_or(0)),
                            value: *value,
                        })
                        .collect(),
                ),
            ),
        };
        DumpLine {
            key: key.to_key(),
            key_type: key.key_type(),
            key_group: group,
            value,
            windows,
            payload_bytes: (!v.payload.is_empty()).then_some(v.payload.len()),
        }
    }
}

/// What `dump` wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DumpSummary {
    /// Lines (keys) written.
    pub keys: u64,
    /// Groups with state read.
    pub groups: u32,
    /// Operator-state entries written (a program's, in a dump of every group).
    pub operator_entries: u64,
    /// Whether the output was closed early (e.g. `| head`); not an error.
    pub output_closed: bool,
}

/// Reads `A-B` (inclusive) or `A`.
pub fn parse_key_groups(text: &str) -> Result<KeyGroupRange> {
    let bad = |reason: &str| ToolError::BadRange {
        text: text.to_owned(),
        reason: reason.to_owned(),
    };
    let num = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|e| bad(&format!("{:?} is not a key group number ({e})", s.trim())))
    };
    let (start, end) = match text.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let g = num(text)?;
            (g, g)
        }
    };
    if start > end {
        return Err(bad("the start is after the end"));
    }
    Ok(KeyGroupRange { start, end })
}

/// One line of `dump` for a program's state: one entry of a key's state (by its declared
/// name) or one of its timers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgramDumpLine {
    /// Its key group.
    pub key_group: u32,
    /// The entry.
    #[serde(flatten)]
    pub entry: keyshift_sdk::block::EntryView,
}

/// Renders one block's lines.
fn render(manifest: &Manifest, b: &Block, shape: &mut Option<Shape>) -> Result<(Vec<u8>, u64)> {
    let codec = |source| ToolError::Block {
        file: b.file.to_string(),
        group: b.group,
        source,
    };
    super::verify::check_block(manifest, b, shape)?;
    if manifest.state_schema == crate::job::PROGRAM_SCHEMA {
        let (_, entries) =
            keyshift_sdk::block::describe(&b.bytes).map_err(|source| ToolError::ProgramBlock {
                file: b.file.to_string(),
                group: b.group,
                source,
            })?;
        let mut out = Vec::with_capacity(b.bytes.len() * 2);
        let n = entries.len() as u64;
        for entry in entries {
            let line = ProgramDumpLine {
                key_group: b.group,
                entry,
            };
            if serde_json::to_writer(&mut out, &line).is_ok() {
                out.push(b'\n');
            }
        }
        return Ok((out, n));
    }
    let window = shape.and_then(|s| s.window_size_ms);
    let mut out = Vec::with_capacity(b.bytes.len());
    let mut n = 0;
    state_codec::for_each_entry(&b.bytes, |key, value| {
        // Serialising plain data into a Vec does not fail; stop quietly if it ever did.
        if serde_json::to_writer(&mut out, &DumpLine::new(&key, b.group, &value, window)).is_ok() {
            out.push(b'\n');
            n += 1;
        }
        Ok(())
    })
    .map_err(codec)?;
    Ok((out, n))
}

/// Writes every key of the groups in `range` (all groups when `None`) to `out` as JSON lines.
/// A closed output (broken pipe) ends the dump early without an error.
pub async fn dump(
    loc: &SnapshotLocation,
    range: Option<KeyGroupRange>,
    out: &mut dyn Write,
) -> Result<DumpSummary> {
    dump_with_progress(loc, range, out, &|_| {}).await
}

/// [`dump()`], calling `progress` after every key group written with the key groups written so
/// far and in all (those of the range that hold state).
pub async fn dump_with_progress(
    loc: &SnapshotLocation,
    range: Option<KeyGroupRange>,
    out: &mut dyn Write,
    progress: &(dyn Fn(super::Advance) + Sync),
) -> Result<DumpSummary> {
    let manifest = Arc::new(read_manifest(loc.store.as_ref(), &loc.dir).await?);
    let all = KeyGroupRange {
        start: 0,
        end: manifest.max_parallelism - 1,
    };
    let range = match range {
        None => all,
        Some(r) if r.end <= all.end => r,
        Some(r) => {
            return Err(ToolError::BadRange {
                text: r.to_string(),
                reason: format!(
                    "the snapshot has key groups 0-{} (maxParallelism {})",
                    all.end, manifest.max_parallelism
                ),
            });
        }
    };
    let windows = blocks::plan_windows(&manifest, range.iter(), WINDOW_BYTES);
    let mut rx = blocks::read_windows(
        loc.store.clone(),
        loc.dir.clone(),
        manifest.clone(),
        windows,
    );
    let mut summary = DumpSummary::default();
    let mut shape: Option<Shape> = None;
    let total = manifest
        .key_groups
        .iter()
        .filter(|g| g.group >= range.start && g.group <= range.end)
        .count() as u64;
    while let Some(fetched) = rx.recv().await {
        let blocks = fetched?;
        let m = manifest.clone();
        let (s, rendered) = blocks::blocking(move || {
            let mut s = shape;
            let r: Result<Vec<(Vec<u8>, u64)>> =
                blocks.iter().map(|b| render(&m, b, &mut s)).collect();
            (s, r)
        })
        .await?;
        shape = s;
        for (text, n) in rendered? {
            if let Err(e) = out.write_all(&text) {
                if e.kind() == std::io::ErrorKind::BrokenPipe {
                    summary.output_closed = true;
                    return Ok(summary);
                }
                return Err(ToolError::Output(e));
            }
            summary.keys += n;
            summary.groups += 1;
            progress(super::Advance {
                done: u64::from(summary.groups).min(total),
                total,
            });
        }
    }
    // A program's operator state belongs to no key group: a dump of every group shows it too.
    if range == all && !manifest.operator_state.is_empty() {
        let sections =
            crate::snapshot::read_operator_state(loc.store.as_ref(), &loc.dir, &manifest).await?;
        let mut text = Vec::new();
        for (i, bytes) in sections.iter().enumerate() {
            let section =
                keyshift_sdk::operator_state::OperatorStates::decode(bytes).map_err(|source| {
                    ToolError::OperatorState {
                        subtask: i as u32,
                        source,
                    }
                })?;
            for view in section.describe() {
                if serde_json::to_writer(&mut text, &view).is_ok() {
                    text.push(b'\n');
                    summary.operator_entries += 1;
                }
            }
        }
        if let Err(e) = out.write_all(&text) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                summary.output_closed = true;
                return Ok(summary);
            }
            return Err(ToolError::Output(e));
        }
    }
    match out.flush() {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => summary.output_closed = true,
        Err(e) => return Err(ToolError::Output(e)),
        Ok(()) => {}
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_group_ranges() {
        assert_eq!(
            parse_key_groups("3-9").unwrap(),
            KeyGroupRange { start: 3, end: 9 }
        );
        assert_eq!(
            parse_key_groups(" 4 ").unwrap(),
            KeyGroupRange { start: 4, end: 4 }
        );
        assert!(parse_key_groups("9-3").is_err());
        assert!(parse_key_groups("a-3").is_err());
        assert!(parse_key_groups("-3").is_err());
    }

    #[test]
    fn lines_are_typed() {
        let v = StateValue {
            acc: AccValue::Scalar(12),
            payload: vec![],
        };
        let line = DumpLine::new(&RecordKey::long(7), 3, &v, None);
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            r#"{"key":7,"keyType":"long","keyGroup":3,"value":12}"#
        );
        let w = StateValue {
            acc: AccValue::Windows(vec![(0, 2)]),
            payload: vec![1, 2],
        };
        let line = DumpLine::new(&RecordKey::string("a"), 1, &w, Some(1000));
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            r#"{"key":"a","keyType":"string","keyGroup":1,"windows":[{"start":0,"end":1000,"value":2}],"payloadBytes":2}"#
        );
    }
}
