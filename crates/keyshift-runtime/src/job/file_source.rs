//! The JSON-lines file source.
//!
//! A directory holds one file per partition; partition `i` is the `i`-th regular, non-hidden
//! file (or symlink to one, as in a ConfigMap volume) in byte-wise name order, and its identity
//! is its file name ([`FileSourceReader::names`]). The directory may also be an object-store URL
//! (`s3://bucket/in`, `gs://`, `az://`): its partitions are then the objects directly under the
//! prefix, read by range, with the same positions and rules ([`super::object_files`]).
//! A position is a byte offset into the partition's file, always at the start of a line, so a
//! restored position resumes exactly: no record is read twice or lost.
//!
//! Snapshots record each partition's name beside its position, and a restore lays positions onto
//! the files by name ([`keyshift_core::positions`]): files added to or removed from the directory between
//! runs shift indexes but never move an offset onto another file. The list of files is taken when
//! the job starts; a file added while it runs is read from the next start (restore) on. Each
//! worker lists the directory itself: a start whose workers listed different files (one appeared
//! or vanished meanwhile) is refused by the coordinator and started again, so that no file is
//! read by two subtasks or by none (see
//! [`StartAccepted::source_partitions`](crate::runtime::protocol::StartAccepted::source_partitions)).
//!
//! A file must only grow. A file shorter than a position to read from (restored from a snapshot,
//! or reached while running) is refused with [`FileSourceError::Shrunk`], naming the file: the
//! bytes at that offset are not what the position was taken on, and reading them could skip or
//! garble records. (A file rewritten to the same or a larger size cannot be told apart: don't.
//! A renamed file is a new partition, read from its start.)
//!
//! * A record is a line ending in `\n` (a `\r` before it is ignored). An unterminated last line
//!   is *not* read — it may still be being written — and is reported in
//!   [`FileBatch::partial_tail_bytes`]; once its newline arrives, the next read picks it up.
//! * Blank lines are skipped (their bytes are consumed).
//! * A line that is not a JSON object with the needed fields is an error
//!   ([`FileSourceError::Malformed`]) naming the file and the byte offset of the line; nothing is
//!   skipped silently, and the position stays at the bad line.
//!
//! Fields: the key field is read as the job's key type (a JSON string for `string` keys; a JSON
//! integer or a string holding one for `long` / `int`); the value field (sum/min/max) must be a
//! JSON integer (or a float with no fractional part); `count` jobs read no value (0). The
//! timestamp field, when configured, must be an integer (ms); without it `ts` is 0.

use super::object_files::ObjectFiles;
use super::record::{Record, RecordKey};
use keyshift_core::keygroup::KeyType;
use serde_json::Value;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Errors of the file source.
#[derive(Debug, thiserror::Error)]
pub enum FileSourceError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} holds no partition files")]
    NoFiles { path: PathBuf },
    #[error(
        "{path}: partition file names must be UTF-8 (a snapshot records them as the partitions' identity): rename it"
    )]
    NonUtf8Name { path: PathBuf },
    #[error(
        "{file} is {size} bytes, shorter than the position {offset} to read it from: it shrank (was it truncated or replaced?); partition files may only grow. Restore the file, or remove it from the directory to skip it (its records up to that position were read)"
    )]
    Shrunk {
        file: PathBuf,
        offset: u64,
        size: u64,
    },
    #[error("no partition {partition}: the source has {partitions}")]
    NoSuchPartition { partition: u32, partitions: u32 },
    #[error("{file}: malformed record at byte offset {offset}: {reason}")]
    Malformed {
        file: PathBuf,
        offset: u64,
        reason: String,
    },
}

/// Why a file source on an object-store URL could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenObjectsError {
    /// The URL names no store this build can open (no retry helps).
    #[error("{0}")]
    Url(String),
    /// Listing failed, or found nothing (a retry may).
    #[error(transparent)]
    Read(FileSourceError),
}

/// Which JSON fields make a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMapping {
    /// The key field.
    pub key_field: String,
    /// How the key is typed (and hashed).
    pub key_type: KeyType,
    /// The value field (`None` for count: value 0).
    pub value_field: Option<String>,
    /// The event-time field in ms (`None`: ts 0).
    pub timestamp_field: Option<String>,
}

/// What one read returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileBatch {
    /// Records appended.
    pub records: usize,
    /// The position after the last consumed line (the start of the next line).
    pub next_offset: u64,
    /// Whether the read reached the end of the file's complete lines (more may come later).
    pub at_end: bool,
    /// Bytes of an unterminated last line left unread.
    pub partial_tail_bytes: u64,
}

