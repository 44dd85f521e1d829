//! The xDS fan-out figure in `docs/xds.md`: the time from the end of a balancing cycle
//! that changes a service's weights until every subscribed ADS stream has received the
//! ClusterLoadAssignment with the new version. A figure, not a timed assertion.
//!
//! The xDS server runs in-process over real TCP on 127.0.0.1, started as the server
//! tests start it (`XdsServer::start` on the publications, limits and counters of a
//! `State` around a `Balancer`), on its own
//! Tokio runtime. The clients are tonic ADS clients on a second runtime: `channels`
//! HTTP/2 connections, each multiplexing `per_channel` streams. Every stream subscribes
//! to the service's ClusterLoadAssignment (EDS), stamps each response on arrival and
//! ACKs it. Each repetition feeds the endpoints new loads (the heavy and the light half
//! swap), runs `state.cycle(now)` (again, if the cycle held the weights after a
//! feed-forward step and published no new version), and waits, bounded, until every
//! stream has the
//! version that the new weights give.
//!
//! The figure is counted from the return of `state.cycle`. The xDS publisher wakes
//! inside that call (the cycle publishes its `Published` on the watch channel before it
//! returns), and on a busy machine the calling
//! thread may be descheduled before it reads the clock, while the fan-out runs: then
//! streams have the new version "before" the call returned (they count as 0, and
//! are reported), and the same interval counted from the call's start is printed too.
//!
//! Run: `cargo bench -p ballast-aggregator --bench xds_fanout`
//! (options: `-- channels=1000 per_channel=1 reps=20 endpoints=20`).

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ballast_aggregator::clock::Clock;
use ballast_aggregator::feed::xds::resources::{ResourceType, Snapshot};
use ballast_aggregator::feed::xds::{Inputs, LbPolicy, XdsServer};
use ballast_aggregator::metrics::XdsResource;
use ballast_aggregator::state::State;
use ballast_aggregator::store::file::FileStore;
use ballast_balance::{Balancer, Observation, Params};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

