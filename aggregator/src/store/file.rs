//! The embedded routing store: one JSON file, replaced atomically.
//!
//! The file I/O is blocking, so each call runs on tokio's blocking pool and the
//! runtime's workers never wait on the disk.

use super::{RoutingStore, StoreError, StoreFuture};
use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The file format, versioned so that a future layout can be told apart.
#[derive(serde::Serialize, serde::Deserialize)]
struct Document {
    format: u32,
    services: BTreeMap<String, ServiceSnapshot>,
}

const FORMAT: u32 = 1;

/// A routing store in one local file. Each write goes to a temporary file in the same
/// directory, is fsynced, and is renamed over the old one, so a crash leaves either the
/// old or the new weights and never half of each.
pub struct FileStore {
    // Shared with the blocking task of each call.
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    // The whole document, so that a batch of services rewrites the file once. The lock
    // also keeps two writes from interleaving on the temporary file.
    cache: Mutex<Option<BTreeMap<String, ServiceSnapshot>>>,
}

impl FileStore {
    /// A store at `path`; the file need not exist yet.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileStore {
            inner: Arc::new(Inner {
                path: path.into(),
                cache: Mutex::new(None),
            }),
        }
    }

    /// Runs `f` on the blocking pool with the store's state.
    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, StoreError> + Send + 'static,
    ) -> StoreFuture<'static, T> {
        let inner = self.inner.clone();
        Box::pin(async move { tokio::task::spawn_blocking(move || f(&inner)).await? })
    }
}

impl Inner {
    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: self.path.display().to_string(),
            source,
        }
    }

    fn read(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(self.io(e)),
        };
        let doc: Document = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
            path: self.path.display().to_string(),
            detail: e.to_string(),
        })?;
        if doc.format != FORMAT {
            return Err(StoreError::Corrupt {
                path: self.path.display().to_string(),
                detail: format!("format {} is not {FORMAT}", doc.format),
            });
        }
        Ok(doc.services)
    }

    fn write_atomically(
        &self,
        services: &BTreeMap<String, ServiceSnapshot>,
    ) -> Result<(), StoreError> {
        let dir = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| self.io(e))?;
        let doc = Document {
            format: FORMAT,
            services: services.clone(),
        };
        let bytes =
            serde_json::to_vec_pretty(&doc).map_err(|e| StoreError::Backend(e.to_string()))?;
        let mut tmp = tempfile_in(dir, &self.path).map_err(|e| self.io(e))?;
        tmp.1.write_all(&bytes).map_err(|e| self.io(e))?;
        tmp.1.sync_all().map_err(|e| self.io(e))?;
        std::fs::rename(&tmp.0, &self.path).map_err(|e| self.io(e))?;
        // The rename is durable only once the directory entry is.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    fn load(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError> {
        let services = self.read()?;
        if let Ok(mut cache) = self.cache.lock() {
            *cache = Some(services.clone());
        }
        Ok(services)
    }

    fn put(&self, changed: &BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError> {
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| StoreError::Backend("store lock poisoned".into()))?;
        let mut all = match cache.take() {
            Some(all) => all,
            None => self.read()?,
        };
        for (k, v) in changed {
            all.insert(k.clone(), v.clone());
        }
        let result = self.write_atomically(&all);
        *cache = Some(all);
        result
    }
}

fn tempfile_in(dir: &Path, target: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "store".into());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let f = std::fs::File::create(&tmp)?;
    Ok((tmp, f))
}

impl RoutingStore for FileStore {
    fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
        self.blocking(Inner::load)
    }

    fn put<'a>(&'a self, changed: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()> {
        if changed.is_empty() {
            return Box::pin(std::future::ready(Ok(())));
        }
        let changed = changed.clone();
        self.blocking(move |inner| inner.put(&changed))
    }

    fn describe(&self) -> String {
        format!("file {}", self.inner.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_balance::EndpointSnapshot;

    fn snap(w: f64) -> ServiceSnapshot {
        ServiceSnapshot {
            version: 3,
            cycle: 9,
            endpoints: [(
                "n1".to_string(),
                EndpointSnapshot {
                    address: "h:1".into(),
                    zone: "z".into(),
                    draining: false,
                    weight: w,
                    strategy_weights: Default::default(),
                },
            )]
            .into(),
        }
    }

    #[tokio::test]
    async fn writes_survive_a_new_store_and_batches_merge() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/weights.json");
        let store = FileStore::new(&path);
        assert!(store.load().await.expect("empty").is_empty());
        store
            .put(&[("a".to_string(), snap(1.5))].into())
            .await
            .expect("put a");
        store
            .put(&[("b".to_string(), snap(0.5))].into())
            .await
            .expect("put b");
        let again = FileStore::new(&path).load().await.expect("load");
        assert_eq!(again.len(), 2);
        assert_eq!(again["a"].endpoints["n1"].weight, 1.5);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[tokio::test]
    async fn a_corrupt_file_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        std::fs::write(&path, b"{not json").expect("write");
        let err = FileStore::new(&path).load().await.expect_err("corrupt");
        assert!(err.to_string().contains("corrupt routing store"), "{err}");
    }
}
