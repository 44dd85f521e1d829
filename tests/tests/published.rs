//! Scenario: every reader of a cycle's publication shows the same weights.
//!
//! One real aggregator (300 ms cycles) with an xDS listener and the file routing
//! store, and three real agents with synthetic speeds 0.6, 1.0 and 1.5 in two zones,
//! so the weights differ and move while the controllers converge. Five readers watch
//! the service:
//!
//! - the HTTP API: `/v1/services/{name}` (the version) and
//!   `/v1/services/{name}/weights` (the version and the weights);
//! - the watch stream, `/v1/services/{name}/weights?watch=true`, read from the
//!   start, every event recorded (its id is the version);
//! - the routing store, the aggregator's JSON file;
//! - an ADS client that subscribes to the service's ClusterLoadAssignment and ACKs
//!   every response, every response recorded;
//! - `/v1/published`, the whole publication every feed reads.
//!
//! Once the weights have settled (the controllers converged, and the service's
//! version held across a later publication), all five must show the same version `V`
//! and the same weights: the HTTP views, the watch event with id `V` and the store
//! the very same numbers, and the xDS client an assignment whose integer weights are
//! `envoy_weight` of them (DRAINING for a drained endpoint), whose `version_info` is
//! that of the assignment the publication yields. Any peer that is missing or
//! broken fails the test by name; every wait is bounded.

use ballast_aggregator::feed::xds::resources::{ResourceType, Snapshot};
use ballast_aggregator::feed::xds::LbPolicy;
use ballast_balance::load::{envoy_weight, haproxy_percent};
use ballast_balance::PublishedService;
use ballast_tests::*;
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SERVICE: &str = "published";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];
const ZONES: [&str; 2] = ["zone-a", "zone-b"];
/// The longest the watch stream reader runs, whatever happens to the test.
const READ_LIMIT: Duration = Duration::from_secs(120);
/// How long the controllers may take to converge.
const CONVERGE_WITHIN: Duration = Duration::from_secs(40);
/// How long the readers may take to agree on one settled version.
const AGREE_WITHIN: Duration = Duration::from_secs(30);
/// How long a stream reader may take to show its first message.
const FIRST_WITHIN: Duration = Duration::from_secs(10);

/// What a reader holds of one endpoint: its weight and whether it drains.
type Weights = BTreeMap<String, (f64, bool)>;

/// What an xDS client holds of one endpoint, by `IP:port`: its
/// `load_balancing_weight` and health status.
type Assignment = BTreeMap<String, (u32, i32)>;

// ---------------------------------------------------------------------------------
// The watch stream

/// A reader of `GET /v1/services/{SERVICE}/weights?watch=true` on its own thread:
/// every event's id and weight set, by version. Stops at the end of the stream or
/// after [`READ_LIMIT`].
struct WatchReader {
    events: Arc<Mutex<BTreeMap<u64, WeightSet>>>,
    /// Why it stopped reading, once it has.
    ended: Arc<Mutex<Option<String>>>,
}

impl WatchReader {
    fn start(http: SocketAddr) -> WatchReader {
        let events = Arc::new(Mutex::new(BTreeMap::new()));
        let ended = Arc::new(Mutex::new(None));
        let (e, end) = (events.clone(), ended.clone());
        std::thread::spawn(move || {
            let why = match Self::run(http, &e) {
                Ok(()) => "the stream ended".to_string(),
                Err(why) => why,
            };
            *end.lock().unwrap() = Some(why);
        });
        WatchReader { events, ended }
    }

