//! The live side of the config directory: watch it, merge what changed, and put the
//! result in force in the balancer and the feeds without a restart.
//!
//! An input of the daemon, like ingest: it writes the balancer's parameters under its
//! lock, and asks the cycle loop to publish new locality splits. What a config is,
//! and how a directory's files merge, is [`crate::config`], which knows nothing of
//! the state.

use crate::config::dir::{self, DirError, Merged, ServiceConfigs};
use crate::config::service::FileError;
use crate::config::{ServiceConfigSettings, StoreConfig};
use crate::door::Door;
use crate::metrics::{FileLabel, Reason};
use crate::state::State;
use ballast_balance::Params;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long after a file event the directory is scanned: editors write a file in
/// several steps, and one scan after the burst sees the finished file.
const SETTLE: Duration = Duration::from_millis(150);

use crate::config::dir::ConfigDirStatus;

/// The config directory of a running aggregator.
pub(crate) struct ConfigDir {
    state: Arc<State>,
    /// Where new locality splits are published from.
    door: Door,
    dir: PathBuf,
    state_path: PathBuf,
    backup_dir: PathBuf,
    settings: ServiceConfigSettings,
    defaults: Params,
}

impl ConfigDir {
    /// Loads the persisted merged config and scans the directory once, so that the
    /// first cycle already runs with every service's overrides. A missing or corrupt
    /// persisted config is logged and counted, and the directory alone is used.
    pub(crate) fn open(
        state: Arc<State>,
        door: Door,
        dir: PathBuf,
        settings: &ServiceConfigSettings,
        store: &StoreConfig,
        defaults: &Params,
    ) -> ConfigDir {
        let state_path = settings.state_path(store);
        let merged = match dir::load_merged(&state_path) {
            Ok(m) => m,
            Err(DirError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Merged::default()
            }
            Err(e) => {
                tracing::error!(error = %e, "the persisted service config is unusable; starting from the directory alone");
                count(&state, "error");
                Merged::default()
            }
        };
        let configs = ServiceConfigs::new(
            merged,
            defaults,
            settings.tombstone_ttl_s.saturating_mul(1000),
        );
        {
            let mut b = state.balancer();
            for (name, entry) in &configs.merged().services {
                b.set_params(name, entry.config.params.clone());
            }
        }
        if state.set_localities(configs.localities()) {
            door.publish();
        }
        *state.config_dir() = Some(ConfigDirStatus {
            dir: dir.clone(),
            configs,
            last_scan_unix_ms: 0,
            scan_error: None,
        });
        let cd = ConfigDir {
            state,
            door,
            dir,
            state_path,
            backup_dir: settings.backup_path(store),
            settings: settings.clone(),
            defaults: defaults.clone(),
        };
        cd.reload();
        cd
    }

    /// Scans the directory and puts what changed in force.
    pub(crate) fn reload(&self) {
        let now = ballast_shared::unix_ms();
        let files = match dir::scan(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                // A vanished directory is an operator's or a mount's problem, not
                // every service's file deleted at once: nothing is tombstoned.
                tracing::warn!(error = %e, "cannot scan the config directory; the config in force stays");
                count(&self.state, "error");
                if let Some(status) = self.state.config_dir().as_mut() {
                    status.scan_error = Some(e.to_string());
                    status.last_scan_unix_ms = now;
                }
                return;
            }
        };
        let mut guard = self.state.config_dir();
        let Some(status) = guard.as_mut() else {
            return;
        };
        let before: BTreeMap<String, FileError> = status.configs.errors().clone();
        let applied = status.configs.apply(&files, &self.defaults, now);
        status.last_scan_unix_ms = now;
        status.scan_error = None;
        for e in &applied.rejected {
            if before.get(&e.file) != Some(e) {
                tracing::warn!(file = %e.file, line = e.line, reason = %e.message,
                    "service config refused; its last good version stays in force");
                self.state
                    .metrics
                    .config_rejected
                    .get_or_create(&FileLabel {
                        file: e.file.clone(),
                    })
                    .inc();
            }
        }
        for name in &applied.tombstoned {
            tracing::warn!(service = %name, ttl_s = self.settings.tombstone_ttl_s,
                "service config file deleted; a tombstone keeps its config until it expires");
        }
        for name in &applied.revived {
            tracing::info!(service = %name, "service config file restored; tombstone revived");
        }
        for name in &applied.expired {
            tracing::info!(service = %name, "tombstone expired; the service follows the defaults");
        }
        let touched = !applied.changed.is_empty()
            || !applied.tombstoned.is_empty()
            || !applied.revived.is_empty();
        if !touched {
            count(&self.state, "unchanged");
            return;
        }
        {
            let mut b = self.state.balancer();
            for name in &applied.changed {
                match status.configs.params(name) {
                    Some(p) => b.set_params(name, p.clone()),
                    None => b.clear_params(name),
                }
            }
        }
        for name in &applied.changed {
            tracing::info!(service = %name, "service config applied");
        }
        if self.state.set_localities(status.configs.localities()) {
            self.door.publish();
        }
        let merged = status.configs.merged().clone();
        drop(guard);
        count(&self.state, "applied");
        if let Err(e) = dir::save_merged(&self.state_path, &merged) {
            tracing::warn!(error = %e, "cannot persist the merged service config");
        }
    }

    /// Backs the merged config up if it changed since the newest backup.
    pub(crate) fn backup(&self) {
        let merged = match self.state.config_dir().as_ref() {
            Some(s) => s.configs.merged().clone(),
            None => return,
        };
        match dir::backup(
            &self.backup_dir,
            &merged,
            ballast_shared::unix_ms(),
            self.settings.backup_keep,
        ) {
            Ok(Some(path)) => tracing::info!(backup = %path.display(), "service config backed up"),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "service config backup failed"),
        }
    }

    /// Watches the directory until the task is aborted: file events trigger a scan
    /// after they settle, and a periodic scan catches anything the watcher missed and
    /// expires tombstones.
    pub(crate) async fn run(self) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let watcher = watch(&self.dir, tx);
        if let Err(e) = &watcher {
            tracing::warn!(error = %e, dir = %self.dir.display(),
                "cannot watch the config directory; changes are picked up by the periodic scan");
        }
        let mut rescan = tokio::time::interval(Duration::from_millis(self.settings.rescan_ms));
        let mut backup =
            tokio::time::interval(Duration::from_secs(self.settings.backup_interval_s));
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        backup.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let this = Arc::new(self);
        loop {
            tokio::select! {
                Some(()) = rx.recv() => {
                    tokio::time::sleep(SETTLE).await;
                    while rx.try_recv().is_ok() {}
                }
                _ = rescan.tick() => {}
                _ = backup.tick() => {
                    let t = this.clone();
                    let _ = tokio::task::spawn_blocking(move || t.backup()).await;
                    continue;
                }
            }
            let t = this.clone();
            let _ = tokio::task::spawn_blocking(move || t.reload()).await;
        }
    }
}

fn count(state: &State, outcome: &str) {
    state
        .metrics
        .config_reloads
        .get_or_create(&Reason {
            reason: outcome.to_string(),
        })
        .inc();
}

fn watch(
    dir: &std::path::Path,
    tx: tokio::sync::mpsc::Sender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    use notify::Watcher;
    let mut w = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            // A full channel already holds a wake-up; one is enough.
            let _ = tx.try_send(());
        }
    })?;
    w.watch(dir, notify::RecursiveMode::NonRecursive)?;
    Ok(w)
}
