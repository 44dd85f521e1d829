//! The routes that act: an operator drains an endpoint, holds a service's weights or
//! pins one endpoint's weight, and lifts each again (see [`ballast_balance::operator`]).
//!
//! Only the `operator` role reaches them (a viewer is answered 403, a request nobody
//! authenticated 401), and each needs a reason. The action goes to the cycle loop
//! through its door, which carries it out between two cycles and publishes it at once,
//! and it is audited: who, what, when, from which address, why.
//!
//! In a cluster, any replica takes an action: on a service it owns, it carries it out
//! itself; on another's, it hands it to the owner through etcd (the door's
//! [`crate::door::Relay`]) and waits a little for the owner's answer. The answer says
//! which happened: 200 when the action is applied (`outcome` `applied`, with the
//! replica that applied it), 202 when it is only accepted for the owner, which has not
//! answered yet (a failover is under way): the owner applies it when it holds the
//! service. The receiving replica audits it either way, naming itself and the owner.

use super::auth::Operator;
use super::listener::Peer;
use super::views::ErrorBody;
use super::ApiError;
use crate::audit::{Audit, AuditRecord};
use crate::door::{Door, Handed, Relay, RelayError, Request};
use crate::state::State;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{ConnectInfo, Path, State as AxState};
use axum::http::StatusCode;
use axum::{Extension, Json};
use ballast_balance::{Act, ActError, Action, Actions};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use utoipa::ToSchema;

/// What the acting routes need: the cycle loop's door, and the audit trail.
#[derive(Clone)]
pub struct Acting {
    /// Where actions go.
    pub door: Door,
    /// Where they are recorded.
    pub audit: Arc<Audit>,
}

/// The schemas of the request bodies, whose optional fields the document leaves
/// optional (every field of an answer is always written, and required).
pub(crate) const REQUEST_BODIES: [&str; 3] = ["ReasonBody", "HoldBody", "PinBody"];

/// A whole number of seconds, written as an integer or a float without a fraction
/// (`30` or `30.0`: JSON does not tell them apart, and JSON Schema's `integer` takes
/// both).
fn whole_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let v: Option<f64> = Option::deserialize(d)?;
    match v {
        None => Ok(None),
        Some(f) if f.fract() == 0.0 && (0.0..=MAX_FOR_S as f64).contains(&f) => {
            // In range and whole: the cast is exact.
            Ok(Some(f as u64))
        }
        Some(f) => Err(serde::de::Error::custom(format!(
            "for_s: {f} is not a whole number of seconds between 0 and {MAX_FOR_S}"
        ))),
    }
}

/// The body of a drain, an undrain, a release or an unpin.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    /// Why, for the audit trail: required, not blank, at most 1024 characters.
    #[schema(min_length = 1, max_length = 1024, pattern = r"\S")]
    pub reason: String,
}

/// The body of a hold.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HoldBody {
    /// Why, for the audit trail: required, not blank, at most 1024 characters.
    #[schema(min_length = 1, max_length = 1024, pattern = r"\S")]
    pub reason: String,
    /// How long the hold lasts, in seconds (at most a year); without it, until
    /// released.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 31_622_400)]
    pub for_s: Option<u64>,
}

/// The body of a pin.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PinBody {
    /// Why, for the audit trail: required, not blank, at most 1024 characters.
    #[schema(min_length = 1, max_length = 1024, pattern = r"\S")]
    pub reason: String,
    /// The weight, in units of the service's mean weight (1.0 is an even share);
    /// within the service's `min_weight` and `max_weight` (409 outside them).
    #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
    pub weight: f64,
    /// How long the pin lasts, in seconds (at most a year); without it, until
    /// unpinned.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 31_622_400)]
    pub for_s: Option<u64>,
}

/// Whether an action was applied, or only accepted for the service's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Applied: in force, and published by the replica that applied it (HTTP 200).
    #[default]
    Applied,
    /// Accepted for the service's owner, which has not applied it yet: in a cluster,
    /// while no replica holds the service (a failover), or its owner is slow to
    /// answer (HTTP 202). The owner applies it when it holds the service.
    Accepted,
}

