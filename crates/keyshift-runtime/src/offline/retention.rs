//! `keyshift savepoint list` and `dispose`, and the in-use marker contract.
//!
//! # What a job "still needs"
//!
//! Offline, a committed snapshot is in use when any of these holds:
//!
//! 1. it is the job's **newest committed checkpoint** (highest id): a `last-state` restart or a
//!    crash recovery restores from it;
//! 2. it is the job's **newest committed snapshot of either kind** by completion time: a restart
//!    after an upgrade or rescale restores from the savepoint just taken;
//! 3. it is listed in the job's **in-use marker** (below).
//!
//! `dispose` refuses such a snapshot unless `--force` is given; it also refuses when the marker
//! exists but cannot be read (it cannot tell, so it does not guess).
//!
//! # The in-use marker: `<storage>/<namespace>/<job>/_in_use.json`
//!
//! Written by whoever restores or pins snapshots (the operator for `spec.restoreFrom` and during a
//! rescale; a worker never writes it), read by `dispose` (and shown by `list`) and by checkpoint
//! retention, which keeps what it pins and deletes no committed checkpoint while it cannot be
//! read. The writer replaces the whole object (a plain put; the operator is the single writer, under its leader lease):
//!
//! ```json
//! {
//!   "formatVersion": 1,
//!   "snapshots": [
//!     {"path": "savepoints/sp-7", "holder": "operator", "reason": "spec.restoreFrom of default/clicks"},
//!     {"path": "checkpoints/chk-42", "holder": "operator", "reason": "rescale 4 -> 6 in progress"}
//!   ],
//!   "updatedAt": "2025-01-02T03:04:05Z"
//! }
//! ```
//!
//! - `path`: the snapshot directory **relative to the job directory**, `checkpoints/chk-<id>` or
//!   `savepoints/sp-<id>` (leading/trailing slashes are ignored). Required.
//! - `holder`, `reason`: free text shown in messages. Optional.
//! - `updatedAt`: optional, informational.
//! - Unknown fields are ignored; a `formatVersion` other than 1 makes the marker unreadable (so
//!   `dispose` refuses). An absent marker means "nothing pinned"; an empty `snapshots` list too.
//!
//! [`read_in_use`] and [`write_in_use`] implement both sides.
//!
//! # Disposal order
//!
//! The manifest is deleted first (from then on the snapshot no longer exists, so nothing can start
//! restoring it), then every other object under the directory; then the directory is listed again
//! and must be empty. An interrupted disposal leaves an uncommitted directory, which `dispose`
//! (with `--force`) or checkpoint retention cleans up.

use super::error::{Result, ToolError};
use super::location::{SnapshotLocation, is_manifest, open_location};
pub use crate::snapshot::{
    IN_USE_FILE, IN_USE_FORMAT_VERSION, InUseEntry, InUseMarker, read_in_use, write_in_use,
};
use crate::snapshot::{
    Manifest, ObjectStore, Path, SnapshotError, SnapshotKind, manifest_path, open_store,
    parse_snapshot_dir_name, read_manifest,
};
use futures::{StreamExt, TryStreamExt};
use jiff::Timestamp;
use object_store::ObjectStoreExt;
use serde::Serialize;

/// One snapshot of a job, as listed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Listed {
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// The id (from the directory name).
    pub id: u64,
    /// `checkpoints/chk-<id>` or `savepoints/sp-<id>`.
    pub path: String,
    /// The snapshot's URL.
    pub url: String,
    /// When it was completed (absent when the manifest is unreadable).
    pub completed_at: Option<Timestamp>,
    /// Parallelism.
    pub parallelism: Option<u32>,
    /// Key-group count.
    pub max_parallelism: Option<u32>,
    /// State bytes.
    pub bytes: Option<u64>,
    /// Keys.
    pub keys: Option<u64>,
    /// Why the job still needs it (empty: it may be disposed of).
    pub in_use: Vec<InUseReason>,
    /// Why the manifest could not be read, if it could not.
    pub error: Option<String>,
}

/// Why a job still needs a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InUseReason {
    /// `newestCheckpoint`, `newestSnapshot` or `marker`.
    pub rule: &'static str,
    /// The explanation.
    pub detail: String,
}