const SERVICE: &str = "web";
const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];
const POLICY: LbPolicy = LbPolicy::RingHash;
/// Bound on connecting every stream and delivering the first assignment to it.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on one repetition's fan-out.
const FANOUT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a fan-out, so that its ACKs are processed before the next cycle (real
/// cycles are a second apart).
const SETTLE: Duration = Duration::from_millis(100);
/// Cycles in a row that may change no weight (the hold after a feed-forward step)
/// before a repetition fails.
const MAX_HELD_CYCLES: usize = 3;
/// Bound on the whole run's wall time; the run stops early with what it has.
const BUDGET: Duration = Duration::from_secs(50);

struct Options {
    channels: usize,
    per_channel: usize,
    reps: usize,
    endpoints: usize,
}

impl Options {
    fn parse() -> Options {
        let mut o = Options {
            channels: 10,
            per_channel: 100,
            reps: 20,
            endpoints: 20,
        };
        // `cargo bench` passes `--bench`; anything not `key=value` is ignored.
        for arg in std::env::args().skip(1) {
            let Some((key, value)) = arg.split_once('=') else {
                continue;
            };
            let Ok(n) = value.parse::<usize>() else {
                eprintln!("xds_fanout: {arg}: not a number; ignored");
                continue;
            };
            match key {
                "channels" => o.channels = n.max(1),
                "per_channel" => o.per_channel = n.max(1),
                "reps" => o.reps = n.max(1),
                "endpoints" => o.endpoints = n.max(2),
                _ => eprintln!("xds_fanout: unknown option {key}; ignored"),
            }
        }
        o
    }

    fn streams(&self) -> usize {
        self.channels * self.per_channel
    }
}

/// One EDS response as a client stream saw it.
struct Event {
    stream: usize,
    version: String,
    at: Instant,
    resources: Vec<Any>,
}

fn main() {
    let opts = Options::parse();
    let started = Instant::now();
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("xds-server")
        .enable_all()
        .build()
        .expect("server runtime");
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("xds-clients")
        .enable_all()
        .build()
        .expect("client runtime");

    let dir = tempfile::tempdir().expect("tempdir");
    let state = fleet(&opts, &dir);
    let listener = server_rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let server = {
        let inputs = Inputs {
            publications: state.subscribe(),
            limits: (&state.limits).into(),
            metrics: state.metrics.xds.clone(),
        };
        server_rt
            .block_on(async move { XdsServer::start(listener, inputs, POLICY) })
            .expect("xDS server")
    };
    let addr = server.local_addr();

    let outcome = client_rt.block_on(run(&opts, &state, addr, started));

    let pushes = state
        .metrics
        .xds
        .pushes
        .get_or_create(&XdsResource::of("endpoints"))
        .get();
    let nacks = state
        .metrics
        .xds
        .nacks
        .get_or_create(&XdsResource::of("endpoints"))
        .get();
    server_rt.block_on(server.stop());
    client_rt.shutdown_timeout(Duration::from_secs(2));
    server_rt.shutdown_timeout(Duration::from_secs(2));

    match outcome {
        Ok(fig) => report(&opts, &fig, pushes, nacks, started.elapsed()),
        Err(e) => {
            eprintln!("xds_fanout: {e}");
            std::process::exit(1);
        }
    }
}

/// A state with one service of `opts.endpoints` endpoints, registered, reporting and
/// past their first cycle.
fn fleet(opts: &Options, dir: &tempfile::TempDir) -> Arc<State> {
    let clock = Clock::start();
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let balancer = Balancer::new(params, clock.now());
    let store = Arc::new(FileStore::new(dir.path().join("weights.json")));
    let state = Arc::new(State::new(balancer, store, clock, 1000));
    {
        let now = state.clock.now();
        let mut b = state.balancer();
        for i in 0..opts.endpoints {
            let addr = format!("127.0.0.1:{}", 20_000 + i);
            b.register(now, SERVICE, &node(i), &addr, ZONES[i % ZONES.len()])
                .expect("register");
        }
    }
    report_loads(&state, opts.endpoints, 0);
    let published = state.cycle(state.clock.now());
    assert!(
        published.service(SERVICE).is_some_and(|s| s.version > 0),
        "the first cycle publishes weights"
    );
    state
}

fn node(i: usize) -> String {
    format!("node-{i:02}")
}

/// Every endpoint reports; in round `round` the even or the odd half is the heavy one,
/// so each round moves every weight by far more than the material-change threshold.
fn report_loads(state: &State, endpoints: usize, round: usize) {
    let now = state.clock.now();
    let mut b = state.balancer();
    for i in 0..endpoints {
        let heavy = (i + round).is_multiple_of(2);
        let obs = Observation {
            cpu: if heavy { 0.8 } else { 0.3 },
            ..Observation::default()
        };
        b.observe(now, SERVICE, &node(i), obs).expect("observe");
    }
}

/// The weights version of the service in the last publication.
fn weights_version(state: &State) -> u64 {
    state.published().service(SERVICE).map_or(0, |s| s.version)
}

/// The EDS version a stream subscribed to the service should now have: that of the
/// last publication's assignment, built as the server builds it.
fn expected_version(state: &State) -> String {
    let snap = Snapshot::prepare(&state.published(), &Snapshot::default()).finish(POLICY);
    let names: BTreeSet<String> = [SERVICE.to_string()].into();
    // The bench's clients name no zone: they get the default assignment.
    snap.select(ResourceType::Endpoints, false, &names, "")
        .version
}

struct Figure {
    /// Cycle end → last stream has the new version, per repetition.
    all: Vec<Duration>,
    /// Cycle start → last stream has it.
    from_start: Vec<Duration>,
    /// Cycle start → first stream has it.
    first: Vec<Duration>,
    /// The cycle calls' own durations.
    cycles: Vec<Duration>,
    setup: Duration,
    endpoints: usize,
    localities: usize,
    cla_bytes: usize,
    /// Responses that arrived before the cycle call returned (counted as 0).
    before_t0: usize,
    /// Cycles run without a new version (holds after a feed-forward step), not
    /// measured.
    held: usize,
    stopped_early: bool,
}

async fn run(
    opts: &Options,
    state: &Arc<State>,
    addr: std::net::SocketAddr,
    started: Instant,
) -> Result<Figure, String> {
    let n = opts.streams();
    let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
    let (stop_tx, stop) = watch::channel(false);
    let setup_started = Instant::now();
    let setup_deadline = tokio::time::Instant::now() + SETUP_TIMEOUT;

    let mut channels = Vec::with_capacity(opts.channels);
    let url = format!("http://{addr}");
    for _ in 0..opts.channels {
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        channels.push(endpoint);
    }
    let connected = tokio::time::timeout_at(
        setup_deadline,
        futures_util::future::join_all(channels.iter().map(|e| e.connect())),
    )
    .await
    .map_err(|_| "connecting the channels timed out".to_string())?;
    let channels: Vec<Channel> = connected
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("connect: {e}"))?;

    let mut tasks = Vec::with_capacity(n);
    for (c, channel) in channels.iter().enumerate() {
        for s in 0..opts.per_channel {
            let id = c * opts.per_channel + s;
            tasks.push(tokio::spawn(client_stream(
                id,
                channel.clone(),
                events_tx.clone(),
                stop.clone(),
            )));
        }
    }
    drop(events_tx);

    let initial = expected_version(state);
    let mut latest = vec![String::new(); n];
    let first = wait_all(
        &mut events,
        &mut latest,
        &initial,
        setup_started,
        setup_started,
        n,
        setup_deadline,
    )
    .await
    .map_err(|short| format!("setup: of {n} streams, {short}"))?;
    let setup = setup_started.elapsed();
    let sample = first.sample;
    let cla = ClusterLoadAssignment::decode(
        sample
            .first()
            .ok_or("the assignment carries no resource")?
            .value
            .as_slice(),
    )
    .map_err(|e| format!("decode: {e}"))?;
    let endpoints = cla.endpoints.iter().map(|l| l.lb_endpoints.len()).sum();
    let localities = cla.endpoints.len();
    let cla_bytes = sample[0].value.len();
    let streams_open = state.metrics.xds.streams.get();
    if streams_open != n as i64 {
        return Err(format!("the server counts {streams_open} streams, not {n}"));
    }

    let mut fig = Figure {
        all: Vec::new(),
        from_start: Vec::new(),
        first: Vec::new(),
        cycles: Vec::new(),
        setup,
        endpoints,
        localities,
        cla_bytes,
        before_t0: 0,
        held: 0,
        stopped_early: false,
    };
    let mut previous = initial;
    for rep in 1..=opts.reps {
        if started.elapsed() > BUDGET {
            fig.stopped_early = true;
            break;
        }
        tokio::time::sleep(SETTLE).await;
        // Nothing should arrive between fan-outs: the streams are quiet.
        let mut stray = 0;
        while events.try_recv().is_ok() {
            stray += 1;
        }
        if stray > 0 {
            return Err(format!(
                "repetition {rep}: {stray} responses arrived between cycles"
            ));
        }

        // The cycle after a feed-forward step holds the weights while the load
        // balancers apply them: such a cycle publishes no new version and pushes
        // nothing, so it is run but not measured.
        let mut held = 0;
        let (cycle_started, t0) = loop {
            report_loads(state, opts.endpoints, rep);
            let before = weights_version(state);
            let cycle_started = Instant::now();
            let published = state.cycle(state.clock.now());
            let t0 = Instant::now();
            if published.service(SERVICE).map_or(0, |s| s.version) > before {
                break (cycle_started, t0);
            }
            held += 1;
            if held >= MAX_HELD_CYCLES {
                return Err(format!(
                    "repetition {rep}: {held} cycles in a row changed no weight"
                ));
            }
        };
        fig.held += held;
        let version = expected_version(state);
        if version == previous {
            return Err(format!("repetition {rep}: the assignment did not change"));
        }
        let deadline = tokio::time::Instant::now() + FANOUT_TIMEOUT;
        // The publisher wakes inside the cycle call, so a response may arrive before
        // `t0` is read: count it from the cycle's start, as zero.
        let got = wait_all(
            &mut events,
            &mut latest,
            &version,
            cycle_started,
            t0,
            n,
            deadline,
        )
        .await
        .map_err(|short| {
            format!("repetition {rep}: within {FANOUT_TIMEOUT:?}, of {n} streams, {short}")
        })?;
        fig.cycles.push(t0 - cycle_started);
        fig.all.push(got.last.saturating_duration_since(t0));
        fig.from_start.push(got.last - cycle_started);
        fig.first.push(got.first - cycle_started);
        fig.before_t0 += got.before_t0;
        previous = version;
    }

    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        futures_util::future::join_all(tasks),
    )
    .await;
    Ok(fig)
}

