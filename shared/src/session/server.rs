//! The aggregator's side of a session.

use super::authz::Peer;
use super::{
    clamp_interval_ms, close, seq_newer, Assignment, FrameReader, MessageKind, ProtocolError,
};
use crate::protocol::Protocol;
use crate::wire::{
    Challenge, EncodeError, Hello, Message, Proof, Reject, RejectReason, Reply, Report, Welcome,
};
use std::time::{Duration, Instant};

/// The longest reject detail sent, in bytes, so that a reject always fits its frame
/// whatever text the reason carries.
pub(super) const MAX_DETAIL: usize = 256;

/// `s` cut to at most `max` bytes, at a character boundary.
pub(super) fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// The server's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConfig {
    /// The report interval agents are told to use, in milliseconds; clamped to
    /// [`super::MIN_INTERVAL_MS`, `super::MAX_INTERVAL_MS`].
    pub interval_ms: u32,
    /// How long a new connection may take to deliver its hello: a connection that
    /// never says hello holds a task and a slot for nothing.
    pub hello_timeout: Duration,
    /// A session that receives this many datagrams that are not reports (undecodable
    /// or unexpected) is closed: its peer is broken or hostile, and serving it costs
    /// the others.
    pub max_bad_datagrams: u32,
    /// The protocol version the connection negotiated ([`Protocol::negotiated`]).
    pub protocol: Protocol,
}

impl ServerConfig {
    /// The defaults, with agents reporting every `interval_ms`.
    pub fn new(interval_ms: u32) -> Self {
        ServerConfig {
            interval_ms,
            hello_timeout: Duration::from_secs(5),
            max_bad_datagrams: 16,
            protocol: Protocol::CURRENT,
        }
    }
}

/// What the server tells its driver.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerEvent {
    /// A well-formed hello from the node its certificate names. The driver registers
    /// the node, then answers with [`ServerSession::welcome`] or
    /// [`ServerSession::reject`].
    Hello(Hello),
    /// The hello was refused here (invalid fields, a node other than the
    /// certificate's, a service or an address the peer's grant does not allow): the
    /// driver sends `frame` on the stream, then closes the connection with
    /// [`close::REJECTED`].
    Refused {
        /// Why, for metrics and logs.
        reject: Reject,
        /// The framed reject.
        frame: Vec<u8>,
    },
    /// A report newer than any before it on this session: for the balancer, then
    /// answered with [`ServerSession::reply`].
    Report(Report),
    /// A report no newer than one already taken (a reordered datagram): dropped, so
    /// that the balancer never goes back to older data. It gets no reply.
    Reordered {
        /// Its sequence number.
        seq: u32,
        /// The newest sequence number taken.
        last: u32,
    },
}

/// Why the server could not go on, or dropped what it was given.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The agent's bytes break the protocol. On the hello stream this ends the session
    /// ([`close::PROTOCOL`]); a bad datagram is only dropped.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// No hello came in time; the session is closed ([`close::PROTOCOL`]).
    #[error("no hello within {0:?}")]
    HelloTimeout(Duration),
    /// The last of too many datagrams that were not reports; the session is closed
    /// ([`close::PROTOCOL`]).
    #[error("{count} datagrams that are not reports, the last: {last}")]
    TooManyBadDatagrams {
        /// How many.
        count: u32,
        /// What was wrong with the last.
        last: ProtocolError,
    },
    /// A datagram came before the session was established. Dropped.
    #[error("a datagram before the welcome")]
    BeforeWelcome,
    /// [`ServerSession::welcome`] or [`ServerSession::reject`] without a hello waiting
    /// for its answer: a mistake of the driver's.
    #[error("no hello is waiting for an answer")]
    NotAdmitting,
    /// The session is over; nothing more goes in or out.
    #[error("the session is closed")]
    Closed,
    /// A message could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

