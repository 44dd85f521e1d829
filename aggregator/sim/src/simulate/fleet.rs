//! The fleet model: endpoints that serve requests by processor sharing, clients that
//! send them, and the measurements an agent would take.
//!
//! Time advances in ticks of [`TICK_MS`]. Requests arrive as one Poisson process
//! (split among clients by their rates, which is the same as one Poisson process per
//! client), each with a log-normal CPU cost. An endpoint with `cores` cores serves its
//! requests by processor sharing: with `n` requests in flight each progresses at
//! `speed × min(1, cores / n)`, so in-flight counts and latencies are real, which
//! least-request pickers and the dead spiral need. Completions inside a tick are
//! resolved exactly by tracking virtual time, so short requests do not waste the rest
//! of their tick.
//!
//! The agent's in-flight count is modelled as what its source would see
//! ([`InflightMeasure`]): the true request count (a service-side gauge), established
//! TCP connections (the old TCP source, which counts idle pooled and multiplexed
//! connections as busy), or connections that owe a response (the new TCP source).
//! Scoring never uses what the agent sees: the true load is
//! `max(cpu, mean requests in flight / SCORE_CAPACITY)` whatever the agent reports.

use super::random::{exponential, lognormal, normal, Alias, Normals};
use super::scenario::FleetSpec;
use super::strategy::{PickerState, Strategy};
use rand::rngs::SmallRng;
use rand::Rng;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// Simulated milliseconds per tick.
pub const TICK_MS: u64 = 10;
/// Milliseconds per aggregator cycle and per agent report (the defaults of `Params`).
pub const CYCLE_MS: u64 = 1000;
/// Ticks per cycle.
pub const TICKS_PER_CYCLE: u64 = CYCLE_MS / TICK_MS;
/// CPU cost of a failed request relative to a served one.
const FAIL_COST: f64 = 0.05;
/// The in-flight count that scores as fully busy in the true load
/// (`max(cpu, mean requests in flight / SCORE_CAPACITY)`), whatever capacity the
/// agents are configured with, so that runs whose agents differ are scored alike.
/// Four requests per core of the 8-core endpoints: at 45 % CPU an endpoint holds 3 to
/// 6 requests, so the term only matters once requests queue, as on a stalled node.
pub const SCORE_CAPACITY: f64 = 32.0;

/// What the agent's in-flight source counts on an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InflightMeasure {
    /// The true number of requests in flight, as a service-side gauge (a Prometheus
    /// metric of the service itself) reports it.
    Requests,
    /// Established TCP connections, the old TCP source: idle pooled connections of
    /// the proxy tier, one connection per HTTP/2 client that has the endpoint in its
    /// subset, and one per HTTP/1 request in flight — whether or not they carry load.
    Established,
    /// Connections that owe a response, the new TCP source: an HTTP/1 request holds
    /// its own connection, so it counts 1; an HTTP/2 connection counts 1 while it has
    /// at least one outstanding stream; an idle connection counts 0.
    #[default]
    Owed,
}

impl InflightMeasure {
    /// How the report tables name it.
    pub fn label(self) -> &'static str {
        match self {
            InflightMeasure::Requests => "requests",
            InflightMeasure::Established => "established connections",
            InflightMeasure::Owed => "connections owing a response",
        }
    }
}

/// One report's in-flight count under every measure, so that strategies whose agents
/// are configured differently can share one run of the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InflightCounts {
    /// Requests in flight (on the CPU and waiting for I/O).
    pub requests: u32,
    /// Established connections.
    pub established: u32,
    /// Connections that owe a response.
    pub owed: u32,
}

impl InflightCounts {
    /// The count `measure` sees.
    pub fn get(&self, measure: InflightMeasure) -> u32 {
        match measure {
            InflightMeasure::Requests => self.requests,
            InflightMeasure::Established => self.established,
            InflightMeasure::Owed => self.owed,
        }
    }
}

