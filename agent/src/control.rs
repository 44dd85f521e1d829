//! The local control socket: the CLI's way into the running daemon.
//!
//! One JSON request per line in, one JSON response per line out. The socket is a Unix
//! socket with mode 0600 from the moment it accepts connections, and each peer's
//! credentials (`SO_PEERCRED`) are checked: only root and the user the agent runs as
//! may drain the node, even if the file's mode is widened later.

use crate::counters::Refused;
use crate::shared::Shared;
use crate::status::Status;
use serde::{Deserialize, Serialize};
use std::io::Read as _;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt as _, AsyncWriteExt};
use tokio::sync::Semaphore;

/// Requests longer than this are refused: nothing legitimate comes close.
pub(crate) const MAX_REQUEST: usize = 4096;

/// Connections served at once; more get a refusal at once. The CLI opens one per
/// command, so only a stuck or hostile client comes near it.
pub(crate) const MAX_CONNECTIONS: usize = 16;

/// How long a client has to send its request, and then to take the answer.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The socket file's mode: the agent's user alone.
pub(crate) const SOCKET_MODE: u32 = 0o600;

/// What the CLI can ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// The agent's status.
    Status,
    /// Start draining (lame duck).
    Drain,
    /// Stop draining; the node comes back through the cold-start ramp.
    Undrain,
}

/// The daemon's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// Whether the request was understood and done.
    pub ok: bool,
    /// The status after the request.
    pub status: Option<Status>,
    /// Whether the service can be stopped without losing requests.
    pub safe_to_stop: Option<bool>,
    /// Why it is safe to stop or not, for people.
    pub stop_reason: Option<String>,
    /// Done, but with a caveat (a drain that will not survive a restart).
    pub warning: Option<String>,
    /// What went wrong.
    pub error: Option<String>,
}

impl Response {
    fn refused(error: String) -> Self {
        Response {
            ok: false,
            status: None,
            safe_to_stop: None,
            stop_reason: None,
            warning: None,
            error: Some(error),
        }
    }
}

/// Why the CLI could not talk to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No daemon is listening.
    #[error("cannot reach the agent at {path}: {source} (is ballast-agent running?)")]
    Connect {
        /// The socket.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    /// The answer is not valid.
    #[error("bad answer from the agent: {0}")]
    Decode(#[from] serde_json::Error),
}

/// The answer to one request line from an allowed peer.
pub(crate) fn answer(shared: &Shared, line: &str) -> Response {
    let request: Request = match serde_json::from_str(line.trim()) {
        Ok(r) => r,
        Err(e) => return Response::refused(format!("bad request: {e}")),
    };
    let persisted = match request {
        Request::Status => Ok(()),
        Request::Drain => {
            tracing::info!("drain requested");
            shared.set_draining(true)
        }
        Request::Undrain => {
            tracing::info!("undrain requested");
            shared.set_draining(false)
        }
    };
    let warning = persisted.err().map(|e| {
        let what = if request == Request::Drain {
            "a restarted agent will not be drained"
        } else {
            "a restarted agent will be drained again"
        };
        tracing::warn!(error = %e, "{what}");
        shared.update(|s| s.last_error = Some(e.to_string()));
        format!("{e}: {what}")
    });
    let status = shared.status();
    let verdict = shared.stop_verdict(&status, Instant::now());
    Response {
        ok: true,
        safe_to_stop: Some(verdict.safe),
        stop_reason: Some(verdict.reason),
        status: Some(status),
        warning,
        error: None,
    }
}

/// Whether a peer with uid `peer` may use the socket of an agent running as `own`:
/// root, or the agent's own user.
pub(crate) fn peer_allowed(peer: u32, own: u32) -> bool {
    peer == 0 || peer == own
}

/// Binds the socket at `path` with mode [`SOCKET_MODE`] before it listens: a connection
/// to a socket that is not listening yet is refused by the kernel, so there is no
/// moment at which anyone else could connect through a wider mode (whatever the
/// umask). Returns the listener and the uid of the agent's own user, read from the
/// socket file it just created.
fn bind(path: &Path) -> std::io::Result<(tokio::net::UnixListener, u32)> {
    use socket2::{Domain, SockAddr, Socket, Type};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // A socket file left by a previous run would make bind fail.
    let _ = std::fs::remove_file(path);
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.bind(&SockAddr::unix(path)?)?;
    let own_uid = std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .and_then(|()| std::fs::metadata(path))
        .map(|m| m.uid())
        .inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })?;
    socket.listen(128)?;
    socket.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(socket.into())?;
    Ok((listener, own_uid))
}

/// Writes `response` on `stream` if it fits at once, and closes it: for connections
/// refused before a task is spent on them. A fresh connection's buffer is empty, so
/// the line fits; the CLI reads it even when its own request could not be written.
fn refuse_now(stream: tokio::net::UnixStream, error: String) {
    if let Ok(mut text) = serde_json::to_string(&Response::refused(error)) {
        text.push('\n');
        let _ = stream.try_write(text.as_bytes());
    }
}

