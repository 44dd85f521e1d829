//! The cycle loop's door: how the tasks that are not the cycle (the cluster's etcd
//! side, the routing store's writer, the config directory) ask for a change of the
//! balancer or of the services served beside it. The cycle loop takes each command
//! between two cycles, holds the balancer for it, and publishes, so that every change
//! of what is served comes in through one door and goes out in one publication order.
//!
//! It is a leaf: the senders know nothing of the state, the cluster's overlay or the
//! loop, and the loop (in the daemon's wiring) knows what each command means.
//!
//! In a cluster, an operator's action on a service another replica owns is not this
//! replica's to carry out: the door then holds a [`Relay`] to the owners' doors, which
//! hands the action to the service's owner (through etcd) as a [`Request`].

use ballast_balance::{Act, ActError, Action, Actions, ServiceSnapshot};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Stored services, by name.
pub type Stored = BTreeMap<String, ServiceSnapshot>;

/// What the cycle loop is asked to do.
pub enum Command {
    /// Take over the stored services the balancer does not hold, as a cluster replica
    /// that just won their buckets: restored and published. Answers how many.
    TakeOver(Stored, oneshot::Sender<usize>),
    /// Let go of the balanced services the predicate picks, as a replica that lost
    /// them: served as last published until their new owner's weights arrive.
    /// Answers their names.
    HandOver(
        Box<dyn Fn(&str) -> bool + Send>,
        oneshot::Sender<Vec<String>>,
    ),
    /// Serve these stored services, as their owners wrote them, where this replica
    /// does not balance them. Answers how many were taken.
    Follow(Stored, oneshot::Sender<usize>),
    /// Restore the services the routing store holds newer than the aggregator where
    /// that replaces nothing live. Answers the names the store must be written again
    /// with the aggregator's weights.
    RestoreNewer(Stored, oneshot::Sender<Vec<String>>),
    /// Publish again: something a publication carries besides the balancer (the
    /// locality splits) changed.
    Publish,
    /// Carry out an operator's action on a service this replica balances, and publish
    /// it at once. Answers the operators' actions in force on the service after it,
    /// or why it was refused.
    Act(String, Act, oneshot::Sender<Result<Actions, ActError>>),
}

/// An operator's action as one replica of a cluster received it, for the service's
/// owner to apply: what, who asked, how they were recognised, from where, why and
/// when, and through which replica. Kept in etcd as JSON until the owner answers it
/// with its [`Outcome`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// The service.
    pub service: String,
    /// What.
    pub action: Action,
    /// Who: the token's name or the certificate's identity.
    pub by: String,
    /// How they were recognised (`token`, `certificate`, `open`).
    pub via: String,
    /// The address the request came from, as the receiving replica saw it.
    pub from: Option<String>,
    /// Why.
    pub reason: String,
    /// When, on the receiving replica's wall clock (ms since the Unix epoch).
    pub at_ms: u64,
    /// The replica whose API received it.
    pub received_by: String,
    /// The owner that took it to apply it, before it applied it: a request claimed and
    /// not answered (the owner died between the two) is applied by no other replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_by: Option<String>,
    /// The owner's answer, once it has given one.
    #[serde(default)]
    pub outcome: Option<Outcome>,
}

impl Request {
    /// The action, as the balancer takes it.
    pub fn act(&self) -> Act {
        Act {
            action: self.action.clone(),
            by: self.by.clone(),
            reason: self.reason.clone(),
            at: self.at_ms,
        }
    }
}

/// The owner's answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The replica that answered: the service's owner.
    pub by: String,
    /// When, on its wall clock.
    pub at_ms: u64,
    /// The operators' actions in force on the service after it, or why it was refused.
    pub result: Result<Actions, ActError>,
}

/// What became of an action handed to the service's owner.
#[derive(Debug, Clone, PartialEq)]
pub enum Handed {
    /// The owner applied it.
    Applied {
        /// The owner's replica name.
        by: String,
        /// The operators' actions in force on the service after it.
        operator: Actions,
    },
    /// Stored for the owner, which did not answer within the wait: no replica holds
    /// the service now (an owner just died), or the owner is slow. The owner applies
    /// it when it holds the service, if that is within `lapses_s` seconds.
    Accepted {
        /// How long the request waits for an owner, in seconds.
        lapses_s: u64,
    },
}

