//! The exactly-once object-store sink, between workers and coordinator.
//!
//! A worker appends its results (JSON lines) to a buffer and, at each snapshot barrier, writes the
//! buffer to a *staging* object: `<sink>/_staging/snap-<id>/part-<subtask>-of-<parallelism>.jsonl`.
//! Only after the coordinator commits snapshot `<id>` does it *publish* the staged parts to
//! `<sink>/snap-<id>/part-...jsonl` (create-only copies). Readers look only at published
//! objects. A snapshot that never commits never publishes; after a failure the job restarts
//! from the last committed snapshot, whose output is published again if the crash came between
//! commit and publish (the copy is create-only, so that is idempotent), and the records after it
//! are reprocessed into a new snapshot id. Each result is therefore visible exactly once.

use crate::snapshot::{ObjectStore, Path};
use futures::TryStreamExt;
use object_store::{ObjectStoreExt, PutMode, PutOptions};

/// Sink failures.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("sink store at {path}: {source}")]
    Store {
        path: String,
        source: object_store::Error,
    },
}

const STAGING: &str = "_staging";

/// Where a subtask stages its results for snapshot `id`.
pub fn staged_part(base: &Path, id: u64, subtask: u32, parallelism: u32) -> Path {
    base.clone()
        .join(STAGING)
        .join(format!("snap-{id}").as_str())
        .join(part_name(subtask, parallelism).as_str())
}

/// Where a part becomes visible once snapshot `id` is committed.
pub fn published_dir(base: &Path, id: u64) -> Path {
    base.clone().join(format!("snap-{id}").as_str())
}

fn part_name(subtask: u32, parallelism: u32) -> String {
    format!("part-{subtask}-of-{parallelism}.jsonl")
}

/// Publishes the staged parts of committed snapshot `id`; returns how many parts are published.
/// Idempotent: parts already published are left as they are.
pub async fn publish(store: &dyn ObjectStore, base: &Path, id: u64) -> Result<usize, SinkError> {
    let staging = base
        .clone()
        .join(STAGING)
        .join(format!("snap-{id}").as_str());
    let err = |path: &Path| {
        let path = path.to_string();
        move |source| SinkError::Store { path, source }
    };
    let staged: Vec<_> = store
        .list(Some(&staging))
        .try_collect()
        .await
        .map_err(err(&staging))?;
    let out = published_dir(base, id);
    for meta in &staged {
        let Some(name) = meta.location.filename() else {
            continue;
        };
        let target = out.clone().join(name);
        let body = store
            .get(&meta.location)
            .await
            .map_err(err(&meta.location))?
            .bytes()
            .await
            .map_err(err(&meta.location))?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match store.put_opts(&target, body.into(), opts).await {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => {}
            Err(e) => return Err(err(&target)(e)),
        }
    }
    Ok(staged.len())
}
