//! The daemon's long-lived tasks, watched. Each must run until shutdown: one that
//! panics or returns leaves a daemon that looks alive and no longer balances, serves or
//! stores. The supervisor reports the first such end, so that the process can log it
//! and exit non-zero, and the service manager restart it.

use futures_util::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A task that ended before shutdown, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskEnd {
    /// Which task.
    pub task: &'static str,
    /// Its panic message, or that it returned.
    pub reason: String,
}

impl std::fmt::Display for TaskEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the {} task ended: {}", self.task, self.reason)
    }
}

/// Spawns watched tasks.
#[derive(Debug, Clone)]
pub struct Supervisor {
    ends: mpsc::UnboundedSender<TaskEnd>,
    /// Set once shutdown begins: tasks ending then are expected.
    stopping: Arc<AtomicBool>,
}

/// Where the ends of watched tasks arrive.
#[derive(Debug)]
pub struct Ends {
    ends: mpsc::UnboundedReceiver<TaskEnd>,
}

/// A supervisor and the receiver of what it sees.
pub fn supervisor() -> (Supervisor, Ends) {
    let (ends, rx) = mpsc::unbounded_channel();
    let sup = Supervisor {
        ends,
        stopping: Arc::new(AtomicBool::new(false)),
    };
    (sup, Ends { ends: rx })
}

impl Supervisor {
    /// A supervisor nobody listens to: its tasks run as plain tasks. For callers that
    /// run a part of the daemon on its own (tests, benches).
    pub fn detached() -> Supervisor {
        supervisor().0
    }

    /// Spawns `fut` as the task `task`. If it panics or returns, the end is reported;
    /// if it is aborted (shutdown), nothing is.
    pub fn spawn<F>(&self, task: &'static str, fut: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let ends = self.ends.clone();
        let stopping = self.stopping.clone();
        tokio::spawn(async move {
            let reason = match AssertUnwindSafe(fut).catch_unwind().await {
                Ok(()) => "it returned".to_string(),
                Err(panic) => format!("it panicked: {}", panic_message(panic.as_ref())),
            };
            if stopping.load(Ordering::Relaxed) {
                return;
            }
            tracing::error!(task, %reason, "a daemon task ended before shutdown");
            let _ = ends.send(TaskEnd { task, reason });
        })
    }
}

impl Supervisor {
    /// Marks the start of shutdown: from now on tasks are expected to end, and their
    /// ends are not reported.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

impl Ends {
    /// The next task end; never resolves while every task runs.
    pub async fn next(&mut self) -> TaskEnd {
        match self.ends.recv().await {
            Some(end) => end,
            // Every supervisor is gone, so no task can end unseen any more.
            None => std::future::pending().await,
        }
    }
}

/// The tasks a watched task starts for the things it manages (a relay's trunk for each
/// replica): each may end, when its thing is gone, but its panic is the watched
/// task's, which [`Children::panicked`] carries on, so that the supervisor reports it
/// as for any watched task. Dropped, it aborts the tasks that still run.
#[derive(Debug, Default)]
pub struct Children {
    tasks: tokio::task::JoinSet<()>,
}

impl Children {
    /// Spawns `fut` as one of these tasks.
    pub fn spawn<F>(&mut self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(fut);
    }

    /// Resolves with the payload of the first task that panics, reaping those that
    /// end otherwise; never while none panics. The caller resumes the panic
    /// (`std::panic::resume_unwind`).
    pub async fn panicked(&mut self) -> Box<dyn std::any::Any + Send> {
        loop {
            match self.tasks.join_next().await {
                Some(Err(e)) if e.is_panic() => return e.into_panic(),
                Some(_) => {}
                None => std::future::pending::<()>().await,
            }
        }
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-text panic".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_or_a_return_is_reported_and_an_abort_is_not() {
        let (sup, mut ends) = supervisor();
        let aborted = sup.spawn("forever", std::future::pending());
        aborted.abort();
        let _ = aborted.await;
        sup.spawn("cycle loop", async { panic!("the cycle broke") });
        let end = ends.next().await;
        assert_eq!(end.task, "cycle loop");
        assert_eq!(end.reason, "it panicked: the cycle broke");
        sup.spawn("ingest", async {});
        assert_eq!(
            ends.next().await,
            TaskEnd {
                task: "ingest",
                reason: "it returned".into()
            }
        );
        // The aborted task reported nothing.
        assert!(ends.ends.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_childs_panic_ends_its_watched_parent_and_a_childs_return_does_not() {
        let (sup, mut ends) = supervisor();
        let (start, mut starts) = mpsc::unbounded_channel::<bool>();
        let parent = sup.spawn("trunks", async move {
            let mut children = Children::default();
            loop {
                tokio::select! {
                    next = starts.recv() => match next {
                        Some(panics) => children.spawn(async move {
                            assert!(!panics, "the trunk to r1 broke");
                        }),
                        None => std::future::pending::<()>().await,
                    },
                    payload = children.panicked() => std::panic::resume_unwind(payload),
                }
            }
        });
        let _ = start.send(false);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(ends.ends.try_recv().is_err(), "a child that returned");
        assert!(!parent.is_finished());
        let _ = start.send(true);
        let end = tokio::time::timeout(std::time::Duration::from_secs(5), ends.next())
            .await
            .expect("the child's panic is reported");
        assert_eq!(end.task, "trunks");
        assert_eq!(end.reason, "it panicked: the trunk to r1 broke");
    }
}