/// When the first and the last stream got the version awaited, and what it carried.
struct Arrivals {
    first: Instant,
    last: Instant,
    /// Streams whose response arrived after `since` but before `t0`.
    before_t0: usize,
    sample: Vec<Any>,
}

/// Why a wait ended without every stream.
struct Shortfall {
    got: usize,
    /// Responses of the version awaited that arrived before `since`.
    early: usize,
    /// Responses of other versions.
    other: usize,
    /// The first few streams without it, with the version each last had.
    missing: Vec<(usize, String)>,
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} streams had it ({} responses of it too early, {} of other versions); \
             missing, with the version last seen: {:?}",
            self.got, self.early, self.other, self.missing
        )
    }
}

/// Waits until each of the `n` streams has received `version` at or after `since`.
async fn wait_all(
    events: &mut mpsc::UnboundedReceiver<Event>,
    latest: &mut [String],
    version: &str,
    since: Instant,
    t0: Instant,
    n: usize,
    deadline: tokio::time::Instant,
) -> Result<Arrivals, Shortfall> {
    let mut seen = vec![false; n];
    let mut short = Shortfall {
        got: 0,
        early: 0,
        other: 0,
        missing: Vec::new(),
    };
    let mut first: Option<Instant> = None;
    let mut last = since;
    let mut sample = Vec::new();
    let mut before_t0 = 0;
    while short.got < n {
        let ev = match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(ev)) => ev,
            Ok(None) | Err(_) => {
                short.missing = (0..n)
                    .filter(|&i| !seen[i])
                    .take(8)
                    .map(|i| (i, latest[i].clone()))
                    .collect();
                return Err(short);
            }
        };
        latest[ev.stream].clone_from(&ev.version);
        if ev.version != version {
            short.other += 1;
            continue;
        }
        if ev.at < since {
            short.early += 1;
            continue;
        }
        if seen[ev.stream] {
            continue;
        }
        seen[ev.stream] = true;
        short.got += 1;
        before_t0 += usize::from(ev.at < t0);
        first = Some(first.map_or(ev.at, |f| f.min(ev.at)));
        last = last.max(ev.at);
        if sample.is_empty() {
            sample = ev.resources;
        }
    }
    Ok(Arrivals {
        first: first.unwrap_or(since),
        last,
        before_t0,
        sample,
    })
}

