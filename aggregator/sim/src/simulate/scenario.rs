//! The scenarios: one fleet each, a timeline of events, and the strategies
//! compared on it.

use super::fleet::InflightMeasure;
use super::strategy::{AgentConfig, StrategyKind};

/// The shape of a fleet and its traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSpec {
    /// Endpoints at the start.
    pub endpoints: usize,
    /// Hardware generations as speed factors, assigned round-robin by index so that
    /// every fleet has the same mix (a random mix would make fleets differ by seed).
    pub speeds: Vec<f64>,
    /// Cores per endpoint: requests beyond this many share the CPU.
    pub cores: u32,
    /// The agents' configured in-flight capacity: 0, the shipped default, lets the
    /// balancer judge the in-flight count against the fleet's typical value; above 0
    /// it is an absolute override (`inflight / capacity`). Strategies may run their
    /// agents with another (see `StrategyKind::BallastAgent`).
    pub capacity: u32,
    /// What the agents' in-flight source counts (the shipped TCP source: connections
    /// that owe a response).
    pub inflight: InflightMeasure,
    /// Idle connections the proxy tier keeps open to each endpoint (HAProxy and Envoy
    /// keep server-side pools), whatever the traffic.
    pub pooled: u32,
    /// Share of the clients that multiplex their requests to an endpoint over one
    /// HTTP/2 connection (gRPC); the others open a connection per request in flight.
    pub http2_share: f64,
    /// Clients at the start.
    pub clients: usize,
    /// Endpoints per client (the discovery system's subset size).
    pub subset: usize,
    /// Spread of client request rates, as the sigma of a log-normal around 1.
    pub client_rate_sigma: f64,
    /// Mean CPU cost of a request, in milliseconds of one core at speed 1.
    pub mean_cost_ms: f64,
    /// Shape of the log-normal cost distribution (1.0: coefficient of variation 1.3).
    pub cost_sigma: f64,
    /// Offered load as a share of the fleet's total CPU.
    pub utilization: f64,
    /// Absolute noise of a CPU measurement (the agent's sampling error).
    pub cpu_noise: f64,
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            endpoints: 50,
            speeds: vec![0.6, 1.0, 1.4],
            cores: 8,
            capacity: 0,
            inflight: InflightMeasure::Owed,
            pooled: 0,
            http2_share: 0.0,
            clients: 300,
            subset: 10,
            client_rate_sigma: 0.5,
            mean_cost_ms: 10.0,
            cost_sigma: 1.0,
            utilization: 0.45,
            cpu_noise: 0.005,
        }
    }
}

/// Something that happens to the fleet at the start of a cycle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EventKind {
    /// New clients with their own random subsets add this share of the offered load.
    AddClients {
        /// Added load relative to the load before, e.g. 0.5 for +50 %.
        share: f64,
        /// How many clients bring it. Few heavy clients (a batch job) give a larger
        /// connection skew than many light ones.
        clients: usize,
    },
    /// Scales every client's request rate.
    ScaleTraffic {
        /// The factor.
        factor: f64,
    },
    /// A new endpoint of this speed joins, cold; each client adds it to its subset
    /// with probability subset / endpoints, as a discovery system would.
    Join {
        /// Its speed factor.
        speed: f64,
    },
    /// The watched endpoint's I/O degrades: every request waits in a FIFO for an I/O
    /// stage that completes only this share of the endpoint's balanced request rate.
    DegradeIo {
        /// Throughput of the I/O stage relative to the endpoint's fair request rate.
        share: f64,
    },
    /// The watched endpoint fails every request at once, at 5 % of the CPU cost.
    FailFast,
    /// A CPU-bound process starts beside the service on the watched endpoint.
    Neighbour {
        /// Its runnable threads as a share of the endpoint's cores.
        cores_share: f64,
        /// Whether it runs niced (see `Neighbour`).
        niced: bool,
    },
}

/// An event and the cycle at whose start it happens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    /// The cycle.
    pub cycle: u32,
    /// What happens.
    pub kind: EventKind,
}

