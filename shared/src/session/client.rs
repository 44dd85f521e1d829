//! The agent's side of a session.

use super::proof::{self, ProofError};
use super::{clamp_interval_ms, Assignment, FrameReader, MessageKind, ProtocolError};
use crate::protocol::Protocol;
use crate::wire::{Challenge, EncodeError, Hello, Message, NodeState, Reject, Report};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The client's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientConfig {
    /// How long the aggregator has to answer the hello. Short, because a dead
    /// aggregator first in the list delays failover by this much.
    pub welcome_timeout: Duration,
    /// Replies missed in a row before the connection counts as dead. QUIC's idle
    /// timeout would notice too, but only after seconds of lost reports; the replies
    /// say sooner.
    pub missed_replies: u32,
    /// Added to `missed_replies` intervals, so that one late reply on a short interval
    /// is not taken for silence.
    pub silence_slack: Duration,
    /// The protocol version the connection negotiated ([`Protocol::negotiated`]).
    pub protocol: Protocol,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            welcome_timeout: Duration::from_secs(3),
            missed_replies: 3,
            silence_slack: Duration::from_secs(1),
            protocol: Protocol::CURRENT,
        }
    }
}

/// One measurement for a report; the session adds the sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Measurement {
    /// CPU utilization relative to what the service may use. May exceed 1.
    pub cpu: f64,
    /// Requests awaiting a response at the report's sample.
    pub inflight: u32,
    /// The mean count over the report interval's samples.
    pub inflight_mean: f64,
    /// The age of the requests owed over the same samples, when the source tells it.
    pub age: Option<crate::wire::RequestAge>,
    /// The configured capacity; 0 lets the aggregator judge the count.
    pub capacity: u32,
    /// Errors per request, when measured.
    pub error_rate: Option<f64>,
    /// Whether the node is a lame duck.
    pub draining: bool,
}

/// What the client tells its driver.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    /// The aggregator welcomed the node: reports start now, one per `interval`.
    Welcomed {
        /// The report interval.
        interval: Duration,
    },
    /// A reply: what the aggregator assigns the node now.
    Assigned {
        /// The assignment.
        assignment: Assignment,
        /// The new report interval, when the reply changed it; the next report is due
        /// one new interval from now.
        new_interval: Option<Duration>,
    },
    /// A report is due: the driver samples and calls [`ClientSession::report`].
    ReportDue,
}

/// Why the client could not go on, or dropped what it was given.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The aggregator's bytes break the protocol. On the hello stream this ends the
    /// session; a bad datagram is only dropped.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The aggregator refused the node.
    #[error("rejected: {} ({})", .0.reason, .0.detail)]
    Rejected(Reject),
    /// No welcome or reject came in time.
    #[error("no answer to the hello within {0:?}")]
    WelcomeTimeout(Duration),
    /// Replies stopped: the connection counts as dead.
    #[error("no reply to {missed} reports")]
    Silent {
        /// The replies missed in a row that the config allows.
        missed: u32,
    },
    /// A datagram arrived, or a report was asked for, before the welcome. Dropped.
    #[error("the session is not established yet")]
    NotEstablished,
    /// The session is over; nothing more goes in or out.
    #[error("the session is closed")]
    Closed,
    /// A message could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// A relay's challenge could not be answered: no key, or one of a type proofs do
    /// not use.
    #[error("cannot prove the key to the relay's primary: {0}")]
    Proof(#[from] ProofError),
}

#[derive(Debug)]
enum State {
    AwaitingWelcome {
        deadline: Option<Instant>,
    },
    Established {
        next_report: Instant,
        last_reply: Instant,
    },
    Closed,
}

/// The agent's side of one connection: sends the hello, takes the welcome or reject,
/// numbers the reports, keeps the latest assignment and the interval the aggregator
/// asks for, and gives the connection up when replies stop.
pub struct ClientSession {
    hello: Hello,
    config: ClientConfig,
    state: State,
    /// The hello stream's reader, for the answer and any challenges after it.
    reader: FrameReader,
    /// The certificate's key, to answer a relay's challenges.
    key: Option<Arc<dyn rustls::sign::SigningKey>>,
    /// Proofs to write on the hello stream.
    stream_out: Vec<u8>,
    interval_ms: u32,
    pub(super) next_seq: u32,
    assignment: Option<Assignment>,
}

impl std::fmt::Debug for ClientSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSession")
            .field("hello", &self.hello)
            .field("state", &self.state)
            .field("interval_ms", &self.interval_ms)
            .field("next_seq", &self.next_seq)
            .field("has_key", &self.key.is_some())
            .finish_non_exhaustive()
    }
}

impl ClientSession {
    /// A session that is about to send `hello`, at `now`.
    pub fn new(hello: Hello, config: ClientConfig, now: Instant) -> Self {
        ClientSession {
            hello,
            config,
            state: State::AwaitingWelcome {
                deadline: now.checked_add(config.welcome_timeout),
            },
            reader: FrameReader::new(config.protocol),
            key: None,
            stream_out: Vec::new(),
            interval_ms: super::MIN_INTERVAL_MS,
            next_seq: 1,
            assignment: None,
        }
    }

