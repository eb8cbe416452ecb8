//! The exactly-once object-store sink, between workers and coordinator: the object-store side of
//! [`crate::job::staging`] (which decides what each subtask stages when).
//!
//! ```text
//! <sink>/_staging/snap-<id>/part-<subtask>-of-<parallelism>.jsonl   staged by a subtask at barrier <id>
//! <sink>/snap-<id>/part-<subtask>-of-<parallelism>.jsonl            published once <id> is committed
//! ```
//!
//! A worker stages ([`stage`]) at each snapshot barrier every result row it emitted since the
//! job's last committed snapshot (rows staged for a snapshot that did not commit ride with the
//! next one), before it acknowledges the snapshot. Only after the coordinator commits snapshot
//! `<id>` does it *publish* the staged parts ([`publish`]: create-only copies, so publishing
//! again is harmless), then remove the staged output at or below `<id>`
//! ([`remove_staged_through`]: published, or carried by a later snapshot). Readers look only at published objects. A snapshot that never commits
//! never publishes; after a failure the job restarts from its last committed snapshot, whose
//! output the coordinator publishes again in case the crash came between commit and publish,
//! and the records after it are reprocessed into new snapshot ids. Each result is therefore
//! visible exactly once.

use crate::job::staging::{
    Output, STAGING_DIR, WriterId, parse_snapshot_dir_name, part_name, snapshot_dir_name,
};
use crate::snapshot::{ObjectStore, Path};
use futures::TryStreamExt;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::collections::BTreeSet;

/// Sink failures.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("sink store: {op} {path}: {source}")]
    Store {
        op: &'static str,
        path: String,
        source: object_store::Error,
    },
    /// A Kafka sink's publish failed (the broker's error).
    #[error("{0}")]
    Kafka(String),
}

impl SinkError {
    fn store(op: &'static str, path: &Path) -> impl FnOnce(object_store::Error) -> SinkError {
        let path = path.to_string();
        move |source| SinkError::Store { op, path, source }
    }
}

/// Where the parts staged for snapshot `id` wait for its commit.
pub fn staged_dir(base: &Path, id: u64) -> Path {
    base.clone()
        .join(STAGING_DIR)
        .join(snapshot_dir_name(id).as_str())
}

/// Where `writer` stages its output for snapshot `id`.
pub fn staged_part(base: &Path, id: u64, writer: WriterId) -> Path {
    staged_dir(base, id).join(part_name(writer).as_str())
}

/// Where the parts of snapshot `id` become visible once it is committed.
pub fn published_dir(base: &Path, id: u64) -> Path {
    base.clone().join(snapshot_dir_name(id).as_str())
}

/// Writes a subtask's output for its barrier (the chunks as they are, without a copy); returns
/// where. An overwrite: snapshot ids are never reused, so only an earlier attempt of this very
/// write can be there.
pub async fn stage(
    store: &dyn ObjectStore,
    base: &Path,
    output: &Output,
) -> Result<Path, SinkError> {
    let path = staged_part(base, output.checkpoint_id, output.writer);
    let payload: PutPayload = output.chunks.iter().cloned().collect();
    store
        .put(&path, payload)
        .await
        .map_err(SinkError::store("put", &path))?;
    Ok(path)
}

/// What [`publish`] found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Published {
    /// Parts staged for the snapshot.
    pub parts: usize,
    /// Parts copied now (the others were published before).
    pub copied: usize,
}

/// The parts staged for snapshot `id`, and the names of those published.
async fn parts(
    store: &dyn ObjectStore,
    base: &Path,
    id: u64,
) -> Result<(Vec<object_store::ObjectMeta>, BTreeSet<String>), SinkError> {
    let staging = staged_dir(base, id);
    let staged = store
        .list_with_delimiter(Some(&staging))
        .await
        .map_err(SinkError::store("list", &staging))?
        .objects;
    if staged.is_empty() {
        return Ok((staged, BTreeSet::new()));
    }
    let out = published_dir(base, id);
    let published = store
        .list_with_delimiter(Some(&out))
        .await
        .map_err(SinkError::store("list", &out))?
        .objects
        .into_iter()
        .filter_map(|o| o.location.filename().map(str::to_owned))
        .collect();
    Ok((staged, published))
}

/// Whether every part staged for snapshot `id` is published (`Some(true)` too when nothing is
/// staged but output is published: its staging was removed; `None`: neither).
pub async fn published(
    store: &dyn ObjectStore,
    base: &Path,
    id: u64,
) -> Result<Option<bool>, SinkError> {
    let (staged, published) = parts(store, base, id).await?;
    if staged.is_empty() {
        // Staged output is removed once published ([`remove_staged_through`]).
        let out = published_dir(base, id);
        let any = !store
            .list_with_delimiter(Some(&out))
            .await
            .map_err(SinkError::store("list", &out))?
            .objects
            .is_empty();
        return Ok(any.then_some(true));
    }
    Ok(Some(staged.iter().all(|m| {
        m.location
            .filename()
            .is_none_or(|name| published.contains(name))
    })))
}

