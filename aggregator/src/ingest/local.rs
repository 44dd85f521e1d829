//! The aggregator's own [`Upstream`]: agents are registered with its balancer and their
//! reports recorded there, and each is answered at once with the node's assignment.
//!
//! Every call ingest makes into the balancer is here, registering a node and recording
//! its reports. A cluster replica admits only agents of services it owns, and a link
//! ends its connection with MOVED when the replica loses the service, so that the
//! agent goes on to the replica that took it over.

use crate::state::State;
use ballast_balance::{BalanceError, Balancer, Millis, Observation, Observed, Published};
use ballast_ingest::upstream::{
    lost, Admitted, Arrival, Close, Downstream, Forwarded, Link, Replica, Trunk, Upstream,
};
use ballast_ingest::Ingest;
use ballast_shared::session::{close, Assignment};
use ballast_shared::wire::{Hello, Reject, RejectReason, Report};
use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::watch;

/// Agents served by this aggregator's balancer.
pub(crate) struct Local {
    state: Arc<State>,
    /// Hellos for services without a file in the config directory are refused.
    require_service_file: bool,
}

impl Local {
    /// Serves agents from `state`'s balancer, under `ingest`'s rule for services
    /// without a file.
    pub(crate) fn new(state: Arc<State>, ingest: &Ingest) -> Self {
        Local {
            state,
            require_service_file: ingest.require_service_file(),
        }
    }

    /// The admission, which needs nothing to wait for.
    fn admit_now(&self, hello: &Hello) -> Result<Admitted<LocalLink>, Reject> {
        let state = &self.state;
        // Subscribed before ownership is checked, so that a loss after the check is
        // seen.
        let losses = state.ownership.as_ref().map(|o| o.watch_losses());
        let not_owner = state
            .ownership
            .as_ref()
            .filter(|o| !o.owns(&hello.service))
            .map(|o| Reject {
                reason: RejectReason::NotOwner,
                detail: o.refusal(&hello.service),
            });
        if let Some(refused) = not_owner {
            return Err(refused);
        }
        if let Some(detail) = self.unconfigured(&hello.service) {
            return Err(Reject {
                reason: RejectReason::UnknownService,
                detail,
            });
        }
        register(state, hello)?;
        Ok(Admitted {
            interval_ms: state.report_interval_ms,
            link: LocalLink {
                state: state.clone(),
                hello: hello.clone(),
                published: Publication::new(state.subscribe()),
                losses,
            },
        })
    }

    /// Why a hello for `service` is refused as unknown before it reaches the balancer:
    /// with a config directory that accepts no unknown services, a service without a
    /// file (a deleted file's tombstone still counts as one, as does a file refused for
    /// a mistake: its team configured the service).
    fn unconfigured(&self, service: &str) -> Option<String> {
        if !self.require_service_file {
            return None;
        }
        let file = crate::config::dir::file_name(service);
        let known = self.state.config_dir().as_ref().is_some_and(|status| {
            status.configs.merged().services.contains_key(service)
                || status.configs.errors().contains_key(&file)
        });
        if known {
            None
        } else {
            Some(format!(
                "service {service:?} has no file {file} in the config directory, and this \
                 aggregator accepts no unknown services (accept_unknown_services = false)"
            ))
        }
    }
}

impl Upstream for Local {
    type Link = LocalLink;

    fn admit(
        &self,
        arrival: Arrival<'_>,
    ) -> impl Future<Output = Result<Admitted<LocalLink>, Reject>> + Send {
        std::future::ready(self.admit_now(arrival.hello))
    }

    fn trunk(&self, trunk: Trunk<'_>) -> impl Future<Output = Result<(), &'static str>> + Send {
        ballast_ingest::primary_trunk::serve(self, trunk)
    }

    fn serve_routes(
        &self,
        trunk: Trunk<'_>,
    ) -> impl Future<Output = Result<(), &'static str>> + Send {
        ballast_ingest::routes_feed::serve(self, trunk)
    }
}

impl Replica for Local {
    /// The replica's name, told to relays; `aggregator` for a lone one.
    fn name(&self) -> &str {
        self.state
            .ownership
            .as_ref()
            .map_or("aggregator", |o| o.replica())
    }

    fn report_interval_ms(&self) -> u32 {
        self.state.report_interval_ms
    }

    /// Moves whenever this replica loses a bucket; `None` for a lone aggregator.
    fn losses(&self) -> Option<watch::Receiver<u64>> {
        self.state.ownership.as_ref().map(|o| o.watch_losses())
    }

    /// The cluster's routes as this replica reads them; `None` for a lone aggregator.
    fn cluster_routes(&self) -> Option<ballast_ingest::routes_feed::RoutesReceiver> {
        self.state.ownership.as_ref().map(|o| o.watch_routes())
    }
}

/// One agent registered with this aggregator's balancer.
pub(crate) struct LocalLink {
    state: Arc<State>,
    /// The agent's hello: its node, service, address and zone.
    hello: Hello,
    /// What the last publication assigns the node.
    published: Publication,
    /// Moves when this replica loses a bucket; `None` for a lone aggregator, or once
    /// the ownership is gone with the daemon.
    losses: Option<watch::Receiver<u64>>,
}

impl Link for LocalLink {
    fn report(&mut self, report: &Report, _raw: &[u8]) -> Forwarded {
        record(&self.state, &self.hello, report, &mut self.published)
    }

    async fn next(&mut self) -> Downstream {
        // A cluster replica that loses the service closes the connection, so that the
        // agent goes on to the replica that took it over.
        loop {
            lost(&mut self.losses).await;
            let state = &self.state;
            if state
                .ownership
                .as_ref()
                .is_some_and(|o| !o.owns(&self.hello.service))
            {
                return Downstream::Close(Close {
                    code: close::MOVED,
                    reason: "moved",
                    detail: Cow::Borrowed("service moved to another replica"),
                });
            }
        }
    }
}