    /// The same session with its certificate's key, with which it answers the
    /// challenges of a relay's primary ([`proof`]).
    pub fn with_key(mut self, key: Arc<dyn rustls::sign::SigningKey>) -> Self {
        self.key = Some(key);
        self
    }

    /// Bytes to write on the hello stream now: the proofs that answer the challenges
    /// taken so far. The driver writes them after each call that takes stream bytes,
    /// and keeps the stream open while the connection lasts (a relay challenges again
    /// when it moves the agent to another primary).
    pub fn take_stream_out(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.stream_out)
    }

    /// The framed hello to write on the session's stream.
    pub fn hello_frame(&self) -> Result<Vec<u8>, ClientError> {
        Ok(self
            .config
            .protocol
            .frame(&Message::Hello(self.hello.clone()))?)
    }

    /// Takes bytes the aggregator sent on the hello stream. A whole welcome
    /// establishes the session; a reject, a timeout or bad bytes close it. A relay's
    /// challenge, before the welcome or after it, is answered with a proof
    /// ([`ClientSession::take_stream_out`]).
    pub fn handle_stream(
        &mut self,
        now: Instant,
        bytes: &[u8],
    ) -> Result<Option<ClientEvent>, ClientError> {
        self.check_welcome_deadline(now)?;
        if matches!(self.state, State::Closed) {
            return Err(ClientError::Closed);
        }
        let msgs = match self.reader.push_many(bytes) {
            Ok(msgs) => msgs,
            Err(e) => return Err(self.fail(e.into())),
        };
        let mut event = None;
        for msg in msgs {
            let established = self.is_established();
            match msg {
                Message::Challenge(c) => {
                    if let Err(e) = self.prove(&c) {
                        return Err(self.fail(e));
                    }
                }
                Message::Welcome(w) if !established => {
                    self.interval_ms = clamp_interval_ms(w.interval_ms);
                    self.state = State::Established {
                        next_report: now,
                        last_reply: now,
                    };
                    event = Some(ClientEvent::Welcomed {
                        interval: self.interval(),
                    });
                }
                Message::Reject(r) if !established => {
                    return Err(self.fail(ClientError::Rejected(r)))
                }
                other => {
                    let expected = if established {
                        "a challenge"
                    } else {
                        "a welcome, a reject or a challenge"
                    };
                    return Err(self.fail(
                        ProtocolError::Unexpected {
                            expected,
                            got: MessageKind::of(&other),
                        }
                        .into(),
                    ));
                }
            }
        }
        Ok(event)
    }

    /// Signs `challenge` and the hello with the certificate's key: the framed proof
    /// goes out on the stream.
    fn prove(&mut self, challenge: &Challenge) -> Result<(), ClientError> {
        let key = self.key.as_ref().ok_or(ProofError::UnsupportedKey)?;
        let proof = proof::sign(key.as_ref(), challenge, &self.hello)?;
        let frame = self.config.protocol.frame(&Message::Proof(proof))?;
        self.stream_out.extend_from_slice(&frame);
        Ok(())
    }

    /// The aggregator finished the hello stream. Before the answer came, that ends the
    /// session; after, it is the normal end of the exchange.
    pub fn handle_stream_end(&mut self) -> Result<(), ClientError> {
        match self.state {
            State::AwaitingWelcome { .. } => Err(self.fail(ProtocolError::StreamEnded.into())),
            State::Established { .. } => Ok(()),
            State::Closed => Err(ClientError::Closed),
        }
    }

    /// Takes one datagram from the aggregator. A reply yields the node's assignment
    /// (and a new interval, if it changed). Anything else is dropped with an error that
    /// leaves the session open: one bad datagram must not cost the connection.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        bytes: &[u8],
    ) -> Result<ClientEvent, ClientError> {
        let State::Established {
            next_report,
            last_reply,
        } = &mut self.state
        else {
            return Err(match self.state {
                State::Closed => ClientError::Closed,
                _ => ClientError::NotEstablished,
            });
        };
        let reply = match self
            .config
            .protocol
            .decode(bytes)
            .map_err(ProtocolError::from)?
        {
            Message::Reply(r) => r,
            other => {
                return Err(ProtocolError::Unexpected {
                    expected: "a reply",
                    got: MessageKind::of(&other),
                }
                .into())
            }
        };
        *last_reply = now;
        // Replies carry no sequence number, so every reply is taken: one reordered
        // behind a newer one holds a weight at most a cycle old, and the next corrects
        // it, while dropping replies by cycle would stall the node if the aggregator's
        // count ever started again.
        let assignment = Assignment::from(&reply);
        self.assignment = Some(assignment);
        let interval_ms = clamp_interval_ms(reply.interval_ms);
        let new_interval = if interval_ms == self.interval_ms {
            None
        } else {
            self.interval_ms = interval_ms;
            let interval = Duration::from_millis(u64::from(interval_ms));
            *next_report = now.checked_add(interval).unwrap_or(now);
            Some(interval)
        };
        Ok(ClientEvent::Assigned {
            assignment,
            new_interval,
        })
    }

    /// When the driver must call [`ClientSession::handle_timeout`] next: the welcome's
    /// deadline, or the next report or the silence deadline, whichever is sooner.
    /// `None` once the session is closed (or if a deadline lies beyond `Instant`'s
    /// range).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::AwaitingWelcome { deadline, .. } => *deadline,
            State::Established { next_report, .. } => Some(match self.silence_deadline() {
                Some(silent) => silent.min(*next_report),
                None => *next_report,
            }),
            State::Closed => None,
        }
    }

    /// Lets time pass. A report falls due ([`ClientEvent::ReportDue`]) once per
    /// interval; the welcome's deadline or silence from the aggregator close the
    /// session.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<Option<ClientEvent>, ClientError> {
        self.check_welcome_deadline(now)?;
        if self.silence_deadline().is_some_and(|d| now >= d) {
            let missed = self.config.missed_replies;
            return Err(self.fail(ClientError::Silent { missed }));
        }
        let interval = self.interval();
        let State::Established { next_report, .. } = &mut self.state else {
            return Ok(None);
        };
        if now < *next_report {
            return Ok(None);
        }
        // Keep to the schedule unless far behind, then start again from now.
        let next = next_report.checked_add(interval).unwrap_or(now);
        *next_report = if next <= now {
            now.checked_add(interval).unwrap_or(now)
        } else {
            next
        };
        Ok(Some(ClientEvent::ReportDue))
    }

    /// The next report, as a datagram to send: `m` with the next sequence number.
    pub fn report(&mut self, m: Measurement) -> Result<Vec<u8>, ClientError> {
        match self.state {
            State::Established { .. } => {}
            State::AwaitingWelcome { .. } => return Err(ClientError::NotEstablished),
            State::Closed => return Err(ClientError::Closed),
        }
        let report = Report {
            seq: self.next_seq,
            cpu: m.cpu as f32,
            inflight: m.inflight,
            inflight_mean: m.inflight_mean as f32,
            age: m.age,
            capacity: m.capacity,
            error_rate: m.error_rate.map(|e| e as f32),
            state: if m.draining {
                NodeState::Draining
            } else {
                NodeState::Serving
            },
        };
        let bytes = self.config.protocol.encode(&Message::Report(report))?;
        self.next_seq = self.next_seq.wrapping_add(1);
        Ok(bytes)
    }

    /// Takes over from `old`, the session of a connection this one replaces (made
    /// with a renewed certificate, before the old one is closed): the reports go on
    /// numbered after `old`'s, so that the aggregator, which starts a new session's
    /// numbering afresh at its hello, takes them all; and, both sessions established,
    /// the next report falls due when `old`'s would have, so that the move neither
    /// skips a report nor adds one.
    pub fn take_over(&mut self, old: &ClientSession) {
        self.next_seq = self.next_seq.max(old.next_seq);
        if let (
            State::Established { next_report, .. },
            State::Established {
                next_report: old_next,
                ..
            },
        ) = (&mut self.state, &old.state)
        {
            *next_report = *old_next;
        }
        if self.assignment.is_none() {
            self.assignment = old.assignment;
        }
    }

    /// Ends the session from this side (the agent is stopping).
    pub fn close(&mut self) {
        self.state = State::Closed;
    }

    /// The report interval in force: the welcome's, or the latest reply's.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(u64::from(self.interval_ms))
    }

    /// The latest assignment of this session; `None` before the first reply.
    pub fn assignment(&self) -> Option<Assignment> {
        self.assignment
    }

    /// Whether the welcome came and the session is open.
    pub fn is_established(&self) -> bool {
        matches!(self.state, State::Established { .. })
    }

    /// Whether the session is over.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    fn silence_deadline(&self) -> Option<Instant> {
        let State::Established { last_reply, .. } = &self.state else {
            return None;
        };
        let silence = Duration::from_millis(u64::from(self.interval_ms))
            .checked_mul(self.config.missed_replies)?
            .checked_add(self.config.silence_slack)?;
        last_reply.checked_add(silence)
    }

    fn check_welcome_deadline(&mut self, now: Instant) -> Result<(), ClientError> {
        if let State::AwaitingWelcome {
            deadline: Some(d), ..
        } = self.state
        {
            if now >= d {
                let timeout = self.config.welcome_timeout;
                return Err(self.fail(ClientError::WelcomeTimeout(timeout)));
            }
        }
        Ok(())
    }

    fn fail(&mut self, e: ClientError) -> ClientError {
        self.state = State::Closed;
        e
    }
}
