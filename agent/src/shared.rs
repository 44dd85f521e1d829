//! What the agent's tasks share: the configuration, the status, the drain flag, the
//! counters and the aggregator's current assignment.
//!
//! Every task (the report loop, the control socket, the agent-check, the metrics
//! server) depends on this module and on nothing of each other's; the daemon only
//! builds the state and starts them.

use crate::config::AgentConfig;
use crate::counters::Metrics;
use crate::sample::AssignmentWatch;
use crate::status::Status;
use ballast_shared::session::Assignment;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the report loop, the control socket, the agent-check and the metrics server
/// share.
pub struct Shared {
    /// The resolved configuration.
    pub config: AgentConfig,
    /// The agent's status.
    status: Mutex<Status>,
    /// Set by `drain`, cleared by `undrain`.
    pub draining: AtomicBool,
    /// Counters for `/metrics` that the status does not hold.
    pub metrics: Metrics,
    /// The aggregator's latest assignment, published by the report loop: the one
    /// place the agent keeps it (the status shows it from here, with when it arrived).
    assignment: watch::Sender<Option<Assignment>>,
}

impl Shared {
    /// Shared state for a configuration.
    pub fn new(config: AgentConfig) -> Self {
        let status = Status {
            node: config.node.clone(),
            service: config.service.clone(),
            address: config.address.clone(),
            address_origin: config.address_origin.to_string(),
            ..Status::default()
        };
        Shared {
            config,
            status: Mutex::new(status),
            draining: AtomicBool::new(false),
            metrics: Metrics::default(),
            assignment: watch::channel(None).0,
        }
    }

    /// Publishes what the aggregator assigned this node in its latest reply, to every
    /// subscriber. A lost connection does not take it back: the load balancers keep
    /// applying the last weights they were given, so it stays the node's best
    /// knowledge of its share until a new reply comes.
    /// It arrives now: the status says when, and the two change under the status's
    /// lock, so that a copy of the status never pairs a weight with another's time.
    pub(crate) fn publish_assignment(&self, assignment: Assignment) {
        self.update(|st| {
            st.weight_unix_ms = Some(ballast_shared::unix_ms());
            st.weight_at = Some(Instant::now());
            self.assignment.send_replace(Some(assignment));
        });
    }

    /// A receiver of the aggregator's current assignment (`None` until the first
    /// reply), for any task or source that follows the node's weight: the synthetic
    /// load model reads its share of the traffic from it.
    pub(crate) fn subscribe_assignment(&self) -> AssignmentWatch {
        self.assignment.subscribe()
    }

    /// The aggregator's current assignment; `None` until the first reply.
    pub fn assignment(&self) -> Option<Assignment> {
        *self.assignment.borrow()
    }