/// A request inside an endpoint.
#[derive(Debug, Clone, Copy)]
struct Job {
    /// Virtual time at which it completes (processor sharing).
    finish: f64,
    /// CPU work in milliseconds of one core at speed 1.
    cost: f64,
    client: u32,
    slot: u32,
    arrived_ms: u64,
    error: bool,
    /// Whether it came on a multiplexed HTTP/2 connection rather than a connection
    /// of its own.
    http2: bool,
}

impl PartialEq for Job {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Job {}
impl PartialOrd for Job {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Job {
    // Reversed, so that the standard max-heap pops the earliest finish first.
    fn cmp(&self, other: &Self) -> Ordering {
        other.finish.total_cmp(&self.finish)
    }
}

/// A fault injected into an endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Healthy.
    None,
    /// Requests wait in a FIFO for an I/O stage of this many completions per ms.
    DegradedIo {
        /// Completions per millisecond.
        rate_per_ms: f64,
    },
    /// Every request fails at once.
    FailFast,
}

/// A CPU-bound process beside the service on an endpoint: a batch job, a log shipper,
/// a sidecar. Its threads each want a whole core for as long as it runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Neighbour {
    /// Runnable threads.
    pub threads: f64,
    /// Niced (19): the scheduler gives it what the service leaves, and the agent
    /// leaves its time out of the CPU it reports (the host source's `nice` column; a
    /// cgroup whose quota does not bind). Otherwise it competes with the service's
    /// requests thread for thread, and the agent's CPU counts it, as the host's or the
    /// cgroup's CPU does.
    pub niced: bool,
}

/// Counters over a measurement window.
#[derive(Debug, Clone, Copy, Default)]
pub struct Window {
    /// When the window started.
    pub start_ms: u64,
    /// Core-milliseconds of CPU used.
    pub busy_core_ms: f64,
    /// Integral of the in-flight count over time, in request-milliseconds.
    pub inflight_ms: f64,
    /// Requests that arrived.
    pub arrivals: u32,
    /// Requests that completed (served or failed).
    pub completions: u32,
    /// Requests that failed.
    pub errors: u32,
}

/// What the agent on an endpoint reports, and what an ORCA report would carry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// CPU utilization over the window, with measurement noise.
    pub cpu: f64,
    /// The in-flight count at the moment of the report (a gauge, as the agent reads
    /// it), under each measure an agent's source may take.
    pub inflight: InflightCounts,
    /// Completions per second over the window.
    pub qps: f64,
    /// Failures per second over the window.
    pub eps: f64,
    /// Failures per completion.
    pub error_rate: f64,
}

/// One endpoint.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Speed factor of its hardware generation.
    pub speed: f64,
    /// Cores.
    pub cores: f64,
    /// Idle connections the proxy tier keeps open to it, whatever the traffic.
    pub pooled: u32,
    /// HTTP/2 clients with it in their subset: one connection each.
    pub http2_connections: u32,
    /// HTTP/2 clients with at least one request in flight to it.
    pub http2_active: u32,
    /// Requests in flight that came on HTTP/1 connections of their own.
    pub http1_inflight: u32,
    /// The tick within each cycle at which its agent reports.
    pub phase: u64,
    /// The injected fault.
    pub fault: Fault,
    /// The process beside the service, if any.
    pub neighbour: Option<Neighbour>,
    /// The agent's current report window.
    pub report: Window,
    /// The current cycle's window, aligned to cycles, for the figures.
    pub metric: Window,
    ps: BinaryHeap<Job>,
    vtime: f64,
    io: VecDeque<Job>,
    io_credit: f64,
}

/// A finished request, handed back to the fleet so the client's counters follow.
#[derive(Debug, Clone, Copy)]
struct Done {
    client: u32,
    slot: u32,
    latency_ms: u64,
}

