//! The config directory merged into one effective config: each service's last good
//! file, the files refused now, and the tombstones of deleted files.
//!
//! Merging is pure: [`ServiceConfigs::apply`] takes what a scan of the directory read
//! and the time, and says what changed. Reading the directory, persisting the merged
//! config, backups and restore are the small I/O functions below it.
//!
//! Robinhood's reasons shape the rules. One mega config makes one team's bad push
//! everybody's incident, so a bad file is refused alone and its last good version stays
//! in force. Deleting a file by mistake must not drop a service's balancing, so a
//! deletion leaves a tombstone that keeps the last config in force for days, and
//! putting the file back within that time revives it as it was.

use super::locality::Localities;
use super::service::{self, FileError, ServiceConfig, MAX_FILE_BYTES};
use ballast_balance::Params;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What the API shows of the config directory.
#[derive(Debug, Clone)]
pub struct ConfigDirStatus {
    /// The directory.
    pub dir: PathBuf,
    /// The merged config and the refusals.
    pub configs: ServiceConfigs,
    /// When the directory was last scanned, in Unix milliseconds.
    pub last_scan_unix_ms: u64,
    /// Why the last scan failed, if it did (the directory missing or unreadable).
    pub scan_error: Option<String>,
}

/// One service in the merged config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The last good version, in force.
    pub config: ServiceConfig,
    /// When that version was loaded, in Unix milliseconds.
    pub loaded_unix_ms: u64,
    /// When the file was found deleted; set for a tombstone.
    pub deleted_unix_ms: Option<u64>,
}

/// The merged config as persisted and backed up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Merged {
    /// Entries by service.
    pub services: BTreeMap<String, Entry>,
}

/// What a scan read for one file: its text, or why it could not be read.
pub(crate) type FileRead = Result<String, FileError>;

/// What one [`ServiceConfigs::apply`] changed.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    /// Services whose config in force changed (new, edited, revived or expired).
    pub changed: BTreeSet<String>,
    /// Files refused in this scan, new or still bad.
    pub rejected: Vec<FileError>,
    /// Services whose file disappeared in this scan.
    pub tombstoned: Vec<String>,
    /// Tombstones whose file came back.
    pub revived: Vec<String>,
    /// Tombstones removed because their time ran out.
    pub expired: Vec<String>,
}

/// The merged config and the current refusals.
#[derive(Debug, Clone)]
pub struct ServiceConfigs {
    merged: Merged,
    errors: BTreeMap<String, FileError>,
    tombstone_ttl_ms: u64,
}

impl ServiceConfigs {
    /// Starts from a persisted merged config (or an empty one). Its sources are parsed
    /// again against `defaults`, since the global defaults may have changed while the
    /// aggregator was down; an entry that no longer validates keeps its stored values.
    pub fn new(mut merged: Merged, defaults: &Params, tombstone_ttl_ms: u64) -> Self {
        for (name, entry) in &mut merged.services {
            if let Ok(cfg) = service::parse(&file_name(name), &entry.config.source, defaults) {
                entry.config = cfg;
            }
        }
        ServiceConfigs {
            merged,
            errors: BTreeMap::new(),
            tombstone_ttl_ms,
        }
    }