/// One ADS stream: subscribes to the service's assignment, stamps and reports every
/// response, ACKs it, until told to stop.
async fn client_stream(
    id: usize,
    channel: Channel,
    events: mpsc::UnboundedSender<Event>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let eds = ResourceType::Endpoints.type_url();
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
    tx.send(DiscoveryRequest {
        node: Some(Node {
            id: format!("bench-{id}"),
            ..Default::default()
        }),
        resource_names: vec![SERVICE.to_string()],
        type_url: eds.to_string(),
        ..Default::default()
    })
    .await
    .map_err(|_| "request channel closed")?;
    let mut inbound = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .map_err(|e| format!("stream {id}: {e}"))?
        .into_inner();
    loop {
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(resp)) => {
                    let at = Instant::now();
                    let ack = DiscoveryRequest {
                        version_info: resp.version_info.clone(),
                        resource_names: vec![SERVICE.to_string()],
                        type_url: resp.type_url.clone(),
                        response_nonce: resp.nonce,
                        ..Default::default()
                    };
                    if resp.type_url == eds {
                        let _ = events.send(Event {
                            stream: id,
                            version: resp.version_info,
                            at,
                            resources: resp.resources,
                        });
                    }
                    if tx.send(ack).await.is_err() {
                        return Ok(());
                    }
                }
                Ok(None) => return Ok(()),
                Err(status) => return Err(format!("stream {id}: {status}")),
            },
            _ = stop.changed() => return Ok(()),
        }
    }
}