impl Endpoint {
    fn new(speed: f64, spec: &FleetSpec, phase: u64, now: u64) -> Self {
        let w = Window {
            start_ms: now,
            ..Window::default()
        };
        Endpoint {
            speed,
            cores: f64::from(spec.cores.max(1)),
            pooled: spec.pooled,
            http2_connections: 0,
            http2_active: 0,
            http1_inflight: 0,
            phase,
            fault: Fault::None,
            neighbour: None,
            report: w,
            metric: w,
            ps: BinaryHeap::new(),
            vtime: 0.0,
            io: VecDeque::new(),
            io_credit: 0.0,
        }
    }

    /// Requests in flight: on the CPU and waiting for I/O.
    pub fn inflight(&self) -> usize {
        self.ps.len() + self.io.len()
    }

    /// What each in-flight source sees now.
    pub fn inflight_counts(&self) -> InflightCounts {
        let sat = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        InflightCounts {
            requests: sat(self.inflight()),
            established: self
                .pooled
                .saturating_add(self.http2_connections)
                .saturating_add(self.http1_inflight),
            owed: self.http1_inflight.saturating_add(self.http2_active),
        }
    }

    /// Cores the service's `n` requests and the neighbour get, by processor sharing:
    /// every runnable thread gets at most one core, and a greedy neighbour's threads
    /// count as the requests do. (Nice 19 against nice 0 is a CFS weight of 15 to
    /// 1024, 1.4 % of a contended core: left out.)
    fn shares(&self, n: f64) -> (f64, f64) {
        match self.neighbour {
            None => (n.min(self.cores), 0.0),
            Some(nb) if nb.niced => {
                let service = n.min(self.cores);
                (service, nb.threads.min(self.cores - service))
            }
            Some(nb) => {
                let total = n + nb.threads;
                if total <= self.cores {
                    (n, nb.threads)
                } else {
                    let per = self.cores / total;
                    (n * per, nb.threads * per)
                }
            }
        }
    }

    /// The cores the service has when it is busy enough to use them: all of them,
    /// less a greedy neighbour's threads. (Under processor sharing a service with
    /// more requests than that squeezes the neighbour further; at the loads the
    /// scenarios run, it does not.)
    pub fn available_cores(&self) -> f64 {
        match self.neighbour {
            Some(nb) if !nb.niced => (self.cores - nb.threads).max(0.0),
            _ => self.cores,
        }
    }

    fn admit(&mut self, mut job: Job) {
        self.report.arrivals += 1;
        if !job.http2 {
            self.http1_inflight += 1;
        }
        self.metric.arrivals += 1;
        match self.fault {
            Fault::None => {
                job.finish = self.vtime + job.cost;
                self.ps.push(job);
            }
            Fault::FailFast => {
                job.error = true;
                job.cost *= FAIL_COST;
                job.finish = self.vtime + job.cost;
                self.ps.push(job);
            }
            Fault::DegradedIo { .. } => self.io.push_back(job),
        }
    }

