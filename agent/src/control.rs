//! The local control socket: the CLI's way into the running daemon.
//!
//! One JSON request per line in, one JSON response per line out. The socket is a Unix
//! socket, so only local users with access to its file can drain the node.

use crate::shared::Shared;
use crate::status::Status;
use serde::{Deserialize, Serialize};
use std::io::Read as _;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt as _, AsyncWriteExt};

/// Requests longer than this are refused: nothing legitimate comes close.
pub(crate) const MAX_REQUEST: usize = 4096;

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
    let verdict = shared.stop_verdict(&status, ballast_shared::unix_ms());
    Response {
        ok: true,
        safe_to_stop: Some(verdict.safe),
        stop_reason: Some(verdict.reason),
        status: Some(status),
        warning,
        error: None,
    }
}

fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A socket file left by a previous run would make bind fail.
    let _ = std::fs::remove_file(path);
    tokio::net::UnixListener::bind(path)
}

/// Serves the control socket at `path` until the task is dropped. Whether binding
/// worked is sent on `ready` first.
pub async fn serve(
    path: PathBuf,
    shared: Arc<Shared>,
    ready: tokio::sync::oneshot::Sender<std::io::Result<()>>,
) -> std::io::Result<()> {
    let listener = match bind(&path) {
        Ok(l) => {
            let _ = ready.send(Ok(()));
            l
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    loop {
        let (stream, _) = listener.accept().await?;
        let shared = shared.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(read.take(MAX_REQUEST as u64 + 1)).lines();
            let response =
                match tokio::time::timeout(Duration::from_secs(5), lines.next_line()).await {
                    Ok(Ok(Some(line))) if line.len() <= MAX_REQUEST => answer(&shared, &line),
                    _ => Response::refused("request missing, too long or not a line".into()),
                };
            if let Ok(mut text) = serde_json::to_string(&response) {
                text.push('\n');
                let _ = write.write_all(text.as_bytes()).await;
            }
        });
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
    stream.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(stream.take(1 << 20)).read_line(&mut answer)?;
    Ok(serde_json::from_str(&answer)?)
}