/// A job's committed snapshots and what pins them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobListing {
    /// The job URL.
    pub url: String,
    /// Checkpoints by id, then savepoints by id.
    pub snapshots: Vec<Listed>,
    /// Why the in-use marker could not be read, if it could not.
    pub marker_error: Option<String>,
}

/// Lists the committed snapshots (those with a manifest) of the job stored at `job_url`
/// (`STORAGE/NAMESPACE/JOB`), with what pins each. Unreadable manifests are listed with their
/// error rather than failing the listing.
pub async fn list_job(job_url: &str) -> Result<JobListing> {
    if let Some(dir) = super::location::local_dir(job_url)
        && !dir.is_dir()
    {
        // Nothing there; do not create the directory just to list it.
        return Ok(JobListing {
            url: job_url.trim().trim_end_matches('/').to_owned(),
            snapshots: Vec::new(),
            marker_error: None,
        });
    }
    let (store, job_dir) = open_store(job_url)?;
    list_in(
        store.as_ref(),
        &job_dir,
        job_url.trim().trim_end_matches('/'),
    )
    .await
}

async fn list_in(store: &dyn ObjectStore, job_dir: &Path, job_url: &str) -> Result<JobListing> {
    let mut snapshots = Vec::new();
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        let folder = job_dir.clone().join(kind.folder());
        let listing = match store.list_with_delimiter(Some(&folder)).await {
            Ok(l) => l.common_prefixes,
            Err(object_store::Error::NotFound { .. }) => Vec::new(),
            Err(e) => return Err(SnapshotError::store("list", &folder, e).into()),
        };
        let mut dirs: Vec<(u64, Path)> = listing
            .into_iter()
            .filter_map(|p| Some((parse_snapshot_dir_name(kind, p.filename()?)?, p)))
            .collect();
        dirs.sort_by_key(|(id, _)| *id);
        let rows: Vec<Option<Listed>> = futures::stream::iter(dirs)
            .map(|(id, dir)| async move {
                let path = kind.relative_dir(id);
                let mut row = Listed {
                    kind,
                    id,
                    url: format!("{job_url}/{path}"),
                    path,
                    completed_at: None,
                    parallelism: None,
                    max_parallelism: None,
                    bytes: None,
                    keys: None,
                    in_use: Vec::new(),
                    error: None,
                };
                match read_manifest(store, &dir).await {
                    Ok(m) => fill(&mut row, &m),
                    Err(SnapshotError::ManifestMissing { .. }) => return Ok(None),
                    Err(e @ SnapshotError::Store { .. }) => return Err(e),
                    Err(e) => row.error = Some(e.to_string()),
                }
                Ok(Some(row))
            })
            .buffered(8)
            .try_collect()
            .await?;
        snapshots.extend(rows.into_iter().flatten());
    }
    let (marker, marker_error) = match read_in_use(store, job_dir).await {
        Ok(m) => (m, None),
        Err(SnapshotError::InUseMarkerCorrupt { path, reason }) => (
            None,
            Some(ToolError::MarkerCorrupt { path, reason }.to_string()),
        ),
        Err(e) => return Err(e.into()),
    };
    mark_in_use(&mut snapshots, marker.as_ref());
    Ok(JobListing {
        url: job_url.to_owned(),
        snapshots,
        marker_error,
    })
}

fn fill(row: &mut Listed, m: &Manifest) {
    row.completed_at = Some(m.completed_at);
    row.parallelism = Some(m.parallelism);
    row.max_parallelism = Some(m.max_parallelism);
    row.bytes = Some(m.stats.total_bytes);
    row.keys = Some(m.stats.total_keys);
}