/// Serves the control socket at `path` until the task is dropped. Whether binding
/// worked is sent on `ready` first.
///
/// At most [`MAX_CONNECTIONS`] are served at once, each within [`REQUEST_TIMEOUT`]
/// to send its request and again to take the answer. A peer that is neither root nor
/// the agent's user gets a refusal, logged and counted.
pub async fn serve(
    path: PathBuf,
    shared: Arc<Shared>,
    ready: tokio::sync::oneshot::Sender<std::io::Result<()>>,
) -> std::io::Result<()> {
    let (listener, own_uid) = match bind(&path) {
        Ok(l) => {
            let _ = ready.send(Ok(()));
            l
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors and the like: pause rather than spin or stop.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            shared.metrics.count_refusal(Refused::ControlConnections);
            tracing::debug!("control connection refused: {MAX_CONNECTIONS} open");
            refuse_now(
                stream,
                format!("busy: {MAX_CONNECTIONS} control connections are open; try again"),
            );
            continue;
        };
        match stream.peer_cred() {
            Ok(cred) if peer_allowed(cred.uid(), own_uid) => {}
            peer => {
                shared.metrics.count_refusal(Refused::ControlPeer);
                let (uid, pid) = match &peer {
                    Ok(c) => (Some(c.uid()), c.pid()),
                    Err(_) => (None, None),
                };
                tracing::warn!(
                    peer_uid = ?uid,
                    peer_pid = ?pid,
                    agent_uid = own_uid,
                    "control connection refused: only root and the agent's user may use it"
                );
                let who = uid.map_or_else(|| "an unknown user".to_string(), |u| format!("uid {u}"));
                refuse_now(
                    stream,
                    format!(
                        "permission denied: {who} may not use the agent's control socket \
                         (root and uid {own_uid} only)"
                    ),
                );
                continue;
            }
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            exchange(stream, &shared).await;
            drop(permit);
        });
    }
}

/// One request and its answer, each within [`REQUEST_TIMEOUT`].
async fn exchange(stream: tokio::net::UnixStream, shared: &Shared) {
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read.take(MAX_REQUEST as u64 + 1)).lines();
    let response = match tokio::time::timeout(REQUEST_TIMEOUT, lines.next_line()).await {
        Ok(Ok(Some(line))) if line.len() <= MAX_REQUEST => answer(shared, &line),
        Err(_) => {
            shared.metrics.count_refusal(Refused::ControlTimeout);
            Response::refused(format!("no request within {} s", REQUEST_TIMEOUT.as_secs()))
        }
        _ => Response::refused("request missing, too long or not a line".into()),
    };
    if let Ok(mut text) = serde_json::to_string(&response) {
        text.push('\n');
        let sent = tokio::time::timeout(REQUEST_TIMEOUT, write.write_all(text.as_bytes())).await;
        if sent.is_err() {
            shared.metrics.count_refusal(Refused::ControlTimeout);
        }
    }
}

/// Sends one request to the daemon at `path` (blocking; for the CLI).
pub fn request(path: &Path, req: Request) -> Result<Response, ControlError> {
    let mut stream =
        std::os::unix::net::UnixStream::connect(path).map_err(|source| ControlError::Connect {
            path: path.display().to_string(),
            source,
        })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut line = serde_json::to_string(&req)?;
    line.push('\n');
    match stream.write_all(line.as_bytes()) {
        // Refused before the request was read (another user, too many connections):
        // the refusal is waiting to be read.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    let mut answer = String::new();
    BufReader::new(stream.take(1 << 20)).read_line(&mut answer)?;
    Ok(serde_json::from_str(&answer)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AgentConfig;

    /// Starts the control socket in `dir`; returns its path and the shared state.
    async fn start(dir: &Path) -> (PathBuf, Arc<Shared>) {
        let path = dir.join("run/agent.sock");
        let shared = Arc::new(Shared::new(AgentConfig::default()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(serve(path.clone(), shared.clone(), tx));
        rx.await.expect("ready sent").expect("bound");
        (path, shared)
    }

    /// One request on a blocking thread, as the CLI makes it.
    async fn ask(path: &Path) -> Result<Response, ControlError> {
        let path = path.to_path_buf();
        tokio::task::spawn_blocking(move || request(&path, Request::Status))
            .await
            .expect("the request thread")
    }

    #[test]
    fn only_root_and_the_agents_own_user_are_allowed() {
        assert!(peer_allowed(0, 998), "root");
        assert!(peer_allowed(998, 998), "the agent's user");
        assert!(!peer_allowed(1000, 998), "another user");
        assert!(!peer_allowed(65534, 998), "nobody");
        assert!(peer_allowed(0, 0), "an agent running as root");
        assert!(!peer_allowed(1000, 0));
    }

    #[tokio::test]
    async fn the_socket_is_created_with_mode_0600_and_serves_its_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _shared) = start(dir.path()).await;
        let meta = std::fs::metadata(&path).expect("socket file");
        assert_eq!(meta.mode() & 0o777, 0o600, "mode {:o}", meta.mode());
        let resp = ask(&path).await.expect("answered");
        assert!(resp.ok && resp.status.is_some(), "{resp:?}");
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_refused_at_once_and_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, shared) = start(dir.path()).await;
        // Clients that connect and send nothing hold their places until the timeout.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(
                tokio::net::UnixStream::connect(&path)
                    .await
                    .expect("connect"),
            );
        }
        let resp = ask(&path).await.expect("a refusal is an answer");
        assert!(!resp.ok, "{resp:?}");
        assert!(
            resp.error.as_deref().is_some_and(|e| e.contains("busy")),
            "{resp:?}"
        );
        assert_eq!(shared.metrics.refusals(Refused::ControlConnections), 1);
        // Once the idle clients leave, the next request is served.
        drop(idle);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match ask(&path).await {
                Ok(r) if r.ok => break,
                other => assert!(Instant::now() < deadline, "still refused: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