/// The answer to an action: its audit record, whether it was applied, and the actions
/// now in force on the service.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ActResult {
    /// The audit record of the action, as the replica that received it keeps it.
    pub audit: AuditRecord,
    /// Applied (HTTP 200), or only accepted for the service's owner (HTTP 202).
    #[serde(default)]
    pub outcome: Outcome,
    /// In a cluster: the replica that applied it (the one that answers, or the
    /// service's owner); absent while only accepted, and outside a cluster.
    #[serde(default)]
    pub applied_by: Option<String>,
    /// The operators' actions in force on the service now: after the action where it
    /// was applied; as this replica last saw the owner's where it was only accepted.
    pub operator: Actions,
}

/// The largest weight a pin may ask for: the largest `max_weight` a service may have.
/// Within it, a weight above the service's own `max_weight` is a conflict (409).
pub const MAX_PIN: f64 = 1000.0;

/// The longest hold or pin, in seconds: a year. Longer is a config change, not an action.
pub const MAX_FOR_S: u64 = 366 * 24 * 3600;

type Peered = Option<Extension<ConnectInfo<Peer>>>;
type WithActing = Option<Extension<Arc<Acting>>>;

/// Counts a refused action and answers it.
fn refuse(
    state: &State,
    action: &str,
    reason: &str,
    status: StatusCode,
    message: String,
) -> ApiError {
    state.metrics.act(action, reason);
    ApiError { status, message }
}

/// The body, or the API's 400.
fn body<T>(
    state: &State,
    action: &str,
    body: Result<Json<T>, JsonRejection>,
) -> Result<T, ApiError> {
    body.map(|Json(b)| b).map_err(|e| {
        refuse(
            state,
            action,
            "bad_body",
            StatusCode::BAD_REQUEST,
            format!("{e}; the body is JSON with a \"reason\""),
        )
    })
}

/// The end time of a hold or pin `for_s` seconds after `now`, or the API's 400.
fn until(
    state: &State,
    action: &str,
    now: u64,
    for_s: Option<u64>,
) -> Result<Option<u64>, ApiError> {
    match for_s {
        Some(s) if s == 0 || s > MAX_FOR_S => Err(refuse(
            state,
            action,
            "bad_for",
            StatusCode::BAD_REQUEST,
            format!("for_s must be between 1 and {MAX_FOR_S} seconds"),
        )),
        Some(s) => Ok(Some(now.saturating_add(s.saturating_mul(1000)))),
        None => Ok(None),
    }
}

/// The HTTP status of a refused action.
fn refused_status(e: &ActError) -> StatusCode {
    match e {
        ActError::UnknownService(_) | ActError::UnknownEndpoint { .. } => StatusCode::NOT_FOUND,
        ActError::NotInForce(_) | ActError::BadWeight { .. } => StatusCode::CONFLICT,
        ActError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ActError::NoReason | ActError::ReasonTooLong | ActError::UntilPast { .. } => {
            StatusCode::BAD_REQUEST
        }
    }
}

/// What an action answers: its status (200 applied, 202 accepted) and body.
type Answer = Result<(StatusCode, Json<ActResult>), ApiError>;

