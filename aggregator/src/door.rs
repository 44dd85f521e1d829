//! The cycle loop's door: how the tasks that are not the cycle (the cluster's etcd
//! side, the routing store's writer, the config directory) ask for a change of the
//! balancer or of the services served beside it. The cycle loop takes each command
//! between two cycles, holds the balancer for it, and publishes, so that every change
//! of what is served comes in through one door and goes out in one publication order.
//!
//! It is a leaf: the senders know nothing of the state, the cluster's overlay or the
//! loop, and the loop (in the daemon's wiring) knows what each command means.

use ballast_balance::{Act, ActError, ServiceSnapshot};
use std::collections::BTreeMap;
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
    /// it at once. Answers whether it was done.
    Act(String, Act, oneshot::Sender<Result<(), ActError>>),
}

/// The sending side, cloned into every task that asks.
#[derive(Clone)]
pub struct Door(mpsc::UnboundedSender<Command>);

/// The cycle loop's side.
pub type Inbox = mpsc::UnboundedReceiver<Command>;

impl Door {
    /// A door and the inbox the cycle loop takes commands from. Unbounded: commands
    /// come from a handful of the daemon's own tasks, each waiting for its answer,
    /// never from peers.
    pub fn new() -> (Door, Inbox) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Door(tx), rx)
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
    pub async fn act(&self, service: String, act: Act) -> Result<(), ActError> {
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
