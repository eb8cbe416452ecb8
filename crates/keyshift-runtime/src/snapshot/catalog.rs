//! Listing a job's snapshots, finding the one a resume restores (and the next id), and deleting old
//! checkpoints.

use super::error::{Result, SnapshotError};
use super::in_use::read_in_use;
use super::layout::{
    SnapshotKind, file_path, job_dir, manifest_path, parse_snapshot_dir_name, snapshot_dir,
    snapshot_url,
};
use super::manifest::{JobIdentity, Manifest, is_referenced_file};
use super::reader::{check_files_present, open_snapshot, read_manifest};
use super::store::open_store;
use futures::{StreamExt, TryStreamExt};
use jiff::Timestamp;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use std::collections::{BTreeMap, BTreeSet};

/// Manifests read at once while listing.
const MANIFESTS_AT_ONCE: usize = 8;

/// A committed snapshot, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// The snapshot id.
    pub id: u64,
    /// Its directory in the store.
    pub dir: Path,
    /// When it was completed.
    pub completed_at: Timestamp,
    /// The parallelism it was taken at.
    pub parallelism: u32,
    /// The key-group count.
    pub max_parallelism: u32,
    /// Bytes of state (sum of the state files).
    pub total_bytes: u64,
    /// Keyed entries.
    pub total_keys: u64,
    /// The job (and state layout) the manifest records, so that a restore's checks need not
    /// read it again.
    pub job: JobIdentity,
}

impl SnapshotInfo {
    /// The summary of a manifest stored in `dir`.
    pub fn from_manifest(dir: Path, m: &Manifest) -> Self {
        SnapshotInfo {
            kind: m.kind,
            id: m.snapshot_id,
            dir,
            completed_at: m.completed_at,
            parallelism: m.parallelism,
            max_parallelism: m.max_parallelism,
            total_bytes: m.stats.total_bytes,
            total_keys: m.stats.total_keys,
            job: m.job.clone(),
        }
    }
}

/// The snapshot directories of one kind under `job_dir`, committed or not, by increasing id.
async fn snapshot_dirs(
    store: &dyn ObjectStore,
    job_dir: &Path,
    kind: SnapshotKind,
) -> Result<Vec<(u64, Path)>> {
    let folder = job_dir.clone().join(kind.folder());
    let listing = match store.list_with_delimiter(Some(&folder)).await {
        Ok(l) => l,
        Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(SnapshotError::store("list", &folder, e)),
    };
    let mut dirs: Vec<(u64, Path)> = listing
        .common_prefixes
        .into_iter()
        .filter_map(|p| {
            let id = parse_snapshot_dir_name(kind, p.filename()?)?;
            Some((id, p))
        })
        .collect();
    dirs.sort_by_key(|(id, _)| *id);
    Ok(dirs)
}

/// A snapshot directory whose manifest exists but cannot be used (corrupt, inconsistent, too
/// large). It is never deleted automatically: it is reported, and restores pass over it.
#[derive(Debug, Clone)]
pub struct UnreadableSnapshot {
    pub kind: SnapshotKind,
    pub id: u64,
    pub dir: Path,
    /// Why its manifest cannot be used.
    pub error: String,
}

/// A job's snapshots as found in storage: the committed ones, and those whose manifest cannot
/// be used.
#[derive(Debug, Clone, Default)]
pub struct SnapshotScan {
    /// Checkpoints by increasing id, then savepoints by increasing id.
    pub snapshots: Vec<SnapshotInfo>,
    /// In the same order.
    pub unreadable: Vec<UnreadableSnapshot>,
}

impl SnapshotScan {
    /// The snapshot a resume restores: the newest one under `max_parallelism` key groups (any
    /// count with `None`; snapshots taken before a restore from a rewritten savepoint have
    /// another count) whose id is above `replaced_up_to` (the job's snapshots at or below it hold
    /// the history a restore from `spec.restoreFrom` replaced), with the snapshots of the same
    /// history newer than it whose manifest cannot be used (passed over). Pure.
    pub fn newest(
        &self,
        max_parallelism: Option<u32>,
        replaced_up_to: Option<u64>,
    ) -> (Option<&SnapshotInfo>, Vec<&UnreadableSnapshot>) {
        let newest = self
            .newest_first(max_parallelism, replaced_up_to)
            .into_iter()
            .next();
        (newest, self.unreadable_above(newest, replaced_up_to))
    }

