//! The file source's partition files in an object store (`s3://`, `gs://`, `az://`, any URL
//! [`crate::snapshot::open_store`] opens): the objects directly under the URL's prefix, read by
//! range from a byte offset as local files are.
//!
//! The file source reads synchronously (a read is a bounded slice of the source task's turn, as
//! a local file's is); the object store's client is asynchronous. The store's requests therefore
//! run on a runtime of their own (one thread, owned by these files), and a read waits for its
//! request's answer. An object that grows (rewritten with more lines appended, as a local file
//! grows) is read on from the position reached. Each partition keeps the size last found and
//! the last range read (at most [`RANGE`] bytes): reads within them make no request, and while a
//! partition is at its end its size is asked for at most once per [`GROWTH_POLL`].

use crate::snapshot::open_store;
use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::io::Read;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a partition at its end is asked for its size again.
pub const GROWTH_POLL: Duration = Duration::from_secs(1);

/// Bytes one range request reads at most (and a partition keeps between reads).
pub const RANGE: u64 = 1 << 20;

/// Why the objects could not be listed or read.
#[derive(Debug, thiserror::Error)]
pub enum ObjectFilesError {
    #[error("{0}")]
    Open(String),
    #[error("{url}: {source}")]
    Store {
        url: String,
        #[source]
        source: object_store::Error,
    },
    #[error("{url}: the object store's I/O thread is gone")]
    Gone { url: String },
}

impl From<ObjectFilesError> for std::io::Error {
    fn from(e: ObjectFilesError) -> Self {
        std::io::Error::other(e)
    }
}

/// The runtime the store's requests run on; shut down in the background when the files are
/// dropped (dropping a runtime inside another's task would panic).
struct Io(Option<tokio::runtime::Runtime>);

impl Drop for Io {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Io")
    }
}

/// What one partition knows of its object.
#[derive(Debug, Default, Clone)]
struct Known {
    /// The size last found.
    size: Option<u64>,
    /// Where a read last reached the end of the complete lines, and when.
    at_end: Option<(u64, Instant)>,
    /// The last range read: its first byte's offset and its bytes.
    chunk: Option<(u64, Bytes)>,
}

/// The partition objects of one URL, and how to reach them.
#[derive(Debug)]
pub struct ObjectFiles {
    url: String,
    store: Arc<dyn ObjectStore>,
    io: Io,
    objects: Vec<ObjectPath>,
    known: Mutex<Vec<Known>>,
}

