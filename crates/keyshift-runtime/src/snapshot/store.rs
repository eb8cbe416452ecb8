//! Opening an object store from a storage URL.

use super::error::{Result, SnapshotError};
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreScheme};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use url::Url;

const S3_HINT: &str = "For S3 set AWS_REGION and credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a role); for an S3-compatible server also AWS_ENDPOINT=http://host:port and AWS_ALLOW_HTTP=true";
const GCS_HINT: &str = "For GCS set GOOGLE_SERVICE_ACCOUNT_KEY (the service account key's JSON), GOOGLE_SERVICE_ACCOUNT (a key file's path) or GOOGLE_APPLICATION_CREDENTIALS, or run with workload identity";
const AZURE_HINT: &str = "For Azure set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or a SAS token / workload identity); az://container/prefix or abfss://container@account.dfs.core.windows.net/prefix";
const FILE_HINT: &str = "Use file:///absolute/path/to/dir (three slashes, absolute path)";
const MEMORY_HINT: &str = "Use memory://name/prefix (tests only; stores sharing a name share data)";

/// Process-wide in-memory stores, one per `memory://<name>` host, so every `open_store` of the
/// same name sees the same objects (like a real bucket).
static MEMORY_STORES: LazyLock<Mutex<HashMap<String, Arc<InMemory>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Opens the object store a storage URL points at and returns it with the URL's path inside it
/// (the prefix under which keyshift lays out jobs).
///
/// | URL | store | prefix |
/// | --- | --- | --- |
/// | `file:///abs/dir` (or a bare `/abs/dir`) | local filesystem rooted at the dir (created if missing), fsync on every write | empty |
/// | `memory://name/p` | a process-global in-memory store per `name` (tests) | `p` |
/// | `s3://bucket/p` | S3 from the `AWS_*` environment (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `AWS_REGION`, keys) | `p` |
/// | `gs://bucket/p` | GCS from the `GOOGLE_*` environment | `p` |
/// | `az://container/p`, `abfs(s)://…` | Azure Blob from the `AZURE_*` environment | `p` |
pub fn open_store(url: &str) -> Result<(Arc<dyn ObjectStore>, Path)> {
    let trimmed = url.trim();
    if trimmed.starts_with('/') {
        return open_local(url, std::path::PathBuf::from(trimmed));
    }
    let parsed = Url::parse(trimmed).map_err(|e| SnapshotError::InvalidUrl {
        url: url.to_owned(),
        reason: e.to_string(),
        hint: "Use a URL such as file:///var/lib/keyshift, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix",
    })?;
    let unsupported = || SnapshotError::UnsupportedScheme {
        url: url.to_owned(),
        scheme: parsed.scheme().to_owned(),
    };
    match parsed.scheme() {
        "memory" => return open_memory(url, &parsed),
        "s3" | "s3a" | "gs" | "az" | "adl" | "azure" | "abfs" | "abfss"
            if parsed.host_str().is_none_or(str::is_empty) =>
        {
            return Err(SnapshotError::InvalidUrl {
                url: url.to_owned(),
                reason: "the bucket (or container) name is missing".to_owned(),
                hint: "Use s3://bucket/prefix, gs://bucket/prefix or az://container/prefix",
            });
        }
        _ => {}
    }
    let (scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|_| unsupported())?;
    let prefix = |hint| {
        Path::parse(path).map_err(|e| SnapshotError::InvalidUrl {
            url: url.to_owned(),
            reason: e.to_string(),
            hint,
        })
    };
    let config = |hint: &'static str| {
        move |source| SnapshotError::StoreConfig {
            url: url.to_owned(),
            hint,
            source,
        }
    };
    match scheme {
        ObjectStoreScheme::Local => {
            let dir = parsed
                .to_file_path()
                .map_err(|()| SnapshotError::InvalidUrl {
                    url: url.to_owned(),
                    reason: "not an absolute local path".to_owned(),
                    hint: FILE_HINT,
                })?;
            open_local(url, dir)
        }
        ObjectStoreScheme::AmazonS3 => {
            let store = AmazonS3Builder::from_env()
                .with_url(trimmed)
                .build()
                .map_err(config(S3_HINT))?;
            Ok((Arc::new(store), prefix(S3_HINT)?))
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let store = GoogleCloudStorageBuilder::from_env()
                .with_url(trimmed)
                .build()
                .map_err(config(GCS_HINT))?;
            Ok((Arc::new(store), prefix(GCS_HINT)?))
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let store = MicrosoftAzureBuilder::from_env()
                .with_url(trimmed)
                .build()
                .map_err(config(AZURE_HINT))?;
            Ok((Arc::new(store), prefix(AZURE_HINT)?))
        }
        _ => Err(unsupported()),
    }
}

