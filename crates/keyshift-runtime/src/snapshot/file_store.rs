//! The `file://` store: object_store's [`LocalFileSystem`] (fsync on), with the two snapshot hot
//! paths done here instead.
//!
//! * **Multipart uploads** (state files): parts are written with positional writes into the
//!   staging file `<dest>#<n>` (the name `LocalFileSystem` uses, so listings skip it), and each
//!   written part's pages are handed to the kernel's writeback at once (`sync_file_range` with
//!   `SYNC_FILE_RANGE_WRITE`, Linux), so the device writes while the encoder produces the next
//!   parts instead of all at the final fsync. Completion is as durable as `LocalFileSystem`'s:
//!   `fsync` of the file, rename into place, `fsync` of the directory (and of any directory
//!   created for it).
//! * **Range reads** ([`ObjectStore::get_ranges`]) read into uninitialised buffers
//!   (`LocalFileSystem` zero-fills each buffer before reading into it).
//!
//! * **Failed writes** (a full disk) remove the directory of the object again when they leave
//!   it empty, so a snapshot whose first write failed leaves no empty directory that retention
//!   (which deletes objects) could never remove.
//!
//! Everything else (single puts, create-only manifests, gets, lists, deletes, copies) is
//! `LocalFileSystem`'s.

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

const STORE: &str = "LocalFileSystem";

/// A `file://` store (see the module docs).
#[derive(Debug)]
pub(crate) struct FileStore {
    inner: LocalFileSystem,
}

impl FileStore {
    /// Wraps `inner`, which must have fsync enabled (the uploads here always fsync).
    pub(crate) fn new(inner: LocalFileSystem) -> Self {
        FileStore { inner }
    }
}

impl FileStore {
    /// The directory holding `location` when it lies below the store's root (a snapshot
    /// directory for a state file or a manifest): removed again, if empty, after a failed write
    /// into it, so that a write that failed on a full disk leaves no empty directory behind.
    fn own_dir(&self, location: &Path) -> Option<PathBuf> {
        if location.parts().count() < 2 {
            return None;
        }
        let path = self.inner.path_to_filesystem(location).ok()?;
        path.parent().map(std::path::Path::to_path_buf)
    }
}

/// Removes `dir` if it is empty (`rmdir(2)` refuses any other); a writer that is creating a
/// file in it at the same moment creates it again.
fn remove_dir_if_empty(dir: &std::path::Path) {
    let _ = std::fs::remove_dir(dir);
}

impl std::fmt::Display for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.inner, f)
    }
}

/// An I/O error as an object-store error, naming the file.
fn io_error(what: &str, path: &std::path::Path, e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: STORE,
        source: format!("{what} {}: {e}", path.display()).into(),
    }
}

/// Runs blocking file work off the async threads (inline without a runtime).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> object_store::Result<T> + Send + 'static,
) -> object_store::Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => rt
            .spawn_blocking(f)
            .await
            .map_err(|e| object_store::Error::Generic {
                store: STORE,
                source: Box::new(e),
            })?,
        Err(_) => f(),
    }
}

#[async_trait]
impl ObjectStore for FileStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let result = self.inner.put_opts(location, payload, opts).await;
        if result.is_err()
            && let Some(dir) = self.own_dir(location)
        {
            let _ = blocking(move || {
                remove_dir_if_empty(&dir);
                Ok(())
            })
            .await;
        }
        result
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        if !opts.attributes.is_empty() {
            // Refused by LocalFileSystem, with its message.
            return self.inner.put_multipart_opts(location, opts).await;
        }
        let dest = self.inner.path_to_filesystem(location)?;
        let own_dir = self.own_dir(location);
        let upload = blocking(move || {
            let (file, staging) = new_staging_file(&dest)?;
            Ok(LocalUpload {
                file: Arc::new(file),
                staging: Some(staging),
                dest,
                own_dir,
                offset: 0,
            })
        })
        .await?;
        Ok(Box::new(upload))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        let path = self.inner.path_to_filesystem(location)?;
        let ranges = ranges.to_vec();
        let location = location.to_string();
        blocking(move || {
            let file = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    return Err(object_store::Error::NotFound {
                        path: location,
                        source: Box::new(e),
                    });
                }
                Err(e) => return Err(io_error("opening", &path, e)),
            };
            ranges.iter().map(|r| read_range(&file, &path, r)).collect()
        })
        .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