/// Sends `action` on `service` through the door, or in a cluster to the service's
/// owner, audits it, and answers it.
async fn carry(
    state: &State,
    acting: WithActing,
    who: Operator,
    peer: Peered,
    service: String,
    action: Action,
    reason: String,
) -> Answer {
    let label = action.label();
    let Some(Extension(acting)) = acting else {
        return Err(refuse(
            state,
            label,
            "unavailable",
            StatusCode::SERVICE_UNAVAILABLE,
            "this aggregator takes no actions".into(),
        ));
    };
    let at = state.clock.wall();
    let relay = acting.door.relay().cloned();
    let record = AuditRecord {
        seq: 0,
        at_ms: at,
        who: who.0.name.clone(),
        via: who.0.via.label().to_string(),
        from: peer.map(|Extension(ConnectInfo(p))| p.addr.to_string()),
        action: label.to_string(),
        service: service.clone(),
        node: action.node().map(str::to_string),
        weight: match action {
            Action::Pin { weight, .. } => Some(weight),
            _ => None,
        },
        until_ms: match action {
            Action::Hold { until_ms } | Action::Pin { until_ms, .. } => until_ms,
            _ => None,
        },
        reason: reason.clone(),
        received_by: relay.as_ref().map(|r| r.replica().to_string()),
        applied_by: None,
    };
    if let Some(relay) = relay.filter(|r| !r.owns(&service)) {
        return hand(state, &acting, relay.as_ref(), record, action).await;
    }
    let act = Act {
        action,
        by: who.0.name,
        reason,
        at,
    };
    match acting.door.act(service, act).await {
        Ok(operator) => {
            state.metrics.act(label, "applied");
            let applied_by = record.received_by.clone();
            let audit = acting.audit.record(AuditRecord {
                applied_by: applied_by.clone(),
                ..record
            });
            let result = ActResult {
                audit,
                outcome: Outcome::Applied,
                applied_by,
                operator,
            };
            Ok((StatusCode::OK, Json(result)))
        }
        Err(e) => Err(refuse(
            state,
            label,
            e.label(),
            refused_status(&e),
            e.to_string(),
        )),
    }
}

/// Hands an action on a service another replica owns to its owner, through `relay`,
/// and answers what became of it. The service and the endpoint it names must be among
/// those this replica serves as their owners stored them, so that nothing is stored
/// for an owner that would only refuse it.
async fn hand(
    state: &State,
    acting: &Acting,
    relay: &dyn Relay,
    record: AuditRecord,
    action: Action,
) -> Answer {
    let label = action.label();
    let service = record.service.clone();
    let seen = state.published().services.get(&service).map(|s| {
        let known = match &action {
            Action::Drain { node } | Action::Pin { node, .. } => s.endpoints.contains_key(node),
            _ => true,
        };
        (known, s.operator.clone())
    });
    let seen_operator = match seen {
        None => {
            let e = ActError::UnknownService(service.clone());
            let message = format!(
                "service {service:?} is not served by any replica of the cluster (none has \
                 stored it)"
            );
            return Err(refuse(
                state,
                label,
                e.label(),
                StatusCode::NOT_FOUND,
                message,
            ));
        }
        Some((false, _)) => {
            let e = ActError::UnknownEndpoint {
                service: service.clone(),
                node: action.node().unwrap_or_default().to_string(),
            };
            return Err(refuse(
                state,
                label,
                e.label(),
                StatusCode::NOT_FOUND,
                e.to_string(),
            ));
        }
        Some((true, operator)) => operator,
    };
    let request = Request {
        service,
        action,
        by: record.who.clone(),
        via: record.via.clone(),
        from: record.from.clone(),
        reason: record.reason.clone(),
        at_ms: record.at_ms,
        received_by: relay.replica().to_string(),
        claimed_by: None,
        outcome: None,
    };
    match relay.hand(request).await {
        Ok(Handed::Applied { by, operator }) => {
            state.metrics.act(label, "applied");
            let audit = acting.audit.record(AuditRecord {
                applied_by: Some(by.clone()),
                ..record
            });
            let result = ActResult {
                audit,
                outcome: Outcome::Applied,
                applied_by: Some(by),
                operator,
            };
            Ok((StatusCode::OK, Json(result)))
        }
        Ok(Handed::Accepted { lapses_s }) => {
            state.metrics.act(label, "accepted");
            tracing::info!(action = label, service = %record.service, lapses_s,
                "an operator's action is accepted for the service's owner, which has not \
                 answered yet: it applies it when it holds the service");
            let audit = acting.audit.record(record);
            let result = ActResult {
                audit,
                outcome: Outcome::Accepted,
                applied_by: None,
                operator: seen_operator,
            };
            Ok((StatusCode::ACCEPTED, Json(result)))
        }
        Err(e) => {
            let status = match &e {
                RelayError::Refused { error, .. } => refused_status(error),
                RelayError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
                RelayError::TooLarge(_) => StatusCode::BAD_REQUEST,
            };
            Err(refuse(state, label, e.label(), status, e.to_string()))
        }
    }
}