/// A directory of JSON-lines partition files.
#[derive(Debug, Clone)]
pub struct FileSourceReader {
    dir: PathBuf,
    files: Vec<PathBuf>,
    /// `files[i]`'s name relative to `dir`.
    names: Vec<String>,
    /// How a line becomes a record of the built-in aggregation (`None`: a program's source,
    /// read line by line with [`FileSourceReader::read_lines`]).
    fields: Option<FieldMapping>,
    /// The objects when `dir` is an object-store URL (`files` then shows each object's URL).
    objects: Option<Arc<ObjectFiles>>,
}

const CHUNK: usize = 256 * 1024;

impl FileSourceReader {
    /// Lists the partition files of `dir`; `fields` make its lines records of the built-in
    /// aggregation ([`FileSourceReader::read_batch`]), or none for a program's lines.
    pub fn open(
        dir: impl AsRef<Path>,
        fields: Option<FieldMapping>,
    ) -> Result<Self, FileSourceError> {
        let dir = dir.as_ref().to_path_buf();
        let io = |source| FileSourceError::Io {
            path: dir.clone(),
            source,
        };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let hidden = entry.file_name().as_encoded_bytes().first() == Some(&b'.');
            // Followed through symlinks: a Kubernetes ConfigMap or Secret volume holds each
            // key as a symlink into a hidden `..data` directory.
            if !hidden && std::fs::metadata(entry.path()).map_err(io)?.is_file() {
                let name = entry
                    .file_name()
                    .into_string()
                    .map_err(|_| FileSourceError::NonUtf8Name { path: entry.path() })?;
                files.push((name, entry.path()));
            }
        }
        if files.is_empty() {
            return Err(FileSourceError::NoFiles { path: dir });
        }
        // Byte-wise name order (UTF-8 orders as its bytes).
        files.sort();
        let (names, files) = files.into_iter().unzip();
        Ok(FileSourceReader {
            dir,
            files,
            names,
            fields,
            objects: None,
        })
    }

    /// Lists the partition objects directly under an object-store URL, as [`Self::open`] lists a
    /// directory's files.
    pub fn open_objects(url: &str, fields: Option<FieldMapping>) -> Result<Self, OpenObjectsError> {
        let (objects, found) = ObjectFiles::open(url).map_err(|e| match e {
            super::object_files::ObjectFilesError::Open(reason) => OpenObjectsError::Url(reason),
            e => OpenObjectsError::Read(FileSourceError::Io {
                path: PathBuf::from(url),
                source: e.into(),
            }),
        })?;
        if found.is_empty() {
            return Err(OpenObjectsError::Read(FileSourceError::NoFiles {
                path: PathBuf::from(url),
            }));
        }
        let (names, files) = found.into_iter().unzip();
        Ok(FileSourceReader {
            dir: PathBuf::from(url),
            files,
            names,
            fields,
            objects: Some(Arc::new(objects)),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of partitions (files).
    pub fn partitions(&self) -> u32 {
        self.files.len() as u32
    }

    /// The file of a partition.
    pub fn file(&self, partition: u32) -> Option<&Path> {
        self.files.get(partition as usize).map(PathBuf::as_path)
    }

    /// Every partition's identity, in partition order: its file name relative to the directory.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    fn path(&self, partition: u32) -> Result<&PathBuf, FileSourceError> {
        self.files
            .get(partition as usize)
            .ok_or(FileSourceError::NoSuchPartition {
                partition,
                partitions: self.partitions(),
            })
    }

    /// Checks that `partition`'s file can be read from `offset`: it is at least that long
    /// ([`FileSourceError::Shrunk`] otherwise).
    pub fn check_position(&self, partition: u32, offset: u64) -> Result<(), FileSourceError> {
        let path = self.path(partition)?;
        let io = |source| FileSourceError::Io {
            path: path.clone(),
            source,
        };
        let size = match &self.objects {
            None => std::fs::metadata(path).map_err(io)?.len(),
            Some(o) => o.size(partition as usize).map_err(|e| io(e.into()))?,
        };
        check_size(path, offset, size)
    }

    /// Reads up to `max_records` records of `partition` from byte `offset` (the start of a
    /// line), appending them to `out`. On a malformed line it returns the error; records before
    /// it stay appended but the caller should not advance past the last good position it was
    /// given (re-read from `offset` after fixing the data).
    pub fn read_batch(
        &self,
        partition: u32,
        offset: u64,
        out: &mut Vec<Record>,
        max_records: usize,
    ) -> Result<FileBatch, FileSourceError> {
        let Some(fields) = &self.fields else {
            return Err(FileSourceError::Malformed {
                file: self.path(partition)?.clone(),
                offset,
                reason: "this source feeds a program: its lines are read with read_lines".into(),
            });
        };
        self.read_lines(partition, offset, max_records, &mut |line| {
            out.push(parse_line(line, fields)?);
            Ok(())
        })
    }

    /// Reads up to `max_lines` non-blank lines of `partition` from byte `offset` (the start of
    /// a line), handing each (without its line end) to `each`. A line `each` refuses is
    /// returned as [`FileSourceError::Malformed`] at its offset; the lines before it were
    /// handed over, but the caller should not advance past the last good position it was
    /// given.
    pub fn read_lines(
        &self,
        partition: u32,
        offset: u64,
        max_lines: usize,
        each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<FileBatch, FileSourceError> {
        let path = self.path(partition)?;
        let io = |source| FileSourceError::Io {
            path: path.clone(),
            source,
        };
        let mut source: Box<dyn Read + '_> = match &self.objects {
            None => {
                let mut file = File::open(path).map_err(io)?;
                check_size(path, offset, file.metadata().map_err(io)?.len())?;
                file.seek(SeekFrom::Start(offset)).map_err(io)?;
                Box::new(file)
            }
            Some(o) => {
                let p = partition as usize;
                let Some(size) = o.size_to_read(p, offset).map_err(|e| io(e.into()))? else {
                    // At its end a moment ago: not asked again yet.
                    return Ok(FileBatch {
                        records: 0,
                        next_offset: offset,
                        at_end: true,
                        partial_tail_bytes: 0,
                    });
                };
                check_size(path, offset, size)?;
                Box::new(o.reader(p, offset, size))
            }
        };
        let mut buf: Vec<u8> = Vec::with_capacity(CHUNK);
        let mut base = offset; // file offset of buf[0]
        let mut pos = 0usize; // start of the next unconsumed line in buf
        let mut records = 0usize;
        let mut eof = false;
        loop {
            while records < max_lines {
                let Some(nl) = memchr::memchr(b'\n', &buf[pos..]) else {
                    break;
                };
                let line_offset = base + pos as u64;
                let line = &buf[pos..pos + nl];
                pos += nl + 1;
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                each(line).map_err(|reason| FileSourceError::Malformed {
                    file: path.clone(),
                    offset: line_offset,
                    reason,
                })?;
                records += 1;
            }
            if records >= max_lines || eof {
                break;
            }
            buf.drain(..pos);
            base += pos as u64;
            pos = 0;
            let start = buf.len();
            buf.resize(start + CHUNK, 0);
            let n = read_full(&mut source, &mut buf[start..]).map_err(io)?;
            buf.truncate(start + n);
            eof = n == 0;
        }
        let at_end = eof && memchr::memchr(b'\n', &buf[pos..]).is_none();
        if let (Some(o), true) = (&self.objects, at_end) {
            o.reached_end(partition as usize, base + pos as u64);
        }
        Ok(FileBatch {
            records,
            next_offset: base + pos as u64,
            at_end,
            partial_tail_bytes: if at_end { (buf.len() - pos) as u64 } else { 0 },
        })
    }
}

fn check_size(path: &Path, offset: u64, size: u64) -> Result<(), FileSourceError> {
    if size < offset {
        return Err(FileSourceError::Shrunk {
            file: path.to_path_buf(),
            offset,
            size,
        });
    }
    Ok(())
}

fn read_full(file: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn field<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Result<&'a Value, String> {
    obj.get(name)
        .ok_or_else(|| format!("missing field {name:?}"))
}

fn integer(v: &Value, what: &str) -> Result<i64, String> {
    if let Some(i) = v.as_i64() {
        return Ok(i);
    }
    if let Some(f) = v.as_f64()
        && f.fract() == 0.0
        && f >= i64::MIN as f64
        && f < i64::MAX as f64
    {
        return Ok(f as i64);
    }
    Err(format!("{what} must be an integer, got {v}"))
}

/// Parses one JSON line into a record.
pub fn parse_line(line: &[u8], fields: &FieldMapping) -> Result<Record, String> {
    let obj: serde_json::Map<String, Value> =
        serde_json::from_slice(line).map_err(|e| format!("not a JSON object: {e}"))?;
    let k = field(&obj, &fields.key_field)?;
    let what = || format!("key field {:?}", fields.key_field);
    let key = match fields.key_type {
        KeyType::String => match k {
            Value::String(s) => RecordKey::string(s.as_str()),
            other => return Err(format!("{} must be a string, got {other}", what())),
        },
        KeyType::Long | KeyType::Int => {
            let v = match k {
                Value::String(s) => s
                    .trim()
                    .parse::<i64>()
                    .map_err(|e| format!("{} {s:?}: {e}", what()))?,
                Value::Number(n) => n
                    .as_i64()
                    .ok_or_else(|| format!("{} must be an integer, got {n}", what()))?,
                other => return Err(format!("{} must be an integer, got {other}", what())),
            };
            if fields.key_type == KeyType::Long {
                RecordKey::long(v)
            } else {
                RecordKey::int(
                    i32::try_from(v).map_err(|_| format!("{} {v} is out of int range", what()))?,
                )
            }
        }
    };
    let value = match &fields.value_field {
        Some(name) => integer(field(&obj, name)?, &format!("value field {name:?}"))?,
        None => 0,
    };
    let ts = match &fields.timestamp_field {
        Some(name) => integer(field(&obj, name)?, &format!("timestamp field {name:?}"))?,
        None => 0,
    };
    Ok(Record { key, value, ts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn fields(key_type: KeyType) -> FieldMapping {
        FieldMapping {
            key_field: "user".into(),
            key_type,
            value_field: Some("amount".into()),
            timestamp_field: Some("ts".into()),
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "keyshift-file-source-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn line(i: u64) -> String {
        format!(
            "{{\"user\":\"u{}\",\"amount\":{},\"ts\":{},\"extra\":[1,2]}}\n",
            i % 7,
            i,
            i * 10
        )
    }

    /// A ConfigMap volume's layout: each key a symlink into a hidden, timestamped directory
    /// that `..data` points at.
    #[test]
    fn a_configmap_volumes_symlinked_files_are_partitions_and_its_hidden_entries_are_not() {
        let dir = temp_dir("configmap");
        let data = dir.join("..2026_12_06_10_00_00.123");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("b.jsonl"), line(1)).unwrap();
        std::fs::write(data.join("a.jsonl"), line(2)).unwrap();
        std::os::unix::fs::symlink("..2026_12_06_10_00_00.123", dir.join("..data")).unwrap();
        for f in ["a.jsonl", "b.jsonl"] {
            std::os::unix::fs::symlink(format!("..data/{f}"), dir.join(f)).unwrap();
        }
        std::os::unix::fs::symlink("..data", dir.join("subdir-link")).unwrap();
        let src = FileSourceReader::open(&dir, Some(fields(KeyType::String))).unwrap();
        assert_eq!(src.names(), ["a.jsonl", "b.jsonl"]);
        let mut out = Vec::new();
        let b = src.read_batch(1, 0, &mut out, 10).unwrap();
        assert_eq!((b.records, out[0].value), (1, 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The same partitions as objects under a URL: listed directly under the prefix (hidden
    /// names and deeper objects are not partitions), read by range from any offset, read on as
    /// an object grows (asked for its size at most once per poll), refused by name when it
    /// shrinks below a position.
    #[test]
    fn objects_under_a_url_are_partitions_read_like_files() {
        use object_store::{ObjectStoreExt, PutPayload};
        let url = format!("memory://file-source-{}/in", std::process::id());
        let (store, prefix) = crate::snapshot::open_store(&url).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let put = |name: &str, text: String| {
            let path = object_store::path::Path::from(format!("{prefix}/{name}"));
            rt.block_on(store.put(&path, PutPayload::from(text.into_bytes())))
                .unwrap();
        };
        let a: String = (0..3).map(line).collect();
        let partial = "{\"user\":\"u1\",\"amo";
        put("b.jsonl", format!("{a}{partial}"));
        put("a.jsonl", line(9));
        put(".hidden", line(1));
        put("deeper/c.jsonl", line(1));
        let src = FileSourceReader::open_objects(&url, Some(fields(KeyType::String))).unwrap();
        assert_eq!(src.names(), ["a.jsonl", "b.jsonl"]);
        assert_eq!(src.file(1), Some(Path::new(&format!("{url}/b.jsonl"))));
        // Every batch size resumes exactly; the unterminated line waits.
        for max in [1, 2, 10] {
            let (mut out, mut at) = (Vec::new(), 0);
            loop {
                let b = src.read_batch(1, at, &mut out, max).unwrap();
                at = b.next_offset;
                if b.at_end {
                    assert_eq!(b.partial_tail_bytes, partial.len() as u64);
                    break;
                }
            }
            assert_eq!(out.iter().map(|r| r.value).collect::<Vec<_>>(), [0, 1, 2]);
            assert_eq!(at, a.len() as u64);
            std::thread::sleep(super::super::object_files::GROWTH_POLL);
        }
        // The object grows (rewritten longer): nothing new is asked for within the poll, then
        // the completed line and the next are read.
        let at = a.len() as u64;
        let mut out = Vec::new();
        let b = src.read_batch(1, at, &mut out, 10).unwrap();
        assert!(b.at_end && b.partial_tail_bytes > 0, "{b:?}");
        put(
            "b.jsonl",
            format!("{a}{partial}unt\":5,\"ts\":50}}\n{}", line(6)),
        );
        let b = src.read_batch(1, at, &mut out, 10).unwrap();
        assert_eq!((b.records, b.next_offset), (0, at), "within the poll");
        std::thread::sleep(super::super::object_files::GROWTH_POLL);
        let b = src.read_batch(1, at, &mut out, 10).unwrap();
        assert_eq!(out.iter().map(|r| r.value).collect::<Vec<_>>(), [5, 6]);
        assert!(b.at_end);
        // Shorter than a position: refused, naming the object.
        put("b.jsonl", line(0));
        let e = src.check_position(1, at).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{url}/b.jsonl")) && e.contains("shrank"),
            "{e}"
        );
        // A URL no store serves is told apart from a listing that fails.
        assert!(matches!(
            FileSourceReader::open_objects("ftp://host/in", None),
            Err(OpenObjectsError::Url(_))
        ));
        assert!(matches!(
            FileSourceReader::open_objects(&format!("{url}/empty"), None),
            Err(OpenObjectsError::Read(FileSourceError::NoFiles { .. }))
        ));
    }

    #[test]
    fn resumes_exactly_from_any_batch_size_including_a_partial_last_line() {
        let dir = temp_dir("resume");
        let mut text = String::new();
        for i in 0..1000 {
            text.push_str(&line(i));
            if i % 97 == 0 {
                text.push_str("\r\n   \n"); // blank lines are consumed, not records
            }
        }
        let partial = "{\"user\":\"u1\",\"amo";
        std::fs::write(dir.join("p-000.jsonl"), format!("{text}{partial}")).unwrap();
        std::fs::write(dir.join("p-001.jsonl"), line(5)).unwrap();
        std::fs::write(dir.join(".hidden"), "x").unwrap();
        let src = FileSourceReader::open(&dir, Some(fields(KeyType::String))).unwrap();
        assert_eq!(src.partitions(), 2);
        for batch in [1usize, 3, 64, 5000] {
            let mut all = Vec::new();
            let mut offset = 0;
            loop {
                let mut out = Vec::new();
                let b = src.read_batch(0, offset, &mut out, batch).unwrap();
                assert_eq!(b.records, out.len());
                all.extend(out);
                offset = b.next_offset;
                if b.at_end {
                    assert_eq!(b.partial_tail_bytes, partial.len() as u64);
                    break;
                }
            }
            assert_eq!(all.len(), 1000, "batch {batch}: no loss, no duplicates");
            for (i, r) in all.iter().enumerate() {
                assert_eq!(r.value, i as i64);
                assert_eq!(r.ts, i as i64 * 10);
                assert_eq!(r.key, RecordKey::string(format!("u{}", i % 7)));
            }
            assert_eq!(offset, text.len() as u64, "stops before the partial line");
        }
        // The partial line completes: the next read from the saved offset picks it up.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join("p-000.jsonl"))
            .unwrap();
        f.write_all(b"unt\":3,\"ts\":1}\n").unwrap();
        let mut out = Vec::new();
        let b = src.read_batch(0, text.len() as u64, &mut out, 10).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].value, 3);
        assert!(b.at_end);
        assert_eq!(b.partial_tail_bytes, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_lines_name_file_and_offset() {
        let dir = temp_dir("malformed");
        let good = line(1);
        std::fs::write(
            dir.join("a.jsonl"),
            format!("{good}{{\"user\":\"x\",\"amount\":\"lots\",\"ts\":1}}\n{good}"),
        )
        .unwrap();
        let src = FileSourceReader::open(&dir, Some(fields(KeyType::String))).unwrap();
        let mut out = Vec::new();
        let err = src.read_batch(0, 0, &mut out, 10).unwrap_err();
        match &err {
            FileSourceError::Malformed {
                file,
                offset,
                reason,
            } => {
                assert!(file.ends_with("a.jsonl"));
                assert_eq!(*offset, good.len() as u64);
                assert!(reason.contains("amount"), "{reason}");
            }
            other => panic!("unexpected {other}"),
        }
        assert!(
            err.to_string()
                .contains(&format!("byte offset {}", good.len()))
        );
        assert!(matches!(
            src.read_batch(5, 0, &mut out, 1),
            Err(FileSourceError::NoSuchPartition { partition: 5, .. })
        ));
        assert!(matches!(
            FileSourceReader::open(dir.join("nope"), Some(fields(KeyType::Long))),
            Err(FileSourceError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn names_are_the_partitions_identity_and_a_shrunk_file_is_refused() {
        let dir = temp_dir("names");
        std::fs::write(dir.join("b.jsonl"), line(1)).unwrap();
        std::fs::write(dir.join("a.jsonl"), format!("{}{}", line(2), line(3))).unwrap();
        std::fs::write(dir.join(".hidden"), "x").unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        let src = FileSourceReader::open(&dir, Some(fields(KeyType::String))).unwrap();
        assert_eq!(src.names(), ["a.jsonl", "b.jsonl"]);
        assert!(src.file(0).unwrap().ends_with("a.jsonl"));
        let len = (line(2).len() + line(3).len()) as u64;
        src.check_position(0, len).unwrap();
        let mut out = Vec::new();
        let b = src.read_batch(0, len, &mut out, 10).unwrap();
        assert_eq!((b.records, b.at_end), (0, true));
        // Truncated below a position: refused by name, at restore and while reading.
        std::fs::write(dir.join("a.jsonl"), line(2)).unwrap();
        let e = src.check_position(0, len).unwrap_err();
        match &e {
            FileSourceError::Shrunk { file, offset, size } => {
                assert!(file.ends_with("a.jsonl"));
                assert_eq!((*offset, *size), (len, line(2).len() as u64));
            }
            other => panic!("unexpected {other}"),
        }
        assert!(e.to_string().contains("a.jsonl"), "{e}");
        assert!(matches!(
            src.read_batch(0, len, &mut out, 10),
            Err(FileSourceError::Shrunk { .. })
        ));
        assert!(out.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn non_utf8_file_names_are_refused() {
        use std::os::unix::ffi::OsStrExt;
        let dir = temp_dir("non-utf8");
        let name = std::ffi::OsStr::from_bytes(b"p-\xff.jsonl");
        std::fs::write(dir.join(name), line(1)).unwrap();
        assert!(matches!(
            FileSourceReader::open(&dir, Some(fields(KeyType::String))),
            Err(FileSourceError::NonUtf8Name { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn typed_keys_and_values() {
        let f = fields(KeyType::Long);
        let r = parse_line(br#"{"user": 12, "amount": 3.0, "ts": 5}"#, &f).unwrap();
        assert_eq!((r.key, r.value, r.ts), (RecordKey::long(12), 3, 5));
        let r = parse_line(br#"{"user": "-4", "amount": 1, "ts": 0}"#, &f).unwrap();
        assert_eq!(r.key, RecordKey::long(-4));
        let i = fields(KeyType::Int);
        assert!(parse_line(br#"{"user": 4294967296, "amount": 1, "ts": 0}"#, &i).is_err());
        assert!(parse_line(br#"{"user": 1.5, "amount": 1, "ts": 0}"#, &f).is_err());
        assert!(parse_line(br#"{"amount": 1, "ts": 0}"#, &f).is_err());
        assert!(parse_line(br#"[1,2]"#, &f).is_err());
        let s = fields(KeyType::String);
        assert!(parse_line(br#"{"user": 7, "amount": 1, "ts": 0}"#, &s).is_err());
        let count = FieldMapping {
            value_field: None,
            timestamp_field: None,
            ..s
        };
        let r = parse_line("{\"user\": \"grüße\"}".as_bytes(), &count).unwrap();
        assert_eq!((r.key, r.value, r.ts), (RecordKey::string("grüße"), 0, 0));
    }
}
