//! HAProxy's agent-check, answered by the aggregator for every node it publishes.
//!
//! Each node's own agent answers HAProxy's agent-check too (`ballast-agent
//! --agent-check`), but a node whose agent is wedged or dead answers nothing, and
//! HAProxy keeps the last weight it heard: an operator's drain of that node would never
//! reach it. This listener answers for any node from the publication instead. HAProxy
//! names the node with `agent-send`:
//!
//! ```text
//! server web-2 10.0.0.12:8080 weight 100 check agent-check agent-addr AGGREGATOR agent-port 7404 agent-send "web web-2\n"
//! ```
//!
//! One connection is one question: HAProxy connects, sends `SERVICE NODE` and a newline,
//! and reads one line back, the same line the node's agent would send
//! ([`ballast_balance::load::haproxy_agent_reply`]): `drain` for an endpoint draining or
//! drained by an operator (even one the aggregator no longer hears from), otherwise
//! `ready up N%`. A node or service the publication does not have gets no answer: the
//! connection is closed, and HAProxy keeps the weight and state it had. Answering
//! `ready` would take the server out of DRAIN, so a replica that does not (yet) have
//! the service, or a mistyped `agent-send`, would undo an operator's drain. It is
//! counted, so that a mistyped `agent-send` shows.
//!
//! Plain TCP, as HAProxy's agent-check is: the answers say what every node's weight
//! is, no more than the node agents' own agent-check ports say. The listener holds at
//! most [`MAX_CONNECTIONS`] connections, at most [`MAX_PER_SOURCE`] from one address,
//! and each for at most [`ANSWER_WITHIN`], so that idle connections from one host
//! cannot crowd out the load balancers' checks.

use crate::metrics::HaproxyMetrics;
use ballast_balance::load::haproxy_agent_reply;
use ballast_balance::Published;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// The most agent-check connections open at once; more are closed unanswered (and
/// counted). HAProxy opens one per server per `agent-inter` and closes it within
/// milliseconds.
pub const MAX_CONNECTIONS: usize = 1024;

/// The most agent-check connections open at once from one address. An HAProxy opens
/// one per server per `agent-inter`, each answered within milliseconds.
pub const MAX_PER_SOURCE: usize = 64;

/// How long a connection may take to name its node and read the answer. HAProxy sends
/// its `agent-send` as soon as it connects.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// The longest question taken: a service and a node name, with room to spare.
pub const MAX_QUESTION: usize = 512;

/// After the first bytes of a question without a newline, how long more may follow
/// before what came is taken as the whole question (an `agent-send` without `\n`).
const QUIET_AFTER: Duration = Duration::from_millis(100);

/// What one answer said, for the replies counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// `ready up N%` for a published endpoint.
    Weight,
    /// `drain`.
    Drain,
    /// No answer, for a node or service the publication does not have.
    Unknown,
}

impl Answer {
    /// Its label in `ballast_haproxy_agent_replies_total`.
    pub fn label(self) -> &'static str {
        match self {
            Answer::Weight => "weight",
            Answer::Drain => "drain",
            Answer::Unknown => "unknown",
        }
    }
}

/// Why a question got no answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuestionError {
    /// Not `SERVICE NODE`.
    #[error("expected `SERVICE NODE` (HAProxy's agent-send), got {0:?}")]
    Malformed(String),
    /// Longer than [`MAX_QUESTION`].
    #[error("a question longer than {MAX_QUESTION} bytes")]
    TooLong,
    /// Nothing, or not all of it, within [`ANSWER_WITHIN`].
    #[error("no question within {ANSWER_WITHIN:?}")]
    Timeout,
    /// The connection failed.
    #[error("connection: {0}")]
    Io(String),
}

impl QuestionError {
    /// Its label in `ballast_haproxy_agent_refused_total`.
    pub fn label(&self) -> &'static str {
        match self {
            QuestionError::Malformed(_) => "malformed",
            QuestionError::TooLong => "too_long",
            QuestionError::Timeout => "timeout",
            QuestionError::Io(_) => "io",
        }
    }
}