/// Reads exactly `range` of `file` into a buffer that is not zero-filled first.
fn read_range(
    file: &File,
    path: &std::path::Path,
    range: &Range<u64>,
) -> object_store::Result<Bytes> {
    let len = range.end.saturating_sub(range.start);
    let cap = usize::try_from(len).map_err(|_| object_store::Error::Generic {
        store: STORE,
        source: format!("range {range:?} of {} is too large", path.display()).into(),
    })?;
    let mut reader = file;
    reader
        .seek(SeekFrom::Start(range.start))
        .map_err(|e| io_error("seeking in", path, e))?;
    let mut buf = Vec::with_capacity(cap);
    // `read_to_end` reads into the spare capacity without initialising it.
    reader
        .take(len)
        .read_to_end(&mut buf)
        .map_err(|e| io_error("reading", path, e))?;
    if buf.len() != cap {
        return Err(object_store::Error::Generic {
            store: STORE,
            source: format!(
                "range {range:?} of {} is past its end ({} bytes read)",
                path.display(),
                buf.len()
            )
            .into(),
        });
    }
    Ok(Bytes::from(buf))
}

/// Times the parent directories of a staging file are created before giving up (another
/// writer's failed write may remove an empty directory in between).
const DIR_ATTEMPTS: u32 = 3;

/// Creates the staging file of `dest` (`<dest>#<n>`, the first free `n`), creating (and
/// fsyncing) missing parent directories.
fn new_staging_file(dest: &std::path::Path) -> object_store::Result<(File, PathBuf)> {
    let mut n = 1u32;
    let mut created_dirs = 0;
    loop {
        let mut staging = dest.as_os_str().to_owned();
        staging.push(format!("#{n}"));
        let staging = PathBuf::from(staging);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&staging)
        {
            Ok(f) => return Ok((f, staging)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => n += 1,
            Err(e) if e.kind() == ErrorKind::NotFound && created_dirs < DIR_ATTEMPTS => {
                created_dirs += 1;
                create_parent_dirs(dest)?;
            }
            Err(e) => return Err(io_error("creating", &staging, e)),
        }
    }
}

/// Creates `path`'s missing parent directories and fsyncs each new one and the existing
/// directory that received the first, so the new entries are durable.
fn create_parent_dirs(path: &std::path::Path) -> object_store::Result<()> {
    let Some(parent) = path.parent() else {
        return Ok(());
    };
    let mut new_dirs = Vec::new();
    let mut dir = Some(parent);
    while let Some(d) = dir.filter(|d| !d.exists()) {
        new_dirs.push(d.to_path_buf());
        dir = d.parent();
    }
    std::fs::create_dir_all(parent).map_err(|e| io_error("creating directory", parent, e))?;
    for d in new_dirs.iter().map(PathBuf::as_path).chain(dir) {
        fsync_dir(d)?;
    }
    Ok(())
}

fn fsync_dir(dir: &std::path::Path) -> object_store::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("syncing directory", dir, e))
}

/// Starts writeback of `len` bytes at `offset` without waiting for it (Linux; elsewhere
/// nothing). Advice only: errors surface at the final fsync.
fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) {
            // SAFETY: a plain syscall on an open descriptor; no memory is passed.
            let _ = unsafe {
                libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// A state file being written (see the module docs).
#[derive(Debug)]
struct LocalUpload {
    file: Arc<File>,
    /// The staging file, until completed or aborted.
    staging: Option<PathBuf>,
    dest: PathBuf,
    /// `dest`'s directory, removed if empty when the upload is abandoned
    /// ([`FileStore::own_dir`]).
    own_dir: Option<PathBuf>,
    /// Where the next part goes.
    offset: u64,
}

impl LocalUpload {
    fn aborted(&self) -> object_store::Error {
        object_store::Error::Generic {
            store: STORE,
            source: format!(
                "upload of {} already completed or aborted",
                self.dest.display()
            )
            .into(),
        }
    }
}

#[async_trait]
impl MultipartUpload for LocalUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let offset = self.offset;
        self.offset += data.content_length() as u64;
        let file = self.file.clone();
        let path = self.staging.clone().unwrap_or_else(|| self.dest.clone());
        Box::pin(blocking(move || {
            use std::os::unix::fs::FileExt;
            let mut at = offset;
            for chunk in data.iter() {
                file.write_all_at(chunk, at)
                    .map_err(|e| io_error("writing", &path, e))?;
                at += chunk.len() as u64;
            }
            start_writeback(&file, offset, at - offset);
            Ok(())
        }))
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let staging = self.staging.clone().ok_or_else(|| self.aborted())?;
        let (file, dest) = (self.file.clone(), self.dest.clone());
        let done = blocking(move || {
            file.sync_all()
                .map_err(|e| io_error("syncing", &staging, e))?;
            std::fs::rename(&staging, &dest).map_err(|e| io_error("renaming", &staging, e))?;
            if let Some(dir) = dest.parent() {
                fsync_dir(dir)?;
            }
            Ok(PutResult {
                e_tag: None,
                version: None,
                extensions: Default::default(),
            })
        })
        .await;
        if done.is_ok() {
            self.staging = None;
        }
        done
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        let staging = self.staging.take().ok_or_else(|| self.aborted())?;
        let own_dir = self.own_dir.take();
        blocking(move || {
            std::fs::remove_file(&staging).map_err(|e| io_error("removing", &staging, e))?;
            if let Some(dir) = own_dir {
                remove_dir_if_empty(&dir);
            }
            Ok(())
        })
        .await
    }
}