/// How agent reports get lost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loss {
    /// Long-run share of reports lost.
    pub share: f64,
    /// Mean length of a loss burst, in reports. Bursts, because congestion and
    /// faults last: an isolated lost report never makes an endpoint stale under a
    /// 3 s staleness bound, so independent loss would not exercise the skip rule.
    pub mean_burst: f64,
}

impl Loss {
    /// No loss.
    pub const NONE: Loss = Loss {
        share: 0.0,
        mean_burst: 1.0,
    };
}

/// One scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// Short identifier, used for file names and `--scenarios`.
    pub id: &'static str,
    /// Title for the report.
    pub title: &'static str,
    /// What it shows, for the report.
    pub about: &'static str,
    /// The fleet.
    pub fleet: FleetSpec,
    /// Cycles (seconds) simulated.
    pub cycles: u32,
    /// The cycle the transient of interest starts; settling and overshoot count from
    /// here, and so does the share of requests served overloaded.
    pub disturbance: u32,
    /// First cycle of the steady-state window, which runs to the end.
    pub steady_from: u32,
    /// Events in cycle order.
    pub events: Vec<Event>,
    /// Report loss.
    pub loss: Loss,
    /// The strategies compared.
    pub strategies: Vec<StrategyKind>,
    /// Leave the watched endpoint out of the load spread: a node that fails every
    /// request serves nothing, and its near-zero load would only pull the average
    /// down and every ratio up.
    pub spread_excludes_watched: bool,
}

impl Scenario {
    /// A shortened copy for tests: fewer cycles, a smaller fleet, the same shape.
    pub fn quick(&self) -> Scenario {
        let mut s = self.clone();
        let scale = |c: u32| (c * 2).div_ceil(5);
        s.cycles = scale(s.cycles);
        s.disturbance = scale(s.disturbance);
        s.steady_from = scale(s.steady_from);
        for e in &mut s.events {
            e.cycle = scale(e.cycle);
        }
        let n = s.fleet.endpoints;
        let m = s.fleet.clients;
        s.fleet.endpoints = n.min(24);
        s.fleet.clients = (m * s.fleet.endpoints / n).max(s.fleet.endpoints * 2);
        for e in &mut s.events {
            if let EventKind::AddClients { clients, .. } = &mut e.kind {
                *clients = (*clients * s.fleet.clients / m.max(1)).max(3);
            }
        }
        s.fleet.subset = s.fleet.subset.min(s.fleet.endpoints / 3).max(2);
        // Fewer, costlier requests keep the same utilization at a fraction of the work.
        s.fleet.mean_cost_ms *= 3.0;
        s
    }
}

/// Idle connections the proxy tier keeps to each endpoint in the pooled-connections
/// scenario: say 8 proxies with 4 worker threads, each keeping one connection to
/// every backend.
pub const POOLED: u32 = 32;

