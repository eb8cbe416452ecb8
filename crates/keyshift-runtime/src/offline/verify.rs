//! `keyshift savepoint verify`: the full check of a snapshot, down to every key.
//!
//! On top of the snapshot layer's check (manifest consistent; every file present with the
//! manifest's size; every block's CRC-32C, hence every file's) every block is decoded: its header
//! must match the manifest (schema, maxParallelism, key group, entry count), all blocks must share
//! one operator shape (function, window), and every key must hash to the block's group. Each file
//! is checked on its own, so one bad file does not hide another; a file's first problem is
//! reported and the rest of that file skipped.

use super::blocks::{self, Block, Shape, WINDOW_BYTES};
use super::error::{Result, ToolError};
use super::location::{SnapshotLocation, is_manifest};
use crate::job::state_codec;
use crate::snapshot::{FileEntry, Manifest, SnapshotError, SnapshotKind, read_manifest};
use futures::TryStreamExt;
use object_store::ObjectStoreExt;
use serde::Serialize;
use std::collections::BTreeSet;
use std::sync::Arc;

/// What was checked in one state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileCheck {
    /// The file name.
    pub name: String,
    /// Its size per the manifest.
    pub size: u64,
    /// Non-empty blocks decoded and checked.
    pub blocks_checked: u32,
    /// Keys checked.
    pub keys_checked: u64,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// The first problem found, if any.
    pub problem: Option<String>,
}

/// The result of a full verification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyOutcome {
    /// The snapshot URL.
    pub url: String,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// The snapshot id.
    pub snapshot_id: u64,
    /// The key-group count.
    pub max_parallelism: u32,
    /// The parallelism it was taken at.
    pub parallelism: u32,
    /// Every state file.
    pub files: Vec<FileCheck>,
    /// Every problem (each names its file); empty when all is good.
    pub problems: Vec<String>,
    /// Things worth knowing that do not make the snapshot invalid (e.g. stray objects).
    pub warnings: Vec<String>,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// Keys decoded and checked.
    pub keys_checked: u64,
}

