//! The balancing core, sans IO.
//!
//! A crate of its own so that sans IO is a fact of its `Cargo.toml`: it depends on serde
//! and thiserror only, so no runtime, socket or clock can be imported by accident.
//!
//! Nothing here reads a clock, a socket or a file: reports and the time come in as
//! arguments, weights and cycle results go out as values. The daemon, the simulator
//! and the tests drive this same code, so what the simulator shows is what runs.
//!
//! A cycle, per service: expire long-silent endpoints; skip the update if in the
//! start-up grace period, if more than the threshold share of endpoints is missing, or
//! if the feedback is too thin; otherwise run one PID controller per fresh endpoint
//! with the average load as setpoint, hold missing endpoints' weights, ramp newcomers
//! from the cold-start weight, give draining endpoints 0, normalise within bounds, and
//! mix the enabled strategies by their gates.

pub mod by_node;
pub mod cpu_floor;
pub mod endpoints;
#[cfg(feature = "gate-probe")]
mod gate_probe;
pub mod inflight;
pub mod load;
pub mod mixture;
pub(crate) mod normalize;
pub mod operator;
pub mod params;
pub mod pid;
pub mod publish;
pub mod service;
pub mod stats;

pub use by_node::ByNode;
pub use operator::{Act, ActError, Action, Actions, Lapsed, Mark, Pin, WallMillis};
pub use params::{Gate, LoadMetric, Params, PidGains, Strategy, StrategyWeights};
pub use publish::{Published, PublishedEndpoint, PublishedService};
pub use service::{
    CycleResult, Endpoint, EndpointSnapshot, EndpointState, Endpoints, Service, ServiceSnapshot,
    SkipReason, MATERIAL_CHANGE,
};
pub use stats::Spread;

use std::collections::{BTreeMap, BTreeSet};

/// Milliseconds on whatever monotonic timeline the caller keeps.
pub type Millis = u64;

/// One report as the balancer needs it.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Observation {
    /// Sequence number within the agent's session, if it numbers its reports.
    pub seq: Option<u32>,
    /// CPU utilization relative to what the service may use.
    pub cpu: f64,
    /// Requests in flight.
    pub inflight: u32,
    /// In-flight count that means fully busy; 0 if not measured.
    pub capacity: u32,
    /// Errors per request, if measured.
    pub error_rate: Option<f64>,
    /// Whether the node asks to drain.
    pub draining: bool,
}

/// Why the balancer refused a registration or a report.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BalanceError {
    /// The service is not on the allow-list.
    #[error("unknown service {0:?}")]
    UnknownService(String),
    /// A registration past one of the [`Limits`].
    #[error("too many {what} (the limit is {limit})")]
    Limit {
        /// What is limited: "services", "endpoints in this service".
        what: &'static str,
        /// The limit.
        limit: usize,
    },
    /// Another node of the service, still reporting, has the address: two endpoints
    /// must not share one, or load balancers would send one node's share to another.
    #[error("address {address} is in use by node {holder:?}, which is still alive")]
    AddressInUse {
        /// The address.
        address: String,
        /// The node that holds it.
        holder: String,
    },
    /// A report for an endpoint that never registered (or has expired).
    #[error("endpoint {node:?} of service {service:?} is not registered")]
    UnknownEndpoint {
        /// The service.
        service: String,
        /// The node.
        node: String,
    },
}

/// What [`Balancer::observe`] made of a report: whether it was taken, and the node as
/// the balancer holds it now. What the reply tells the node (its assignment, the
/// session's type in `ballast-shared`) is read from this where no publication holds
/// the node yet.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// Whether the report was accepted (false for a reordered, older report).
    pub accepted: bool,
    /// The last cycle that updated the service's live weights.
    pub cycle: u64,
    /// The node's endpoint, its live weight, drain, load and in-flight trust.
    pub endpoint: Endpoint<'a>,
}