impl ServerError {
    /// A short, stable label for metrics: the reason the offending message counts as
    /// rejected under.
    pub fn label(&self) -> &'static str {
        match self {
            ServerError::Protocol(p) | ServerError::TooManyBadDatagrams { last: p, .. } => {
                p.label()
            }
            ServerError::HelloTimeout(_) => "hello_timeout",
            ServerError::BeforeWelcome => "no_hello",
            ServerError::NotAdmitting | ServerError::Closed => "state",
            ServerError::Encode(_) => "encode",
        }
    }
}

#[derive(Debug)]
enum State {
    AwaitingHello {
        deadline: Option<Instant>,
        reader: FrameReader,
    },
    Admitting {
        hello: Hello,
    },
    Established {
        hello: Hello,
        last_seq: Option<u32>,
        bad: u32,
    },
    Closed {
        code: u32,
    },
}

/// The aggregator's side of one connection: takes the hello, checks it against the
/// certificate's identity and what the peer may claim (its services, its address),
/// answers with a welcome or a reject, drops reordered reports, builds the reply to
/// each report, and closes a session whose peer keeps breaking the protocol.
#[derive(Debug)]
pub struct ServerSession {
    peer: Peer,
    config: ServerConfig,
    interval_ms: u32,
    state: State,
    /// The hello stream after the hello: the proofs a relay's agent sends.
    proofs: FrameReader,
}

impl ServerSession {
    /// A session for a connection from `peer` (the identity its certificate names, its
    /// source address and what it may claim), accepted at `now`.
    pub fn new(peer: Peer, config: ServerConfig, now: Instant) -> Self {
        ServerSession {
            peer,
            config,
            interval_ms: clamp_interval_ms(config.interval_ms),
            state: State::AwaitingHello {
                deadline: now.checked_add(config.hello_timeout),
                reader: FrameReader::new(config.protocol),
            },
            proofs: FrameReader::new(config.protocol),
        }
    }

    /// A relay's primary's challenge, framed for the agent's hello stream. Only
    /// `ballast/2` has challenges; an agent of `ballast/1` cannot be asked.
    pub fn challenge_frame(&self, challenge: &Challenge) -> Result<Vec<u8>, ServerError> {
        Ok(self
            .config
            .protocol
            .frame(&Message::Challenge(challenge.clone()))?)
    }

    /// Takes bytes the agent sent on its hello stream after the hello: the proofs
    /// they complete. Anything but a proof there breaks the protocol.
    pub fn handle_proofs(&mut self, bytes: &[u8]) -> Result<Vec<Proof>, ProtocolError> {
        self.proofs
            .push_many(bytes)?
            .into_iter()
            .map(|m| match m {
                Message::Proof(p) => Ok(p),
                other => Err(ProtocolError::Unexpected {
                    expected: "a proof",
                    got: MessageKind::of(&other),
                }),
            })
            .collect()
    }