    /// The snapshots a resume may restore (see [`SnapshotScan::newest`]), newest first. Pure.
    pub fn newest_first(
        &self,
        max_parallelism: Option<u32>,
        replaced_up_to: Option<u64>,
    ) -> Vec<&SnapshotInfo> {
        let mut found: Vec<&SnapshotInfo> = self
            .snapshots
            .iter()
            .filter(|s| max_parallelism.is_none_or(|g| s.max_parallelism == g))
            .filter(|s| replaced_up_to.is_none_or(|b| s.id > b))
            .collect();
        found.sort_by_key(|s| std::cmp::Reverse(s.id));
        found
    }

    /// The snapshots whose manifest cannot be used above `chosen` (or above `replaced_up_to`
    /// when nothing is chosen): those a resume from `chosen` passes over. Pure.
    fn unreadable_above(
        &self,
        chosen: Option<&SnapshotInfo>,
        replaced_up_to: Option<u64>,
    ) -> Vec<&UnreadableSnapshot> {
        let floor = chosen.map(|s| s.id).or(replaced_up_to);
        self.unreadable
            .iter()
            .filter(|u| floor.is_none_or(|f| u.id > f))
            .collect()
    }
}

/// The snapshots of the job stored under `job_dir`: the committed ones (with a manifest) and
/// those whose manifest is corrupt, inconsistent or too large. Directories without a manifest
/// (aborted or in-progress snapshots) are left out; a store error, or a manifest of a format
/// this build does not read, is an error.
pub async fn scan_snapshots(store: &dyn ObjectStore, job_dir: &Path) -> Result<SnapshotScan> {
    let mut out = SnapshotScan::default();
    for (kind, id, dir, manifest) in read_manifests(store, job_dir).await? {
        match manifest {
            Ok(m) => out.snapshots.push(SnapshotInfo::from_manifest(dir, &m)),
            Err(SnapshotError::ManifestMissing { .. }) => {}
            Err(e) if e.is_bad_manifest() => out.unreadable.push(UnreadableSnapshot {
                kind,
                id,
                dir,
                error: e.to_string(),
            }),
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The committed snapshots (those with a manifest) of the job stored under `job_dir`:
/// checkpoints by increasing id, then savepoints by increasing id. Directories without a manifest
/// (aborted or in-progress snapshots) are left out; a manifest that cannot be read is an error
/// (see [`scan_snapshots`] to pass over it).
pub async fn list_snapshots(store: &dyn ObjectStore, job_dir: &Path) -> Result<Vec<SnapshotInfo>> {
    let mut out = Vec::new();
    for (_, _, dir, manifest) in read_manifests(store, job_dir).await? {
        match manifest {
            Ok(m) => out.push(SnapshotInfo::from_manifest(dir, &m)),
            Err(SnapshotError::ManifestMissing { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Every snapshot directory of the job under `job_dir` with the outcome of reading its
/// manifest: checkpoints by increasing id, then savepoints.
async fn read_manifests(
    store: &dyn ObjectStore,
    job_dir: &Path,
) -> Result<Vec<(SnapshotKind, u64, Path, Result<Manifest>)>> {
    let mut out = Vec::new();
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        let dirs = snapshot_dirs(store, job_dir, kind).await?;
        let found: Vec<_> = futures::stream::iter(dirs)
            .map(|(id, dir)| async move {
                let manifest = read_manifest(store, &dir).await;
                (kind, id, dir, manifest)
            })
            .buffered(MANIFESTS_AT_ONCE)
            .collect()
            .await;
        out.extend(found);
    }
    Ok(out)
}

/// The newest committed checkpoint of the job under `job_dir`, if any (reads manifests from the
/// highest id down until one exists).
pub async fn latest_checkpoint(
    store: &dyn ObjectStore,
    job_dir: &Path,
) -> Result<Option<SnapshotInfo>> {
    let dirs = snapshot_dirs(store, job_dir, SnapshotKind::Checkpoint).await?;
    for (_, dir) in dirs.into_iter().rev() {
        match read_manifest(store, &dir).await {
            Ok(m) => return Ok(Some(SnapshotInfo::from_manifest(dir, &m))),
            Err(SnapshotError::ManifestMissing { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// What [`retain`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetentionReport {
    /// Ids of the committed checkpoints kept, newest first.
    pub kept: Vec<u64>,
    /// Ids of the committed checkpoints deleted.
    pub deleted: Vec<u64>,
    /// Ids of checkpoint directories without a manifest (aborted checkpoints) that were deleted.
    pub orphans_deleted: Vec<u64>,
    /// Objects deleted in all.
    pub objects_deleted: usize,
    /// Ids of committed checkpoints whose manifest cannot be used: neither counted as kept nor
    /// deleted, newest first.
    pub unreadable_kept: Vec<u64>,
    /// Ids of committed checkpoints the job's in-use marker pins (a rescale's base, a
    /// `spec.restoreFrom`): kept beyond the newest `keep_newest`, newest first.
    pub pinned_kept: Vec<u64>,
    /// Why the in-use marker could not be read, if it could not: then no committed checkpoint
    /// was deleted (what it pins is unknown), only aborted ones.
    pub marker_error: Option<String>,
}

/// Deletes the committed checkpoints of the job under `job_dir` beyond the newest `keep_newest`
/// (at least 1 is always kept), and the checkpoint directories without a manifest whose id is below
/// the newest committed checkpoint (aborted checkpoints). Savepoints are never touched, and neither
/// are uncommitted directories newer than the newest checkpoint (they may be in progress).
///
/// A checkpoint's manifest is deleted first, then its files, so an interrupted deletion leaves an
/// orphan (cleaned up next time), never a snapshot that looks valid but lacks files. A file that
/// a kept snapshot (checkpoint or savepoint) reads from the deleted checkpoint's directory
/// (incremental checkpoints, [`referenced_files`]) stays; it goes with the orphan directory once
/// no kept snapshot refers to it.
///
/// A checkpoint the job's in-use marker ([`read_in_use`]) pins is kept too (and what it reads
/// from other checkpoints); while the marker cannot be read, no committed checkpoint is deleted.
pub async fn retain(
    store: &dyn ObjectStore,
    job_dir: &Path,
    keep_newest: usize,
) -> Result<RetentionReport> {
    let keep_newest = keep_newest.max(1);
    let mut report = RetentionReport::default();
    let marker = match read_in_use(store, job_dir).await {
        Ok(m) => m,
        Err(e @ SnapshotError::InUseMarkerCorrupt { .. }) => {
            report.marker_error = Some(e.to_string());
            None
        }
        Err(e) => return Err(e),
    };
    let pinned = |id: u64| {
        marker
            .as_ref()
            .is_some_and(|m| m.pins_snapshot(SnapshotKind::Checkpoint, id))
    };
    let dirs = snapshot_dirs(store, job_dir, SnapshotKind::Checkpoint).await?;
    // Committed = the manifest exists (readable or not: existence is what makes a snapshot).
    let committed: Vec<bool> = futures::stream::iter(&dirs)
        .map(|(_, dir)| async move {
            let path = manifest_path(dir);
            match store.head(&path).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(SnapshotError::store("head", &path, e)),
            }
        })
        .buffered(MANIFESTS_AT_ONCE)
        .try_collect()
        .await?;

    let newest_committed = dirs
        .iter()
        .zip(&committed)
        .rev()
        .find(|(_, c)| **c)
        .map(|((id, _), _)| *id);
    let Some(newest_committed) = newest_committed else {
        return Ok(report);
    };
    let mut committed_seen = 0usize;
    // Decide first, delete after: what is deleted must not hold a file that a snapshot kept
    // refers to (incremental checkpoints).
    let mut doomed: Vec<(u64, &Path, bool)> = Vec::new();
    for ((id, dir), is_committed) in dirs.iter().zip(&committed).rev() {
        if *is_committed {
            // Only usable checkpoints count towards the ones kept, and one whose manifest
            // cannot be used is never deleted (it is left for a person to look at): otherwise a
            // corrupt newest checkpoint would have the last good one deleted.
            match read_manifest(store, dir).await {
                Ok(_) => {}
                Err(e) if e.is_bad_manifest() => {
                    report.unreadable_kept.push(*id);
                    continue;
                }
                Err(SnapshotError::ManifestMissing { .. }) => continue,
                Err(e) => return Err(e),
            }
            if pinned(*id) {
                report.pinned_kept.push(*id);
                continue;
            }
            committed_seen += 1;
            if committed_seen <= keep_newest {
                report.kept.push(*id);
                continue;
            }
            if report.marker_error.is_some() {
                continue;
            }
            doomed.push((*id, dir, true));
        } else if *id < newest_committed {
            doomed.push((*id, dir, false));
        }
    }
    if doomed.is_empty() {
        return Ok(report);
    }
    let leaving: BTreeSet<&Path> = doomed
        .iter()
        .filter(|(_, _, committed)| *committed)
        .map(|(_, dir, _)| *dir)
        .collect();
    let kept_refs = referenced_files(store, job_dir, &leaving).await?;
    for (id, dir, is_committed) in doomed {
        if is_committed {
            // Manifest first: from here on the snapshot no longer exists.
            delete_object(store, &manifest_path(dir)).await?;
            report.objects_deleted += 1 + delete_unreferenced(store, dir, &kept_refs).await?;
            report.deleted.push(id);
        } else {
            report.objects_deleted += delete_unreferenced(store, dir, &kept_refs).await?;
            report.orphans_deleted.push(id);
        }
    }
    report.deleted.reverse();
    report.orphans_deleted.reverse();
    Ok(report)
}

/// Every file that a committed snapshot of the job under `job_dir` (other than those in
/// `leaving`) reads from another snapshot's directory (incremental checkpoints), as store
/// paths. Those files must stay while such a snapshot is kept, even when the snapshot that
/// wrote them is deleted. Manifests that cannot be used are passed over (their snapshots
/// cannot be restored anyway); a store error is an error.
pub async fn referenced_files(
    store: &dyn ObjectStore,
    job_dir: &Path,
    leaving: &BTreeSet<&Path>,
) -> Result<BTreeSet<Path>> {
    let mut out = BTreeSet::new();
    for (_, _, dir, manifest) in read_manifests(store, job_dir).await? {
        if leaving.contains(&dir) {
            continue;
        }
        match manifest {
            Ok(m) => {
                for f in m.files.iter().filter(|f| is_referenced_file(&f.name)) {
                    out.insert(file_path(&dir, &f.name));
                }
            }
            Err(SnapshotError::ManifestMissing { .. }) => {}
            Err(e) if e.is_bad_manifest() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Deletes every object under `dir` but those in `keep`; returns how many it deleted.
pub async fn delete_unreferenced(
    store: &dyn ObjectStore,
    dir: &Path,
    keep: &BTreeSet<Path>,
) -> Result<usize> {
    let keep = keep.clone();
    let locations = store
        .list(Some(dir))
        .map_ok(|m| m.location)
        .try_filter(move |p| futures::future::ready(!keep.contains(p)))
        .boxed();
    let results: Vec<_> = store.delete_stream(locations).collect().await;
    let mut deleted = 0;
    for r in results {
        match r {
            Ok(_) => deleted += 1,
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(SnapshotError::store("delete", dir, e)),
        }
    }
    Ok(deleted)
}

async fn delete_object(store: &dyn ObjectStore, path: &Path) -> Result<()> {
    match store.delete(path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(SnapshotError::store("delete", path, e)),
    }
}

// Discovery: which snapshots a job has, which one a resume restores, what a restoreFrom names.

/// One more than the largest snapshot id in the job's storage (checkpoints and savepoints,
/// committed or not, so an id is never reused).
pub async fn next_snapshot_id(store: &dyn ObjectStore, job_dir: &Path) -> Result<u64> {
    Ok(snapshot_ids(store, job_dir)
        .await?
        .first()
        .map_or(1, |(id, _)| id + 1))
}

/// Every snapshot directory of the job (checkpoints and savepoints, committed or not), newest
/// (largest id) first.
pub async fn snapshot_ids(
    store: &dyn ObjectStore,
    job_dir: &Path,
) -> Result<Vec<(u64, SnapshotKind)>> {
    let mut ids = Vec::new();
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        let prefix = job_dir.clone().join(kind.folder());
        let listing = store
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(|e| SnapshotError::store("list", &prefix, e))?;
        ids.extend(listing.common_prefixes.iter().filter_map(|dir| {
            dir.filename()
                .and_then(|n| parse_snapshot_dir_name(kind, n))
                .map(|id| (id, kind))
        }));
    }
    ids.sort_unstable_by(|a, b| b.cmp(a));
    Ok(ids)
}

/// Whether snapshot `id` of the job is committed (its manifest exists).
pub async fn is_committed(
    store: &dyn ObjectStore,
    job_dir: &Path,
    kind: SnapshotKind,
    id: u64,
) -> Result<bool> {
    let path = manifest_path(&snapshot_dir(job_dir, kind, id));
    match store.head(&path).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(SnapshotError::store("head", &path, e)),
    }
}

/// The key-group count and the job identity of the snapshot named by a spec.restoreFrom `url`
/// (from its manifest) of a job in `namespace` with snapshots in `storage`, or why it cannot be
/// restored from.
pub async fn restore_source(
    url: &str,
    storage: &str,
    namespace: &str,
) -> Result<(u32, JobIdentity), String> {
    match open_snapshot(url).await {
        Ok((_, _, m)) => Ok((m.max_parallelism, m.job)),
        // The storage's words about a path outside this namespace's own storage could tell a
        // tenant about another's: they go to the operator's log only.
        Err(e) if !url.starts_with(&format!("{}/{namespace}/", storage.trim_end_matches('/'))) => {
            tracing::warn!(%url, error = %e, "spec.restoreFrom cannot be read");
            Err(format!(
                "spec.restoreFrom {url} cannot be restored: it is not a committed snapshot this job can read (the storage's error is in the operator's log, as the URL is outside this namespace's storage); point it at a committed savepoint or checkpoint directory (one holding _manifest.json), or remove it"
            ))
        }
        Err(e) => Err(format!(
            "spec.restoreFrom {url} cannot be restored: {e}; point it at a committed savepoint or checkpoint directory (one holding _manifest.json), or remove it"
        )),
    }
}

/// The newest snapshot of a job that a resume can restore, and the newer ones it passed over.
#[derive(Debug, Clone, Default)]
pub struct Newest {
    /// Its URL and summary (with the job identity its manifest records).
    pub found: Option<(String, SnapshotInfo)>,
    /// Snapshots of the same history newer than it whose manifest cannot be used (never
    /// deleted; the caller reports them).
    pub skipped: Vec<UnreadableSnapshot>,
}

/// The newest committed snapshot (checkpoint or savepoint, by id) of a job that can be restored,
/// taken under `max_parallelism` key groups (any, with `None`: after a restore from a rewritten
/// savepoint the job's older snapshots have the old key-group count and can no longer be
/// restored by it) and above `replaced_up_to` (see `status.replacedHistoryUpTo`). A snapshot
/// whose manifest is corrupt, inconsistent or too large, or one of whose state files (its own or
/// one of an earlier checkpoint it reads) is missing or of another size, is passed over (and
/// named in [`Newest::skipped`], newest first, with why), never an error: what every resume,
/// adoption and `keyshift local` start asks, in one place ([`SnapshotScan::newest_first`],
/// [`check_files_present`]). A store error is an error (it says nothing about the snapshot).
pub async fn newest_snapshot(
    storage: &str,
    namespace: &str,
    job: &str,
    max_parallelism: Option<u32>,
    replaced_up_to: Option<u64>,
) -> Result<Newest> {
    newest_snapshot_except(
        storage,
        namespace,
        job,
        max_parallelism,
        replaced_up_to,
        &BTreeMap::new(),
    )
    .await
}

/// [`newest_snapshot`], passing over the snapshots in `unrestorable` too (by URL, with why:
/// those a restore found it cannot restore, such as a block that does not match its checksum,
/// which no listing can tell).
pub async fn newest_snapshot_except(
    storage: &str,
    namespace: &str,
    job: &str,
    max_parallelism: Option<u32>,
    replaced_up_to: Option<u64>,
    unrestorable: &BTreeMap<String, String>,
) -> Result<Newest> {
    let (store, base) = open_store(storage)?;
    let job_dir = job_dir(&base, namespace, job);
    let scan = scan_snapshots(store.as_ref(), &job_dir).await?;
    let mut lacking = Vec::new();
    let mut found = None;
    for info in scan.newest_first(max_parallelism, replaced_up_to) {
        let url = snapshot_url(storage, namespace, job, info.kind, info.id);
        if let Some(why) = unrestorable.get(&url) {
            lacking.push(UnreadableSnapshot {
                kind: info.kind,
                id: info.id,
                dir: info.dir.clone(),
                error: why.clone(),
            });
            continue;
        }
        match restorable(store.as_ref(), &info.dir).await {
            Ok(()) => {
                found = Some(info);
                break;
            }
            Err(e) if e.is_unrestorable() => lacking.push(UnreadableSnapshot {
                kind: info.kind,
                id: info.id,
                dir: info.dir.clone(),
                error: e.to_string(),
            }),
            Err(e) => return Err(e),
        }
    }
    let mut skipped: Vec<UnreadableSnapshot> = scan
        .unreadable_above(found, replaced_up_to)
        .into_iter()
        .cloned()
        .chain(lacking)
        .collect();
    skipped.sort_by_key(|u| std::cmp::Reverse(u.id));
    Ok(Newest {
        found: found.map(|s| {
            (
                snapshot_url(storage, namespace, job, s.kind, s.id),
                s.clone(),
            )
        }),
        skipped,
    })
}

/// Whether the committed snapshot in `dir` can be restored as far as can be told without
/// reading its state: its manifest reads and every file it names is there at its size.
async fn restorable(store: &dyn ObjectStore, dir: &Path) -> Result<()> {
    let manifest = read_manifest(store, dir).await?;
    check_files_present(store, dir, &manifest).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_skips_other_key_group_counts_replaced_history_and_passes_over_bad_ones() {
        let job = JobIdentity {
            namespace: "ns".into(),
            name: "j".into(),
            job_fingerprint: String::new(),
            layout: None,
        };
        let snap = |id: u64, groups: u32| SnapshotInfo {
            kind: SnapshotKind::Checkpoint,
            id,
            dir: format!("ns/j/checkpoints/chk-{id}").into(),
            completed_at: Timestamp::now(),
            parallelism: 2,
            max_parallelism: groups,
            total_bytes: 0,
            total_keys: 0,
            job: job.clone(),
        };
        let bad = |id: u64| UnreadableSnapshot {
            kind: SnapshotKind::Savepoint,
            id,
            dir: format!("ns/j/savepoints/sp-{id}").into(),
            error: "corrupt".into(),
        };
        let scan = SnapshotScan {
            snapshots: vec![snap(3, 128), snap(5, 128), snap(6, 1024), snap(4, 128)],
            unreadable: vec![bad(2), bad(7)],
        };
        let pick = |g, after| {
            let (newest, skipped) = scan.newest(g, after);
            (
                newest.map(|s| s.id),
                skipped.iter().map(|u| u.id).collect::<Vec<_>>(),
            )
        };
        assert_eq!(pick(Some(128), None), (Some(5), vec![7]));
        assert_eq!(pick(Some(1024), None), (Some(6), vec![7]));
        assert_eq!(pick(None, None), (Some(6), vec![7]));
        // Restored from spec.restoreFrom when the newest id was 5: 3, 4 and 5 are the old
        // history; until a new snapshot commits there is nothing of the job's own to resume.
        assert_eq!(pick(Some(128), Some(5)), (None, vec![7]));
        assert_eq!(pick(Some(128), Some(4)), (Some(5), vec![7]));
        assert_eq!(pick(Some(512), None), (None, vec![2, 7]));
        assert_eq!(pick(Some(512), Some(7)), (None, vec![]));
    }
}