/// Why an action could not be handed to the service's owner, or was refused there.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RelayError {
    /// The owner refused it.
    #[error("{error} (answered by {by}, the service's owner)")]
    Refused {
        /// The owner's replica name.
        by: String,
        /// Why.
        error: ActError,
    },
    /// etcd did not take the request, or the owner's answer could not be read.
    #[error("cannot hand the action to the service's owner through etcd: {0}")]
    Store(String),
    /// The request is larger than a request is allowed to be.
    #[error("the action is too large to hand to the service's owner ({0} bytes)")]
    TooLarge(usize),
}

impl RelayError {
    /// A short label for metrics: the owner's refusal's own, or `relay_failed`,
    /// `relay_too_large`.
    pub fn label(&self) -> &'static str {
        match self {
            RelayError::Refused { error, .. } => error.label(),
            RelayError::Store(_) => "relay_failed",
            RelayError::TooLarge(_) => "relay_too_large",
        }
    }
}

/// A future a [`Relay`] answers with.
pub type Relaying<'a> = Pin<Box<dyn Future<Output = Result<Handed, RelayError>> + Send + 'a>>;

/// The way to the owners' doors, in a cluster.
pub trait Relay: Send + Sync {
    /// This replica's name.
    fn replica(&self) -> &str;
    /// Whether this replica applies actions on `service` itself: it owns it now.
    fn owns(&self, service: &str) -> bool;
    /// Hands `request` to the owner of its service and waits a little for the answer.
    fn hand(&self, request: Request) -> Relaying<'_>;
}

/// The sending side, cloned into every task that asks.
#[derive(Clone)]
pub struct Door(mpsc::UnboundedSender<Command>, Option<Arc<dyn Relay>>);

/// The cycle loop's side.
pub type Inbox = mpsc::UnboundedReceiver<Command>;

impl Door {
    /// A door and the inbox the cycle loop takes commands from. Unbounded: commands
    /// come from a handful of the daemon's own tasks, each waiting for its answer,
    /// never from peers.
    pub fn new() -> (Door, Inbox) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Door(tx, None), rx)
    }

    /// This door, with the way to the owners' doors of a cluster.
    pub fn with_relay(self, relay: Arc<dyn Relay>) -> Door {
        Door(self.0, Some(relay))
    }

    /// The way to the owners' doors, for a cluster replica.
    pub fn relay(&self) -> Option<&Arc<dyn Relay>> {
        self.1.as_ref()
    }

    /// Sends a command whose answer is awaited; the default answer when the cycle
    /// loop is gone (the daemon is shutting down).
    async fn ask<T: Default>(&self, command: impl FnOnce(oneshot::Sender<T>) -> Command) -> T {
        let (tx, rx) = oneshot::channel();
        if self.0.send(command(tx)).is_err() {
            return T::default();
        }
        rx.await.unwrap_or_default()
    }

    /// See [`Command::TakeOver`].
    pub async fn take_over(&self, stored: Stored) -> usize {
        self.ask(|tx| Command::TakeOver(stored, tx)).await
    }

    /// See [`Command::HandOver`].
    pub async fn hand_over(&self, gone: impl Fn(&str) -> bool + Send + 'static) -> Vec<String> {
        self.ask(|tx| Command::HandOver(Box::new(gone), tx)).await
    }

    /// See [`Command::Follow`].
    pub async fn follow(&self, stored: Stored) -> usize {
        self.ask(|tx| Command::Follow(stored, tx)).await
    }

    /// See [`Command::RestoreNewer`].
    pub async fn restore_newer(&self, newer: Stored) -> Vec<String> {
        self.ask(|tx| Command::RestoreNewer(newer, tx)).await
    }

    /// See [`Command::Act`]. Each caller is an authenticated operator's request,
    /// waiting for its answer: the HTTP listener's connection limit bounds how many
    /// wait at once.
    pub async fn act(&self, service: String, act: Act) -> Result<Actions, ActError> {
        let (tx, rx) = oneshot::channel();
        let gone = || ActError::Unavailable;
        self.0
            .send(Command::Act(service, act, tx))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// See [`Command::Publish`]; not awaited.
    pub fn publish(&self) {
        let _ = self.0.send(Command::Publish);
    }
}