/// Publishes the staged parts of committed snapshot `id`, then removes what is staged at or below
/// `id` ([`remove_staged_through`]). Idempotent: parts already published are left as they are
/// (and not read again). Only call it for an id committed by this job: a
/// snapshot that did not commit has output staged that is carried by a later one.
pub async fn publish(
    store: &dyn ObjectStore,
    base: &Path,
    id: u64,
) -> Result<Published, SinkError> {
    let (staged, existing) = parts(store, base, id).await?;
    let out = published_dir(base, id);
    let mut done = Published {
        parts: staged.len(),
        copied: 0,
    };
    for meta in &staged {
        let Some(name) = meta.location.filename() else {
            continue;
        };
        if existing.contains(name) {
            continue;
        }
        let target = out.clone().join(name);
        let body = store
            .get(&meta.location)
            .await
            .map_err(SinkError::store("get", &meta.location))?
            .bytes()
            .await
            .map_err(SinkError::store("read", &meta.location))?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match store.put_opts(&target, body.into(), opts).await {
            Ok(_) => done.copied += 1,
            // Published by an earlier attempt meanwhile: the same bytes (staged once, never
            // changed after the commit).
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {}
            Err(e) => return Err(SinkError::store("create-only put", &target)(e)),
        }
    }
    remove_staged_through(store, base, id).await?;
    Ok(done)
}

/// Deletes the staged output of snapshot ids at or below `id`, once `id` is published:
/// published too (outputs publish in id order), or staged for a snapshot that did not commit
/// and carried by a later one. Both sinks call it after each publish, so that `_staging/`
/// holds only what is not yet published.
pub async fn remove_staged_through(
    store: &dyn ObjectStore,
    base: &Path,
    id: u64,
) -> Result<(), SinkError> {
    let staging = base.clone().join(STAGING_DIR);
    let listing = store
        .list_with_delimiter(Some(&staging))
        .await
        .map_err(SinkError::store("list", &staging))?;
    for prefix in listing.common_prefixes {
        let Some(sid) = prefix.filename().and_then(parse_snapshot_dir_name) else {
            continue;
        };
        if sid > id {
            continue;
        }
        let objects: Vec<object_store::ObjectMeta> = store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(SinkError::store("list", &prefix))?;
        for o in objects {
            match store.delete(&o.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(SinkError::store("delete", &o.location)(e)),
            }
        }
    }
    Ok(())
}

/// The largest snapshot id whose output is published under the sink (`<base>/snap-<id>/`), if
/// any: how far the sink's readers have seen the job's results.
pub async fn published_through(
    store: &dyn ObjectStore,
    base: &Path,
) -> Result<Option<u64>, SinkError> {
    let listing = store
        .list_with_delimiter(Some(base))
        .await
        .map_err(SinkError::store("list", base))?;
    Ok(listing
        .common_prefixes
        .iter()
        .filter_map(|p| p.filename().and_then(parse_snapshot_dir_name))
        .max())
}

/// The largest snapshot id that has output under the sink, staged or published (0: none), so
/// that a coordinator never reuses one (e.g. for a job deleted and created again whose snapshot
/// storage is gone but whose sink output is not).
pub async fn max_snapshot_id(store: &dyn ObjectStore, base: &Path) -> Result<u64, SinkError> {
    let mut max = 0;
    let staging = base.clone().join(STAGING_DIR);
    for dir in [base, &staging] {
        let listing = store
            .list_with_delimiter(Some(dir))
            .await
            .map_err(SinkError::store("list", dir))?;
        for prefix in listing.common_prefixes {
            if let Some(id) = prefix.filename().and_then(parse_snapshot_dir_name) {
                max = max.max(id);
            }
        }
    }
    Ok(max)
}

