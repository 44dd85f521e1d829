//! The embedded routing store: one JSON file, replaced atomically.
//!
//! The file I/O is blocking, so each call runs on tokio's blocking pool and the
//! runtime's workers never wait on the disk.
//!
//! Each service in the file is checked when it is read ([`super::validate`]): one that
//! does not parse or is not valid is dropped with a log line and counted, and the
//! others load. A file that is not JSON at all, or of another format, still fails the
//! load: that is a file someone else wrote, not a service gone bad.
//!
//! The same format keeps the etcd store's local copy; that file is labelled with the
//! etcd prefix it copies ([`FileStore::with_origin`]), so that a copy of another prefix
//! is never served.

use super::validate::{self, Defect, SkipCounts};
use super::{RoutingStore, StoreError, StoreFuture};
use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The file format, versioned so that a future layout can be told apart.
#[derive(serde::Serialize)]
struct Document<'a> {
    format: u32,
    /// What the file copies, for a copy (the etcd store's local copy); absent in the
    /// weights file itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    origin: Option<&'a str>,
    services: &'a BTreeMap<String, ServiceSnapshot>,
}

/// [`Document`] as read: each service is parsed on its own, so that one bad service
/// does not take the others with it.
#[derive(serde::Deserialize)]
struct RawDocument {
    format: u32,
    #[serde(default)]
    origin: Option<String>,
    services: BTreeMap<String, serde_json::Value>,
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
    /// What the file must say it copies; `None` for the weights file itself.
    origin: Option<String>,
    // The whole document, so that a batch of services rewrites the file once. The lock
    // also keeps two writes from interleaving on the temporary file.
    cache: Mutex<Option<BTreeMap<String, ServiceSnapshot>>>,
    skipped: SkipCounts,
}