/// What the last publication assigns one connection's node, looked up once per
/// publication rather than once per report: a report then costs no search of the
/// published endpoints, only a check that no newer publication came out.
struct Publication {
    latest: watch::Receiver<Arc<Published>>,
    /// The lookup in the publication `latest` has seen: `None` until it is made, then
    /// the node's assignment, or `None` within when the publication does not hold it.
    looked_up: Option<Option<Assignment>>,
}

impl Publication {
    fn new(latest: watch::Receiver<Arc<Published>>) -> Publication {
        Publication {
            latest,
            looked_up: None,
        }
    }

    /// The node's assignment in the latest publication, if that holds it.
    fn assignment(&mut self, hello: &Hello) -> Option<Assignment> {
        // An error means the daemon's sender is gone: the last value still stands.
        if self.latest.has_changed().unwrap_or(false) {
            self.looked_up = None;
        }
        if let Some(found) = self.looked_up {
            return found;
        }
        let published = self.latest.borrow_and_update();
        let found = published
            .service(&hello.service)
            .and_then(|svc| Some((svc, svc.endpoints.get(hello.node.as_str())?)))
            .map(|(svc, e)| Assignment {
                weight: e.weight,
                cycle: svc.cycle,
                draining: e.draining,
                load: e.load,
                inflight_trusted: e.inflight_trusted,
            });
        drop(published);
        self.looked_up = Some(found);
        found
    }
}

/// What the balancer holds for the node a report came from, as its reply says it: for
/// a node no publication holds yet.
fn live_assignment(observed: &Observed<'_>) -> Assignment {
    let e = observed.endpoint;
    Assignment {
        weight: e.weight(),
        cycle: observed.cycle,
        draining: e.draining(),
        load: e.load(),
        inflight_trusted: e.inflight_trusted(),
    }
}

/// The refusal a registration error amounts to.
fn refusal(e: BalanceError) -> Reject {
    let reason = match e {
        BalanceError::Limit { .. } => RejectReason::LimitReached,
        BalanceError::AddressInUse { .. } => RejectReason::AddressNotAllowed,
        BalanceError::UnknownService(_) | BalanceError::UnknownEndpoint { .. } => {
            RejectReason::UnknownService
        }
    };
    Reject {
        reason,
        detail: e.to_string(),
    }
}

/// The refusal of a node whose service this replica does not balance. To be called
/// under the balancer's lock: a cluster replica lets go of a service (under the same
/// lock) only after it stopped owning it, so a registration that passes here is swept
/// with the service, and none can bring a lost service back.
fn not_owner(state: &State, hello: &Hello) -> Option<Reject> {
    (!state.balances(&hello.service)).then(|| Reject {
        reason: RejectReason::NotOwner,
        detail: state
            .ownership
            .as_ref()
            .map(|o| o.refusal(&hello.service))
            .unwrap_or_default(),
    })
}

/// Registers the node `hello` names with `balancer`, or refreshes it.
fn enter(balancer: &mut Balancer, now: Millis, hello: &Hello) -> Result<(), BalanceError> {
    balancer.register(
        now,
        &hello.service,
        &hello.node,
        &hello.address,
        &hello.zone,
    )
}

/// Registers the node a hello names, or refreshes it; or the refusal.
fn register(state: &State, hello: &Hello) -> Result<(), Reject> {
    let now = state.clock.now();
    let mut balancer = state.balancer();
    if let Some(refused) = not_owner(state, hello) {
        return Err(refused);
    }
    enter(&mut balancer, now, hello).map_err(refusal)
}

/// Records a report, and looks up what the reply tells the node. The reply's weight
/// comes from the last publication, as every feed's does, so an agent's HAProxy
/// agent-check answers what xDS and the store say; only a node registered since then,
/// not yet published, hears the balancer's own starting weight.
fn record(state: &State, hello: &Hello, report: &Report, published: &mut Publication) -> Forwarded {
    let now = state.clock.now();
    let mut balancer = state.balancer();
    match balancer.observe(now, &hello.service, &hello.node, observation(report)) {
        Ok(observed) => {
            let (live, accepted) = (live_assignment(&observed), observed.accepted);
            drop(balancer);
            Forwarded::Assigned {
                assignment: published.assignment(hello).unwrap_or(live),
                accepted,
            }
        }
        // Forgotten while connected (a long stall, or another node took its address):
        // registered again if it still may be, and the report dropped; else refused.
        Err(BalanceError::UnknownEndpoint { .. }) => match not_owner(state, hello) {
            Some(refused) => Forwarded::Refused(refused.reason),
            None => match enter(&mut balancer, now, hello) {
                Ok(()) => Forwarded::Dropped("unknown_endpoint"),
                Err(e) => Forwarded::Refused(refusal(e).reason),
            },
        },
        // Reports never create anything, so no limit can refuse one; an unknown
        // service is one removed since the hello.
        Err(
            e @ (BalanceError::UnknownService(_)
            | BalanceError::Limit { .. }
            | BalanceError::AddressInUse { .. }),
        ) => Forwarded::Refused(refusal(e).reason),
    }
}

/// The balancer's view of a wire report: the conversion belongs to ingest, so that the
/// core knows nothing of the wire.
fn observation(r: &Report) -> Observation {
    Observation {
        seq: Some(r.seq),
        cpu: f64::from(r.cpu),
        inflight: r.inflight,
        capacity: r.capacity,
        error_rate: r.error_rate.map(f64::from),
        draining: r.state == ballast_shared::wire::NodeState::Draining,
    }
}

#[cfg(test)]
mod primary_trunk_tests;