/// Applies the "still needed" rules of the module docs.
fn mark_in_use(rows: &mut [Listed], marker: Option<&InUseMarker>) {
    let newest_checkpoint = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.kind == SnapshotKind::Checkpoint)
        .max_by_key(|(_, r)| r.id)
        .map(|(i, _)| i);
    let newest_any = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((r.completed_at?, r.kind == SnapshotKind::Checkpoint, r.id, i)))
        .max()
        .map(|(.., i)| i);
    for (i, row) in rows.iter_mut().enumerate() {
        if Some(i) == newest_checkpoint {
            row.in_use.push(InUseReason {
                rule: "newestCheckpoint",
                detail: "it is the job's newest checkpoint (a last-state restart or crash recovery restores from it)"
                    .to_owned(),
            });
        }
        if Some(i) == newest_any {
            row.in_use.push(InUseReason {
                rule: "newestSnapshot",
                detail: "it is the job's newest snapshot (a restart after an upgrade or rescale restores from it)"
                    .to_owned(),
            });
        }
        if let Some(m) = marker {
            for e in m.pins(&row.path) {
                row.in_use.push(InUseReason {
                    rule: "marker",
                    detail: format!(
                        "the in-use marker {IN_USE_FILE} lists it (holder: {}; reason: {})",
                        e.holder.as_deref().unwrap_or("unspecified"),
                        e.reason.as_deref().unwrap_or("unspecified")
                    ),
                });
            }
        }
    }
}

/// What `dispose` did (or, with `dry_run`, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DisposeReport {
    /// The snapshot URL.
    pub url: String,
    /// Whether a manifest was there (a committed snapshot).
    pub committed: bool,
    /// Objects deleted (or that would be), the manifest included.
    pub objects: usize,
    /// Bytes deleted (or that would be).
    pub bytes: u64,
    /// Reasons to keep it that `--force` overrode.
    pub forced_over: Vec<String>,
    /// Its files that other snapshots of the job still read (incremental checkpoints): kept
    /// (retention deletes them once no snapshot refers to them).
    pub kept_referenced: usize,
    /// Nothing was deleted.
    pub dry_run: bool,
}

/// Options of [`dispose`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DisposeOptions {
    /// Delete even when the job still needs it (or it is uncommitted, or the marker is unreadable).
    pub force: bool,
    /// Only report what would be deleted.
    pub dry_run: bool,
}

/// Disposes of the snapshot at `url` (a `.../checkpoints/chk-<id>` or `.../savepoints/sp-<id>`
/// directory): refuses one the job still needs (see the module docs) unless forced, then deletes
/// the manifest first and every other object after it.
pub async fn dispose(url: &str, opts: DisposeOptions) -> Result<DisposeReport> {
    let not_in_layout = || ToolError::NotSnapshotUrl {
        url: url.to_owned(),
        hint: ": dispose needs the job directory to tell whether the job still needs the snapshot",
    };
    if super::location::split_snapshot_url(url).is_none() {
        return Err(not_in_layout());
    }
    let loc = match open_location(url) {
        Err(ToolError::Snapshot(SnapshotError::ManifestMissing { .. })) => {
            return Err(ToolError::NothingThere {
                url: url.trim().trim_end_matches('/').to_owned(),
            });
        }
        other => other?,
    };
    let (Some(job_dir), Some(relative)) = (loc.job_dir.clone(), loc.relative()) else {
        return Err(not_in_layout());
    };
    let objects: Vec<object_store::ObjectMeta> = loc
        .store
        .list(Some(&loc.dir))
        .try_collect()
        .await
        .map_err(|e| SnapshotError::store("list", &loc.dir, e))?;
    let committed = loc.is_committed().await?;
    let mut forced_over = Vec::new();
    if !committed {
        if objects.is_empty() {
            return Err(ToolError::NothingThere { url: loc.url });
        }
        if !opts.force {
            return Err(ToolError::Uncommitted {
                url: loc.url,
                objects: objects.len(),
            });
        }
        forced_over.push("it is not committed (no manifest)".to_owned());
    } else {
        let job_url = loc
            .url
            .strip_suffix(&relative)
            .map(|s| s.trim_end_matches('/'))
            .unwrap_or_default()
            .to_owned();
        let listing = list_in(loc.store.as_ref(), &job_dir, &job_url).await?;
        let mut reasons: Vec<String> = listing
            .snapshots
            .iter()
            .find(|r| r.path == relative)
            .map(|r| r.in_use.iter().map(|u| u.detail.clone()).collect())
            .unwrap_or_default();
        if let Some(e) = listing.marker_error {
            reasons.push(e);
        }
        if !reasons.is_empty() {
            if !opts.force {
                return Err(ToolError::InUse {
                    url: loc.url,
                    reasons: reasons.join("; "),
                });
            }
            forced_over = reasons;
        }
    }
    // Files another snapshot of the job reads stay (incremental checkpoints).
    let leaving = std::collections::BTreeSet::from([&loc.dir]);
    let keep = crate::snapshot::referenced_files(loc.store.as_ref(), &job_dir, &leaving).await?;
    let (kept, objects): (Vec<_>, Vec<_>) = objects
        .into_iter()
        .partition(|m| keep.contains(&m.location));
    let report = DisposeReport {
        url: loc.url.clone(),
        committed,
        objects: objects.len(),
        bytes: objects.iter().map(|m| m.size).sum(),
        forced_over,
        kept_referenced: kept.len(),
        dry_run: opts.dry_run,
    };
    if opts.dry_run {
        return Ok(report);
    }
    delete_snapshot(&loc, objects, &keep).await?;
    Ok(report)
}

