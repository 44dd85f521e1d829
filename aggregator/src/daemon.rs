//! The running aggregator: QUIC ingest, the cycle loop and the HTTP API around one
//! shared state.

use crate::clock::Clock;
use crate::cluster::overlay::Overlay;
use crate::config::Config;
use crate::door::{Command, Door, Inbox};
use crate::state::State;
use crate::store::{RoutingStore, StoreError};
use ballast_balance::Balancer;
use ballast_shared::tls::CertificateDer;
use ballast_shared::tls::{Identity, TlsError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// TLS material is missing or invalid.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A socket could not be bound.
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The routing store could not be read.
    #[error("routing store: {0}")]
    Store(#[from] StoreError),
    /// A file the xDS port's TLS needs cannot be read.
    #[error("xDS TLS: cannot read {path}: {source}")]
    XdsTls {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The authorization policy or the certificate revocation list is unusable.
    #[error(transparent)]
    Ingest(#[from] crate::ingest::IngestError),
    /// The HTTP API's token file is unusable.
    #[error("HTTP API: {0}")]
    Auth(#[from] crate::api::auth::AuthError),
    /// A thread of the QUIC ingest could not start.
    #[error(transparent)]
    Quic(crate::ingest::ThreadsError),
}

impl From<crate::ingest::ThreadsError> for DaemonError {
    fn from(e: crate::ingest::ThreadsError) -> Self {
        match e {
            crate::ingest::ThreadsError::Bind { addr, source, .. } => DaemonError::Bind {
                what: "QUIC",
                addr,
                source,
            },
            other => DaemonError::Quic(other),
        }
    }
}

/// A started aggregator.
pub struct Daemon {
    /// Shared state, for in-process callers such as the demo.
    pub state: Arc<State>,
    /// The bound QUIC address.
    pub quic_addr: SocketAddr,
    /// The bound HTTP address.
    pub http_addr: SocketAddr,
    /// The bound xDS address, when configured.
    pub xds_addr: Option<SocketAddr>,
    /// The bound address of the HAProxy agent-check feed, when configured.
    pub agent_check_addr: Option<SocketAddr>,
    xds: Option<crate::feed::xds::XdsServer>,
    quic: Arc<crate::ingest::threads::Threads>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    store_writer: tokio::task::JoinHandle<()>,
    supervisor: crate::supervise::Supervisor,
    ends: crate::supervise::Ends,
    /// As a cluster replica: the signal that hands the buckets on, and the task that
    /// does it.
    cluster: Option<(
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    )>,
}

/// How long shutdown waits for a cluster replica to give its buckets up.
const CLUSTER_HANDOVER: Duration = Duration::from_secs(2);

/// How long shutdown waits for the routing store to take the last publication, so that
/// a restart resumes from the weights and version the feeds last served.
const STORE_FLUSH: Duration = Duration::from_secs(5);

/// TLS material loaded from the configured files.
pub fn load_tls(cfg: &Config) -> Result<(Identity, Vec<CertificateDer<'static>>), TlsError> {
    Ok((cfg.tls.identity()?, cfg.tls.ca_certs()?))
}

impl Daemon {
    /// Starts everything with the routing store from `cfg`: etcd if `[store.etcd]` is
    /// set, else the file.
    pub async fn start(
        cfg: &Config,
        identity: Identity,
        client_ca: &[CertificateDer<'static>],
    ) -> Result<Daemon, DaemonError> {
        match &cfg.cluster {
            Some(cluster) => Self::start_replica(cfg, cluster, identity, client_ca).await,
            None => {
                let store = crate::store::open(&cfg.store)?;
                let audit = Arc::new(crate::audit::Audit::default());
                Self::start_with_store(cfg, identity, client_ca, store, None, Door::new(), audit)
                    .await
            }
        }
    }

    /// Starts one replica of a cluster: its etcd store fenced by its ownership, and
    /// the task that holds its lease and buckets.
    #[cfg(feature = "etcd")]
    async fn start_replica(
        cfg: &Config,
        cluster: &crate::config::ClusterConfig,
        identity: Identity,
        client_ca: &[CertificateDer<'static>],
    ) -> Result<Daemon, DaemonError> {
        let replica = cluster
            .replica
            .clone()
            .unwrap_or_else(|| ballast_config::default_replica_name(cfg.quic.port()));
        let ownership = Arc::new(crate::cluster::Ownership::new(&replica, cluster.buckets));
        let store = crate::store::open_fenced(
            &cfg.store,
            crate::store::etcd::Fence {
                ownership: ownership.clone(),
                cluster: cluster.name.clone(),
            },
        )?;
        let dyn_store: Arc<dyn RoutingStore> = store.clone();
        // The cluster's task moves services through the cycle loop's door; operators'
        // actions on services other replicas own go to their owners through etcd.
        let (door, inbox) = Door::new();
        let audit = Arc::new(crate::audit::Audit::default());
        let door = door.with_relay(Arc::new(crate::cluster::requests::EtcdRelay::new(
            store.clone(),
            ownership.clone(),
            &cluster.name,
        )));
        let mut daemon = Self::start_with_store(
            cfg,
            identity,
            client_ca,
            dyn_store,
            Some(ownership.clone()),
            (door.clone(), inbox),
            audit.clone(),
        )
        .await?;
        let advertise = cluster
            .advertise
            .clone()
            .unwrap_or_else(|| default_advertise(daemon.quic_addr));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut member = crate::cluster::etcd::Replica::new(
            door,
            daemon.state.metrics.clone(),
            store,
            ownership,
            cluster,
            advertise,
            stopped,
            audit,
        );
        tracing::info!(%replica, cluster = %cluster.name, buckets = cluster.buckets,
            "serving as a cluster replica");
        if let Some(answerer) = member.take_answerer() {
            let task = daemon
                .supervisor
                .spawn("cluster action requests", answerer.run());
            daemon.tasks.push(task);
        }
        let task = daemon.supervisor.spawn("cluster membership", member.run());
        daemon.cluster = Some((stop, task));
        Ok(daemon)
    }

    #[cfg(not(feature = "etcd"))]
    async fn start_replica(
        _cfg: &Config,
        _cluster: &crate::config::ClusterConfig,
        _identity: Identity,
        _client_ca: &[CertificateDer<'static>],
    ) -> Result<Daemon, DaemonError> {
        Err(DaemonError::Store(StoreError::Backend(
            "a cluster is configured, but this ballast-aggregator was built without the \
             etcd feature (build with `--features ballast-aggregator/etcd`)"
                .into(),
        )))
    }

    /// Starts everything with the given routing store (any [`RoutingStore`], so that
    /// tests can bring their own): restores from it, then writes to it in the
    /// background. The cycle loop takes its commands from `door`'s inbox; the caller
    /// keeps a clone of the door for the tasks it starts besides (a replica's cluster
    /// membership), and of `audit`, the trail every action is recorded in.
    pub(crate) async fn start_with_store(
        cfg: &Config,
        identity: Identity,
        client_ca: &[CertificateDer<'static>],
        store: Arc<dyn RoutingStore>,
        ownership: Option<Arc<crate::cluster::Ownership>>,
        (door, inbox): (Door, Inbox),
        audit: Arc<crate::audit::Audit>,
    ) -> Result<Daemon, DaemonError> {
        let clock = Clock::start();
        let restored = store.load().await?;
        let mut balancer = Balancer::new(cfg.balance.0.clone(), clock.now());
        balancer.set_limits(crate::config::core_limits(
            &cfg.limits,
            cfg.service_config.tombstone_ttl_s.saturating_mul(1000),
        ));
        balancer.restrict_services(cfg.services.as_ref().map(|s| s.iter().cloned().collect()));
        // A replica of a cluster restores a service when it takes the service's
        // bucket over, not at start: until then another replica may own it.
        if ownership.is_none() {
            if !restored.is_empty() {
                tracing::info!(services = restored.len(), store = %store.describe(), "weights restored from the routing store");
            }
            balancer.restore(clock.now(), &restored);
        }
        let mut state = State::new(balancer, store, clock, cfg.report_interval_ms)
            .with_limits(cfg.limits.clone());
        if let Some(ownership) = ownership {
            state = state.with_ownership(ownership);
        }
        let state = Arc::new(state);
        let restored_by_takeover = crate::store::Restored::default();
        let mut overlay = Overlay::new(restored_by_takeover.clone());
        if state.ownership.is_some() {
            // Until it owns anything, a replica serves every stored service as stored:
            // its feeds are whole from the start.
            let (tx, _) = tokio::sync::oneshot::channel();
            apply(&state, &mut overlay, Command::Follow(restored, tx));
        }
        state.health.set_cycle_ms(cfg.balance.cycle_ms);
        let (supervisor, ends) = crate::supervise::supervisor();
        // Before anything can publish: the writer takes what is current now (the
        // restored services) as what the store holds, and writes every change after it.
        let store_writer = crate::store::writer(
            state.subscribe(),
            crate::store::Sink {
                store: state.store.clone(),
                status: state.store_status.clone(),
                metrics: state.metrics.clone(),
                ownership: state.ownership.clone(),
                restored: restored_by_takeover,
                door: door.clone(),
            },
        );

        let (server, ingest) = crate::ingest::setup(cfg, identity, client_ca)?;
        // The xDS port presents the agents' listener's certificate and, in mutual
        // mode, checks clients against its CAs and revocation list: one set of watched
        // files, taken live by both.
        let xds_tls = xds_tls(cfg, &ingest)?;
        // The HTTP listener's TLS: on the files of [tls], the QUIC listener's live
        // certificate and verifier (its revocation list included); on files of its own,
        // with the revocation list of [http_auth] crl, watched here.
        let http_tls = match &cfg.http_tls {
            Some(files) => Some(crate::api::listener::http_tls(
                files,
                cfg.http_auth.crl.clone(),
                Duration::from_millis(cfg.http_auth.crl_check_ms),
                &cfg.tls,
                &ingest,
            )?),
            None => None,
        };
        let local = Arc::new(crate::ingest::local::Local::new(state.clone(), &ingest));
        let quic = Arc::new(
            crate::ingest::threads::start(
                server,
                cfg.quic,
                cfg.quic_threads,
                state.metrics.ingest.clone(),
                ingest,
                local,
                &supervisor,
            )
            .await?,
        );
        let quic_addr = quic.addr;
        let mut auth = crate::api::auth::Auth::new(&cfg.http_auth, state.metrics.clone())?;
        if let Some(tls) = &http_tls {
            auth = auth.with_revocation(tls.revocation.clone());
        }
        let auth = Arc::new(auth);
        let listener = tokio::net::TcpListener::bind(cfg.http)
            .await
            .map_err(|source| DaemonError::Bind {
                what: "HTTP",
                addr: cfg.http,
                source,
            })?;
        let http_addr = listener.local_addr().map_err(|source| DaemonError::Bind {
            what: "HTTP",
            addr: cfg.http,
            source,
        })?;
        let xds = match cfg.xds {
            Some(addr) => {
                let bind_error = |source| DaemonError::Bind {
                    what: "xDS",
                    addr,
                    source,
                };
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(bind_error)?;
                let inputs = crate::feed::xds::Inputs {
                    publications: state.subscribe(),
                    limits: (&state.limits).into(),
                    metrics: state.metrics.xds.clone(),
                };
                let server = crate::feed::xds::XdsServer::start_supervised(
                    listener,
                    inputs,
                    cfg.xds_lb_policy,
                    xds_tls,
                    &supervisor,
                )
                .map_err(bind_error)?;
                Some(server)
            }
            None => None,
        };
        let xds_addr = xds.as_ref().map(|x| x.local_addr());

        let mut tasks = Vec::new();
        let agent_check_addr = match cfg.agent_check {
            Some(addr) => {
                let bind_error = |source| DaemonError::Bind {
                    what: "agent-check",
                    addr,
                    source,
                };
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(bind_error)?;
                let bound = listener.local_addr().map_err(bind_error)?;
                tasks.push(supervisor.spawn(
                    "HAProxy agent-check",
                    crate::feed::haproxy::serve(
                        listener,
                        state.subscribe(),
                        state.metrics.haproxy.clone(),
                    ),
                ));
                tracing::info!(addr = %bound, "answering HAProxy's agent-check");
                Some(bound)
            }
            None => None,
        };
        let threads = quic.clone();
        tasks.push(supervisor.spawn("QUIC ingest", async move {
            threads.ended().await;
        }));
        if let Some(dir) = &cfg.service_config.dir {
            let config_dir = crate::reload::ConfigDir::open(
                state.clone(),
                door.clone(),
                dir.clone(),
                &cfg.service_config,
                &cfg.store,
                &cfg.balance,
            );
            tasks.push(supervisor.spawn("config directory", config_dir.run()));
        }
        tasks.push(supervisor.spawn(
            "cycle loop",
            cycle_loop(
                state.clone(),
                overlay,
                inbox,
                Duration::from_millis(cfg.balance.cycle_ms.min(CYCLE_TICK_MS)),
                audit.clone(),
            ),
        ));
        let acting = crate::api::act::Acting {
            door: door.clone(),
            audit: audit.clone(),
        };
        let app = crate::api::router_with(state.clone(), auth.clone())
            .layer(axum::Extension(Arc::new(acting)))
            .into_make_service_with_connect_info::<crate::api::listener::Peer>();
        let mut listener = crate::api::listener::Limited::new(
            listener,
            state.metrics.clone(),
            state.limits.http(),
        );
        if let Some(tls) = http_tls {
            tasks.extend(tls.spawn_watches(&supervisor, &state.metrics.ingest));
            listener = listener.with_tls(tls.config);
        }
        if let Some(watch) = auth.watch_tokens() {
            tasks.push(supervisor.spawn("HTTP token file", watch));
        }
        tracing::info!(
            tls = cfg.http_tls.is_some(),
            tokens = auth.takes_tokens(),
            certificates = auth.takes_certificates(),
            "HTTP API credentials"
        );
        tasks.push(supervisor.spawn("HTTP API", async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "HTTP API stopped");
            }
        }));
        tracing::info!(%quic_addr, %http_addr, "aggregator serving");
        Ok(Daemon {
            state,
            quic_addr,
            http_addr,
            xds_addr,
            agent_check_addr,
            xds,
            quic,
            tasks,
            store_writer: supervisor.spawn("routing store writer", store_writer),
            supervisor,
            ends,
            cluster: None,
        })
    }

    /// Waits until one of the tasks that must run until shutdown ends (a panic, or a
    /// loop that returned) and says which and how. A daemon for which this returns
    /// is broken: the caller logs it, shuts down and exits non-zero, so that the
    /// service manager restarts it.
    pub async fn failed(&mut self) -> crate::supervise::TaskEnd {
        self.ends.next().await
    }

    /// Stops serving: agents see the connection close and will reconnect elsewhere.
    pub async fn shutdown(self) {
        self.supervisor.stop();
        // A cluster replica hands its buckets on first (writes and agents stop, the
        // lease is revoked), so that the others take them now, not a lease later.
        if let Some((stop, task)) = self.cluster {
            let _ = stop.send(true);
            if tokio::time::timeout(CLUSTER_HANDOVER, task).await.is_err() {
                tracing::warn!("the cluster's buckets were not handed on in time; they move when the lease lapses");
            }
        }
        self.quic
            .close(crate::ingest::quic::close::NORMAL, b"shutting down");
        for t in &self.tasks {
            t.abort();
        }
        // Nothing publishes any more; let the writer catch up with the last publication.
        let last = self.state.published().version;
        let flushed = tokio::time::timeout(STORE_FLUSH, async {
            while self.state.store_status.written_version() < Some(last) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if flushed.is_err() {
            tracing::warn!(
                version = last,
                "the routing store did not take the last weights before shutdown"
            );
        }
        self.store_writer.abort();
        if let Some(xds) = self.xds {
            xds.stop().await;
        }
        self.quic.stopped().await;
    }
}

/// The QUIC address a replica names to agents it refuses when none is configured:
/// the address it listens on, or, when that is every address of the host (`0.0.0.0`,
/// `[::]`), the host's name and the port, which an agent can resolve and a listening
/// wildcard is not.
#[cfg(feature = "etcd")]
fn default_advertise(quic: std::net::SocketAddr) -> String {
    match ballast_config::host_name() {
        Some(host) if quic.ip().is_unspecified() => format!("{host}:{}", quic.port()),
        _ => quic.to_string(),
    }
}

/// The xDS port's TLS, as `xds_tls` asks: the certificate the agents' listener
/// presents, and in `mutual` mode its client CAs and revocation list
/// (`authorization.crl`), all taken live from their files; `None` for plaintext.
fn xds_tls(
    cfg: &Config,
    ingest: &crate::ingest::Ingest,
) -> Result<Option<crate::feed::xds::XdsTls>, DaemonError> {
    use crate::config::XdsTls as Mode;
    let revocation = match cfg.xds_tls {
        Mode::Plaintext => return Ok(None),
        Mode::Tls => None,
        Mode::Mutual => Some(ingest.revocation()),
    };
    let tls =
        crate::feed::xds::XdsTls::new(ingest.live_tls(), revocation).map_err(TlsError::from)?;
    Ok(Some(tls))
}

/// The cycle loop's tick at most: services may override the cycle length, so the loop
/// ticks finely and runs each service when its own cycle is due.
const CYCLE_TICK_MS: u64 = 100;

/// Runs the services' cycles as they fall due, and between them the commands that
/// come through the door: the one task that publishes, so that the cluster's overlay
/// is its own and publications go out in the order of the changes they show.
async fn cycle_loop(
    state: Arc<State>,
    mut overlay: Overlay,
    mut inbox: Inbox,
    period: Duration,
    audit: Arc<crate::audit::Audit>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let slack = u64::try_from(period.as_millis() / 2).unwrap_or(0);
    tick.tick().await;
    loop {
        tokio::select! {
            biased;
            Some(command) = inbox.recv() => apply(&state, &mut overlay, command),
            _ = tick.tick() => {
                // Readers, the store writer among them, take the publication from the
                // watch.
                let now = state.clock.now();
                lapse(&state, &overlay, &audit, now);
                let _ = state.cycle_due(now, slack, overlay.followed());
                state.health.ticked(now);
            }
        }
    }
}

/// Lifts the operators' holds and pins whose end time has passed, publishes them at
/// once, and audits each.
fn lapse(
    state: &State,
    overlay: &Overlay,
    audit: &crate::audit::Audit,
    now: ballast_balance::Millis,
) {
    let wall = state.clock.wall();
    let lapsed = {
        let mut b = state.balancer();
        let lapsed = b.lapse(wall);
        if !lapsed.is_empty() {
            let ran = lapsed.iter().map(|l| l.service.clone()).collect();
            state.publish(&b, &ran, overlay.followed(), now);
        }
        lapsed
    };
    for l in lapsed {
        audit.record(crate::audit::AuditRecord {
            seq: 0,
            at_ms: wall,
            who: "expiry".into(),
            via: "expiry".into(),
            from: None,
            action: l.action.label().to_string(),
            service: l.service,
            node: l.action.node().map(str::to_string),
            weight: None,
            until_ms: l.mark.until_ms,
            reason: format!(
                "lapsed at its end time; set by {}: {}",
                l.mark.by, l.mark.reason
            ),
            received_by: None,
            applied_by: state.ownership.as_ref().map(|o| o.replica().to_string()),
        });
    }
}

/// Carries a command out, holding the balancer, and answers it. An answer nobody waits
/// for any more is dropped.
fn apply(state: &State, overlay: &mut Overlay, command: Command) {
    let now = state.clock.now();
    let mut b = state.balancer();
    let publish =
        |b: &ballast_balance::Balancer, ran: &_, followed: &_| state.publish(b, ran, followed, now);
    match command {
        Command::TakeOver(stored, answer) => {
            let _ = answer.send(overlay.take_over(&mut b, &stored, now, publish));
        }
        Command::HandOver(gone, answer) => {
            let last = state.published();
            let _ = answer.send(overlay.hand_over(&mut b, &*gone, &last, publish));
        }
        Command::Follow(stored, answer) => {
            let localities = state.localities();
            let _ = answer.send(overlay.follow(&b, &stored, now, &localities, publish));
        }
        Command::RestoreNewer(newer, answer) => {
            let balances = |service: &str| state.balances(service);
            let _ = answer.send(crate::store::restore_newer(&mut b, newer, &balances, now));
        }
        Command::Act(service, act, answer) => {
            let result = b.act(&service, &act).map(|()| {
                let actions = b.service(&service).map(|s| s.actions().clone());
                let ran = std::iter::once(service).collect();
                state.publish(&b, &ran, overlay.followed(), now);
                actions.unwrap_or_default()
            });
            let _ = answer.send(result);
        }
        Command::Publish => {
            state.publish(
                &b,
                &std::collections::BTreeSet::new(),
                overlay.followed(),
                now,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::file::FileStore;
    use crate::store::StoreFuture;
    use ballast_balance::{Observation, ServiceSnapshot};
    use ballast_shared::pki::Ca;
    use std::collections::BTreeMap;

    /// A routing store whose writes panic, as a bug in a store would.
    struct PanickingStore;

    impl RoutingStore for PanickingStore {
        fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
            Box::pin(async { Ok(BTreeMap::new()) })
        }

        fn put<'a>(&'a self, _: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()> {
            Box::pin(async { panic!("the store broke") })
        }

        fn describe(&self) -> String {
            "panicking".into()
        }
    }

    fn loopback_config() -> Config {
        Config {
            quic: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            xds: None,
            ..Config::default()
        }
    }

    use crate::test_http::raw_get as get;

    #[tokio::test]
    async fn a_task_that_panics_is_reported_so_that_the_process_can_exit() {
        let ca = Ca::generate("test CA").expect("CA");
        let server = ca
            .issue_server(&["localhost".to_string()])
            .expect("server certificate");
        let identity = server.identity("server").expect("identity");
        let client_ca = ballast_shared::tls::certs_from_pem(&ca.pem().cert, "CA").expect("CA");
        let cfg = loopback_config();
        let mut daemon = Daemon::start_with_store(
            &cfg,
            identity,
            &client_ca,
            Arc::new(PanickingStore),
            None,
            Door::new(),
            Arc::new(crate::audit::Audit::default()),
        )
        .await
        .expect("starts");
        // A publication with something to store makes the writer call the store.
        let state = daemon.state.clone();
        let now = state.clock.now();
        state.write_balancer(|b| {
            b.register(now, "web", "n1", "127.0.0.1:80", "")
                .expect("registers");
            b.observe(now, "web", "n1", Observation::default())
                .expect("observes");
        });
        state.cycle(now);
        let end = tokio::time::timeout(Duration::from_secs(10), daemon.failed())
            .await
            .expect("the failure is reported");
        assert_eq!(end.task, "routing store writer");
        assert!(end.reason.contains("the store broke"), "{end}");
        daemon.shutdown().await;
    }

    #[tokio::test]
    async fn healthz_fails_when_the_cycle_loop_has_stopped() {
        let clock = crate::clock::Clock::start();
        let balancer = Balancer::new(ballast_balance::Params::default(), clock.now());
        let store = Arc::new(FileStore::new(
            std::env::temp_dir().join("ballast-healthz-never-written.json"),
        ));
        // A state with no cycle loop: as if the loop had died.
        let state = Arc::new(State::new(balancer, store, clock, 1000));
        state.health.set_cycle_ms(500);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let app = crate::api::router(state.clone());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        state.health.ticked(state.clock.now());
        let fresh = get(addr, "/healthz").await;
        assert!(fresh.starts_with("HTTP/1.0 200"), "{fresh}");
        // Three cycle lengths (1.5 s) without a tick.
        tokio::time::sleep(Duration::from_millis(1600)).await;
        let late = get(addr, "/healthz").await;
        assert!(late.starts_with("HTTP/1.0 503"), "{late}");
        assert!(
            late.contains("\"failing\"") && late.contains("cycle loop"),
            "{late}"
        );
        // The loop runs again: healthy again.
        state.health.ticked(state.clock.now());
        let again = get(addr, "/healthz").await;
        assert!(again.starts_with("HTTP/1.0 200"), "{again}");
        server.abort();
    }
}
