//! Turning the URLs users type into a store, a snapshot directory and (when the URL follows the
//! layout `STORAGE/NAMESPACE/JOB/{checkpoints/chk-<id>,savepoints/sp-<id>}`) the job directory.

use super::error::Result;
use crate::snapshot::{
    MANIFEST_FILE, ObjectStore, Path, SnapshotError, SnapshotKind, manifest_path, open_store,
    parse_snapshot_dir_name,
};
use object_store::ObjectStoreExt;
use std::path::PathBuf;
use std::sync::Arc;

/// A snapshot directory as named by a URL.
#[derive(Debug, Clone)]
pub struct SnapshotLocation {
    /// The URL as given.
    pub url: String,
    /// The store holding it.
    pub store: Arc<dyn ObjectStore>,
    /// The snapshot directory inside the store.
    pub dir: Path,
    /// The job directory inside the store, when the URL follows the layout.
    pub job_dir: Option<Path>,
    /// Kind and id from the directory name (`chk-<id>`, `sp-<id>`), when it follows the layout.
    pub named: Option<(SnapshotKind, u64)>,
}

impl SnapshotLocation {
    /// The snapshot directory relative to its job directory (`savepoints/sp-7`), if known.
    pub fn relative(&self) -> Option<String> {
        let (kind, id) = self.named?;
        Some(kind.relative_dir(id))
    }

    /// Whether the manifest exists (the snapshot is committed).
    pub async fn is_committed(&self) -> Result<bool> {
        let path = manifest_path(&self.dir);
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(source) => Err(SnapshotError::Store {
                op: "head",
                path: path.to_string(),
                source,
            }
            .into()),
        }
    }

    /// The URL of a file of the snapshot, for messages.
    pub fn file_url(&self, name: &str) -> String {
        format!("{}/{name}", self.url.trim_end_matches('/'))
    }
}

/// Splits `.../<job>/checkpoints/chk-<id>` (or `savepoints/sp-<id>`) into the job URL, the kind and
/// the id. Trailing slashes are ignored.
pub fn split_snapshot_url(url: &str) -> Option<(String, SnapshotKind, u64)> {
    let trimmed = url.trim().trim_end_matches('/');
    let (rest, name) = trimmed.rsplit_once('/')?;
    let (job, folder) = rest.rsplit_once('/')?;
    let kind = [SnapshotKind::Checkpoint, SnapshotKind::Savepoint]
        .into_iter()
        .find(|k| k.folder() == folder)?;
    let id = parse_snapshot_dir_name(kind, name)?;
    // The job part must still name a location (not just `file:/` or `s3:/`).
    let after_scheme = job.split_once("://").map_or(job, |(_, r)| r);
    if after_scheme.trim_matches('/').is_empty() && !job.starts_with('/') {
        return None;
    }
    Some((job.to_owned(), kind, id))
}

/// The local directory of a `file://` URL or a bare absolute path (`None` for other stores).
pub(crate) fn local_dir(url: &str) -> Option<PathBuf> {
    let url = url.trim();
    if url.starts_with('/') {
        return Some(PathBuf::from(url));
    }
    if !url.starts_with("file:") {
        return None;
    }
    url::Url::parse(url).ok()?.to_file_path().ok()
}

/// Opens the snapshot directory a URL names, to read it. A local (`file://`) directory that does
/// not exist is reported as a missing snapshot rather than created.
///
/// When the URL follows the layout, the store is opened at the job directory so the tools can also
/// see the job's other snapshots (and messages name paths such as
/// `savepoints/sp-7/state-0-of-4.bin`); otherwise at the URL itself.
pub fn open_location(url: &str) -> Result<SnapshotLocation> {
    if let Some(dir) = local_dir(url)
        && !dir.is_dir()
    {
        return Err(SnapshotError::ManifestMissing {
            path: format!("{}/{MANIFEST_FILE}", url.trim().trim_end_matches('/')),
        }
        .into());
    }
    open_location_for_write(url)
}