/// The service and node a question names: `SERVICE NODE`, separated by white space,
/// the line end optional.
pub fn parse_question(bytes: &[u8]) -> Result<(&str, &str), QuestionError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| QuestionError::Malformed(String::from_utf8_lossy(bytes).into_owned()))?;
    let mut words = text.split_ascii_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some(service), Some(node), None) => Ok((service, node)),
        _ => Err(QuestionError::Malformed(text.trim_end().to_string())),
    }
}

/// The line HAProxy is sent for `node` of `service` as `published` has them; none for
/// a node or service it does not have.
pub fn answer(published: &Published, service: &str, node: &str) -> (Option<String>, Answer) {
    let Some(svc) = published.services.get(service) else {
        return (None, Answer::Unknown);
    };
    // An operator's drain holds for a node the aggregator no longer hears from, and
    // after its endpoint expired from the weights.
    if svc.operator.drained(node) {
        return (Some(haproxy_agent_reply(None, true)), Answer::Drain);
    }
    match svc.endpoints.get(node) {
        Some(e) if e.draining => (Some(haproxy_agent_reply(None, true)), Answer::Drain),
        Some(e) => (
            Some(haproxy_agent_reply(Some(e.weight), false)),
            Answer::Weight,
        ),
        None => (None, Answer::Unknown),
    }
}

/// Answers agent-checks on `listener` from `publications` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    publications: watch::Receiver<Arc<Published>>,
    metrics: Arc<HaproxyMetrics>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let sources = Arc::new(Sources::default());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // A full file table or the like: wait, rather than spin on it.
                tracing::warn!(error = %e, "agent-check listener: accept failed");
                metrics.refuse("accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            metrics.refuse("connections");
            continue;
        };
        let Some(source) = Sources::take(&sources, peer.ip()) else {
            metrics.refuse("connections_per_source");
            continue;
        };
        let publications = publications.clone();
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            match tokio::time::timeout(ANSWER_WITHIN, one(stream, &publications)).await {
                Ok(Ok(answer)) => metrics.reply(answer.label()),
                Ok(Err(e)) => {
                    metrics.refuse(e.label());
                    tracing::debug!(?peer, error = %e, "agent-check question refused");
                }
                Err(_) => metrics.refuse(QuestionError::Timeout.label()),
            }
            drop((slot, source));
        });
    }
}

/// Connections open now, by source address.
#[derive(Default)]
struct Sources(std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>);

/// One connection's place in [`Sources`], given back when dropped.
struct Source(Arc<Sources>, IpAddr);