    /// Serves for `dt` ms ending at `end_ms`, appending completions to `done`.
    fn advance(&mut self, end_ms: u64, dt: f64, done: &mut Vec<Done>) {
        if let Fault::DegradedIo { rate_per_ms } = self.fault {
            self.io_credit += rate_per_ms * dt;
            while self.io_credit >= 1.0 {
                let Some(mut job) = self.io.pop_front() else {
                    break;
                };
                self.io_credit -= 1.0;
                job.finish = self.vtime + job.cost;
                self.ps.push(job);
            }
            if self.io.is_empty() {
                // An idle I/O stage does not bank capacity for later bursts.
                self.io_credit = self.io_credit.min(1.0);
            }
        }
        let mut left = dt;
        let mut busy = 0.0;
        // The neighbour's CPU over the tick.
        let mut beside = 0.0;
        // Also runs with no time left, so that requests finishing exactly at the end
        // of the tick complete in it.
        while let Some(next) = self.ps.peek() {
            let n = self.ps.len() as f64;
            let (active, neighbour) = self.shares(n);
            // Work per request per ms: each request gets at most one core.
            let rate = self.speed * active / n;
            let need = (next.finish - self.vtime).max(0.0) / rate;
            if need > left {
                self.vtime += rate * left;
                busy += active * left;
                beside += neighbour * left;
                left = 0.0;
                break;
            }
            self.vtime = self.vtime.max(next.finish);
            left -= need;
            busy += active * need;
            beside += neighbour * need;
            if let Some(job) = self.ps.pop() {
                let latency_ms = end_ms.saturating_sub(job.arrived_ms);
                self.report.completions += 1;
                self.metric.completions += 1;
                if !job.http2 {
                    self.http1_inflight = self.http1_inflight.saturating_sub(1);
                }
                if job.error {
                    self.report.errors += 1;
                    self.metric.errors += 1;
                }
                done.push(Done {
                    client: job.client,
                    slot: job.slot,
                    latency_ms,
                });
            }
        }
        if self.ps.is_empty() {
            // Keep virtual time small so that its precision does not erode.
            self.vtime = 0.0;
            beside += self.shares(0.0).1 * left;
        }
        // The agent reads the CPU of the host or the cgroup, a greedy neighbour's
        // included; the figures score the service's own.
        let seen = match self.neighbour {
            Some(nb) if !nb.niced => beside,
            _ => 0.0,
        };
        self.report.busy_core_ms += busy + seen;
        self.metric.busy_core_ms += busy;
        let inflight = self.inflight() as f64 * dt;
        self.report.inflight_ms += inflight;
        self.metric.inflight_ms += inflight;
    }

    /// Closes the agent's window at `now` and returns what it reports.
    pub fn take_report(&mut self, now: u64, noise: f64, rng: &mut SmallRng) -> Measurement {
        let w = std::mem::replace(
            &mut self.report,
            Window {
                start_ms: now,
                ..Window::default()
            },
        );
        let span = now.saturating_sub(w.start_ms).max(1) as f64;
        let cpu = (w.busy_core_ms / (self.cores * span) + noise * normal(rng)).max(0.0);
        let secs = span / 1000.0;
        Measurement {
            cpu,
            inflight: self.inflight_counts(),
            qps: f64::from(w.completions) / secs,
            eps: f64::from(w.errors) / secs,
            error_rate: if w.completions > 0 {
                f64::from(w.errors) / f64::from(w.completions)
            } else {
                0.0
            },
        }
    }

    /// Closes the cycle-aligned window at `now` and returns the true load over it,
    /// `max(cpu, mean requests in flight / SCORE_CAPACITY)`, without measurement
    /// noise, the CPU utilization alone, and the window's counters. The CPU is the
    /// service's own, over the cores a greedy neighbour leaves it.
    pub fn take_metric(&mut self, now: u64) -> (f64, f64, Window) {
        let w = std::mem::replace(
            &mut self.metric,
            Window {
                start_ms: now,
                ..Window::default()
            },
        );
        let span = now.saturating_sub(w.start_ms).max(1) as f64;
        let cpu = w.busy_core_ms / (self.available_cores().max(1e-9) * span);
        let inflight = w.inflight_ms / span / SCORE_CAPACITY;
        (cpu.max(inflight), cpu, w)
    }
}

/// One client: its subset, its own in-flight view and its picker.
#[derive(Debug, Clone)]
pub struct Client {
    /// Endpoint indices it may send to.
    pub subset: Vec<u32>,
    /// Its requests in flight to each subset slot.
    pub inflight: Vec<u32>,
    /// Whether it multiplexes its requests to an endpoint on one HTTP/2 connection
    /// (a gRPC client); otherwise each request holds a connection of its own.
    pub http2: bool,
    /// Requests per ms.
    pub rate: f64,
    /// The strategy's per-client state.
    pub picker: PickerState,
}

/// Latency histogram with eight buckets per doubling.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
}

impl Histogram {
    const PER_DOUBLING: f64 = 8.0;

    fn new() -> Self {
        Histogram {
            counts: vec![0; 8 * 40],
        }
    }