impl VerifyOutcome {
    /// Whether everything checked out.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Fully verifies the snapshot at `loc`. A missing or unreadable manifest is an error; problems
/// in state files are collected in the outcome (see [`VerifyOutcome::ok`]).
pub async fn verify_keys(loc: &SnapshotLocation) -> Result<VerifyOutcome> {
    verify_keys_with_progress(loc, &|_| {}).await
}

/// [`verify_keys`], calling `progress` as the work advances (after every window of blocks
/// read and every file) with the state bytes checked so far and in all.
pub async fn verify_keys_with_progress(
    loc: &SnapshotLocation,
    progress: &(dyn Fn(super::Advance) + Sync),
) -> Result<VerifyOutcome> {
    let manifest = Arc::new(read_manifest(loc.store.as_ref(), &loc.dir).await?);
    let mut problems = Vec::new();
    if let Some((kind, id)) = loc.named
        && (kind != manifest.kind || id != manifest.snapshot_id)
    {
        problems.push(format!(
            "{}: the manifest describes {} {} but lies in the directory of {kind} {id}",
            crate::snapshot::manifest_path(&loc.dir),
            manifest.kind,
            manifest.snapshot_id
        ));
    }
    let mut shape: Option<Shape> = None;
    let mut files = Vec::with_capacity(manifest.files.len());
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    let mut files_done = 0u64;
    for f in &manifest.files {
        let mut tick = |in_file: u64| {
            progress(super::Advance {
                done: (files_done + in_file).min(total),
                total,
            })
        };
        let check = check_file(loc, &manifest, f, &mut shape, &mut tick).await?;
        files_done += f.size;
        progress(super::Advance {
            done: files_done.min(total),
            total,
        });
        if let Some(p) = &check.problem {
            problems.push(p.clone());
        }
        files.push(check);
    }
    let warnings = stray_objects(loc, &manifest).await?;
    Ok(VerifyOutcome {
        url: loc.url.clone(),
        kind: manifest.kind,
        snapshot_id: manifest.snapshot_id,
        max_parallelism: manifest.max_parallelism,
        parallelism: manifest.parallelism,
        bytes_checked: files.iter().map(|f| f.bytes_checked).sum(),
        keys_checked: files.iter().map(|f| f.keys_checked).sum(),
        files,
        problems,
        warnings,
    })
}

/// Checks one file; problems go into the result, only internal failures are errors.
async fn check_file(
    loc: &SnapshotLocation,
    manifest: &Arc<Manifest>,
    f: &FileEntry,
    shape: &mut Option<Shape>,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<FileCheck> {
    let mut check = FileCheck {
        name: f.name.clone(),
        size: f.size,
        blocks_checked: 0,
        keys_checked: 0,
        bytes_checked: 0,
        problem: None,
    };
    let path = crate::snapshot::file_path(&loc.dir, &f.name);
    match loc.store.head(&path).await {
        Ok(meta) if meta.size != f.size => {
            check.problem = Some(
                SnapshotError::SizeMismatch {
                    path: path.to_string(),
                    expected: f.size,
                    actual: meta.size,
                }
                .to_string(),
            );
            return Ok(check);
        }
        Ok(_) => {}
        Err(e) => {
            check.problem = Some(SnapshotError::store("head", &path, e).to_string());
            return Ok(check);
        }
    }
    if let Some(g) = manifest
        .key_groups
        .iter()
        .find(|g| g.file == f.name && g.length == 0 && g.entries != 0)
    {
        check.problem = Some(format!(
            "state file {path}: key group {} has no bytes but the manifest says it holds {} entries",
            g.group, g.entries
        ));
        return Ok(check);
    }
    let groups: Vec<u32> = manifest
        .key_groups
        .iter()
        .filter(|g| g.file == f.name)
        .map(|g| g.group)
        .collect();
    let windows = blocks::plan_windows(manifest, groups, WINDOW_BYTES);
    let mut rx = blocks::read_windows(
        loc.store.clone(),
        loc.dir.clone(),
        manifest.clone(),
        windows,
    );
    while let Some(fetched) = rx.recv().await {
        let blocks = match fetched {
            Ok(b) => b,
            Err(e) => {
                check.problem = Some(e.to_string());
                return Ok(check);
            }
        };
        let m = manifest.clone();
        let s = *shape;
        let (s, result) = blocks::blocking(move || {
            let mut s = s;
            let r = check_blocks(&m, &blocks, &mut s);
            (s, r)
        })
        .await?;
        *shape = s;
        match result {
            Ok((n, keys, bytes)) => {
                check.blocks_checked += n;
                check.keys_checked += keys;
                check.bytes_checked += bytes;
                progress(check.bytes_checked);
            }
            Err(e) => {
                check.problem = Some(e.to_string());
                return Ok(check);
            }
        }
    }
    Ok(check)
}

/// Decodes and checks blocks; returns (blocks, keys, bytes) checked.
fn check_blocks(
    manifest: &Manifest,
    blocks: &[Block],
    shape: &mut Option<Shape>,
) -> Result<(u32, u64, u64)> {
    let (mut keys, mut bytes) = (0u64, 0u64);
    for b in blocks {
        check_block(manifest, b, shape)?;
        keys += b.entries;
        bytes += b.bytes.len() as u64;
    }
    Ok((blocks.len() as u32, keys, bytes))
}

/// Decodes one block and checks its header against the manifest and every key's group.
pub(crate) fn check_block(manifest: &Manifest, b: &Block, shape: &mut Option<Shape>) -> Result<()> {
    let codec = |source| ToolError::Block {
        file: b.file.to_string(),
        group: b.group,
        source,
    };
    let Some(entry) = manifest.group(b.group) else {
        return Ok(());
    };
    if manifest.state_schema == crate::job::PROGRAM_SCHEMA {
        // A program's block: decoded by the SDK, its group, key-group count and every key's
        // group checked (its step and states are the job's to check on restore).
        keyshift_sdk::block::check(&b.bytes, b.group, manifest.max_parallelism).map_err(
            |source| ToolError::ProgramBlock {
                file: b.file.to_string(),
                group: b.group,
                source,
            },
        )?;
        return Ok(());
    }
    let header = state_codec::decode_header(&b.bytes).map_err(codec)?;
    blocks::check_header(manifest, entry, &header, shape)?;
    let max_p = manifest.max_parallelism;
    let mut wrong: Option<(String, u32)> = None;
    state_codec::for_each_raw_entry(&b.bytes, |key, _| {
        if wrong.is_none() {
            let actual = key.key_group(max_p);
            if actual != b.group {
                wrong = Some((key.to_key().to_string(), actual));
            }
        }
        Ok(())
    })
    .map_err(codec)?;
    if let Some((key, actual)) = wrong {
        return Err(ToolError::KeyInWrongGroup {
            file: b.file.to_string(),
            group: b.group,
            key,
            actual,
            max_parallelism: max_p,
        });
    }
    Ok(())
}

/// Objects in the snapshot directory the manifest does not name.
async fn stray_objects(loc: &SnapshotLocation, manifest: &Manifest) -> Result<Vec<String>> {
    let known: BTreeSet<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
    let listed: Vec<object_store::ObjectMeta> = loc
        .store
        .list(Some(&loc.dir))
        .try_collect()
        .await
        .map_err(|e| SnapshotError::store("list", &loc.dir, e))?;
    Ok(listed
        .into_iter()
        .filter(|m| !is_manifest(&loc.dir, &m.location))
        .filter(|m| {
            m.location.prefix_match(&loc.dir).and_then(|mut parts| {
                let first = parts.next()?;
                parts
                    .next()
                    .is_none()
                    .then(|| known.contains(first.as_ref()))
            }) != Some(true)
        })
        .map(|m| {
            format!(
                "{} is not named by the manifest (a leftover? it is ignored by restores)",
                m.location
            )
        })
        .collect())
}