impl FileStore {
    /// A store at `path`; the file need not exist yet.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self::build(path.into(), None)
    }

    /// A store at `path` that holds a copy of `origin` (e.g. `etcd prefix /ballast`):
    /// the file is labelled with it, and a file labelled otherwise is refused.
    pub fn with_origin(path: impl Into<PathBuf>, origin: impl Into<String>) -> Self {
        Self::build(path.into(), Some(origin.into()))
    }

    fn build(path: PathBuf, origin: Option<String>) -> Self {
        FileStore {
            inner: Arc::new(Inner {
                path,
                origin,
                cache: Mutex::new(None),
                skipped: SkipCounts::default(),
            }),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Replaces the whole file with `services`: the services not among them are
    /// removed.
    pub fn replace(&self, services: BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'static, ()> {
        self.blocking(move |inner| inner.replace(services))
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

    fn corrupt(&self, detail: String) -> StoreError {
        StoreError::Corrupt {
            path: self.path.display().to_string(),
            detail,
        }
    }

    fn read(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(self.io(e)),
        };
        let doc: RawDocument =
            serde_json::from_slice(&bytes).map_err(|e| self.corrupt(e.to_string()))?;
        if doc.format != FORMAT {
            return Err(self.corrupt(format!("format {} is not {FORMAT}", doc.format)));
        }
        if doc.origin != self.origin {
            return Err(self.corrupt(format!(
                "a copy of {}, not of {}",
                doc.origin.as_deref().unwrap_or("nothing (a weights file)"),
                self.origin.as_deref().unwrap_or("nothing (a weights file)"),
            )));
        }
        let mut services = BTreeMap::new();
        for (service, value) in doc.services {
            match validate::snapshot_from_json(&service, value) {
                Ok(snapshot) => {
                    services.insert(service, snapshot);
                }
                Err(corrupt) => self.skip(&service, corrupt.defect, &corrupt.detail),
            }
        }
        Ok(services)
    }

    fn skip(&self, service: &str, defect: Defect, detail: &str) {
        tracing::warn!(file = %self.path.display(), %service, reason = defect.label(),
            error = detail, "routing store: a corrupt service is skipped; the others load");
        self.skipped.record(defect);
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
            origin: self.origin.as_deref(),
            services,
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

    fn replace(&self, services: BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError> {
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| StoreError::Backend("store lock poisoned".into()))?;
        let result = self.write_atomically(&services);
        *cache = Some(services);
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

    fn take_skipped(&self) -> BTreeMap<Defect, u64> {
        self.inner.skipped.take()
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
            operator: Default::default(),
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
    async fn corrupt_services_are_dropped_and_counted_and_the_others_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        let mut negative = serde_json::to_value(snap(1.0)).expect("json");
        negative["endpoints"]["n1"]["weight"] = serde_json::json!(-2.0);
        let mut no_port = serde_json::to_value(snap(1.0)).expect("json");
        no_port["endpoints"]["n1"]["address"] = serde_json::json!("10.0.0.1");
        let mut bad_node = serde_json::to_value(snap(1.0)).expect("json");
        let ep = bad_node["endpoints"]["n1"].take();
        bad_node["endpoints"] = serde_json::json!({ "n 1": ep });
        let doc = serde_json::json!({
            "format": 1,
            "services": {
                "good": serde_json::to_value(snap(1.5)).expect("json"),
                "negative": negative,
                "no-port": no_port,
                "bad-node": bad_node,
                "not-a-snapshot": "weights",
                "bad name": serde_json::to_value(snap(1.0)).expect("json"),
            }
        });
        std::fs::write(&path, serde_json::to_vec(&doc).expect("json")).expect("write");
        let store = FileStore::new(&path);
        let loaded = store.load().await.expect("the good service loads");
        assert_eq!(loaded.keys().collect::<Vec<_>>(), ["good"]);
        assert_eq!(loaded["good"], snap(1.5));
        let skipped = store.take_skipped();
        assert_eq!(
            skipped,
            [
                (Defect::Unparseable, 1),
                (Defect::Service, 1),
                (Defect::Node, 1),
                (Defect::Address, 1),
                (Defect::Weight, 1)
            ]
            .into()
        );
        assert!(store.take_skipped().is_empty(), "counted once");
        // The next write keeps only what loaded.
        store
            .put(&[("other".to_string(), snap(0.5))].into())
            .await
            .expect("put");
        let again = FileStore::new(&path);
        assert_eq!(again.load().await.expect("load").len(), 2);
        assert!(again.take_skipped().is_empty());
    }

    #[tokio::test]
    async fn a_copy_is_labelled_and_a_copy_of_something_else_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.etcd-copy.json");
        let copy = FileStore::with_origin(&path, "etcd prefix /a");
        copy.replace([("web".to_string(), snap(1.0))].into())
            .await
            .expect("replace");
        copy.replace([("api".to_string(), snap(2.0))].into())
            .await
            .expect("replace");
        let same = FileStore::with_origin(&path, "etcd prefix /a");
        assert_eq!(
            same.load().await.expect("load").keys().collect::<Vec<_>>(),
            ["api"],
            "replace removes what it does not name"
        );
        let other = FileStore::with_origin(&path, "etcd prefix /b");
        let err = other.load().await.expect_err("another prefix");
        assert!(err.to_string().contains("etcd prefix /a"), "{err}");
        let err = FileStore::new(&path)
            .load()
            .await
            .expect_err("not a weights file");
        assert!(err.to_string().contains("copy"), "{err}");
    }

    #[tokio::test]
    async fn a_corrupt_file_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        std::fs::write(&path, b"{not json").expect("write");
        let err = FileStore::new(&path).load().await.expect_err("corrupt");
        assert!(err.to_string().contains("corrupt routing store"), "{err}");
    }

    #[tokio::test]
    async fn a_weight_reads_back_bit_for_bit() {
        // Found by fuzzing: the shortest digits of 16/15 (and of one weight in ten)
        // were read back one unit in the last place off, until serde_json parsed floats
        // exactly (its `float_roundtrip` feature).
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        for w in [
            16.0 / 15.0,
            1.0 / 11.0,
            1.0 / 53.0,
            0.1 + 0.2,
            9.999999999999998,
        ] {
            let store = FileStore::new(&path);
            store
                .put(&[("a".to_string(), snap(w))].into())
                .await
                .expect("put");
            let back = FileStore::new(&path).load().await.expect("load");
            let read = back["a"].endpoints["n1"].weight;
            assert_eq!(read.to_bits(), w.to_bits(), "{w} read back as {read}");
        }
    }

    /// A weights file exactly as the release that spoke `ballast/1` wrote it (pretty
    /// JSON, format 1, no origin), and one of a release before strategy weights,
    /// zones and draining were kept: today's reader loads both.
    #[tokio::test]
    async fn files_the_previous_releases_wrote_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        let previous = br#"{
  "format": 1,
  "services": {
    "web": {
      "version": 41,
      "cycle": 120,
      "endpoints": {
        "web-1": {
          "address": "10.0.0.1:8080",
          "zone": "z1",
          "draining": false,
          "weight": 1.3,
          "strategy_weights": {
            "pid": 1.3,
            "round_robin": 1.0
          }
        },
        "web-2": {
          "address": "10.0.0.2:8080",
          "zone": "",
          "draining": true,
          "weight": 0.0,
          "strategy_weights": {}
        }
      }
    }
  }
}"#;
        std::fs::write(&path, previous).expect("write");
        let loaded = FileStore::new(&path).load().await.expect("loads");
        let web = &loaded["web"];
        assert_eq!((web.version, web.cycle), (41, 120));
        assert_eq!(web.endpoints["web-1"].weight, 1.3);
        assert_eq!(
            web.endpoints["web-1"].strategy_weights[&ballast_balance::Strategy::Pid],
            1.3
        );
        assert!(web.endpoints["web-2"].draining);

        let older = br#"{"format":1,"services":{"api":{"version":2,"cycle":2,"endpoints":{"a-1":{"address":"h:1","weight":0.5}}}}}"#;
        std::fs::write(&path, older).expect("write");
        let loaded = FileStore::new(&path).load().await.expect("loads");
        let a1 = &loaded["api"].endpoints["a-1"];
        assert_eq!((a1.weight, a1.draining, a1.zone.as_str()), (0.5, false, ""));
        assert!(a1.strategy_weights.is_empty());
    }

    /// What a later release may add to a service (a field this one does not know) is
    /// ignored, so that this release reads what the next writes; a file of a format
    /// this release does not know is refused whole, by its number.
    #[tokio::test]
    async fn added_fields_are_ignored_and_an_unknown_format_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        let added = br#"{"format":1,"written_by":"9.9.9","services":{"api":{"version":2,"cycle":2,"future":[1,2],"endpoints":{"a-1":{"address":"h:1","weight":0.5,"weight_floor":0.1}}}}}"#;
        std::fs::write(&path, added).expect("write");
        let loaded = FileStore::new(&path).load().await.expect("loads");
        assert_eq!(loaded["api"].endpoints["a-1"].weight, 0.5);

        let next = br#"{"format":2,"services":{}}"#;
        std::fs::write(&path, next).expect("write");
        let err = FileStore::new(&path).load().await.expect_err("refused");
        assert!(err.to_string().contains("format 2 is not 1"), "{err}");
    }
}