    fn bucket(ms: u64) -> usize {
        ((ms as f64 + 1.0).log2() * Self::PER_DOUBLING) as usize
    }

    fn record(&mut self, ms: u64) {
        let b = Self::bucket(ms).min(self.counts.len() - 1);
        self.counts[b] += 1;
    }

    /// The quantile `q`, as the upper edge of its bucket, in ms.
    pub fn quantile(&self, q: f64) -> f64 {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return 2f64.powf((b as f64 + 1.0) / Self::PER_DOUBLING) - 1.0;
            }
        }
        0.0
    }
}

/// The whole fleet.
#[derive(Debug, Clone)]
pub struct Fleet {
    /// Its shape.
    pub spec: FleetSpec,
    /// Endpoints by index; they never leave.
    pub endpoints: Vec<Endpoint>,
    /// Clients by index.
    pub clients: Vec<Client>,
    /// Latency of completed requests since the last reset.
    pub latency: Histogram,
    pick_client: Alias,
    normals: Normals,
    total_rate: f64,
    next_arrival: f64,
    done: Vec<Done>,
}

impl Fleet {
    /// A fleet built from `spec` with the fleet stream `rng`; arrivals start at 0
    /// drawn from `arrivals`.
    pub fn new(spec: &FleetSpec, rng: &mut SmallRng, arrivals: &mut SmallRng) -> Self {
        let endpoints: Vec<Endpoint> = (0..spec.endpoints)
            .map(|i| {
                let speed = spec.speeds[i % spec.speeds.len().max(1)];
                Endpoint::new(speed, spec, rng.gen_range(0..TICKS_PER_CYCLE), 0)
            })
            .collect();
        let capacity: f64 = endpoints.iter().map(|e| e.cores * e.speed).sum();
        let total = spec.utilization * capacity / spec.mean_cost_ms;
        let mut fleet = Fleet {
            spec: spec.clone(),
            endpoints,
            clients: Vec::new(),
            latency: Histogram::new(),
            pick_client: Alias::default(),
            normals: Normals::default(),
            total_rate: 0.0,
            next_arrival: 0.0,
            done: Vec::new(),
        };
        fleet.add_clients(spec.clients, total, rng);
        fleet.next_arrival = exponential(arrivals, 1.0 / fleet.total_rate.max(1e-12));
        fleet
    }

    /// Offered requests per ms.
    pub fn offered_rate(&self) -> f64 {
        self.total_rate
    }

    /// Adds `count` clients whose rates add up to `rate` requests per ms, each with a
    /// random subset.
    pub fn add_clients(&mut self, count: usize, rate: f64, rng: &mut SmallRng) {
        let n = self.endpoints.len();
        let s = self.spec.subset.clamp(1, n.max(1));
        let raw: Vec<f64> = (0..count)
            .map(|_| lognormal(rng, 1.0, self.spec.client_rate_sigma))
            .collect();
        let sum: f64 = raw.iter().sum::<f64>().max(1e-12);
        let share = self.spec.http2_share.clamp(0.0, 1.0);
        for (i, r) in raw.into_iter().enumerate() {
            let subset: Vec<u32> = rand::seq::index::sample(rng, n, s)
                .into_iter()
                .map(|i| i as u32)
                .collect();
            // Every 1/share-th client speaks HTTP/2: a fixed stride rather than a coin
            // flip, so that the fleet's random stream is the same whatever the share.
            let http2 = ((i + 1) as f64 * share).floor() > (i as f64 * share).floor();
            if http2 {
                for &e in &subset {
                    if let Some(ep) = self.endpoints.get_mut(e as usize) {
                        ep.http2_connections += 1;
                    }
                }
            }
            self.clients.push(Client {
                inflight: vec![0; subset.len()],
                http2,
                picker: PickerState::new(subset.len(), rng),
                subset,
                rate: r / sum * rate,
            });
        }
        self.rebuild_rates();
    }

    /// Multiplies every client's rate by `factor`.
    pub fn scale_traffic(&mut self, factor: f64) {
        for c in &mut self.clients {
            c.rate *= factor;
        }
        self.rebuild_rates();
    }

