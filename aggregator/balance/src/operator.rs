//! What operators set on a service from the control plane: drains of endpoints, a hold
//! on the whole service, pins of single endpoints' weights.
//!
//! An operator's drain is taken exactly as if the node's agent had said it drains, and
//! it holds until the operator undrains it, whatever the agent says meanwhile (a wedged
//! or dead agent says nothing at all). A hold freezes the controller: every cycle of a
//! held service is skipped with [`crate::SkipReason::Held`], so the weights stay what
//! they were, to the bit. A pin fixes one endpoint's published weight; the controller
//! shares out what is left among the others.
//!
//! Times here are wall-clock milliseconds (since the Unix epoch) that the caller passes
//! in: unlike the cycle's monotonic timeline they mean the same after a restart, and
//! the actions are stored with the service. Nothing here reads a clock.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Wall-clock milliseconds since the Unix epoch, as the caller reads them.
pub type WallMillis = u64;

/// Who set an action, why and when: what every action carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Mark {
    /// Who set it: the token's name or the client certificate's identity.
    pub by: String,
    /// The reason the operator gave.
    pub reason: String,
    /// When it was set.
    pub since_ms: WallMillis,
    /// When it lapses by itself; `None` holds until it is lifted.
    pub until_ms: Option<WallMillis>,
}

impl Mark {
    /// Whether it has lapsed at `wall`.
    pub fn lapsed(&self, wall: WallMillis) -> bool {
        self.until_ms.is_some_and(|until| until <= wall)
    }
}

/// One endpoint's weight, fixed by an operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Pin {
    /// The weight, in units of the service's mean weight (1.0 is an even share).
    pub weight: f64,
    /// Who, why, when, until when.
    pub mark: Mark,
}

/// The operators' actions in force on one service, stored with it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Actions {
    /// Drained endpoints, by node.
    pub drains: BTreeMap<String, Mark>,
    /// The hold on the whole service, if any.
    pub hold: Option<Mark>,
    /// Pinned endpoints, by node.
    pub pins: BTreeMap<String, Pin>,
}

impl Actions {
    /// Whether no action is in force.
    pub fn is_empty(&self) -> bool {
        self.drains.is_empty() && self.hold.is_none() && self.pins.is_empty()
    }

    /// Whether an operator drained `node`.
    pub fn drained(&self, node: &str) -> bool {
        !self.drains.is_empty() && self.drains.contains_key(node)
    }

    /// The weight an operator pinned `node` at, if any.
    pub fn pinned(&self, node: &str) -> Option<f64> {
        if self.pins.is_empty() {
            return None;
        }
        self.pins.get(node).map(|p| p.weight)
    }
}

/// What an operator asks of a service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Drain `node`: weight 0 and draining in every feed, until undrained.
    Drain {
        /// The node.
        node: String,
    },
    /// Lift an operator's drain of `node`.
    Undrain {
        /// The node.
        node: String,
    },
    /// Freeze the service's weights, until released or `until_ms`.
    Hold {
        /// When the hold lapses by itself.
        until_ms: Option<WallMillis>,
    },
    /// Lift the hold.
    Release,
    /// Fix `node`'s weight at `weight` (in units of the mean), until unpinned or
    /// `until_ms`.
    Pin {
        /// The node.
        node: String,
        /// The weight.
        weight: f64,
        /// When the pin lapses by itself.
        until_ms: Option<WallMillis>,
    },
    /// Lift the pin of `node`.
    Unpin {
        /// The node.
        node: String,
    },
}

impl Action {
    /// A short label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Action::Drain { .. } => "drain",
            Action::Undrain { .. } => "undrain",
            Action::Hold { .. } => "hold",
            Action::Release => "release",
            Action::Pin { .. } => "pin",
            Action::Unpin { .. } => "unpin",
        }
    }

    /// The node it names, if it names one.
    pub fn node(&self) -> Option<&str> {
        match self {
            Action::Drain { node }
            | Action::Undrain { node }
            | Action::Pin { node, .. }
            | Action::Unpin { node } => Some(node),
            Action::Hold { .. } | Action::Release => None,
        }
    }
}

/// An action with who asks, why and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Act {
    /// What.
    pub action: Action,
    /// Who: the token's name or the certificate's identity.
    pub by: String,
    /// Why, in the operator's words; must not be blank.
    pub reason: String,
    /// When, on the wall clock.
    pub at: WallMillis,
}

/// Why an action was refused. Serialisable, so that a cluster replica that applies an
/// action another replica received can say why it refused it.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum ActError {
    /// The balancer does not hold the service.
    #[error("service {0:?} is not balanced here (unknown, or owned by another replica)")]
    UnknownService(String),
    /// The service has no such endpoint.
    #[error("service {service:?} has no endpoint {node:?}")]
    UnknownEndpoint {
        /// The service.
        service: String,
        /// The node.
        node: String,
    },
    /// Lifting an action that is not in force.
    #[error("{0}")]
    NotInForce(String),
    /// No reason given.
    #[error("a reason is required: say why, for the audit trail")]
    NoReason,
    /// A reason past [`MAX_REASON`] characters.
    #[error("the reason is longer than {MAX_REASON} characters")]
    ReasonTooLong,
    /// A pin's weight that is not a finite number within the service's bounds.
    #[error("a pinned weight must be at least {min} and at most {max} (the service's min_weight and max_weight); got {got}")]
    BadWeight {
        /// The weight asked for.
        got: f64,
        /// The smallest allowed.
        min: f64,
        /// The largest allowed.
        max: f64,
    },
    /// The aggregator is shutting down and takes no more actions.
    #[error("the aggregator is shutting down")]
    Unavailable,
    /// An end time that has passed.
    #[error("the end time {until_ms} ms is not after now ({now_ms} ms since the Unix epoch)")]
    UntilPast {
        /// The end asked for.
        until_ms: WallMillis,
        /// Now.
        now_ms: WallMillis,
    },
}

impl ActError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ActError::UnknownService(_) => "unknown_service",
            ActError::UnknownEndpoint { .. } => "unknown_endpoint",
            ActError::NotInForce(_) => "not_in_force",
            ActError::NoReason => "no_reason",
            ActError::ReasonTooLong => "reason_too_long",
            ActError::BadWeight { .. } => "bad_weight",
            ActError::Unavailable => "unavailable",
            ActError::UntilPast { .. } => "until_past",
        }
    }
}

/// The longest reason accepted, in characters: every action is stored with the service and
/// audited, so what a credential can make the aggregator keep is bounded.
pub const MAX_REASON: usize = 1024;

/// An action that lapsed by itself at its end time.
#[derive(Debug, Clone, PartialEq)]
pub struct Lapsed {
    /// The service.
    pub service: String,
    /// What lapsed: a `Release` or an `Unpin`.
    pub action: Action,
    /// The mark it carried.
    pub mark: Mark,
}

/// Checks what every action needs: a reason within [`MAX_REASON`], an end in the future.
pub(crate) fn check(act: &Act) -> Result<(), ActError> {
    if act.reason.trim().is_empty() {
        return Err(ActError::NoReason);
    }
    if act.reason.chars().count() > MAX_REASON {
        return Err(ActError::ReasonTooLong);
    }
    if let Action::Hold {
        until_ms: Some(until),
    }
    | Action::Pin {
        until_ms: Some(until),
        ..
    } = act.action
    {
        if until <= act.at {
            return Err(ActError::UntilPast {
                until_ms: until,
                now_ms: act.at,
            });
        }
    }
    Ok(())
}
