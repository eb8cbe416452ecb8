//! Where things live in the store (`docs/architecture.md` §6). Pure: names and paths only.
//!
//! ```text
//! <storage prefix>/<namespace>/<job>/
//!     checkpoints/chk-<id>/_manifest.json
//!     checkpoints/chk-<id>/state-<subtask>-of-<parallelism>.bin
//!     savepoints/sp-<id>/_manifest.json
//!     savepoints/sp-<id>/state-<subtask>-of-<parallelism>.bin
//! ```

use object_store::path::Path;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The manifest's file name inside a snapshot directory.
pub const MANIFEST_FILE: &str = "_manifest.json";
/// The folder of a job's checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The folder of a job's savepoints.
pub const SAVEPOINTS_DIR: &str = "savepoints";

/// Whether a snapshot is a periodic checkpoint (retained by count) or a savepoint (kept until the
/// user disposes of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// Taken periodically; old ones are deleted by [`retain`](super::retain).
    Checkpoint,
    /// Taken on demand (and before a rescale or upgrade); never deleted automatically.
    Savepoint,
}

impl SnapshotKind {
    /// The folder under the job directory holding snapshots of this kind.
    pub fn folder(self) -> &'static str {
        match self {
            SnapshotKind::Checkpoint => CHECKPOINTS_DIR,
            SnapshotKind::Savepoint => SAVEPOINTS_DIR,
        }
    }

    /// The directory-name prefix of this kind (`chk-` / `sp-`).
    pub fn dir_prefix(self) -> &'static str {
        match self {
            SnapshotKind::Checkpoint => "chk-",
            SnapshotKind::Savepoint => "sp-",
        }
    }

    /// Snapshot `id`'s directory relative to its job directory: `checkpoints/chk-<id>` or
    /// `savepoints/sp-<id>` (the in-use marker's and the listings' paths).
    pub fn relative_dir(self, id: u64) -> String {
        format!("{}/{}{id}", self.folder(), self.dir_prefix())
    }
}

impl fmt::Display for SnapshotKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SnapshotKind::Checkpoint => "checkpoint",
            SnapshotKind::Savepoint => "savepoint",
        })
    }
}

/// `<base>/<namespace>/<job>`: everything keyshift stores for one job.
pub fn job_dir(base: &Path, namespace: &str, job: &str) -> Path {
    base.clone().join(namespace).join(job)
}

/// `<job_dir>/checkpoints/chk-<id>` or `<job_dir>/savepoints/sp-<id>`.
pub fn snapshot_dir(job_dir: &Path, kind: SnapshotKind, id: u64) -> Path {
    job_dir
        .clone()
        .join(kind.folder())
        .join(format!("{}{id}", kind.dir_prefix()).as_str())
}

/// The manifest of the snapshot in `dir`.
pub fn manifest_path(dir: &Path) -> Path {
    dir.clone().join(MANIFEST_FILE)
}

/// The state file a subtask writes: `state-<subtask>-of-<parallelism>.bin`.
pub fn state_file_name(subtask: u32, parallelism: u32) -> String {
    format!("state-{subtask}-of-{parallelism}.bin")
}

/// Where the file a manifest in `dir` names lies: a plain name in `dir` itself; a file of another
/// snapshot of the job (`checkpoints/chk-<id>/<file>`, incremental checkpoints) relative to the
/// job directory, the parent of `dir`'s parent.
pub fn file_path(dir: &Path, name: &str) -> Path {
    if !name.contains('/') {
        return dir.clone().join(name);
    }
    let parts: Vec<_> = dir.parts().collect();
    let job = parts.len().saturating_sub(2);
    let mut path: Path = parts.into_iter().take(job).collect();
    for part in name.split('/') {
        path = path.join(part);
    }
    path
}

/// Reads the id out of a snapshot directory name of the given kind (`chk-17` -> 17).
pub fn parse_snapshot_dir_name(kind: SnapshotKind, name: &str) -> Option<u64> {
    let digits = name.strip_prefix(kind.dir_prefix())?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The URL of everything keyshift stores for one job under a storage root (no trailing `/`).
pub fn job_url(storage: &str, namespace: &str, job: &str) -> String {
    format!("{}/{namespace}/{job}", storage.trim_end_matches('/'))
}

/// The URL of a snapshot directory under a storage root.
pub fn snapshot_url(
    storage: &str,
    namespace: &str,
    job: &str,
    kind: SnapshotKind,
    id: u64,
) -> String {
    format!(
        "{}/{}/{}{id}",
        job_url(storage, namespace, job),
        kind.folder(),
        kind.dir_prefix()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let base = Path::from("bucket-prefix/keyshift");
        let job = job_dir(&base, "team-a", "clicks");
        assert_eq!(job.as_ref(), "bucket-prefix/keyshift/team-a/clicks");
        let chk = snapshot_dir(&job, SnapshotKind::Checkpoint, 42);
        assert_eq!(
            chk.as_ref(),
            "bucket-prefix/keyshift/team-a/clicks/checkpoints/chk-42"
        );
        let sp = snapshot_dir(&job, SnapshotKind::Savepoint, 7);
        assert_eq!(
            manifest_path(&sp).as_ref(),
            "bucket-prefix/keyshift/team-a/clicks/savepoints/sp-7/_manifest.json"
        );
        assert_eq!(
            snapshot_dir(
                &job_dir(&Path::default(), "ns", "j"),
                SnapshotKind::Checkpoint,
                1
            )
            .as_ref(),
            "ns/j/checkpoints/chk-1"
        );
        assert_eq!(state_file_name(3, 8), "state-3-of-8.bin");
        assert_eq!(
            file_path(&chk, "state-0-of-2.bin").as_ref(),
            "bucket-prefix/keyshift/team-a/clicks/checkpoints/chk-42/state-0-of-2.bin"
        );
        assert_eq!(
            file_path(&chk, "checkpoints/chk-40/state-1-of-2.bin").as_ref(),
            "bucket-prefix/keyshift/team-a/clicks/checkpoints/chk-40/state-1-of-2.bin"
        );
        assert_eq!(
            file_path(&Path::from("checkpoints/chk-3"), "checkpoints/chk-2/a.bin").as_ref(),
            "checkpoints/chk-2/a.bin"
        );
    }

    #[test]
    fn dir_names() {
        use SnapshotKind::*;
        assert_eq!(parse_snapshot_dir_name(Checkpoint, "chk-17"), Some(17));
        assert_eq!(parse_snapshot_dir_name(Savepoint, "sp-0"), Some(0));
        assert_eq!(parse_snapshot_dir_name(Checkpoint, "sp-3"), None);
        assert_eq!(parse_snapshot_dir_name(Checkpoint, "chk-"), None);
        assert_eq!(parse_snapshot_dir_name(Checkpoint, "chk-+1"), None);
        assert_eq!(parse_snapshot_dir_name(Checkpoint, "chk-1x"), None);
    }
}