    fn rebuild_rates(&mut self) {
        let rates: Vec<f64> = self.clients.iter().map(|c| c.rate).collect();
        self.total_rate = rates.iter().sum();
        self.pick_client = Alias::new(&rates);
    }

    /// Restarts the arrival process at `now` after a change of rates (it is
    /// memoryless, so this changes nothing but the rate).
    pub fn restart_arrivals(&mut self, now: u64, arrivals: &mut SmallRng) {
        self.next_arrival = now as f64 + exponential(arrivals, 1.0 / self.total_rate.max(1e-12));
    }

    /// Adds a cold endpoint at `now`; each client takes it into its subset with
    /// probability subset / endpoints. Returns its index.
    pub fn join(&mut self, speed: f64, now: u64, rng: &mut SmallRng) -> usize {
        let idx = self.endpoints.len();
        let p = self.spec.subset as f64 / idx.max(1) as f64;
        let phase = rng.gen_range(0..TICKS_PER_CYCLE);
        self.endpoints
            .push(Endpoint::new(speed, &self.spec, phase, now));
        for c in &mut self.clients {
            if rng.gen_bool(p.clamp(0.0, 1.0)) {
                c.subset.push(idx as u32);
                c.inflight.push(0);
                c.picker.add_slot();
                if c.http2 {
                    self.endpoints[idx].http2_connections += 1;
                }
            }
        }
        idx
    }

    /// The request rate endpoint `idx` would get if load were balanced by speed.
    pub fn fair_rate(&self, idx: usize) -> f64 {
        let speeds: f64 = self.endpoints.iter().map(|e| e.speed).sum();
        self.total_rate * self.endpoints[idx].speed / speeds.max(1e-12)
    }

    /// Advances one tick starting at `now`: arrivals picked by `strategy`, then
    /// service on every endpoint.
    pub fn tick(
        &mut self,
        now: u64,
        strategy: &Strategy,
        arrivals: &mut SmallRng,
        picker: &mut SmallRng,
    ) {
        let end = now + TICK_MS;
        let mean_gap = 1.0 / self.total_rate.max(1e-12);
        let mu = self.spec.mean_cost_ms.ln() - self.spec.cost_sigma * self.spec.cost_sigma / 2.0;
        while self.next_arrival < end as f64 {
            let c = self.pick_client.sample(arrivals);
            // Log-normal cost, as `random::lognormal` with the spare normal kept.
            let cost = (mu + self.spec.cost_sigma * self.normals.next(arrivals)).exp();
            self.next_arrival += exponential(arrivals, mean_gap);
            let Some(client) = self.clients.get_mut(c) else {
                continue;
            };
            let slot = strategy.pick(client, picker);
            let Some(&ep) = client.subset.get(slot) else {
                continue;
            };
            client.inflight[slot] += 1;
            let endpoint = &mut self.endpoints[ep as usize];
            if client.http2 && client.inflight[slot] == 1 {
                endpoint.http2_active += 1;
            }
            endpoint.admit(Job {
                finish: 0.0,
                cost,
                client: c as u32,
                slot: slot as u32,
                arrived_ms: now,
                error: false,
                http2: client.http2,
            });
        }
        let dt = TICK_MS as f64;
        let mut done = std::mem::take(&mut self.done);
        for e in &mut self.endpoints {
            e.advance(end, dt, &mut done);
        }
        for d in done.drain(..) {
            if let Some(c) = self.clients.get_mut(d.client as usize) {
                if let Some(n) = c.inflight.get_mut(d.slot as usize) {
                    *n = n.saturating_sub(1);
                    if c.http2 && *n == 0 {
                        let ep = c.subset.get(d.slot as usize).copied();
                        if let Some(e) = ep.and_then(|i| self.endpoints.get_mut(i as usize)) {
                            e.http2_active = e.http2_active.saturating_sub(1);
                        }
                    }
                }
            }
            self.latency.record(d.latency_ms);
        }
        self.done = done;
    }

