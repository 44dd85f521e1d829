//! The HTTP API's listener, with its limits: a cap on open connections, a deadline for
//! every request on a connection (the first and each one after it), and an idle
//! timeout. A client that trickles its headers, on a new connection or on one that
//! has had its answers, or a watcher that stops reading, holds a connection for a
//! bounded time, and no number of them can take more than the cap.

use crate::config::limits::Limits;
use crate::metrics::Metrics;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Accepts at most `http_max_connections` at a time; the rest wait in the backlog.
pub(crate) struct Limited {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    /// Where refusals and cut-off connections are counted.
    metrics: Arc<Metrics>,
    /// How long each request has, from its first byte, for its response to start.
    request: Duration,
    /// How long a connection may then go without a byte either way.
    idle: Duration,
}

impl Limited {
    /// Limits `inner` by `limits`, counting what it refuses or cuts off in `metrics`.
    pub(crate) fn new(inner: TcpListener, metrics: Arc<Metrics>, limits: &Limits) -> Self {
        let permits = Arc::new(Semaphore::new(limits.http_max_connections));
        Limited {
            inner,
            permits,
            metrics,
            request: Duration::from_millis(limits.http_request_timeout_ms),
            idle: Duration::from_millis(limits.http_idle_timeout_ms),
        }
    }
}

impl axum::serve::Listener for Limited {
    type Io = Guarded;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let permit = match self.permits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    self.metrics.refuse_http("connections");
                    match self.permits.clone().acquire_owned().await {
                        Ok(p) => p,
                        // The semaphore is never closed.
                        Err(_) => continue,
                    }
                }
            };
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    let guarded = Guarded::new(
                        stream,
                        permit,
                        self.metrics.clone(),
                        self.request,
                        self.idle,
                    );
                    return (guarded, addr);
                }
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// Where a connection is between requests, for its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A request is being read: from the accept, or from the first byte after a
    /// response. Reads do not move the deadline: the whole request head must come
    /// within `http_request_timeout_ms`, so no request can be trickled in.
    Request,
    /// A response is being written (a watch stream's, say); each write moves the
    /// deadline `http_idle_timeout_ms` on.
    Responding,
}

/// One accepted connection, holding its place under the cap, cut off when it misses
/// its deadline: every request on it (the first and each one after a response) must
/// have its response started within `http_request_timeout_ms` of its first byte,
/// and between requests, or while a response is written, a byte must move every
/// `http_idle_timeout_ms`.
pub(crate) struct Guarded {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
    deadline: Pin<Box<Sleep>>,
    phase: Phase,
    request: Duration,
    idle: Duration,
}

impl Guarded {
    fn new(
        stream: TcpStream,
        permit: OwnedSemaphorePermit,
        metrics: Arc<Metrics>,
        request: Duration,
        idle: Duration,
    ) -> Self {
        Guarded {
            stream,
            _permit: permit,
            metrics,
            deadline: Box::pin(tokio::time::sleep(request)),
            phase: Phase::Request,
            request,
            idle,
        }
    }

    /// After bytes were read: the first after a response begins the next request,
    /// whose deadline runs from now and is not moved by the rest of it.
    fn read_some(&mut self) {
        if self.phase == Phase::Responding {
            self.phase = Phase::Request;
            self.deadline.as_mut().reset(Instant::now() + self.request);
        }
    }

    /// After bytes were written: a response is under way, and may go on while bytes
    /// keep moving.
    fn wrote_some(&mut self) {
        let next = Instant::now() + self.idle;
        if self.phase == Phase::Request {
            self.phase = Phase::Responding;
            self.deadline.as_mut().reset(next);
        } else if next > self.deadline.deadline() + Duration::from_millis(250) {
            // Resetting the timer on every small write costs more than it buys.
            self.deadline.as_mut().reset(next);
        }
    }

    /// `poll` as the stream answered it; a pending one becomes the timeout error once
    /// the deadline has passed (its waker is registered either way).
    fn guard<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => match self.expired(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }

    /// Moves the deadline on after a write of `n` bytes.
    fn wrote(&mut self, r: &io::Result<usize>) {
        if matches!(r, Ok(n) if *n > 0) {
            self.wrote_some();
        }
    }

    /// The timeout error if the deadline has passed; registers the waker otherwise.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.deadline.as_mut().poll(cx).is_pending() {
            return None;
        }
        let reason = match self.phase {
            Phase::Request => "request_timeout",
            Phase::Responding => "idle_timeout",
        };
        self.metrics.refuse_http(reason);
        Some(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("HTTP connection cut off: {reason}"),
        ))
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if poll.is_ready() && buf.filled().len() > before {
            self.read_some();
        }
        self.guard(cx, poll)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, data);
        if let Poll::Ready(r) = &poll {
            self.wrote(r);
        }
        self.guard(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.guard(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = ready!(Pin::new(&mut self.stream).poll_shutdown(cx));
        Poll::Ready(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(r) = &poll {
            self.wrote(r);
        }
        self.guard(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