    /// Merges a scan of the directory, `files` by file name, at `now_unix_ms`.
    pub fn apply(
        &mut self,
        files: &BTreeMap<String, FileRead>,
        defaults: &Params,
        now_unix_ms: u64,
    ) -> Applied {
        let mut out = Applied::default();
        let mut present = BTreeSet::new();
        let mut errors = BTreeMap::new();
        for (file, read) in files {
            let Some(name) = service_of(file) else {
                continue;
            };
            if !is_service_name(name) {
                errors.insert(
                    file.clone(),
                    FileError {
                        file: file.clone(),
                        line: None,
                        message: format!(
                            "{name:?} is not a valid service name (letters, digits, '.', '_', \
                             '-'; at most 64)"
                        ),
                    },
                );
                continue;
            }
            present.insert(name.to_string());
            let parsed = read
                .clone()
                .and_then(|text| service::parse(file, &text, defaults));
            let entry = self.merged.services.get_mut(name);
            match (parsed, entry) {
                (Ok(cfg), Some(entry)) => {
                    if entry.deleted_unix_ms.take().is_some() {
                        out.revived.push(name.to_string());
                        out.changed.insert(name.to_string());
                    }
                    if entry.config != cfg {
                        entry.config = cfg;
                        entry.loaded_unix_ms = now_unix_ms;
                        out.changed.insert(name.to_string());
                    }
                }
                (Ok(cfg), None) => {
                    self.merged.services.insert(
                        name.to_string(),
                        Entry {
                            config: cfg,
                            loaded_unix_ms: now_unix_ms,
                            deleted_unix_ms: None,
                        },
                    );
                    out.changed.insert(name.to_string());
                }
                (Err(e), entry) => {
                    // The file is back, even if bad: no longer a tombstone, and the last
                    // good version stays in force.
                    if let Some(entry) = entry {
                        if entry.deleted_unix_ms.take().is_some() {
                            out.revived.push(name.to_string());
                        }
                    }
                    errors.insert(file.clone(), e);
                }
            }
        }
        for (name, entry) in &mut self.merged.services {
            if !present.contains(name) && entry.deleted_unix_ms.is_none() {
                entry.deleted_unix_ms = Some(now_unix_ms);
                out.tombstoned.push(name.clone());
            }
        }
        let ttl = self.tombstone_ttl_ms;
        self.merged
            .services
            .retain(|name, entry| match entry.deleted_unix_ms {
                Some(at) if now_unix_ms.saturating_sub(at) >= ttl => {
                    out.expired.push(name.clone());
                    out.changed.insert(name.clone());
                    false
                }
                _ => true,
            });
        out.rejected = errors.values().cloned().collect();
        self.errors = errors;
        out
    }

    /// The merged config.
    pub fn merged(&self) -> &Merged {
        &self.merged
    }

    /// Files refused in the last scan, by file name.
    pub fn errors(&self) -> &BTreeMap<String, FileError> {
        &self.errors
    }

    /// A service's parameters in force, if its config sets them.
    pub fn params(&self, service: &str) -> Option<&Params> {
        self.merged.services.get(service).map(|e| &e.config.params)
    }

    /// The locality splits in force, tombstones included.
    pub fn localities(&self) -> Localities {
        Localities {
            services: self
                .merged
                .services
                .iter()
                .filter(|(_, e)| !e.config.locality.is_empty())
                .map(|(n, e)| (n.clone(), e.config.locality.clone()))
                .collect(),
        }
    }

    /// How long a tombstone lasts.
    pub(crate) fn tombstone_ttl_ms(&self) -> u64 {
        self.tombstone_ttl_ms
    }
}

/// The file that holds `service`'s config.
pub fn file_name(service: &str) -> String {
    format!("{service}.toml")
}

/// The service a file configures; `None` for files that are not service configs
/// (editor swap files, dotfiles, other extensions).
pub(crate) fn service_of(file: &str) -> Option<&str> {
    if file.starts_with('.') {
        return None;
    }
    file.strip_suffix(".toml")
}

/// Whether `name` is one a scan takes a service file's name for: letters, digits,
/// '.', '_' and '-', at most 64 bytes.
fn is_service_name(name: &str) -> bool {
    ballast_shared::wire::is_valid_name(name) && !name.is_empty() && name.len() <= 64
}

/// Why the config directory, the persisted config or a backup could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A persisted config or backup is not what this version writes.
    #[error("{path}: not a Ballast config backup: {detail}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> DirError + '_ {
    move |source| DirError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads every service file of `dir`. A file too big or unreadable is a refusal of
/// that file, not of the scan.
pub(crate) fn scan(dir: &Path) -> Result<BTreeMap<String, FileRead>, DirError> {
    let mut files = BTreeMap::new();
    for item in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let item = item.map_err(io_error(dir))?;
        let Ok(name) = item.file_name().into_string() else {
            continue;
        };
        if service_of(&name).is_none() {
            continue;
        }
        let path = item.path();
        let read = read_bounded(&path).map_err(|e| FileError {
            file: name.clone(),
            line: None,
            message: e.to_string(),
        });
        files.insert(name, read);
    }
    Ok(files)
}