    /// Max/avg of the CPU load the clients' current weights imply: each endpoint's
    /// expected request rate (every client's rate split over its subset by its
    /// scheduler's weights) times the mean cost, over its cores × speed. It is the
    /// imbalance the weights themselves cause, without the request noise of a
    /// one-second measurement and without queues, so a step response read from it
    /// counts cycles of the controller rather than luck of the draw.
    pub fn implied_max_over_avg(&self) -> f64 {
        let mut rate = vec![0.0; self.endpoints.len()];
        for c in &self.clients {
            let w = c.picker.weights();
            let sum: f64 = w.iter().filter(|x| x.is_finite() && **x > 0.0).sum();
            for (slot, &e) in c.subset.iter().enumerate() {
                let share = match w.get(slot) {
                    _ if sum <= 0.0 => 1.0 / c.subset.len() as f64,
                    Some(&x) if x.is_finite() && x > 0.0 => x / sum,
                    _ => 0.0,
                };
                if let Some(r) = rate.get_mut(e as usize) {
                    *r += c.rate * share;
                }
            }
        }
        let loads: Vec<f64> = rate
            .iter()
            .zip(&self.endpoints)
            .map(|(r, e)| r * self.spec.mean_cost_ms / (e.cores * e.speed))
            .collect();
        ballast_balance::Spread::of(&loads).max_over_avg
    }