    fn run(http: SocketAddr, events: &Mutex<BTreeMap<u64, WeightSet>>) -> Result<(), String> {
        let url = format!("http://{http}/v1/services/{SERVICE}/weights?watch=true");
        let client = reqwest::blocking::Client::builder()
            .timeout(READ_LIMIT)
            .no_proxy()
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let resp = client
            .get(&url)
            .send()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status().as_u16();
        let kind = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if status != 200 || !kind.starts_with("text/event-stream") {
            return Err(format!("GET {url}: status {status}, content type {kind:?}"));
        }
        let (mut event, mut id, mut data) = (String::new(), String::new(), String::new());
        for line in std::io::BufReader::new(resp).lines() {
            let line = line.map_err(|e| format!("reading the watch stream: {e}"))?;
            let line = line.trim_end_matches('\r');
            if line.is_empty() {
                if !data.is_empty() {
                    if event != "weights" {
                        return Err(format!("an event of type {event:?}: {data}"));
                    }
                    let set: WeightSet = serde_json::from_str(&data)
                        .map_err(|e| format!("event data is not a weight set ({e}): {data}"))?;
                    if id != set.version.to_string() {
                        return Err(format!("event id {id:?} for version {}", set.version));
                    }
                    events.lock().unwrap().insert(set.version, set);
                }
                (event, id, data) = (String::new(), String::new(), String::new());
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => event = value.to_string(),
                "id" => id = value.to_string(),
                "data" => {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(value);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The event with id `version`, if it came.
    fn event(&self, version: u64) -> Option<WeightSet> {
        self.events.lock().unwrap().get(&version).cloned()
    }

    fn versions(&self) -> Vec<u64> {
        self.events.lock().unwrap().keys().copied().collect()
    }

    /// Panics, naming the watch stream, if it stopped.
    fn alive(&self) {
        if let Some(why) = self.ended.lock().unwrap().clone() {
            panic!(
                "the watch stream reader stopped: {why}; versions seen: {:?}",
                self.versions()
            );
        }
    }
}

// ---------------------------------------------------------------------------------
// The xDS client

/// What `r` assigns each endpoint. Panics on an endpoint no xDS client could use: no
/// timing explains it.
fn assignment(r: &EdsResponse) -> Assignment {
    r.endpoints()
        .unwrap_or_else(|e| panic!("the xDS client got {e}"))
        .into_iter()
        .map(|(addr, lb)| {
            let weight = lb.load_balancing_weight.map_or(0, |w| w.value);
            (addr, (weight, lb.health_status))
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// The routing store

/// The service's version and weights in the store file; `Err` until it has them.
fn stored(agg: &Aggregator) -> Result<(u64, Weights, BTreeMap<String, String>), String> {
    let path = agg.store_path();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("the store file {}: {e}", path.display()))?;
    let doc: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the store file is not JSON ({e}): {text}"));
    let svc = &doc["services"][SERVICE];
    if svc.is_null() {
        return Err("the store file has no entry for the service yet".into());
    }
    let version = svc["version"]
        .as_u64()
        .unwrap_or_else(|| panic!("a stored service without a version: {svc}"));
    let mut weights = Weights::new();
    let mut addresses = BTreeMap::new();
    for (node, e) in svc["endpoints"]
        .as_object()
        .unwrap_or_else(|| panic!("a stored service without endpoints: {svc}"))
    {
        let (Some(w), Some(d), Some(a)) = (
            e["weight"].as_f64(),
            e["draining"].as_bool(),
            e["address"].as_str(),
        ) else {
            panic!("a stored endpoint without weight, draining or address: {node}: {e}");
        };
        weights.insert(node.clone(), (w, d));
        addresses.insert(node.clone(), a.to_string());
    }
    Ok((version, weights, addresses))
}

// ---------------------------------------------------------------------------------
// The comparison

/// What the readers agreed on.
#[derive(Debug)]
struct Agreement {
    /// The service's weights version.
    version: u64,
    /// The publication that showed it first in the pass, and the later one that
    /// still did.
    publications: (u64, u64),
    weights: Weights,
    /// The xDS `version_info` of the assignment.
    xds_version: String,
}

/// The publication's service: its weights and addresses, by node.
fn published_weights(svc: &PublishedService) -> (Weights, BTreeMap<String, String>) {
    let weights = svc
        .endpoints
        .iter()
        .map(|(n, e)| (n.to_string(), (e.weight, e.draining)))
        .collect();
    let addresses = svc
        .endpoints
        .iter()
        .map(|(n, e)| (n.to_string(), e.address.to_string()))
        .collect();
    (weights, addresses)
}

/// The assignment an xDS client must hold for `weights`: `envoy_weight` of each, or
/// DRAINING at weight 1.
fn expected_assignment(weights: &Weights, addresses: &BTreeMap<String, String>) -> Assignment {
    weights
        .iter()
        .map(|(node, (w, draining))| {
            let entry = if *draining {
                (1, HealthStatus::Draining as i32)
            } else {
                (envoy_weight(*w), HealthStatus::Healthy as i32)
            };
            (addresses[node].clone(), entry)
        })
        .collect()
}

/// The `version_info` of the default assignment of the service in `p`, as the xDS
/// server builds it from that publication.
fn xds_version_of(p: &Published) -> String {
    let snap = Snapshot::prepare(p, &Snapshot::default()).finish(LbPolicy::RingHash);
    let names: BTreeSet<String> = [SERVICE.to_string()].into();
    snap.select(ResourceType::Endpoints, false, &names, "")
        .version
}

/// One pass over the readers. `Err` when they do not (yet) agree: one lags, or the
/// version moved on during the pass, or it has not held across a publication. Panics
/// on what no timing explains: the same version with other weights, or a reader gone.
fn agree(agg: &Aggregator, watch: &WatchReader, ads: &EdsWatch) -> Result<Agreement, String> {
    watch.alive();
    ads.alive();
    let p = agg.published();
    let svc = p
        .service(SERVICE)
        .ok_or("the publication has no such service yet")?
        .clone();
    let version = svc.version;
    let (weights, addresses) = published_weights(&svc);

    // The HTTP API.
    let detail = agg.service(SERVICE);
    if detail.version != version {
        return Err(format!(
            "/v1/services/{SERVICE} at version {}, /v1/published at {version}",
            detail.version
        ));
    }
    let set = agg.weights(SERVICE);
    if set.version != version {
        return Err(format!(
            "/v1/services/{SERVICE}/weights at version {}, /v1/published at {version}",
            set.version
        ));
    }
    check_set("/v1/services/{name}/weights", &set, &weights, &addresses);
    assert_eq!(
        set.cycle, svc.cycle,
        "/weights and /v1/published show version {version} from different cycles"
    );

    // The routing store: written after the publication, so it may lag a little.
    let (stored_version, stored_weights, stored_addresses) = stored(agg)?;
    if stored_version != version {
        return Err(format!(
            "the store at version {stored_version}, /v1/published at {version}"
        ));
    }
    assert_eq!(
        stored_weights, weights,
        "the store and /v1/published both at version {version}, with other weights"
    );
    assert_eq!(
        stored_addresses, addresses,
        "store addresses, version {version}"
    );

    // The watch stream: the event whose id is the version.
    let event = watch.event(version).ok_or_else(|| {
        format!(
            "no watch event with id {version} yet; ids seen: {:?}",
            watch.versions()
        )
    })?;
    check_set("the watch event", &event, &weights, &addresses);
    assert_eq!(
        (event.version, event.cycle),
        (set.version, set.cycle),
        "the watch event and /weights for version {version}"
    );

    // The xDS client: an assignment of these weights, as this publication yields it.
    let want = expected_assignment(&weights, &addresses);
    let xds_version = xds_version_of(&p);
    let responses = ads.responses();
    let Some(got) = responses.iter().rev().find(|r| assignment(r) == want) else {
        return Err(format!(
            "no xDS assignment with version {version}'s weights yet: want {want:?}, last of {} \
             responses {:?}",
            responses.len(),
            responses.last().map(|r| (&r.version_info, assignment(r)))
        ));
    };
    assert_eq!(
        got.version_info, xds_version,
        "the xDS client holds version {version}'s weights under another version_info"
    );

    // Settled: a later publication still shows the same version.
    let later = wait_for(Duration::from_secs(3), "a later publication", || {
        let q = agg.published();
        if q.version > p.version {
            Ok(q)
        } else {
            Err(format!("publication {} still", q.version))
        }
    });
    let still = later.service(SERVICE).map(|s| s.version);
    if still != Some(version) {
        return Err(format!(
            "version {version} did not hold: publication {} has {still:?}",
            later.version
        ));
    }
    Ok(Agreement {
        version,
        publications: (p.version, later.version),
        weights,
        xds_version,
    })
}

/// A weight set must carry exactly the publication's weights, drains and addresses,
/// and each sink's integer of them.
fn check_set(what: &str, set: &WeightSet, weights: &Weights, addresses: &BTreeMap<String, String>) {
    assert_eq!(set.service, SERVICE, "{what}");
    let got: Weights = set
        .weights
        .iter()
        .map(|(n, e)| (n.to_string(), (e.weight, e.draining)))
        .collect();
    assert_eq!(
        &got, weights,
        "{what} and /v1/published at version {}, with other weights",
        set.version
    );
    for (node, e) in &set.weights {
        assert_eq!(&e.address, &addresses[node], "{what}: {node}'s address");
        assert_eq!(
            e.envoy,
            envoy_weight(e.weight),
            "{what}: {node}'s envoy weight"
        );
        let percent = if e.draining {
            0
        } else {
            haproxy_percent(e.weight)
        };
        assert_eq!(
            e.haproxy_percent, percent,
            "{what}: {node}'s HAProxy percentage"
        );
    }
}

#[test]
fn every_reader_of_a_publication_shows_the_same_version_and_weights() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, xds_aggregator_opts());
    let nodes = node_names(SERVICE, SPEEDS.len());
    let agents = start_speeds(&pki, &agg, SERVICE, &nodes, &SPEEDS, |i, opts| {
        opts.zone = Some(ZONES[i % ZONES.len()].to_string());
    });

    // Both stream readers from before convergence, so they see the versions go by.
    let watch = WatchReader::start(agg.http_addr());
    let ads = EdsWatch::start(agg.xds(), SERVICE);
    wait_for(FIRST_WITHIN, "the watch stream's first event", || {
        watch.alive();
        if watch.versions().is_empty() {
            Err("no event".into())
        } else {
            Ok(())
        }
    });
    wait_for(
        FIRST_WITHIN,
        "the xDS client's first assignment",
        || match ads.latest().map(|r| assignment(&r)) {
            Some(a) if a.len() == SPEEDS.len() => Ok(()),
            last => Err(format!("{last:?}")),
        },
    );

    // The controllers converge: the weights then sit near the speeds' ratios.
    wait_for(CONVERGE_WITHIN, "the weights to converge", || {
        converged(&agg, SERVICE, 5, 1.1)
    });

    let a = wait_for(
        AGREE_WITHIN,
        "the API, the watch stream, the store, xDS and /v1/published to agree on one settled version",
        || agree(&agg, &watch, &ads),
    );
    eprintln!(
        "version {} (publications {} and {}), xDS version_info {}, weights {:?}",
        a.version, a.publications.0, a.publications.1, a.xds_version, a.weights
    );
    // The weights steer: they are not the equal weights the fleet started from.
    let envoy: Vec<u32> = a.weights.values().map(|(w, _)| envoy_weight(*w)).collect();
    let (lo, hi) = (
        envoy.iter().min().copied().unwrap_or(0),
        envoy.iter().max().copied().unwrap_or(0),
    );
    assert!(
        hi > lo + 200,
        "converged weights should differ with the speeds: {:?}",
        a.weights
    );

    // A drain: the next settled version has the node draining in every reader (and
    // DRAINING at weight 1 over xDS).
    let drained = &nodes[0];
    agents[0].drain();
    let b = wait_for(
        AGREE_WITHIN,
        "every reader to agree on a settled version with the drain",
        || {
            let b = agree(&agg, &watch, &ads)?;
            match b.weights.get(drained) {
                Some((w, true)) if *w == 0.0 => Ok(b),
                other => Err(format!("version {}: {drained} is {other:?}", b.version)),
            }
        },
    );
    eprintln!(
        "after the drain: version {} (publications {} and {}), weights {:?}",
        b.version, b.publications.0, b.publications.1, b.weights
    );
    assert!(b.version > a.version);
    assert!(
        agg.counter("ballast_xds_nacks_total", &[]) == 0.0,
        "the xDS client rejected resources; log:\n{}",
        agg.log_tail(30)
    );
    drop(ads);
    drop(agents);
}