/// The nearest-rank percentile of sorted durations.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

fn report(opts: &Options, fig: &Figure, pushes: u64, nacks: u64, wall: Duration) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    let summary = |v: &[Duration]| {
        let mut s = v.to_vec();
        s.sort();
        (
            percentile(&s, 50.0),
            percentile(&s, 95.0),
            *s.last().expect("at least one repetition"),
        )
    };
    let (p50, p95, max) = summary(&fig.all);
    let (f50, f95, fmax) = summary(&fig.first);
    let (s50, s95, smax) = summary(&fig.from_start);
    let (c50, _, cmax) = summary(&fig.cycles);
    println!("## xDS fan-out: cycle end → every stream has the new ClusterLoadAssignment\n");
    println!(
        "| streams | connections | streams per connection | endpoints per CLA | localities | CLA bytes | repetitions |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | {} | {} | {} |\n",
        opts.streams(),
        opts.channels,
        opts.per_channel,
        fig.endpoints,
        fig.localities,
        fig.cla_bytes,
        fig.all.len()
    );
    println!("| interval | p50 ms | p95 ms | max ms |");
    println!("|---|---|---|---|");
    println!(
        "| **`state.cycle` returns → all {} streams have the new version** | **{}** | **{}** | **{}** |",
        opts.streams(),
        ms(p50),
        ms(p95),
        ms(max)
    );
    println!(
        "| `state.cycle` is called → all {} streams have it | {} | {} | {} |",
        opts.streams(),
        ms(s50),
        ms(s95),
        ms(smax)
    );
    println!(
        "| `state.cycle` is called → the first stream has it | {} | {} | {} |\n",
        ms(f50),
        ms(f95),
        ms(fmax)
    );
    println!(
        "Per repetition, all streams (ms): {}\n",
        fig.all
            .iter()
            .map(|d| ms(*d))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "Cycle call itself: p50 {} ms, max {} ms. Setup (connect, subscribe, first assignment to every stream): {} ms. \
         EDS responses pushed: {pushes}; NACKs: {nacks}. Percentiles are nearest-rank over the repetitions. \
         Server and clients share this machine ({cores} cores, load average {load} at the end), each on a 2-worker Tokio runtime; \
         clients stamp each response on arrival and ACK it. Responses that arrived before the \
         cycle call returned (counted as 0 ms): {}. Cycles that held the weights (after a \
         feed-forward step; run, not measured): {}. Whole run: {:.1} s.{}",
        ms(c50),
        ms(cmax),
        ms(fig.setup),
        fig.before_t0,
        fig.held,
        wall.as_secs_f64(),
        if fig.stopped_early {
            " Stopped early at the time budget."
        } else {
            ""
        }
    );
}