    /// Starts (`true`) or ends a drain, and records it in the drain file so that a
    /// restarted agent keeps it. The drain takes effect even when the file cannot be
    /// written: taking traffic off a node must not depend on its disk. The error says
    /// what will not survive a restart.
    pub(crate) fn set_draining(&self, on: bool) -> Result<(), DrainFileError> {
        let was = self.draining.swap(on, Ordering::Relaxed);
        self.update(|s| {
            s.draining = on;
            // The quiet period counts from the drain: a node idle before it proves
            // nothing about the load balancers having seen it. A repeated drain (a
            // script that retries) does not start it again.
            if on != was {
                s.inflight_zero_since_unix_ms = None;
                s.inflight_zero_since = None;
            }
        });
        match self.config.drain_path() {
            Some(path) if on => write_drain_file(path),
            Some(path) => match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(DrainFileError {
                    path: path.display().to_string(),
                    source: e,
                }),
                _ => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Whether stopping the service is safe at `now` (monotonic), by the configured
    /// quiet period; a sample older than three report intervals is too old to tell.
    pub(crate) fn stop_verdict(&self, status: &Status, now: Instant) -> crate::status::StopVerdict {
        let max_age = Duration::from_millis(u64::from(self.config.interval_ms) * 3);
        let quiet = Duration::from_millis(self.config.drain_quiet_ms);
        status.stop_verdict(now, quiet, max_age)
    }

    /// A copy of the status, with the current assignment.
    pub fn status(&self) -> Status {
        let guard = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let mut status = guard.clone();
        status.show_assignment(self.assignment.borrow().as_ref());
        status
    }

    /// Changes the status in place.
    pub fn update(&self, f: impl FnOnce(&mut Status)) {
        let mut guard = self.status.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard);
    }
}

/// The next connection on `listener`, for the tasks that serve TCP (the agent-check
/// and the metrics server). Accept errors (out of file descriptors and the like) pause
/// the loop instead of spinning it; the listener itself stays usable.
pub async fn accept(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => return stream,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The drain file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("drain file {path}: {source}")]
pub struct DrainFileError {
    /// The file.
    pub path: String,
    /// The cause.
    pub source: std::io::Error,
}

/// Writes the drain file atomically (a temporary file renamed over it), creating its
/// directory.
fn write_drain_file(path: &Path) -> Result<(), DrainFileError> {
    let err = |source| DrainFileError {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("drained.tmp");
    let text = format!(
        "drained at {} ms since the Unix epoch; `ballast-agent undrain` ends it\n",
        ballast_shared::unix_ms()
    );
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Whether the drain file says the node is drained. A file that cannot be looked at
/// is an error: starting undrained could send traffic to a node under maintenance.
pub(crate) fn drained_on_disk(cfg: &AgentConfig) -> Result<bool, DrainFileError> {
    let Some(path) = cfg.drain_path() else {
        return Ok(false);
    };
    match std::fs::metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DrainFileError {
            path: path.display().to_string(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_survives_in_the_drain_file_until_undrain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = AgentConfig {
            control_socket: dir.path().join("run/agent.sock"),
            ..AgentConfig::default()
        }
        .resolve();
        let file = dir.path().join("run/agent.drained");
        assert_eq!(cfg.drain_path(), Some(file.as_path()));
        assert!(!drained_on_disk(&cfg).expect("readable"));
        let shared = Shared::new(cfg.clone());
        shared.update(|s| {
            s.inflight_zero_since_unix_ms = Some(1);
            s.inflight_zero_since = Some(Instant::now());
        });
        shared.set_draining(true).expect("written");
        assert!(shared.status().draining);
        assert_eq!(
            (
                shared.status().inflight_zero_since_unix_ms,
                shared.status().inflight_zero_since
            ),
            (None, None),
            "the quiet period restarts at the drain"
        );
        assert!(drained_on_disk(&cfg).expect("readable"), "{file:?}");
        shared.update(|s| s.inflight_zero_since_unix_ms = Some(2));
        shared.set_draining(true).expect("drain twice is fine");
        assert_eq!(
            shared.status().inflight_zero_since_unix_ms,
            Some(2),
            "a repeated drain keeps the quiet period"
        );
        shared.set_draining(false).expect("removed");
        assert!(!drained_on_disk(&cfg).expect("readable"));
        shared.set_draining(false).expect("undrain twice is fine");

        // A drain file that cannot be written: the drain still holds, with the error.
        let blocked = AgentConfig {
            drain_file: Some(dir.path().join("not-a-dir")),
            ..AgentConfig::default()
        };
        std::fs::create_dir_all(dir.path().join("not-a-dir/x")).expect("a directory");
        let shared = Shared::new(blocked);
        let err = shared
            .set_draining(true)
            .expect_err("a directory is in the way");
        assert!(err.to_string().contains("not-a-dir"), "{err}");
        assert!(shared.draining.load(Ordering::Relaxed) && shared.status().draining);
    }

    #[test]
    fn subscribers_see_each_assignment_published() {
        let shared = Shared::new(AgentConfig::default());
        let mut rx = shared.subscribe_assignment();
        assert_eq!(*rx.borrow(), None, "nothing before the first reply");
        let a = Assignment {
            weight: 0.4,
            cycle: 3,
            draining: false,
            load: 0.7,
            inflight_trusted: true,
        };
        shared.publish_assignment(a);
        assert!(rx.has_changed().expect("the sender lives"));
        assert_eq!(*rx.borrow_and_update(), Some(a));
        assert_eq!(shared.assignment(), Some(a));
        // Publishing works with no subscriber at all.
        drop(rx);
        shared.publish_assignment(Assignment { weight: 2.0, ..a });
        assert_eq!(shared.assignment().map(|a| a.weight), Some(2.0));
    }
}