/// Why a service file was not read.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    /// The file system refused.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A directory, a device or a socket under a service file's name.
    #[error("not a regular file")]
    NotAFile,
    /// A symbolic link: followed, it would let whoever can write the directory make
    /// the aggregator read any file it can read, as a service's config.
    #[error("a symbolic link: a service file must be a regular file in the directory")]
    Symlink,
    /// Over the size limit: refused unread.
    #[error("{0} bytes is more than the {MAX_FILE_BYTES}-byte limit of a service file")]
    TooLarge(u64),
    /// Not text.
    #[error("not UTF-8 text")]
    NotUtf8,
}

fn read_bounded(path: &Path) -> Result<String, ReadError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Opened without following a link, then checked as opened: nothing can swap the
    // file for a link between the check and the read.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => ReadError::Symlink,
            _ => ReadError::Io(e),
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(ReadError::NotAFile);
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge(meta.len()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|_| ReadError::NotUtf8)
}

/// Validates every service file in `dir` against `defaults`, as a scan would, without
/// a running aggregator: each file with its verdict, by file name.
pub fn check(
    dir: &Path,
    defaults: &Params,
) -> Result<BTreeMap<String, Result<(), FileError>>, DirError> {
    let files = scan(dir)?;
    let mut configs = ServiceConfigs::new(Merged::default(), defaults, u64::MAX);
    configs.apply(&files, defaults, 0);
    Ok(files
        .keys()
        .map(|f| {
            let verdict = match configs.errors().get(f) {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            };
            (f.clone(), verdict)
        })
        .collect())
}

/// Writes `bytes` to `path` so that a reader sees the old or the new file, never half.
///
/// The new file is first written under a fresh random name beside `path`, created
/// exclusively (`O_EXCL`, no link followed): a file or link planted under a name the
/// writer would use is never written through, whoever else can write the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DirError> {
    write_atomic_mode(path, bytes, 0o644)
}

/// [`write_atomic`] with the new file's permission bits (0o600 for a secret's file).
pub(crate) fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), DirError> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{:016x}.tmp~", rand::random::<u64>()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(&tmp)(e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_error(path)(e)
    })
}

/// Reads a persisted merged config or a backup, and checks every service's values as
/// a config file's are checked: a file edited by hand or damaged on disk must not
/// bring, say, a `min_weight` above `max_weight` into the core.
pub(crate) fn load_merged(path: &Path) -> Result<Merged, DirError> {
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    let corrupt = |detail: String| DirError::Corrupt {
        path: path.display().to_string(),
        detail,
    };
    let merged: Merged = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    for (name, entry) in &merged.services {
        // `restore` writes a file by the name: it must be one a scan could have taken.
        if !is_service_name(name) {
            return Err(corrupt(format!("{name:?} is not a valid service name")));
        }
        entry
            .config
            .params
            .validate()
            .map_err(|e| corrupt(format!("service {name:?}: {e}")))?;
        super::locality::validate(&entry.config.locality)
            .map_err(|e| corrupt(format!("service {name:?}: {e}")))?;
    }
    Ok(merged)
}

/// Persists the merged config.
pub(crate) fn save_merged(path: &Path, merged: &Merged) -> Result<(), DirError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_error(parent))?;
    }
    // Serialising plain data to a Vec cannot fail.
    let bytes = serde_json::to_vec_pretty(merged).unwrap_or_default();
    write_atomic(path, &bytes)
}