    /// Forgets the latencies recorded so far.
    pub fn reset_latency(&mut self) {
        self.latency = Histogram::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processor_sharing_conserves_work() {
        let mut e = two_cores_four_requests(5.0, None);
        let mut done = Vec::new();
        // 20 core-ms of work on 2 cores takes 10 ms.
        e.advance(10, 10.0, &mut done);
        assert_eq!(done.len(), 4);
        assert!((e.metric.busy_core_ms - 20.0).abs() < 1e-9);
    }

    /// An endpoint of 2 cores with `neighbour` beside it, holding four requests of
    /// `cost` core-ms each.
    fn two_cores_four_requests(cost: f64, neighbour: Option<Neighbour>) -> Endpoint {
        let spec = FleetSpec {
            cores: 2,
            ..FleetSpec::default()
        };
        let mut e = Endpoint::new(1.0, &spec, 0, 0);
        e.neighbour = neighbour;
        for i in 0..4 {
            e.admit(Job {
                finish: 0.0,
                cost,
                client: 0,
                slot: i,
                arrived_ms: 0,
                error: false,
                http2: false,
            });
        }
        e
    }

    /// The window's CPU is `want` core-ms.
    fn assert_core_ms(window: &Window, want: f64) {
        assert!(
            (window.busy_core_ms - want).abs() < 1e-9,
            "{window:?}, not {want}"
        );
    }

    /// Four requests of 6 core-ms each on 2 cores, with a neighbour of 2 threads
    /// beside them, for 10 ms: what the service gets, what the agent reads.
    fn beside_neighbour(niced: bool) -> (Endpoint, usize) {
        let neighbour = Neighbour {
            threads: 2.0,
            niced,
        };
        let mut e = two_cores_four_requests(6.0, Some(neighbour));
        let mut done = Vec::new();
        e.advance(10, 10.0, &mut done);
        (e, done.len())
    }

    #[test]
    fn a_greedy_neighbour_takes_cores_thread_for_thread_and_the_agent_counts_it() {
        // Six runnable threads on two cores: the requests get 4/6 of the CPU, 13.3
        // core-ms of their 24 in 10 ms, so none finishes; the neighbour the rest.
        let (e, done) = beside_neighbour(false);
        assert_eq!(done, 0);
        assert_core_ms(&e.metric, 40.0 / 3.0);
        assert_core_ms(&e.report, 20.0);
        assert_eq!(e.available_cores(), 0.0);
    }

    #[test]
    fn a_niced_neighbour_gets_what_the_service_leaves_and_the_agent_leaves_it_out() {
        // The requests get both cores, as alone: 24 core-ms take 12 ms, so 20 of it
        // is done in 10 ms; the neighbour gets nothing while they run, and the agent
        // reads only the service's time.
        let (mut e, done) = beside_neighbour(true);
        assert_eq!(done, 0);
        assert_core_ms(&e.metric, 20.0);
        assert_core_ms(&e.report, 20.0);
        assert_eq!(e.available_cores(), 2.0);
        // Once they finish (2 ms more), the neighbour has the cores, unread.
        let mut done = Vec::new();
        e.advance(20, 10.0, &mut done);
        assert_eq!(done.len(), 4);
        assert_core_ms(&e.report, 24.0);
    }

    #[test]
    fn degraded_io_piles_up_in_flight() {
        let spec = FleetSpec::default();
        let mut e = Endpoint::new(1.0, &spec, 0, 0);
        e.fault = Fault::DegradedIo { rate_per_ms: 0.01 };
        let mut done = Vec::new();
        for t in 0..100u64 {
            e.admit(Job {
                finish: 0.0,
                cost: 1.0,
                client: 0,
                slot: 0,
                arrived_ms: t * 10,
                error: false,
                http2: false,
            });
            e.advance((t + 1) * 10, 10.0, &mut done);
        }
        assert!(e.inflight() > 80, "in flight {}", e.inflight());
        assert!(done.len() <= 11);
    }

    #[test]
    fn each_source_counts_what_it_sees() {
        let spec = FleetSpec {
            endpoints: 1,
            clients: 4,
            subset: 1,
            pooled: 5,
            http2_share: 0.5,
            ..FleetSpec::default()
        };
        let mut rng =
            crate::simulate::random::stream(1, "counts", crate::simulate::random::Stream::Fleet);
        let mut arrivals = rng.clone();
        let mut fleet = Fleet::new(&spec, &mut rng, &mut arrivals);
        assert_eq!(fleet.clients.iter().filter(|c| c.http2).count(), 2);
        let idle = fleet.endpoints[0].inflight_counts();
        // Idle: the pool and the two HTTP/2 connections are established, nothing is owed.
        assert_eq!((idle.requests, idle.established, idle.owed), (0, 7, 0));
        // Three requests from one HTTP/2 client, two from one HTTP/1 client.
        let h2 = fleet.clients.iter().position(|c| c.http2).unwrap_or(0);
        let h1 = fleet.clients.iter().position(|c| !c.http2).unwrap_or(0);
        for (c, n) in [(h2, 3), (h1, 2)] {
            for _ in 0..n {
                let http2 = fleet.clients[c].http2;
                fleet.clients[c].inflight[0] += 1;
                if http2 && fleet.clients[c].inflight[0] == 1 {
                    fleet.endpoints[0].http2_active += 1;
                }
                fleet.endpoints[0].admit(Job {
                    finish: 0.0,
                    cost: 1e6,
                    client: c as u32,
                    slot: 0,
                    arrived_ms: 0,
                    error: false,
                    http2,
                });
            }
        }
        let busy = fleet.endpoints[0].inflight_counts();
        assert_eq!(busy.requests, 5);
        // Established: the pool, two HTTP/2 connections, two HTTP/1 requests.
        assert_eq!(busy.established, 9);
        // Owed: one per HTTP/1 request, one for the HTTP/2 client with streams open.
        assert_eq!(busy.owed, 3);
        assert_eq!(busy.get(InflightMeasure::Owed), 3);
    }

    #[test]
    fn histogram_quantiles_are_ordered() {
        let mut h = Histogram::new();
        for ms in 0..1000 {
            h.record(ms);
        }
        let p50 = h.quantile(0.5);
        let p99 = h.quantile(0.99);
        assert!(p50 > 400.0 && p50 < 600.0, "p50 {p50}");
        assert!(p99 >= p50 && p99 < 1100.0, "p99 {p99}");
    }
}