impl Drop for LocalUpload {
    fn drop(&mut self) {
        // Abandoned: remove the staging file (best effort), and its directory if now empty.
        if let Some(staging) = self.staging.take() {
            let _ = std::fs::remove_file(staging);
            if let Some(dir) = self.own_dir.take() {
                remove_dir_if_empty(&dir);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;
    use object_store::{ObjectStoreExt, WriteMultipart};

    fn store(dir: &std::path::Path) -> FileStore {
        FileStore::new(
            LocalFileSystem::new_with_prefix(dir)
                .unwrap()
                .with_fsync(true),
        )
    }

    fn staging_files(dir: &std::path::Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                } else if e.file_name().to_string_lossy().contains('#') {
                    out.push(e.path().display().to_string());
                }
            }
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multipart_upload_then_range_reads() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path());
        let path = Path::from("a/b/chk-1/state-0.bin");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let upload = s.put_multipart(&path).await.unwrap();
        let mut w = WriteMultipart::new_with_chunk_size(upload, 7_000);
        // Invisible while being written.
        w.put(Bytes::copy_from_slice(&data[..50_000]));
        w.wait_for_capacity(0).await.unwrap();
        assert!(s.head(&path).await.is_err());
        let listed: Vec<_> = s.list(None).try_collect().await.unwrap();
        assert!(listed.is_empty(), "{listed:?}");
        w.put(Bytes::copy_from_slice(&data[50_000..]));
        w.finish().await.unwrap();
        assert!(staging_files(tmp.path()).is_empty());
        assert_eq!(s.head(&path).await.unwrap().size, data.len() as u64);
        let got = s
            .get_ranges(&path, &[0..10, 10..60_000, 99_990..100_000, 5..5])
            .await
            .unwrap();
        assert_eq!(&got[0][..], &data[0..10]);
        assert_eq!(&got[1][..], &data[10..60_000]);
        assert_eq!(&got[2][..], &data[99_990..]);
        assert!(got[3].is_empty());
        // Past the end, and a missing file.
        assert!(
            s.get_ranges(&path, std::slice::from_ref(&(99_000..100_001)))
                .await
                .is_err()
        );
        assert!(matches!(
            s.get_ranges(&Path::from("nope"), std::slice::from_ref(&(0..1)))
                .await,
            Err(object_store::Error::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn aborted_and_dropped_uploads_leave_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path());
        let path = Path::from("x/state.bin");
        let mut up = s.put_multipart(&path).await.unwrap();
        up.put_part(PutPayload::from_static(b"hello"))
            .await
            .unwrap();
        up.abort().await.unwrap();
        let up = s.put_multipart(&path).await.unwrap();
        drop(up);
        assert!(staging_files(tmp.path()).is_empty());
        assert!(s.head(&path).await.is_err());
        // The directory they created is gone with them; one that holds a file stays.
        assert!(!tmp.path().join("x").exists());
        s.put(&Path::from("y/kept"), "k".into()).await.unwrap();
        let mut up = s.put_multipart(&Path::from("y/state.bin")).await.unwrap();
        up.abort().await.unwrap();
        assert!(tmp.path().join("y/kept").exists());
        // Create-only puts are LocalFileSystem's.
        let m = Path::from("x/_manifest.json");
        let create = PutOptions::from(object_store::PutMode::Create);
        s.put_opts(&m, "a".into(), create.clone()).await.unwrap();
        assert!(matches!(
            s.put_opts(&m, "b".into(), create).await,
            Err(object_store::Error::AlreadyExists { .. })
        ));
    }
}