/// Deletes the manifest, then the other objects, then checks nothing is left.
async fn delete_snapshot(
    loc: &SnapshotLocation,
    objects: Vec<object_store::ObjectMeta>,
    keep: &std::collections::BTreeSet<Path>,
) -> Result<()> {
    let manifest = manifest_path(&loc.dir);
    match loc.store.delete(&manifest).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(SnapshotError::store("delete", &manifest, e).into()),
    }
    let rest: Vec<object_store::Result<Path>> = objects
        .into_iter()
        .filter(|m| !is_manifest(&loc.dir, &m.location))
        .map(|m| Ok(m.location))
        .collect();
    let results: Vec<_> = loc
        .store
        .delete_stream(futures::stream::iter(rest).boxed())
        .collect()
        .await;
    for r in results {
        match r {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(SnapshotError::store("delete", &loc.dir, e).into()),
        }
    }
    let left: Vec<object_store::ObjectMeta> = loc
        .store
        .list(Some(&loc.dir))
        .try_filter(|m| futures::future::ready(!keep.contains(&m.location)))
        .try_collect()
        .await
        .map_err(|e| SnapshotError::store("list", &loc.dir, e))?;
    if let Some(first) = left.first() {
        return Err(ToolError::NotDeleted {
            url: loc.url.clone(),
            remaining: left.len(),
            example: first.location.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kind: SnapshotKind, id: u64, secs: i64) -> Listed {
        let path = kind.relative_dir(id);
        Listed {
            kind,
            id,
            url: format!("x/{path}"),
            path,
            completed_at: Timestamp::from_second(secs).ok(),
            parallelism: Some(1),
            max_parallelism: Some(128),
            bytes: Some(0),
            keys: Some(0),
            in_use: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn newest_checkpoint_newest_snapshot_and_marker_are_in_use() {
        use SnapshotKind::*;
        let mut rows = vec![
            row(Checkpoint, 1, 10),
            row(Checkpoint, 2, 20),
            row(Savepoint, 1, 5),
            row(Savepoint, 2, 30),
            row(Savepoint, 3, 1),
        ];
        let marker: InUseMarker = serde_json::from_str(
            r#"{"formatVersion":1,"snapshots":[{"path":"/savepoints/sp-1/","reason":"restoreFrom"}],"extra":true}"#,
        )
        .unwrap();
        mark_in_use(&mut rows, Some(&marker));
        let used: Vec<(&str, usize)> = rows
            .iter()
            .map(|r| (r.path.as_str(), r.in_use.len()))
            .collect();
        assert_eq!(
            used,
            [
                ("checkpoints/chk-1", 0),
                ("checkpoints/chk-2", 1),
                ("savepoints/sp-1", 1),
                ("savepoints/sp-2", 1),
                ("savepoints/sp-3", 0),
            ]
        );
        assert!(rows[2].in_use[0].detail.contains("restoreFrom"));
        assert_eq!(rows[1].in_use[0].rule, "newestCheckpoint");
        assert_eq!(rows[3].in_use[0].rule, "newestSnapshot");
    }
}