    /// When the driver must call [`ServerSession::handle_timeout`]: the hello's
    /// deadline while it is awaited, otherwise `None` (QUIC's idle timeout ends a
    /// silent established connection).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::AwaitingHello { deadline, .. } => *deadline,
            _ => None,
        }
    }

    /// Lets time pass: no hello by its deadline closes the session.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ServerError> {
        if let State::AwaitingHello {
            deadline: Some(d), ..
        } = self.state
        {
            if now >= d {
                let timeout = self.config.hello_timeout;
                return Err(self.fail(ServerError::HelloTimeout(timeout)));
            }
        }
        Ok(())
    }

    /// Takes bytes the agent sent on the hello stream. A whole, valid hello from the
    /// certificate's node, for a service and an address the peer may claim, yields
    /// [`ServerEvent::Hello`]; any other hello, [`ServerEvent::Refused`]; bad bytes or
    /// another message close the session.
    pub fn handle_stream(
        &mut self,
        now: Instant,
        bytes: &[u8],
    ) -> Result<Option<ServerEvent>, ServerError> {
        self.handle_timeout(now)?;
        let reader = match &mut self.state {
            State::AwaitingHello { reader, .. } => reader,
            // The driver stops reading after the hello; anything more is dropped.
            State::Admitting { .. } | State::Established { .. } if bytes.is_empty() => {
                return Ok(None)
            }
            State::Admitting { .. } | State::Established { .. } => {
                return Err(ProtocolError::TrailingFrame(bytes.len()).into())
            }
            State::Closed { .. } => return Err(ServerError::Closed),
        };
        let hello = match reader.push(bytes) {
            Ok(Some(Message::Hello(h))) => h,
            Ok(Some(other)) => {
                return Err(self.fail(
                    ProtocolError::Unexpected {
                        expected: "a hello",
                        got: MessageKind::of(&other),
                    }
                    .into(),
                ))
            }
            Ok(None) => return Ok(None),
            Err(e) => return Err(self.fail(e.into())),
        };
        if let Some(reject) = self.refusal(&hello) {
            self.state = State::Admitting { hello };
            let frame = self.reject(reject.reason, reject.detail.clone())?;
            return Ok(Some(ServerEvent::Refused { reject, frame }));
        }
        self.state = State::Admitting {
            hello: hello.clone(),
        };
        Ok(Some(ServerEvent::Hello(hello)))
    }

    /// The agent finished the hello stream. Before the hello was whole, that ends the
    /// session; after, it is the normal end of the exchange.
    pub fn handle_stream_end(&mut self) -> Result<(), ServerError> {
        match self.state {
            State::AwaitingHello { .. } => Err(self.fail(ProtocolError::StreamEnded.into())),
            State::Closed { .. } => Err(ServerError::Closed),
            _ => Ok(()),
        }
    }

    /// Welcomes the node whose hello is waiting: the framed welcome to send on the
    /// stream. Reports are taken from now on.
    pub fn welcome(&mut self) -> Result<Vec<u8>, ServerError> {
        let hello = match std::mem::replace(&mut self.state, State::Closed { code: 0 }) {
            State::Admitting { hello } => hello,
            other => {
                self.state = other;
                return Err(ServerError::NotAdmitting);
            }
        };
        self.state = State::Established {
            hello,
            last_seq: None,
            bad: 0,
        };
        let welcome = Welcome {
            interval_ms: self.interval_ms,
        };
        Ok(self.config.protocol.frame(&Message::Welcome(welcome))?)
    }

    /// Refuses the node whose hello is waiting (for a reason only the driver can judge,
    /// such as a service the aggregator does not serve): the framed reject to send on
    /// the stream before closing the connection with [`close::REJECTED`].
    pub fn reject(&mut self, reason: RejectReason, detail: String) -> Result<Vec<u8>, ServerError> {
        if !matches!(self.state, State::Admitting { .. }) {
            return Err(ServerError::NotAdmitting);
        }
        self.state = State::Closed {
            code: close::REJECTED,
        };
        let detail = truncate(detail, MAX_DETAIL);
        Ok(self
            .config
            .protocol
            .frame(&Message::Reject(Reject { reason, detail }))?)
    }

    /// Takes one datagram from the agent. A report newer than any before it yields
    /// [`ServerEvent::Report`]; an older one, [`ServerEvent::Reordered`]. Anything
    /// else is dropped with an error, and too many close the session.
    pub fn handle_datagram(&mut self, bytes: &[u8]) -> Result<ServerEvent, ServerError> {
        let max_bad = self.config.max_bad_datagrams;
        let State::Established { last_seq, bad, .. } = &mut self.state else {
            return Err(match self.state {
                State::Closed { .. } => ServerError::Closed,
                _ => ServerError::BeforeWelcome,
            });
        };
        let fault = match self.config.protocol.decode(bytes) {
            Ok(Message::Report(report)) => {
                return Ok(match *last_seq {
                    Some(last) if !seq_newer(report.seq, last) => ServerEvent::Reordered {
                        seq: report.seq,
                        last,
                    },
                    _ => {
                        *last_seq = Some(report.seq);
                        ServerEvent::Report(report)
                    }
                });
            }
            Ok(other) => ProtocolError::Unexpected {
                expected: "a report",
                got: MessageKind::of(&other),
            },
            Err(e) => ProtocolError::Decode(e),
        };
        *bad = bad.saturating_add(1);
        if *bad >= max_bad {
            let count = *bad;
            return Err(self.fail(ServerError::TooManyBadDatagrams { count, last: fault }));
        }
        Err(fault.into())
    }

    /// The reply to the report just taken, as a datagram: `assignment` and the report
    /// interval in force.
    pub fn reply(&self, assignment: &Assignment) -> Result<Vec<u8>, ServerError> {
        match self.state {
            State::Established { .. } => {}
            State::Closed { .. } => return Err(ServerError::Closed),
            _ => return Err(ServerError::BeforeWelcome),
        }
        let reply = Reply {
            weight: assignment.weight as f32,
            cycle: assignment.cycle,
            interval_ms: self.interval_ms,
            draining: assignment.draining,
            load: assignment.load as f32,
            inflight_trusted: assignment.inflight_trusted,
        };
        Ok(self.config.protocol.encode(&Message::Reply(reply))?)
    }

    /// Changes the report interval the agent is told with every reply from now on
    /// (clamped like every interval); returns the interval in force.
    pub fn set_interval_ms(&mut self, interval_ms: u32) -> u32 {
        self.interval_ms = clamp_interval_ms(interval_ms);
        self.interval_ms
    }

    /// The report interval in force, in milliseconds.
    pub fn interval_ms(&self) -> u32 {
        self.interval_ms
    }

    /// The identity of the client certificate.
    pub fn identity(&self) -> &str {
        &self.peer.identity
    }

    /// The peer: its identity, its source address and what it may claim.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// The hello taken, once there is one that was not refused.
    pub fn hello(&self) -> Option<&Hello> {
        match &self.state {
            State::Admitting { hello } | State::Established { hello, .. } => Some(hello),
            _ => None,
        }
    }

    /// Whether the welcome went out and the session is open.
    pub fn is_established(&self) -> bool {
        matches!(self.state, State::Established { .. })
    }

    /// The QUIC close code for the connection once the session is over: `None` while
    /// it goes on.
    pub fn close_code(&self) -> Option<u32> {
        match self.state {
            State::Closed { code } => Some(code),
            _ => None,
        }
    }

    /// Why a hello is refused before it reaches the balancer, if it is.
    fn refusal(&self, hello: &Hello) -> Option<Reject> {
        if let Err(e) = hello.validate() {
            return Some(Reject {
                reason: RejectReason::InvalidHello,
                detail: e.to_string(),
            });
        }
        let peer = &self.peer;
        if hello.node != peer.identity {
            return Some(Reject {
                reason: RejectReason::IdentityMismatch,
                detail: format!(
                    "certificate is for {:?}, hello claims {:?}",
                    peer.identity, hello.node
                ),
            });
        }
        if !peer.grant.allows_service(&hello.service) {
            let allowed = if peer.grant.services.is_empty() {
                "no service: its certificate names none and no policy rule grants any".to_string()
            } else {
                format!("only {}", peer.grant.services.join(", "))
            };
            return Some(Reject {
                reason: RejectReason::ServiceNotAllowed,
                detail: format!(
                    "{:?} may not serve {:?}; it may serve {allowed}",
                    peer.identity, hello.service
                ),
            });
        }
        if let Err(e) = peer.grant.check_address(&hello.address, peer.source) {
            return Some(Reject {
                reason: RejectReason::AddressNotAllowed,
                detail: e.to_string(),
            });
        }
        None
    }

    fn fail(&mut self, e: ServerError) -> ServerError {
        self.state = State::Closed {
            code: close::PROTOCOL,
        };
        e
    }
}