impl Sources {
    /// A place for one more connection from `ip`, unless it has [`MAX_PER_SOURCE`].
    fn take(this: &Arc<Sources>, ip: IpAddr) -> Option<Source> {
        let mut open = this.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= MAX_PER_SOURCE {
            return None;
        }
        *n += 1;
        Some(Source(Arc::clone(this), ip))
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        let mut open = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}

/// Reads one question from `stream`, writes its answer and closes.
async fn one(
    mut stream: TcpStream,
    publications: &watch::Receiver<Arc<Published>>,
) -> Result<Answer, QuestionError> {
    let mut buf = [0u8; MAX_QUESTION + 1];
    let mut len = 0;
    loop {
        let read = if len == 0 {
            stream.read(&mut buf[len..]).await
        } else {
            match tokio::time::timeout(QUIET_AFTER, stream.read(&mut buf[len..])).await {
                Ok(read) => read,
                // Bytes without a newline, then quiet: that was the question.
                Err(_) => break,
            }
        };
        let n = read.map_err(|e| QuestionError::Io(e.to_string()))?;
        if n == 0 {
            break;
        }
        len += n;
        if buf[..len].contains(&b'\n') {
            break;
        }
        if len > MAX_QUESTION {
            return Err(QuestionError::TooLong);
        }
    }
    if len == 0 {
        return Err(QuestionError::Malformed(String::new()));
    }
    let line = buf[..len].split(|&b| b == b'\n').next().unwrap_or_default();
    let (service, node) = parse_question(line)?;
    let (reply, answer) = {
        let published = publications.borrow();
        self::answer(&published, service, node)
    };
    match reply {
        Some(reply) => stream
            .write_all(reply.as_bytes())
            .await
            .map_err(|e| QuestionError::Io(e.to_string()))?,
        None => tracing::debug!(service, node, "agent-check for a node not published"),
    }
    let _ = stream.shutdown().await;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_balance::{Act, Action, Balancer, Observation, Params, PublishedService};

    #[test]
    fn one_source_holds_at_most_its_share_of_the_connections() {
        let sources = Arc::new(Sources::default());
        let a = IpAddr::from([10, 0, 0, 1]);
        let held: Vec<Source> = (0..MAX_PER_SOURCE)
            .map(|_| Sources::take(&sources, a).expect("a place"))
            .collect();
        assert!(
            Sources::take(&sources, a).is_none(),
            "one too many from {a}"
        );
        let b = IpAddr::from([10, 0, 0, 2]);
        assert!(
            Sources::take(&sources, b).is_some(),
            "another source is served"
        );
        drop(held);
        let again = Sources::take(&sources, a);
        assert!(again.is_some(), "places are given back");
        assert_eq!(
            sources.0.lock().expect("lock").len(),
            1,
            "no entry kept for b"
        );
        drop(again);
        assert!(
            sources.0.lock().expect("lock").is_empty(),
            "no entry kept for a"
        );
    }

    #[test]
    fn a_question_names_a_service_and_a_node() {
        assert_eq!(parse_question(b"web web-2\n"), Ok(("web", "web-2")));
        assert_eq!(parse_question(b"web web-2"), Ok(("web", "web-2")));
        assert_eq!(parse_question(b"  web\tweb-2\r\n"), Ok(("web", "web-2")));
        for bad in [
            &b""[..],
            b"\n",
            b"web\n",
            b"web web-2 extra\n",
            b"\xff web\n",
        ] {
            assert!(
                matches!(parse_question(bad), Err(QuestionError::Malformed(_))),
                "{bad:?}"
            );
        }
    }

    /// The publication of `b`'s service `web`, as the daemon makes it.
    fn publication(b: &Balancer) -> Published {
        let svc = b.service("web").expect("the service");
        let mut p = Published::default();
        p.services.insert(
            "web".into(),
            Arc::new(PublishedService::of(svc, 0, Default::default())),
        );
        p
    }

    #[test]
    fn the_answer_is_the_published_weight_or_a_drain_even_after_the_node_is_gone() {
        let mut b = Balancer::new(Params::default(), 0);
        for (i, node) in ["web-1", "web-2", "web-3"].into_iter().enumerate() {
            b.register(0, "web", node, &format!("10.0.0.{i}:80"), "")
                .expect("registers");
            let obs = Observation {
                cpu: 0.5,
                ..Observation::default()
            };
            b.observe(0, "web", node, obs).expect("observes");
        }
        b.cycle(0);
        let published = publication(&b);
        let (line, a) = answer(&published, "web", "web-1");
        assert_eq!(a, Answer::Weight);
        let line = line.expect("an answer");
        assert!(
            line.starts_with("ready up ") && line.ends_with("%\n"),
            "{line:?}"
        );
        // Nothing for what it does not have: `ready` would undo a drain in HAProxy.
        assert_eq!(answer(&published, "web", "web-9"), (None, Answer::Unknown));
        assert_eq!(answer(&published, "api", "web-1"), (None, Answer::Unknown));
        let drain = Act {
            action: Action::Drain {
                node: "web-2".into(),
            },
            by: "oncall".into(),
            reason: "disk full".into(),
            at: 0,
        };
        b.act("web", &drain).expect("drains");
        let mut published = publication(&b);
        assert_eq!(
            answer(&published, "web", "web-2"),
            (Some("drain\n".into()), Answer::Drain)
        );
        // The drained node's endpoint expires from the weights; the drain still holds.
        let web = published.services.get_mut("web").expect("web");
        let mut svc = (**web).clone();
        assert!(svc.endpoints.remove("web-2").is_some());
        *web = Arc::new(svc);
        assert_eq!(
            answer(&published, "web", "web-2"),
            (Some("drain\n".into()), Answer::Drain)
        );
    }
}