/// The service and node of a `{name}/endpoints/{node}` path, or the API's 400.
fn endpoint_path(
    state: &State,
    action: &str,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), ApiError> {
    path.map(|Path(p)| p).map_err(|e| {
        refuse(
            state,
            action,
            "bad_path",
            StatusCode::BAD_REQUEST,
            e.to_string(),
        )
    })
}

/// The service of a `{name}` path, or the API's 400.
fn service_path(
    state: &State,
    action: &str,
    path: Result<Path<String>, PathRejection>,
) -> Result<String, ApiError> {
    path.map(|Path(p)| p).map_err(|e| {
        refuse(
            state,
            action,
            "bad_path",
            StatusCode::BAD_REQUEST,
            e.to_string(),
        )
    })
}

#[utoipa::path(
    post,
    path = "/v1/services/{name}/endpoints/{node}/drain",
    operation_id = "drain_endpoint",
    tag = "actions",
    summary = "Drain an endpoint (operator)",
    description = "Weight 0 and DRAINING in every feed within one cycle, exactly as if \
        the node's agent had asked, whether or not its agent still reports; it holds \
        until undrained, across restarts and changes of owner. Audited.",
    params(
        ("name" = String, Path, description = "The service"),
        ("node" = String, Path, description = "The endpoint's node"),
    ),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "Drained: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service or endpoint (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn drain(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<(String, String)>, PathRejection>,
    b: Result<Json<ReasonBody>, JsonRejection>,
) -> Answer {
    let (service, node) = endpoint_path(&state, "drain", path)?;
    let b = body(&state, "drain", b)?;
    let action = Action::Drain { node };
    carry(&state, acting, who, peer, service, action, b.reason).await
}

#[utoipa::path(
    delete,
    path = "/v1/services/{name}/endpoints/{node}/drain",
    operation_id = "undrain_endpoint",
    tag = "actions",
    summary = "Lift an operator's drain (operator)",
    description = "The endpoint comes back cold, as a newcomer, unless its own agent \
        asks to drain. Audited.",
    params(
        ("name" = String, Path, description = "The service"),
        ("node" = String, Path, description = "The endpoint's node"),
    ),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "Undrained: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 409, description = "The endpoint is not drained by an operator", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn undrain(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<(String, String)>, PathRejection>,
    b: Result<Json<ReasonBody>, JsonRejection>,
) -> Answer {
    let (service, node) = endpoint_path(&state, "undrain", path)?;
    let b = body(&state, "undrain", b)?;
    let action = Action::Undrain { node };
    carry(&state, acting, who, peer, service, action, b.reason).await
}