/// Bounds on what registrations may create, so that a broken or hostile agent cannot
/// grow the aggregator without end: every service costs history, metric series and
/// xDS resources pushed to every client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Services in all.
    pub max_services: usize,
    /// Endpoints in one service.
    pub max_endpoints_per_service: usize,
    /// Services one node may serve at once. A registration for one more first
    /// forgets the node's registrations elsewhere that have gone stale (a node that
    /// moved to another service), and is refused if that is not enough.
    pub services_per_node: usize,
    /// How long a service with no endpoints, and no parameters or allowance of its own
    /// (no config file), is kept before it is forgotten.
    pub empty_service_ttl_ms: Millis,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_services: 10_000,
            max_endpoints_per_service: 50_000,
            services_per_node: usize::MAX,
            // The config directory's tombstone period.
            empty_service_ttl_ms: 3 * 24 * 3600 * 1000,
        }
    }
}

/// All services and their endpoints.
#[derive(Debug, Clone)]
pub struct Balancer {
    defaults: Params,
    overrides: BTreeMap<String, Params>,
    allowed: Option<BTreeSet<String>>,
    services: BTreeMap<String, Service>,
    grace_until: Millis,
    /// When each service's next cycle is due, for [`Balancer::cycle_due`].
    next_cycle: BTreeMap<String, Millis>,
    limits: Limits,
    /// Since when each service has had no endpoint.
    empty_since: BTreeMap<String, Millis>,
}

impl Balancer {
    /// A balancer started at `now`, with `defaults` for every service. No weights
    /// change until the grace period of `defaults` has passed.
    pub fn new(defaults: Params, now: Millis) -> Self {
        Balancer {
            grace_until: now.saturating_add(defaults.grace_ms),
            defaults,
            overrides: BTreeMap::new(),
            allowed: None,
            services: BTreeMap::new(),
            next_cycle: BTreeMap::new(),
            limits: Limits::default(),
            empty_since: BTreeMap::new(),
        }
    }

    /// Sets the limits on registrations.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Checks that `node` may serve one more service than it does, besides `service`;
    /// forgets its stale registrations elsewhere if that makes room.
    fn make_room_for(
        &mut self,
        now: Millis,
        service: &str,
        node: &str,
    ) -> Result<(), BalanceError> {
        let limit = self.limits.services_per_node;
        if limit == usize::MAX {
            return Ok(());
        }
        let elsewhere = |b: &Balancer| -> Vec<String> {
            b.services
                .values()
                .filter(|s| s.name != service && s.endpoints().contains_key(node))
                .map(|s| s.name.clone())
                .collect()
        };
        let others = elsewhere(self);
        if others.len() < limit {
            return Ok(());
        }
        for name in &others {
            let Some(svc) = self.services.get_mut(name) else {
                continue;
            };
            let params = svc.params.clone();
            let stale = svc
                .endpoint(node)
                .is_some_and(|e| !e.is_fresh(now, &params));
            if !stale {
                continue;
            }
            svc.forget_moved_node(node);
            self.forget_if_empty(name);
        }
        if elsewhere(self).len() < limit {
            Ok(())
        } else {
            Err(BalanceError::Limit {
                what: "services for this node",
                limit,
            })
        }
    }