/// Every scenario, in report order.
pub fn all() -> Vec<Scenario> {
    use StrategyKind::*;
    let base = vec![RoundRobin, Ballast, A58, P2c, EnvoyLeastRequest];
    let fleet = FleetSpec::default();
    vec![
        Scenario {
            id: "steady",
            title: "Steady heterogeneous fleet",
            about: "50 endpoints of three hardware generations (speeds 0.6, 1.0, 1.4), \
                    300 clients with 10-endpoint random subsets and log-normal request \
                    rates, at 45 % average CPU. Every strategy starts from equal weights \
                    at cycle 0.",
            fleet: fleet.clone(),
            cycles: 150,
            disturbance: 0,
            steady_from: 60,
            events: vec![],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "step",
            title: "+50 % step in offered load",
            about: "The steady fleet; at cycle 60, 30 heavy new clients (a batch job, \
                    each 5 times a typical client) with their own random 10-endpoint \
                    subsets add 50 % to the offered load (45 % to about 68 % CPU). New \
                    subsets mean a new connection skew, which is what the weights must \
                    correct: a uniform step would leave every ratio unchanged.",
            fleet: fleet.clone(),
            cycles: 150,
            disturbance: 60,
            steady_from: 100,
            events: vec![Event {
                cycle: 60,
                kind: EventKind::AddClients {
                    share: 0.5,
                    clients: 30,
                },
            }],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "cold_join",
            title: "A node joins cold",
            about: "The steady fleet; at cycle 60 a 51st endpoint (speed 1.0) joins and \
                    is added to about a fifth of the clients' subsets. The watched \
                    endpoint is the newcomer.",
            fleet: fleet.clone(),
            cycles: 140,
            disturbance: 60,
            steady_from: 100,
            events: vec![Event {
                cycle: 60,
                kind: EventKind::Join { speed: 1.0 },
            }],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "degraded_io",
            title: "Degraded I/O (the dead spiral)",
            about: "At cycle 30 one endpoint (speed 1.0) gets stuck on slow I/O: its \
                    requests queue for an I/O stage that completes half of its fair \
                    request rate. Its CPU falls, its in-flight count grows. Ballast runs \
                    three times: steering by CPU alone; with the shipped agents (in-flight \
                    judged against the fleet's typical value, capacity 0); and with agents \
                    configured with a capacity of 32 (`in-flight / 32`).",
            fleet: fleet.clone(),
            cycles: 120,
            disturbance: 30,
            steady_from: 80,
            events: vec![Event {
                cycle: 30,
                kind: EventKind::DegradeIo { share: 0.5 },
            }],
            loss: Loss::NONE,
            strategies: vec![
                RoundRobin,
                BallastCpuOnly,
                Ballast,
                BallastAgent(AgentConfig {
                    capacity: 32,
                    ..AgentConfig::SHIPPED
                }),
                A58,
                P2c,
                EnvoyLeastRequest,
            ],
            spread_excludes_watched: false,
        },
        Scenario {
            id: "pooled_http2",
            title: "Pooled and HTTP/2 connections",
            about: "The degraded-I/O fleet behind connections that carry no load: the \
                    proxy tier keeps 32 idle pooled connections open to every endpoint, \
                    and half of the clients are HTTP/2 (gRPC) clients with one multiplexed \
                    connection to each endpoint of their subset; the other half send each \
                    request on a connection of its own. At cycle 30 one endpoint (speed \
                    1.0) stalls on I/O as in the degraded-I/O scenario. Ballast runs with \
                    three agent configurations: the old default (established connections, \
                    capacity 100), established connections with a capacity tuned to the \
                    fleet (32), and the new default (connections that owe a response, \
                    capacity 0: judged against the fleet's typical value).",
            fleet: FleetSpec {
                pooled: POOLED,
                http2_share: 0.5,
                ..fleet.clone()
            },
            cycles: 120,
            disturbance: 30,
            steady_from: 80,
            events: vec![Event {
                cycle: 30,
                kind: EventKind::DegradeIo { share: 0.5 },
            }],
            loss: Loss::NONE,
            strategies: vec![
                RoundRobin,
                BallastAgent(AgentConfig::OLD_DEFAULT),
                BallastAgent(AgentConfig {
                    capacity: 32,
                    ..AgentConfig::OLD_DEFAULT
                }),
                BallastAgent(AgentConfig::SHIPPED),
            ],
            spread_excludes_watched: false,
        },
        Scenario {
            id: "fail_fast",
            title: "A node that fails fast",
            about: "At cycle 30 one endpoint (speed 1.0) starts failing every request at \
                    once, at 5 % of the CPU cost: low CPU, nothing in flight, the SRE \
                    book's broken cashier. Its agent reports the error rate. The \
                    spread is over the 49 healthy endpoints.",
            fleet: fleet.clone(),
            cycles: 120,
            disturbance: 30,
            steady_from: 80,
            events: vec![Event {
                cycle: 30,
                kind: EventKind::FailFast,
            }],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: true,
        },
        Scenario {
            id: "loss_10",
            title: "10 % report loss",
            about: "The steady fleet, with 10 % of agent reports lost in bursts of 5 s \
                    on average. Only the strategies fed by Ballast's reports are exposed.",
            fleet: fleet.clone(),
            cycles: 150,
            disturbance: 0,
            steady_from: 60,
            events: vec![],
            loss: Loss {
                share: 0.10,
                mean_burst: 5.0,
            },
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "loss_20",
            title: "20 % report loss",
            about: "As above with 20 % lost: now the missing share often passes 15 % and \
                    whole cycles are skipped.",
            fleet: fleet.clone(),
            cycles: 150,
            disturbance: 0,
            steady_from: 60,
            events: vec![],
            loss: Loss {
                share: 0.20,
                mean_burst: 5.0,
            },
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "small_loss",
            title: "A small service with 20 % report loss",
            about: "Four endpoints (speeds 0.6, 1.0, 1.4, 0.6), 24 clients that each reach \
                    all four, at 45 % average CPU, with 20 % of agent reports lost in bursts \
                    of 5 s on average. One silent endpoint is a quarter of the service.",
            fleet: FleetSpec {
                endpoints: 4,
                clients: 24,
                subset: 4,
                ..fleet.clone()
            },
            cycles: 150,
            disturbance: 0,
            steady_from: 60,
            events: vec![],
            loss: Loss {
                share: 0.20,
                mean_burst: 5.0,
            },
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "low_traffic",
            title: "Very low traffic",
            about: "The steady fleet; at cycle 40 traffic drops to 2 % of what it was \
                    (about 1 % CPU, 7 requests per endpoint per second). The feedback is \
                    too thin to steer by.",
            fleet: fleet.clone(),
            cycles: 120,
            disturbance: 40,
            steady_from: 60,
            events: vec![Event {
                cycle: 40,
                kind: EventKind::ScaleTraffic { factor: 0.02 },
            }],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        Scenario {
            id: "fleet_1000",
            title: "1,000 endpoints",
            about: "1,000 endpoints, 2,500 clients with 20-endpoint subsets, requests of \
                    40 ms mean cost (about 90 per endpoint per second, so each report is \
                    noisier than in the 50-endpoint fleet).",
            fleet: FleetSpec {
                endpoints: 1000,
                clients: 2500,
                subset: 20,
                mean_cost_ms: 40.0,
                ..fleet.clone()
            },
            cycles: 80,
            disturbance: 0,
            steady_from: 45,
            events: vec![],
            loss: Loss::NONE,
            strategies: base.clone(),
            spread_excludes_watched: false,
        },
        neighbour(
            "neighbour",
            "A CPU-bound neighbour",
            "The steady fleet; at cycle 40 a process with 4 CPU-bound threads (a batch \
             job, half of the 8 cores) starts beside the service on one endpoint (speed \
             1.0) and competes with its requests thread for thread. The agent's CPU, the \
             host's or the cgroup's, counts the neighbour's; the service keeps the other 4 \
             cores, so its fair share of the fleet's remaining capacity is about half its \
             share before. The spread is over the 49 other endpoints.",
            false,
            &fleet,
            &base,
        ),
        neighbour(
            "niced_neighbour",
            "A niced neighbour",
            "As above, with the neighbour niced (19): the scheduler gives it only the cores \
             the service leaves, and the agent leaves its time out of the CPU it reports \
             (the host's `nice` column; in a cgroup, niced members' time while the quota \
             does not bind). The endpoint keeps its whole capacity, so its share should \
             not change.",
            true,
            &fleet,
            &base,
        ),
    ]
}

/// A neighbour of half the cores starts beside the service on one endpoint of the
/// steady fleet at cycle 40; the spread leaves that endpoint out.
fn neighbour(
    id: &'static str,
    title: &'static str,
    about: &'static str,
    niced: bool,
    fleet: &FleetSpec,
    strategies: &[StrategyKind],
) -> Scenario {
    Scenario {
        id,
        title,
        about,
        fleet: fleet.clone(),
        cycles: 120,
        disturbance: 40,
        steady_from: 80,
        events: vec![Event {
            cycle: 40,
            kind: EventKind::Neighbour {
                cores_share: 0.5,
                niced,
            },
        }],
        loss: Loss::NONE,
        strategies: strategies.to_vec(),
        spread_excludes_watched: true,
    }
}