/// Test doubles, for this crate's tests and (with the `testing` feature) the product's.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use crate::snapshot::Path;
    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
        PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
    };
    use std::sync::Mutex;

    /// An in-memory store whose next puts under a prefix fail (see [`Flaky::fail_puts`]).
    #[derive(Debug, Default)]
    pub struct Flaky {
        inner: InMemory,
        /// Prefix and how many more puts under it fail.
        failing: Mutex<Option<(String, usize)>>,
        /// Prefix under which every read fails.
        unreadable: Mutex<Option<String>>,
    }

    impl std::fmt::Display for Flaky {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Flaky({})", self.inner)
        }
    }

    impl Flaky {
        /// The next `times` puts of objects under `prefix` fail.
        pub fn fail_puts(&self, prefix: &str, times: usize) {
            *self.failing.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((prefix.to_owned(), times));
        }

        /// Every read of an object under `prefix` fails from now on.
        pub fn fail_gets(&self, prefix: &str) {
            *self.unreadable.lock().unwrap_or_else(|e| e.into_inner()) = Some(prefix.to_owned());
        }

        /// Puts under the failing prefix that are still to fail.
        pub fn failures_left(&self) -> usize {
            self.failing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map_or(0, |f| f.1)
        }

        fn injected(&self, location: &Path) -> Option<object_store::Error> {
            let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
            match failing.as_mut() {
                Some((prefix, left)) if *left > 0 && location.as_ref().starts_with(&**prefix) => {
                    *left -= 1;
                    Some(object_store::Error::Generic {
                        store: "Flaky",
                        source: format!("injected put failure at {location}").into(),
                    })
                }
                _ => None,
            }
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Flaky {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            opts: PutOptions,
        ) -> Result<PutResult> {
            if let Some(e) = self.injected(location) {
                return Err(e);
            }
            self.inner.put_opts(location, payload, opts).await
        }
        async fn put_multipart_opts(
            &self,
            location: &Path,
            opts: PutMultipartOptions,
        ) -> Result<Box<dyn MultipartUpload>> {
            if let Some(e) = self.injected(location) {
                return Err(e);
            }
            self.inner.put_multipart_opts(location, opts).await
        }
        async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
            let unreadable = self
                .unreadable
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_deref()
                .is_some_and(|prefix| location.as_ref().starts_with(prefix));
            if unreadable {
                return Err(object_store::Error::Generic {
                    store: "Flaky",
                    source: format!("injected read failure at {location}").into(),
                });
            }
            self.inner.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: BoxStream<'static, Result<Path>>,
        ) -> BoxStream<'static, Result<Path>> {
            self.inner.delete_stream(locations)
        }
        fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
            self.inner.list(prefix)
        }
        async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }
        async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Flaky;
    use super::*;
    use crate::job::staging::{Committed, StagingSink};
    use crate::job::{ResultRow, record::RecordKey};
    use futures::TryStreamExt;

    fn writer(subtask: u32) -> WriterId {
        WriterId {
            subtask,
            parallelism: 2,
        }
    }

    async fn text(store: &dyn ObjectStore, path: &Path) -> String {
        let bytes = store.get(path).await.unwrap().bytes().await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    async fn names(store: &dyn ObjectStore, base: &Path) -> Vec<String> {
        let all: Vec<_> = store.list(Some(base)).try_collect().await.unwrap();
        let mut names: Vec<String> = all.into_iter().map(|o| o.location.to_string()).collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn staged_parts_publish_once_and_publishing_again_changes_nothing() {
        let store = Flaky::default();
        let base = Path::from("out");
        let stage_rows = |id: u64| {
            let store = &store;
            let base = &base;
            async move {
                for subtask in 0..2 {
                    let mut sink = StagingSink::new(writer(subtask));
                    sink.emit(&[ResultRow {
                        key: RecordKey::int(subtask as i32),
                        window: None,
                        value: 7,
                    }]);
                    let out = sink.on_barrier(id, Committed::Through(id - 1)).unwrap();
                    stage(store, base, &out).await.unwrap();
                }
            }
        };
        // 2 never commits (its rows ride with 3); 4 is staged after 3.
        for id in [2, 3, 4] {
            stage_rows(id).await;
        }
        assert_eq!(max_snapshot_id(&store, &base).await.unwrap(), 4);
        assert_eq!(published(&store, &base, 3).await.unwrap(), Some(false));
        // The first copy fails half way: one part is published, the other not, and nothing
        // staged is removed.
        store.fail_puts("out/snap-3/part-1", 1);
        assert!(publish(&store, &base, 3).await.is_err());
        assert_eq!(names(&store, &published_dir(&base, 3)).await.len(), 1);
        assert_eq!(published(&store, &base, 3).await.unwrap(), Some(false));
        assert_eq!(names(&store, &staged_dir(&base, 3)).await.len(), 2);
        let p = publish(&store, &base, 3).await.unwrap();
        assert_eq!(
            p,
            Published {
                parts: 2,
                copied: 1
            }
        );
        // Published: what is staged at or below 3 is gone (2's too), 4's stays.
        assert_eq!(
            names(&store, &base).await,
            [
                "out/_staging/snap-4/part-0-of-2.jsonl",
                "out/_staging/snap-4/part-1-of-2.jsonl",
                "out/snap-3/part-0-of-2.jsonl",
                "out/snap-3/part-1-of-2.jsonl",
            ]
        );
        assert_eq!(published(&store, &base, 3).await.unwrap(), Some(true));
        assert_eq!(published(&store, &base, 2).await.unwrap(), None);
        // Publishing again changes nothing.
        assert_eq!(
            publish(&store, &base, 3).await.unwrap(),
            Published::default()
        );
        assert_eq!(names(&store, &published_dir(&base, 3)).await.len(), 2);
        assert_eq!(
            text(&store, &Path::from("out/snap-3/part-1-of-2.jsonl")).await,
            "{\"key\":1,\"value\":7}\n"
        );
        assert_eq!(max_snapshot_id(&store, &base).await.unwrap(), 4);
        // 4 is staged, not published: the readers have seen up to 3.
        assert_eq!(published_through(&store, &base).await.unwrap(), Some(3));
        assert_eq!(
            published_through(&store, &Path::from("elsewhere"))
                .await
                .unwrap(),
            None
        );
        // Nothing staged or published: nothing to publish.
        assert_eq!(
            publish(&store, &base, 9).await.unwrap(),
            Published::default()
        );
        assert_eq!(published(&store, &base, 9).await.unwrap(), None);
    }
}