/// Backups in `dir`, oldest first.
pub fn backups(dir: &Path) -> Result<Vec<PathBuf>, DirError> {
    let mut found: Vec<(u64, PathBuf)> = match std::fs::read_dir(dir) {
        Ok(items) => items
            .filter_map(Result::ok)
            .filter_map(|i| {
                let name = i.file_name().into_string().ok()?;
                let stamp = name
                    .strip_prefix("services-")?
                    .strip_suffix(".json")?
                    .parse()
                    .ok()?;
                Some((stamp, i.path()))
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_error(dir)(e)),
    };
    found.sort();
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// Writes a backup of `merged` into `dir` unless the newest one already holds the same,
/// then keeps only the newest `keep`. Returns the new backup's path, if one was written.
pub fn backup(
    dir: &Path,
    merged: &Merged,
    now_unix_ms: u64,
    keep: usize,
) -> Result<Option<PathBuf>, DirError> {
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    let existing = backups(dir)?;
    let same = existing
        .last()
        .and_then(|p| load_merged(p).ok())
        .is_some_and(|m| &m == merged);
    let written = if same {
        None
    } else {
        let path = dir.join(format!("services-{now_unix_ms}.json"));
        save_merged(&path, merged)?;
        Some(path)
    };
    let all = backups(dir)?;
    for old in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        std::fs::remove_file(old).map_err(io_error(old))?;
    }
    Ok(written)
}

/// Puts a backup's services back into the config directory as files. Tombstones in
/// the backup are not written: their files were deleted when it was taken. With
/// `exact`, service files the backup does not have are removed, so the directory says
/// what the backup says (the removed services become tombstones, as any deletion).
/// Returns the files written and removed.
pub fn restore(
    backup: &Path,
    dir: &Path,
    exact: bool,
) -> Result<(Vec<String>, Vec<String>), DirError> {
    let merged = load_merged(backup)?;
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    let mut written = Vec::new();
    for (name, entry) in &merged.services {
        if entry.deleted_unix_ms.is_some() {
            continue;
        }
        let file = file_name(name);
        write_atomic(&dir.join(&file), entry.config.source.as_bytes())?;
        written.push(file);
    }
    let mut removed = Vec::new();
    if exact {
        for file in scan(dir)?.into_keys() {
            if !written.contains(&file) {
                let path = dir.join(&file);
                std::fs::remove_file(&path).map_err(io_error(&path))?;
                removed.push(file);
            }
        }
    }
    Ok((written, removed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 24 * 3600 * 1000;

    fn files(items: &[(&str, &str)]) -> BTreeMap<String, FileRead> {
        items
            .iter()
            .map(|(f, t)| (f.to_string(), Ok(t.to_string())))
            .collect()
    }

    fn configs() -> ServiceConfigs {
        ServiceConfigs::new(Merged::default(), &Params::default(), 3 * DAY)
    }

    #[test]
    fn files_become_services_and_others_are_ignored() {
        let mut c = configs();
        let out = c.apply(
            &files(&[
                ("web.toml", "[balance]\nmissing_threshold = 0.2\n"),
                ("db.toml", ""),
                (".web.toml.swp", "junk"),
            ]),
            &Params::default(),
            0,
        );
        assert_eq!(out.changed, ["db", "web"].map(String::from).into());
        assert_eq!(c.params("web").map(|p| p.missing_threshold), Some(0.2));
        assert!(out.rejected.is_empty());
        // Unchanged files change nothing.
        let again = c.apply(
            &files(&[
                ("web.toml", "[balance]\nmissing_threshold = 0.2\n"),
                ("db.toml", ""),
            ]),
            &Params::default(),
            1,
        );
        assert!(again.changed.is_empty());
    }

    #[test]
    fn a_bad_file_keeps_its_last_good_version_and_touches_no_other() {
        let mut c = configs();
        let d = Params::default();
        c.apply(
            &files(&[
                ("web.toml", "[balance]\nmissing_threshold = 0.2\n"),
                ("db.toml", ""),
            ]),
            &d,
            0,
        );
        let out = c.apply(
            &files(&[
                ("web.toml", "[balance]\nmissing_threshold = 7\n"),
                ("db.toml", "[balance]\nmissing_threshold = 0.3\n"),
            ]),
            &d,
            1,
        );
        assert_eq!(out.changed, ["db".to_string()].into());
        assert_eq!(out.rejected.len(), 1);
        assert_eq!(out.rejected[0].file, "web.toml");
        assert_eq!(out.rejected[0].line, Some(2));
        assert_eq!(c.params("web").map(|p| p.missing_threshold), Some(0.2));
        assert_eq!(c.params("db").map(|p| p.missing_threshold), Some(0.3));
        assert!(c.errors().contains_key("web.toml"));
        // Fixed: the error goes.
        c.apply(&files(&[("web.toml", ""), ("db.toml", "")]), &d, 2);
        assert!(c.errors().is_empty());
    }

    #[test]
    fn a_bad_new_file_is_refused_and_configures_nothing() {
        let mut c = configs();
        let out = c.apply(&files(&[("new.toml", "[balance\n")]), &Params::default(), 0);
        assert!(out.changed.is_empty());
        assert_eq!(c.params("new"), None);
        assert_eq!(out.rejected.len(), 1);
    }

    #[test]
    fn an_invalid_service_name_is_refused() {
        let mut c = configs();
        let out = c.apply(&files(&[("we b.toml", "")]), &Params::default(), 0);
        assert_eq!(out.rejected.len(), 1);
        assert!(out.rejected[0].message.contains("service name"));
    }

    #[test]
    fn deletion_leaves_a_tombstone_that_revives_or_expires() {
        let mut c = configs();
        let d = Params::default();
        let text = "[balance]\nmissing_threshold = 0.2\n[locality.a]\na = 1\n";
        c.apply(&files(&[("web.toml", text)]), &d, 0);

        let out = c.apply(&files(&[]), &d, 1000);
        assert_eq!(out.tombstoned, ["web"]);
        assert!(
            out.changed.is_empty(),
            "a tombstone keeps the config in force"
        );
        assert_eq!(c.params("web").map(|p| p.missing_threshold), Some(0.2));
        assert!(c.localities().split_for("web", "a").is_some());
        assert_eq!(c.merged().services["web"].deleted_unix_ms, Some(1000));

        // Back within the period: revived as it was.
        let out = c.apply(&files(&[("web.toml", text)]), &d, 2 * DAY);
        assert_eq!(out.revived, ["web"]);
        assert_eq!(c.merged().services["web"].deleted_unix_ms, None);

        // Deleted again and left past the period: gone.
        c.apply(&files(&[]), &d, 3 * DAY);
        let out = c.apply(&files(&[]), &d, 6 * DAY - 1);
        assert!(out.expired.is_empty());
        let out = c.apply(&files(&[]), &d, 6 * DAY);
        assert_eq!(out.expired, ["web"]);
        assert_eq!(out.changed, ["web".to_string()].into());
        assert_eq!(c.params("web"), None);
    }

    #[test]
    fn a_restart_reparses_sources_against_new_defaults() {
        let mut c = configs();
        c.apply(
            &files(&[("web.toml", "[balance]\nkind = 1\n")]),
            &Params::default(),
            0,
        );
        c.apply(&files(&[("web.toml", "")]), &Params::default(), 0);
        let merged = c.merged().clone();
        let new_defaults = Params {
            thin_load: 0.05,
            ..Params::default()
        };
        let c = ServiceConfigs::new(merged, &new_defaults, DAY);
        assert_eq!(c.params("web").map(|p| p.thin_load), Some(0.05));
    }

    #[test]
    fn backups_keep_the_newest_and_restore_puts_files_back() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (conf, bak) = (tmp.path().join("conf"), tmp.path().join("bak"));
        std::fs::create_dir_all(&conf).expect("mkdir");
        let mut c = configs();
        let d = Params::default();
        for (i, t) in [
            "",
            "[balance]\nthin_load = 0.03\n",
            "[balance]\nthin_load = 0.04\n",
        ]
        .iter()
        .enumerate()
        {
            c.apply(&files(&[("web.toml", t), ("db.toml", "")]), &d, i as u64);
            let again = backup(&bak, c.merged(), i as u64 * 10, 2).expect("backup");
            assert!(again.is_some());
            // Nothing new: no new backup.
            assert_eq!(
                backup(&bak, c.merged(), i as u64 * 10 + 1, 2).expect("b"),
                None
            );
        }
        let kept = backups(&bak).expect("list");
        assert_eq!(kept.len(), 2);
        assert!(kept[1].ends_with("services-20.json"), "{kept:?}");

        std::fs::write(conf.join("stray.toml"), "").expect("write");
        let (written, removed) = restore(&kept[0], &conf, true).expect("restore");
        assert_eq!(written, ["db.toml", "web.toml"]);
        assert_eq!(removed, ["stray.toml"]);
        let web = std::fs::read_to_string(conf.join("web.toml")).expect("read");
        assert_eq!(web, "[balance]\nthin_load = 0.03\n");

        std::fs::write(kept[0].clone(), "{").expect("corrupt");
        assert!(matches!(
            restore(&kept[0], &conf, false),
            Err(DirError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_persisted_config_with_values_out_of_range_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("services.json");
        let mut c = configs();
        c.apply(&files(&[("web.toml", "")]), &Params::default(), 0);
        let mut merged = c.merged().clone();
        save_merged(&path, &merged).expect("save");
        assert_eq!(load_merged(&path).expect("a good one loads"), merged);
        // Edited on disk: min above max, which f64::clamp would panic on.
        let entry = merged.services.get_mut("web").expect("web");
        entry.config.params.min_weight = 5.0;
        entry.config.params.max_weight = 2.0;
        save_merged(&path, &merged).expect("save");
        match load_merged(&path) {
            Err(DirError::Corrupt { detail, .. }) => {
                assert!(detail.contains("web"), "{detail}")
            }
            other => panic!("loaded: {other:?}"),
        }
    }

    #[test]
    fn a_persisted_config_with_an_invalid_service_name_is_refused() {
        // Found by fuzzing: a name no scan takes, such as one with a path in it, which
        // `restore` would write a file by.
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("services.json");
        let mut c = configs();
        c.apply(&files(&[("web.toml", "")]), &Params::default(), 0);
        for bad in ["a  pi", "../../etc/cron.d/x", ""] {
            let mut merged = c.merged().clone();
            let entry = merged.services.remove("web").expect("web");
            merged.services.insert(bad.to_string(), entry);
            save_merged(&path, &merged).expect("save");
            match load_merged(&path) {
                Err(DirError::Corrupt { detail, .. }) => {
                    assert!(detail.contains("not a valid service name"), "{detail}")
                }
                other => panic!("{bad:?} loaded: {other:?}"),
            }
        }
    }

    #[test]
    fn check_gives_each_file_a_verdict() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::write(tmp.path().join("ok.toml"), "").expect("write");
        std::fs::write(tmp.path().join("bad.toml"), "[balance]\nx = 1\n").expect("write");
        std::fs::write(tmp.path().join("notes.txt"), "ignored").expect("write");
        let v = check(tmp.path(), &Params::default()).expect("check");
        assert_eq!(v.len(), 2);
        assert_eq!(v["ok.toml"], Ok(()));
        assert_eq!(v["bad.toml"].as_ref().map_err(|e| e.line), Err(Some(2)));
        assert!(check(&tmp.path().join("nope"), &Params::default()).is_err());
    }

    #[test]
    fn a_symbolic_link_in_the_directory_is_refused_by_the_scan() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (dir, outside) = (tmp.path().join("conf"), tmp.path().join("secret"));
        std::fs::create_dir(&dir).expect("dir");
        std::fs::write(&outside, "").expect("a file the directory's writer cannot read");
        std::os::unix::fs::symlink(&outside, dir.join("web.toml")).expect("link");
        std::fs::write(dir.join("api.toml"), "").expect("write");
        let found = scan(&dir).expect("scan");
        assert!(found["api.toml"].is_ok(), "the others are read");
        match &found["web.toml"] {
            Err(e) => assert!(e.message.contains("symbolic link"), "{e:?}"),
            Ok(text) => panic!("read through the link: {text:?}"),
        }
    }

    #[test]
    fn an_atomic_write_does_not_write_through_a_planted_link() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tempdir");
        let (dir, victim) = (tmp.path().join("conf"), tmp.path().join("victim"));
        std::fs::create_dir(&dir).expect("dir");
        std::fs::write(&victim, "untouched").expect("victim");
        // Links under the temporary names a predictable writer would use.
        for name in ["web.tmp~", "web.toml.tmp", ".web.toml.tmp~"] {
            std::os::unix::fs::symlink(&victim, dir.join(name)).expect("link");
        }
        write_atomic(&dir.join("web.toml"), b"[balance]\n").expect("write");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("victim"),
            "untouched"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("web.toml")).expect("written"),
            "[balance]\n"
        );
        let mode = std::fs::metadata(dir.join("web.toml"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
        let left: Vec<String> = std::fs::read_dir(&dir)
            .expect("dir")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with("tmp~") && n.len() > 16)
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    #[test]
    fn a_file_too_big_is_refused_by_the_scan() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let big = vec![b'#'; MAX_FILE_BYTES as usize + 1];
        std::fs::write(tmp.path().join("big.toml"), big).expect("write");
        std::fs::write(tmp.path().join("ok.toml"), "").expect("write");
        let found = scan(tmp.path()).expect("scan");
        assert!(found["big.toml"]
            .as_ref()
            .is_err_and(|e| e.message.contains("limit")));
        assert!(found["ok.toml"].is_ok());
    }
}