impl ObjectFiles {
    /// Lists the objects directly under `url`'s prefix: `(name, display path)` per partition in
    /// byte-wise name order (hidden names, starting with `.`, are not partitions).
    pub fn open(url: &str) -> Result<(Self, Vec<(String, PathBuf)>), ObjectFilesError> {
        let (store, prefix) = open_store(url).map_err(|e| ObjectFilesError::Open(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("keyshift-file-source-io")
            .enable_all()
            .build()
            .map_err(|e| ObjectFilesError::Open(format!("{url}: no I/O runtime: {e}")))?;
        let mut files = ObjectFiles {
            url: url.trim_end_matches('/').to_owned(),
            store,
            io: Io(Some(rt)),
            objects: Vec::new(),
            known: Mutex::new(Vec::new()),
        };
        let store = files.store.clone();
        let listing = files.run(async move { store.list_with_delimiter(Some(&prefix)).await })?;
        let mut found: Vec<(String, ObjectPath)> = listing
            .objects
            .into_iter()
            .filter_map(|o| {
                let name = o.location.filename()?.to_owned();
                (!name.starts_with('.')).then_some((name, o.location))
            })
            .collect();
        found.sort();
        let shown = found
            .iter()
            .map(|(name, _)| (name.clone(), PathBuf::from(format!("{}/{name}", files.url))))
            .collect();
        files.known = Mutex::new(vec![Known::default(); found.len()]);
        files.objects = found.into_iter().map(|(_, p)| p).collect();
        Ok((files, shown))
    }

    /// Runs one request of the store on the files' runtime and waits for its answer.
    fn run<T: Send + 'static>(
        &self,
        request: impl Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> Result<T, ObjectFilesError> {
        let gone = || ObjectFilesError::Gone {
            url: self.url.clone(),
        };
        let rt = self.io.0.as_ref().ok_or_else(gone)?;
        let answer = futures::executor::block_on(rt.spawn(request)).map_err(|_| gone())?;
        answer.map_err(|source| ObjectFilesError::Store {
            url: self.url.clone(),
            source,
        })
    }

    fn known(&self) -> MutexGuard<'_, Vec<Known>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current size of `partition`'s object (asked for).
    pub fn size(&self, partition: usize) -> Result<u64, ObjectFilesError> {
        let (store, path) = (self.store.clone(), self.objects[partition].clone());
        let size = self.run(async move { store.head(&path).await })?.size;
        if let Some(k) = self.known().get_mut(partition) {
            if k.size != Some(size) {
                // Rewritten: what was read of it is not what it holds now.
                k.chunk = None;
            }
            k.size = Some(size);
        }
        Ok(size)
    }

    /// The size to read `partition` up to from `offset`: `None` when a read ended at this
    /// offset, at the end of its complete lines, less than [`GROWTH_POLL`] ago (not asked for
    /// again yet); the size last found while `offset` lies below it and no read ended there (no
    /// request); else asked for.
    pub fn size_to_read(
        &self,
        partition: usize,
        offset: u64,
    ) -> Result<Option<u64>, ObjectFilesError> {
        let (at_end, size) = self
            .known()
            .get(partition)
            .map_or((None, None), |k| (k.at_end, k.size));
        match (at_end, size) {
            // At the end a moment ago: not asked for again yet; a while ago: asked for.
            (Some((end, when)), _) if end == offset => match when.elapsed() < GROWTH_POLL {
                true => Ok(None),
                false => self.size(partition).map(Some),
            },
            (_, Some(size)) if offset < size => Ok(Some(size)),
            _ => self.size(partition).map(Some),
        }
    }

    /// Records that a read of `partition` consumed every complete line: the next one, from
    /// `end`, asks for its size again only after [`GROWTH_POLL`].
    pub fn reached_end(&self, partition: usize, end: u64) {
        if let Some(k) = self.known().get_mut(partition) {
            k.at_end = Some((end, Instant::now()));
        }
    }

    /// A reader of `partition`'s bytes `[offset, end)`.
    pub fn reader(&self, partition: usize, offset: u64, end: u64) -> ObjectReader<'_> {
        ObjectReader {
            files: self,
            partition,
            pos: offset,
            end,
        }
    }
}

/// Reads one object's byte range through its partition's last range, in requests of at most
/// [`RANGE`] bytes.
pub struct ObjectReader<'a> {
    files: &'a ObjectFiles,
    partition: usize,
    pos: u64,
    end: u64,
}

impl Read for ObjectReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.end || buf.is_empty() {
            return Ok(0);
        }
        let pos = self.pos;
        let cached = self
            .files
            .known()
            .get(self.partition)
            .and_then(|k| k.chunk.clone())
            .filter(|(start, bytes)| (*start..*start + bytes.len() as u64).contains(&pos));
        let (start, bytes) = match cached {
            Some(chunk) => chunk,
            None => {
                let range = pos..self.end.min(pos + RANGE);
                let (store, path) = (
                    self.files.store.clone(),
                    self.files.objects[self.partition].clone(),
                );
                let bytes = self
                    .files
                    .run(async move { store.get_range(&path, range).await })?;
                if bytes.is_empty() {
                    return Ok(0);
                }
                if let Some(k) = self.files.known().get_mut(self.partition) {
                    k.chunk = Some((pos, bytes.clone()));
                }
                (pos, bytes)
            }
        };
        let from = (pos - start) as usize;
        let left = (self.end - pos) as usize;
        let n = (bytes.len() - from).min(buf.len()).min(left);
        buf[..n].copy_from_slice(&bytes[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}