/// Opens the snapshot directory a URL names, to write it (a local directory is created).
pub fn open_location_for_write(url: &str) -> Result<SnapshotLocation> {
    if let Some((job_url, kind, id)) = split_snapshot_url(url)
        && let Ok((store, job_dir)) = open_store(&job_url)
    {
        let dir = crate::snapshot::snapshot_dir(&job_dir, kind, id);
        return Ok(SnapshotLocation {
            url: url.trim().trim_end_matches('/').to_owned(),
            store,
            dir,
            job_dir: Some(job_dir),
            named: Some((kind, id)),
        });
    }
    let (store, dir) = open_store(url)?;
    Ok(SnapshotLocation {
        url: url.trim().trim_end_matches('/').to_owned(),
        store,
        dir,
        job_dir: None,
        named: None,
    })
}

/// Whether an object path inside a snapshot directory is its manifest.
pub(crate) fn is_manifest(dir: &Path, path: &Path) -> bool {
    path.prefix_match(dir)
        .map(|mut parts| {
            parts.next().is_some_and(|p| p.as_ref() == MANIFEST_FILE) && parts.next().is_none()
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_layout_urls() {
        assert_eq!(
            split_snapshot_url("s3://b/pre/ns/job/savepoints/sp-7/"),
            Some(("s3://b/pre/ns/job".into(), SnapshotKind::Savepoint, 7))
        );
        assert_eq!(
            split_snapshot_url("file:///var/x/ns/job/checkpoints/chk-12"),
            Some(("file:///var/x/ns/job".into(), SnapshotKind::Checkpoint, 12))
        );
        assert_eq!(
            split_snapshot_url("/abs/ns/j/savepoints/sp-1"),
            Some(("/abs/ns/j".into(), SnapshotKind::Savepoint, 1))
        );
        assert_eq!(split_snapshot_url("s3://b/ns/job/savepoints/chk-7"), None);
        assert_eq!(split_snapshot_url("s3://b/ns/job/other/sp-7"), None);
        assert_eq!(split_snapshot_url("s3://b/ns/job/savepoints/sp-x"), None);
        assert_eq!(split_snapshot_url("file:///checkpoints/chk-1"), None);
        assert_eq!(split_snapshot_url("sp-1"), None);
    }

    #[test]
    fn reading_a_missing_local_dir_does_not_create_it() {
        let tmp = tempfile::tempdir().unwrap();
        let url = format!("file://{}/ns/job/savepoints/sp-1", tmp.path().display());
        let err = open_location(&url).unwrap_err().to_string();
        assert!(err.contains("sp-1/_manifest.json not found"), "{err}");
        assert!(!tmp.path().join("ns").exists());
        open_location_for_write(&url).unwrap();
        assert!(tmp.path().join("ns/job").is_dir());
        assert_eq!(local_dir("/a/b"), Some(PathBuf::from("/a/b")));
        assert_eq!(local_dir("s3://b/x"), None);
    }

    #[test]
    fn opens_memory_locations() {
        let loc = open_location("memory://loc-test/pre/ns/job/savepoints/sp-3").unwrap();
        assert_eq!(loc.dir.as_ref(), "pre/ns/job/savepoints/sp-3");
        assert_eq!(loc.job_dir.as_ref().unwrap().as_ref(), "pre/ns/job");
        assert_eq!(loc.relative().as_deref(), Some("savepoints/sp-3"));
        assert!(is_manifest(&loc.dir, &manifest_path(&loc.dir)));
        assert!(!is_manifest(
            &loc.dir,
            &loc.dir.clone().join("state-0-of-1.bin")
        ));
        let loc = open_location("memory://loc-test/anywhere").unwrap();
        assert_eq!(loc.dir.as_ref(), "anywhere");
        assert!(loc.job_dir.is_none() && loc.named.is_none());
    }
}