    /// Forgets the services that have had no endpoint for longer than
    /// [`Limits::empty_service_ttl_ms`] and have no parameters or allowance of their
    /// own (no config file names them). Returns their names.
    pub fn sweep_empty(&mut self, now: Millis) -> Vec<String> {
        for (name, svc) in &self.services {
            if svc.endpoints().is_empty() {
                self.empty_since.entry(name.clone()).or_insert(now);
            } else {
                self.empty_since.remove(name);
            }
        }
        let ttl = self.limits.empty_service_ttl_ms;
        let gone: Vec<String> = self
            .empty_since
            .iter()
            .filter(|(name, since)| {
                now.saturating_sub(**since) > ttl
                    && !self.overrides.contains_key(*name)
                    && !self.allowed.as_ref().is_some_and(|a| a.contains(*name))
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in &gone {
            self.services.remove(name);
            self.next_cycle.remove(name);
            self.empty_since.remove(name);
        }
        gone
    }

    /// Limits registration to these services; `None` admits any (the zero-config default).
    pub fn restrict_services(&mut self, allowed: Option<BTreeSet<String>>) {
        self.allowed = allowed;
    }

    /// Sets a service's own parameters, replacing the defaults for it.
    pub fn set_params(&mut self, service: &str, params: Params) {
        if let Some(s) = self.services.get_mut(service) {
            s.params = params.clone();
        }
        self.overrides.insert(service.to_string(), params);
    }

    /// Drops a service's own parameters: it follows the defaults again.
    pub fn clear_params(&mut self, service: &str) {
        self.overrides.remove(service);
        if let Some(s) = self.services.get_mut(service) {
            s.params = self.defaults.clone();
        }
    }

    /// The global defaults.
    pub fn defaults(&self) -> &Params {
        &self.defaults
    }

    /// The parameters in force for a service.
    pub fn params(&self, service: &str) -> &Params {
        self.overrides.get(service).unwrap_or(&self.defaults)
    }

    fn service_mut(&mut self, service: &str) -> Result<&mut Service, BalanceError> {
        if let Some(allowed) = &self.allowed {
            if !allowed.contains(service) {
                return Err(BalanceError::UnknownService(service.to_string()));
            }
        }
        if !self.services.contains_key(service) {
            if self.services.len() >= self.limits.max_services {
                return Err(BalanceError::Limit {
                    what: "services",
                    limit: self.limits.max_services,
                });
            }
            let params = self.params(service).clone();
            self.services
                .insert(service.to_string(), Service::new(service, params));
        }
        self.services
            .get_mut(service)
            .ok_or_else(|| BalanceError::UnknownService(service.to_string()))
    }

    /// Registers (or re-registers) an endpoint: auto-registration, the zero-config way
    /// endpoints become known.
    pub fn register(
        &mut self,
        now: Millis,
        service: &str,
        node: &str,
        address: &str,
        zone: &str,
    ) -> Result<(), BalanceError> {
        self.make_room_for(now, service, node)?;
        let limit = self.limits.max_endpoints_per_service;
        let svc = self.service_mut(service)?;
        if svc.endpoints().len() >= limit && !svc.endpoints().contains_key(node) {
            return Err(BalanceError::Limit {
                what: "endpoints in this service",
                limit,
            });
        }
        svc.take_address(now, node, address)?;
        svc.register(now, node, address, zone);
        self.note_move(now, service, node);
        Ok(())
    }

    /// A node that says hello to `service` has left its other services if it stopped
    /// reporting there: forget it at once where it is already stale, and mark it
    /// where it is not yet, so that it is forgotten when it goes stale instead of being
    /// waited for as missing (which could freeze the service it left). A node that
    /// serves several services at once keeps reporting to each, and a report clears
    /// the mark.
    fn note_move(&mut self, now: Millis, service: &str, node: &str) {
        let others: Vec<String> = self
            .services
            .values()
            .filter(|s| s.name != service && s.endpoints().contains_key(node))
            .map(|s| s.name.clone())
            .collect();
        for name in others {
            let Some(svc) = self.services.get_mut(&name) else {
                continue;
            };
            if svc.moved_away(now, node) {
                self.forget_if_empty(&name);
            }
        }
    }

    /// Removes service `name` if it has no endpoint left and no config of its own: a
    /// node hopping from service to service must not leave a trail of empty services.
    fn forget_if_empty(&mut self, name: &str) {
        let configured = self.overrides.contains_key(name)
            || self.allowed.as_ref().is_some_and(|a| a.contains(name));
        if !configured
            && self
                .services
                .get(name)
                .is_some_and(|s| s.endpoints().is_empty())
        {
            self.services.remove(name);
            self.next_cycle.remove(name);
            self.empty_since.remove(name);
        }
    }

    /// Records a report and returns the node's current assignment, and whether the
    /// report was taken.
    pub fn observe(
        &mut self,
        now: Millis,
        service: &str,
        node: &str,
        obs: Observation,
    ) -> Result<Observed<'_>, BalanceError> {
        let unknown = || BalanceError::UnknownEndpoint {
            service: service.to_string(),
            node: node.to_string(),
        };
        let svc = self.services.get_mut(service).ok_or_else(unknown)?;
        let cycle = svc.weights_cycle;
        let (accepted, ep) = svc.observe_endpoint(now, node, obs).ok_or_else(unknown)?;
        Ok(Observed {
            accepted,
            cycle,
            endpoint: ep,
        })
    }

    /// Runs one cycle of every service at `now`.
    pub fn cycle(&mut self, now: Millis) -> Vec<CycleResult> {
        let grace = self.grace_until;
        self.services
            .values_mut()
            .map(|s| s.cycle(now, grace))
            .collect()
    }

    /// Runs the services whose cycle is due at `now`, each on its own `cycle_ms`, for a
    /// caller that ticks more often than any service cycles. `slack` is how early a
    /// cycle may run (half the caller's tick keeps a tick's jitter from costing a
    /// whole tick). A service's first call runs it.
    pub fn cycle_due(&mut self, now: Millis, slack: Millis) -> Vec<CycleResult> {
        let grace = self.grace_until;
        let mut results = Vec::new();
        for (name, svc) in &mut self.services {
            let due = self.next_cycle.get(name).copied().unwrap_or(now);
            if now.saturating_add(slack) < due {
                continue;
            }
            let period = svc.params.cycle_ms.max(1);
            // Keep to the schedule, not to when the tick came, unless far behind.
            let next = due.saturating_add(period);
            let next = if next <= now { now + period } else { next };
            self.next_cycle.insert(name.clone(), next);
            results.push(svc.cycle(now, grace));
        }
        results
    }

    /// Runs one cycle of one service at `now`, for services whose cycles are paced apart.
    pub fn cycle_service(&mut self, now: Millis, service: &str) -> Option<CycleResult> {
        let grace = self.grace_until;
        self.services.get_mut(service).map(|s| s.cycle(now, grace))
    }

    /// A service by name.
    pub fn service(&self, name: &str) -> Option<&Service> {
        self.services.get(name)
    }

    /// Every service, by name.
    pub fn services(&self) -> impl Iterator<Item = &Service> {
        self.services.values()
    }

    /// Puts back the services the routing store kept, as after a restart.
    pub fn restore(&mut self, now: Millis, snapshots: &BTreeMap<String, ServiceSnapshot>) {
        for (name, snap) in snapshots {
            let params = self.params(name).clone();
            let mut svc = Service::new(name, params);
            svc.restore(now, snap);
            self.services.insert(name.clone(), svc);
        }
    }

    /// Lets go of a service whole, as when another aggregator replica takes it over:
    /// its endpoints, its cycle schedule and its emptiness clock. Its own parameters
    /// stay, since they come from configuration. Returns whether it was held.
    pub fn remove_service(&mut self, name: &str) -> bool {
        self.next_cycle.remove(name);
        self.empty_since.remove(name);
        self.services.remove(name).is_some()
    }

    /// When the start-up grace period ends.
    pub fn grace_until(&self) -> Millis {
        self.grace_until
    }

    /// Carries out an operator's action on `service` (see [`operator`]).
    pub fn act(&mut self, service: &str, act: &Act) -> Result<(), ActError> {
        self.services
            .get_mut(service)
            .ok_or_else(|| ActError::UnknownService(service.to_string()))?
            .act(act)
    }

    /// Lifts the operators' holds and pins whose end time has passed at `wall`, in
    /// every service; returns them.
    pub fn lapse(&mut self, wall: WallMillis) -> Vec<Lapsed> {
        self.services
            .values_mut()
            .filter(|s| !s.actions().is_empty())
            .flat_map(|s| s.lapse(wall))
            .collect()
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod operator_tests;