#[utoipa::path(
    post,
    path = "/v1/services/{name}/hold",
    operation_id = "hold_service",
    tag = "actions",
    summary = "Hold a service's weights (operator)",
    description = "Freezes every weight at its current value, to the bit, until \
        released or for `for_s` seconds; the service's cycles are \
        skipped with the reason `held`. Audited.",
    params(("name" = String, Path, description = "The service")),
    request_body = HoldBody,
    responses(
        (status = 200, description = "Held: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, a duration out of bounds, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn hold(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<String>, PathRejection>,
    b: Result<Json<HoldBody>, JsonRejection>,
) -> Answer {
    let service = service_path(&state, "hold", path)?;
    let b = body(&state, "hold", b)?;
    let until_ms = until(&state, "hold", state.clock.wall(), b.for_s)?;
    let action = Action::Hold { until_ms };
    carry(&state, acting, who, peer, service, action, b.reason).await
}

#[utoipa::path(
    delete,
    path = "/v1/services/{name}/hold",
    operation_id = "release_service",
    tag = "actions",
    summary = "Release a service's hold (operator)",
    description = "The controllers steer again from the next cycle. Audited.",
    params(("name" = String, Path, description = "The service")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "Released: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 409, description = "The service is not held", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn release(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<String>, PathRejection>,
    b: Result<Json<ReasonBody>, JsonRejection>,
) -> Answer {
    let service = service_path(&state, "release", path)?;
    let b = body(&state, "release", b)?;
    carry(
        &state,
        acting,
        who,
        peer,
        service,
        Action::Release,
        b.reason,
    )
    .await
}

#[utoipa::path(
    post,
    path = "/v1/services/{name}/endpoints/{node}/pin",
    operation_id = "pin_endpoint",
    tag = "actions",
    summary = "Pin an endpoint's weight (operator)",
    description = "Fixes the endpoint's published weight (in units of the mean) until \
        unpinned or for `for_s` seconds; the controllers share out \
        the rest among the others. Audited.",
    params(
        ("name" = String, Path, description = "The service"),
        ("node" = String, Path, description = "The endpoint's node"),
    ),
    request_body = PinBody,
    responses(
        (status = 200, description = "Pinned: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, a weight out of bounds, a duration out of bounds, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service or endpoint (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 409, description = "A weight outside the service's min_weight and max_weight", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn pin(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<(String, String)>, PathRejection>,
    b: Result<Json<PinBody>, JsonRejection>,
) -> Answer {
    let (service, node) = endpoint_path(&state, "pin", path)?;
    let b = body(&state, "pin", b)?;
    let until_ms = until(&state, "pin", state.clock.wall(), b.for_s)?;
    if !(b.weight > 0.0 && b.weight <= MAX_PIN) {
        return Err(refuse(
            &state,
            "pin",
            "bad_weight",
            StatusCode::BAD_REQUEST,
            format!("weight must be above 0 and at most {MAX_PIN}"),
        ));
    }
    let action = Action::Pin {
        node,
        weight: b.weight,
        until_ms,
    };
    carry(&state, acting, who, peer, service, action, b.reason).await
}

#[utoipa::path(
    delete,
    path = "/v1/services/{name}/endpoints/{node}/pin",
    operation_id = "unpin_endpoint",
    tag = "actions",
    summary = "Lift a pin (operator)",
    description = "The endpoint's controller steers it again, from the pinned weight. Audited.",
    params(
        ("name" = String, Path, description = "The service"),
        ("node" = String, Path, description = "The endpoint's node"),
    ),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "Unpinned: applied (by the service's owner, in a cluster)", body = ActResult),
        (status = 202, description = "In a cluster: accepted for the service's owner, which has not answered yet (`outcome` is `accepted`); it applies it when it holds the service", body = ActResult),
        (status = 400, description = "No reason, or a body that does not parse", body = ErrorBody),
        (status = 404, description = "No such service (in a cluster: at none of its replicas)", body = ErrorBody),
        (status = 409, description = "The endpoint is not pinned", body = ErrorBody),
        (status = 503, description = "The aggregator takes no actions now, or (in a cluster) cannot hand the action to the service's owner through etcd", body = ErrorBody),
    )
)]
pub(crate) async fn unpin(
    who: Operator,
    peer: Peered,
    acting: WithActing,
    AxState(state): AxState<Arc<State>>,
    path: Result<Path<(String, String)>, PathRejection>,
    b: Result<Json<ReasonBody>, JsonRejection>,
) -> Answer {
    let (service, node) = endpoint_path(&state, "unpin", path)?;
    let b = body(&state, "unpin", b)?;
    let action = Action::Unpin { node };
    carry(&state, acting, who, peer, service, action, b.reason).await
}

#[utoipa::path(
    get,
    path = "/v1/audit",
    operation_id = "list_audit",
    tag = "actions",
    summary = "The audit trail of operators' actions, newest first",
    description = "Who did what, when, from which address and why; the newest 1000 \
        records since the aggregator started (every record is also in its log).",
    responses((status = 200, description = "The records kept, newest first", body = Vec<AuditRecord>))
)]
pub(crate) async fn audit(acting: WithActing) -> Json<Vec<AuditRecord>> {
    Json(
        acting
            .map(|Extension(a)| a.audit.newest_first())
            .unwrap_or_default(),
    )
}