fn open_local(url: &str, dir: std::path::PathBuf) -> Result<(Arc<dyn ObjectStore>, Path)> {
    if !dir.is_absolute() {
        return Err(SnapshotError::InvalidUrl {
            url: url.to_owned(),
            reason: "the path is not absolute".to_owned(),
            hint: FILE_HINT,
        });
    }
    std::fs::create_dir_all(&dir).map_err(|source| SnapshotError::CreateDir {
        url: url.to_owned(),
        path: dir.clone(),
        source,
    })?;
    let store = LocalFileSystem::new_with_prefix(&dir)
        .map_err(|source| SnapshotError::StoreConfig {
            url: url.to_owned(),
            hint: FILE_HINT,
            source,
        })?
        // Durability: fsync file contents and parent directories before a write returns.
        .with_fsync(true)
        // Deleting a snapshot's last file removes its (then empty) directory.
        .with_automatic_cleanup(true);
    // State-file uploads and range reads are done by `FileStore` itself (see `super::file_store`).
    Ok((
        Arc::new(super::file_store::FileStore::new(store)),
        Path::default(),
    ))
}

fn open_memory(url: &str, parsed: &Url) -> Result<(Arc<dyn ObjectStore>, Path)> {
    let name = parsed.host_str().unwrap_or_default().to_owned();
    let prefix = Path::parse(parsed.path()).map_err(|e| SnapshotError::InvalidUrl {
        url: url.to_owned(),
        reason: e.to_string(),
        hint: MEMORY_HINT,
    })?;
    let mut stores = MEMORY_STORES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let store = stores
        .entry(name)
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone();
    Ok((store, prefix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn memory_stores_are_shared_by_name() {
        let (a, pa) = open_store("memory://store-unit-test/some/prefix").unwrap();
        assert_eq!(pa.as_ref(), "some/prefix");
        a.put(&pa.clone().join("x"), "hello".into()).await.unwrap();
        let (b, _) = open_store("memory://store-unit-test").unwrap();
        let got = b
            .get(&pa.clone().join("x"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&got[..], b"hello");
        let (c, _) = open_store("memory://another-name").unwrap();
        assert!(c.get(&pa.clone().join("x")).await.is_err());
    }

    #[test]
    fn file_url_creates_the_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        let url = format!("file://{}", dir.display());
        let (_store, prefix) = open_store(&url).unwrap();
        assert!(prefix.is_root());
        assert!(dir.is_dir());
        open_store(&dir.display().to_string()).unwrap();
    }

    #[test]
    fn bad_urls_are_explained() {
        let err = open_store("ftp://x/y").unwrap_err().to_string();
        assert!(
            err.contains("ftp://x/y") && err.contains("file:///"),
            "{err}"
        );
        let err = open_store("not a url").unwrap_err().to_string();
        assert!(
            err.contains("not a url") && err.contains("s3://bucket"),
            "{err}"
        );
        let err = open_store("s3:///prefix").unwrap_err().to_string();
        assert!(
            err.contains("bucket (or container) name is missing"),
            "{err}"
        );
        let err = open_store("gs://").unwrap_err().to_string();
        assert!(err.contains("name is missing"), "{err}");
    }

    #[test]
    fn cloud_urls_build_clients_without_io() {
        let (_s, p) = open_store("s3://bucket/some/prefix").unwrap();
        assert_eq!(p.as_ref(), "some/prefix");
        // Azure needs an account before it can build a client; the error says how to give one.
        if std::env::var_os("AZURE_STORAGE_ACCOUNT_NAME").is_none() {
            let err = open_store("az://container/pre").unwrap_err().to_string();
            assert!(
                err.contains("az://container/pre") && err.contains("AZURE_STORAGE_ACCOUNT_NAME"),
                "{err}"
            );
        }
    }
}
