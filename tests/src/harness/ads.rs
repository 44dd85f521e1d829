//! A raw ADS client of the aggregator's xDS server, and the aggregator the xDS tests
//! read it from.
//!
//! The tests that compare what an xDS client is sent with the other feeds need the
//! responses themselves (version, nonce, the decoded ClusterLoadAssignments), not a
//! real proxy's interpretation of them: [`EdsWatch`] subscribes like an Envoy would,
//! ACKs every response so the server keeps pushing, and records each one for the test
//! to read.

use super::aggregator::{AggregatorOpts, XdsTarget};
use ballast_aggregator::feed::xds::resources::ResourceType;
use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Node};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, LbEndpoint,
};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest a watch runs, whatever happens to the test, so that its thread ends
/// even when the test hangs. Reading a watch that ran out fails the test.
pub const WATCH_LIMIT: Duration = Duration::from_secs(120);
/// How long connecting and opening the stream may take: the server is on loopback,
/// so a longer wait means it is not answering.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);
/// How often the watch looks at its stop flag while no response comes.
const STOP_POLL: Duration = Duration::from_millis(200);

/// Aggregator options for the tests that watch weights over xDS: ADS on, and 300 ms
/// cycles and reports (1 s grace), so that weights move, converge and reach the xDS
/// client within seconds.
pub fn xds_aggregator_opts() -> AggregatorOpts {
    AggregatorOpts {
        xds: true,
        ..AggregatorOpts::default()
            .cycle_ms(300)
            .report_interval_ms(300)
            .grace_ms(1000)
    }
}

/// One EDS response as the client got it.
#[derive(Debug, Clone)]
pub struct EdsResponse {
    /// Its `version_info`, which the client ACKed.
    pub version_info: String,
    /// Its `nonce`.
    pub nonce: String,
    /// Its resources, decoded.
    pub assignments: Vec<ClusterLoadAssignment>,
}

impl EdsResponse {
    /// Every endpoint of every assignment, by `IP:port`. `Err` names the first one
    /// without a socket address and port, which no xDS client could route to.
    pub fn endpoints(&self) -> Result<BTreeMap<String, &LbEndpoint>, String> {
        let mut out = BTreeMap::new();
        for lb in self
            .assignments
            .iter()
            .flat_map(|cla| &cla.endpoints)
            .flat_map(|l| &l.lb_endpoints)
        {
            let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &lb.host_identifier else {
                return Err(format!("an endpoint without an address: {lb:?}"));
            };
            let Some(address::Address::SocketAddress(sa)) =
                e.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                return Err(format!("an endpoint that is not a socket address: {e:?}"));
            };
            let Some(socket_address::PortSpecifier::PortValue(port)) = sa.port_specifier else {
                return Err(format!("an endpoint without a port: {sa:?}"));
            };
            out.insert(format!("{}:{port}", sa.address), lb);
        }
        Ok(out)
    }
}

/// How an [`EdsWatch`]'s reason for stopping starts when it reached the server but
/// the ADS stream did not open: what a client refused at the TLS layer gets.
pub const OPEN_FAILED: &str = "open the ADS stream";

/// An xDS client of one service's endpoints: an ADS stream on its own thread (with its
/// own runtime, so the tests stay synchronous) that subscribes to the service's
/// ClusterLoadAssignment, ACKs every response and records each. Stopped on drop, or
/// after [`WATCH_LIMIT`].
pub struct EdsWatch {
    what: String,
    responses: Arc<Mutex<Vec<EdsResponse>>>,
    /// Why it stopped, once it has.
    ended: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EdsWatch {
    /// Subscribes to `service`'s endpoints at the xDS server `xds`. Returns at once;
    /// the responses come in the background.
    pub fn start(xds: XdsTarget, service: &str) -> EdsWatch {
        let what = format!("the xDS client of {service}'s endpoints at {}", xds.addr);
        let responses = Arc::new(Mutex::new(Vec::new()));
        let ended = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, end, st, svc) = (
            responses.clone(),
            ended.clone(),
            stop.clone(),
            service.to_string(),
        );
        let thread = std::thread::spawn(move || {
            let why = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt
                    .block_on(run(xds, &svc, &r, &st))
                    .unwrap_or_else(|why| why),
                Err(e) => format!("no runtime for it: {e}"),
            };
            *end.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
        });
        EdsWatch {
            what,
            responses,
            ended,
            stop,
            thread: Some(thread),
        }
    }

    /// Every response so far, oldest first. Panics, naming the client and why, once it
    /// has stopped: what it holds then no longer follows the server.
    pub fn responses(&self) -> Vec<EdsResponse> {
        self.alive();
        self.recorded().clone()
    }

    /// The latest response, if one came. Panics like [`EdsWatch::responses`].
    pub fn latest(&self) -> Option<EdsResponse> {
        self.alive();
        self.recorded().last().cloned()
    }

    fn recorded(&self) -> std::sync::MutexGuard<'_, Vec<EdsResponse>> {
        self.responses.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the client stopped, once it has; `None` while it follows the server.
    pub fn ended(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Panics, naming the client and why, if it has stopped.
    pub fn alive(&self) {
        if let Some(why) = self.ended() {
            panic!(
                "{} stopped: {why}; {} responses before",
                self.what,
                self.recorded().len()
            );
        }
    }
}

impl Drop for EdsWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The stream: subscribe, then record and ACK each response until stopped. Returns
/// why it stopped, `Err` when the stream failed.
async fn run(
    xds: XdsTarget,
    service: &str,
    responses: &Mutex<Vec<EdsResponse>>,
    stop: &AtomicBool,
) -> Result<String, String> {
    let deadline = Instant::now() + WATCH_LIMIT;
    let type_url = ResourceType::Endpoints.type_url();
    let request = |version: &str, nonce: &str| DiscoveryRequest {
        version_info: version.to_string(),
        resource_names: vec![service.to_string()],
        type_url: type_url.to_string(),
        response_nonce: nonce.to_string(),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let first = DiscoveryRequest {
        node: Some(Node {
            id: format!("ballast-tests-eds-{service}"),
            ..Default::default()
        }),
        ..request("", "")
    };
    tx.send(first).await.map_err(|e| e.to_string())?;
    let open = async {
        let mut client = AggregatedDiscoveryServiceClient::new(xds.channel().await?);
        client
            .stream_aggregated_resources(
                tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await
            .map_err(|e| format!("{OPEN_FAILED}: {e}"))
    };
    let mut stream = tokio::time::timeout(CONNECT_WITHIN, open)
        .await
        .map_err(|_| format!("no ADS stream within {CONNECT_WITHIN:?}"))??
        .into_inner();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() >= deadline {
            return Err(format!("it ran past its limit of {WATCH_LIMIT:?}"));
        }
        let Ok(next) = tokio::time::timeout(STOP_POLL, stream.message()).await else {
            continue;
        };
        let resp = next
            .map_err(|e| format!("ADS stream: {e}"))?
            .ok_or("the server ended the ADS stream")?;
        if resp.type_url != type_url {
            return Err(format!("a response of type {}", resp.type_url));
        }
        let assignments = resp
            .resources
            .iter()
            .map(|any| ClusterLoadAssignment::decode(any.value.as_slice()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("a ClusterLoadAssignment that does not decode: {e}"))?;
        responses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(EdsResponse {
                version_info: resp.version_info.clone(),
                nonce: resp.nonce.clone(),
                assignments,
            });
        tx.send(request(&resp.version_info, &resp.nonce))
            .await
            .map_err(|_| "the ADS stream stopped taking requests".to_string())?;
    }
    Ok("stopped by the test".to_string())
}
