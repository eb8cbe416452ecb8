//! The in-use marker `<storage>/<namespace>/<job>/_in_use.json`: the snapshots a job's operator
//! pins (a `spec.restoreFrom`, a rescale's savepoint), which neither checkpoint retention
//! ([`super::retain`]) nor `keyshift savepoint dispose` deletes. Its contract (format, writer,
//! readers) is in `crate::offline::retention`'s module docs.

use super::error::{Result, SnapshotError};
use super::layout::SnapshotKind;
use jiff::Timestamp;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

/// The in-use marker's file name in the job directory.
pub const IN_USE_FILE: &str = "_in_use.json";
/// The marker format this build reads and writes.
pub const IN_USE_FORMAT_VERSION: u32 = 1;

/// One pinned snapshot in the in-use marker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InUseEntry {
    /// `checkpoints/chk-<id>` or `savepoints/sp-<id>`, relative to the job directory.
    pub path: String,
    /// Who pins it (free text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Why (free text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The in-use marker `<job>/_in_use.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InUseMarker {
    /// Always [`IN_USE_FORMAT_VERSION`].
    pub format_version: u32,
    /// The pinned snapshots.
    #[serde(default)]
    pub snapshots: Vec<InUseEntry>,
    /// When the writer last updated it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

impl InUseMarker {
    /// A marker pinning the given snapshots.
    pub fn new(snapshots: Vec<InUseEntry>) -> Self {
        InUseMarker {
            format_version: IN_USE_FORMAT_VERSION,
            snapshots,
            updated_at: Some(Timestamp::now()),
        }
    }

    /// The entries naming `relative` (`savepoints/sp-7`).
    pub fn pins<'a>(&'a self, relative: &'a str) -> impl Iterator<Item = &'a InUseEntry> + 'a {
        self.snapshots
            .iter()
            .filter(move |e| e.path.trim_matches('/') == relative)
    }

    /// Whether snapshot `id` of `kind` is pinned.
    pub fn pins_snapshot(&self, kind: SnapshotKind, id: u64) -> bool {
        let relative = kind.relative_dir(id);
        self.pins(&relative).next().is_some()
    }
}

fn marker_path(job_dir: &Path) -> Path {
    job_dir.clone().join(IN_USE_FILE)
}

/// Reads the in-use marker of the job in `job_dir` (`None` when there is none); one that does
/// not parse, or of another format, is [`SnapshotError::InUseMarkerCorrupt`].
pub async fn read_in_use(store: &dyn ObjectStore, job_dir: &Path) -> Result<Option<InUseMarker>> {
    let path = marker_path(job_dir);
    let bytes = match async { store.get(&path).await?.bytes().await }.await {
        Ok(b) => b,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(SnapshotError::store("read", &path, e)),
    };
    let corrupt = |reason: String| SnapshotError::InUseMarkerCorrupt {
        path: path.to_string(),
        reason,
    };
    let marker: InUseMarker = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if marker.format_version != IN_USE_FORMAT_VERSION {
        return Err(corrupt(format!(
            "formatVersion {} is not {IN_USE_FORMAT_VERSION}",
            marker.format_version
        )));
    }
    Ok(Some(marker))
}

/// Writes (replaces) the in-use marker of the job in `job_dir`.
pub async fn write_in_use(
    store: &dyn ObjectStore,
    job_dir: &Path,
    marker: &InUseMarker,
) -> Result<()> {
    let path = marker_path(job_dir);
    let json =
        serde_json::to_vec_pretty(marker).map_err(|e| SnapshotError::InUseMarkerCorrupt {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
    store
        .put(&path, PutPayload::from(json))
        .await
        .map_err(|e| SnapshotError::store("write", &path, e))?;
    Ok(())
}
