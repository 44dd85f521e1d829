//! The running aggregator: QUIC ingest, the cycle loop and the HTTP API around one
//! shared state.

use crate::clock::Clock;
use crate::config::Config;
use crate::state::State;
use crate::store::{file::FileStore, RoutingStore, StoreError};
use ballast_balance::Balancer;
use ballast_shared::tls::CertificateDer;
use ballast_shared::tls::{self, Identity, TlsError};
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
    xds: Option<crate::feed::xds::XdsServer>,
    endpoint: quinn::Endpoint,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    store_writer: tokio::task::JoinHandle<()>,
}

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
        let store: Arc<dyn RoutingStore> = match &cfg.store.etcd {
            Some(etcd) => etcd_store(etcd).await?,
            None => Arc::new(FileStore::new(cfg.store.path.clone())),
        };
        Self::start_with_store(cfg, identity, client_ca, store).await
    }

    /// Starts everything with the given routing store (any [`RoutingStore`], so that
    /// tests can bring their own): restores from it, then writes to it in the
    /// background.
    pub(crate) async fn start_with_store(
        cfg: &Config,
        identity: Identity,
        client_ca: &[CertificateDer<'static>],
        store: Arc<dyn RoutingStore>,
    ) -> Result<Daemon, DaemonError> {
        let clock = Clock::start();
        let restored = store.load().await?;
        let mut balancer = Balancer::new(cfg.balance.clone(), clock.now());
        balancer.restrict_services(cfg.services.as_ref().map(|s| s.iter().cloned().collect()));
        if !restored.is_empty() {
            tracing::info!(services = restored.len(), store = %store.describe(), "weights restored from the routing store");
        }
        balancer.restore(clock.now(), &restored);
        let state = Arc::new(State::new(balancer, store, clock, cfg.report_interval_ms));
        // Before anything can publish: the writer takes what is current now (the
        // restored services) as what the store holds, and writes every change after it.
        let store_writer = crate::store::writer(state.clone());

        let server = tls::server_config(identity, client_ca)?;
        let endpoint =
            quinn::Endpoint::server(server, cfg.quic).map_err(|source| DaemonError::Bind {
                what: "QUIC",
                addr: cfg.quic,
                source,
            })?;
        let quic_addr = endpoint.local_addr().map_err(|source| DaemonError::Bind {
            what: "QUIC",
            addr: cfg.quic,
            source,
        })?;
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
                let server =
                    crate::feed::xds::XdsServer::start(listener, state.clone(), cfg.xds_lb_policy)
                        .map_err(bind_error)?;
                Some(server)
            }
            None => None,
        };
        let xds_addr = xds.as_ref().map(|x| x.local_addr());

        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(crate::ingest::quic::serve(
            endpoint.clone(),
            state.clone(),
        )));
        if let Some(dir) = &cfg.service_config.dir {
            let config_dir = crate::config::watch::ConfigDir::open(
                state.clone(),
                dir.clone(),
                &cfg.service_config,
                &cfg.store,
                &cfg.balance,
            );
            tasks.push(tokio::spawn(config_dir.run()));
        }
        tasks.push(tokio::spawn(cycle_loop(
            state.clone(),
            Duration::from_millis(cfg.balance.cycle_ms.min(CYCLE_TICK_MS)),
        )));
        let app = crate::api::router(state.clone());
        tasks.push(tokio::spawn(async move {
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
            xds,
            endpoint,
            tasks,
            store_writer: tokio::spawn(store_writer),
        })
    }

    /// Stops serving: agents see the connection close and will reconnect elsewhere.
    pub async fn shutdown(self) {
        self.endpoint
            .close(crate::ingest::quic::close::NORMAL.into(), b"shutting down");
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
        self.endpoint.wait_idle().await;
    }
}

#[cfg(feature = "etcd")]
async fn etcd_store(cfg: &crate::config::EtcdConfig) -> Result<Arc<dyn RoutingStore>, DaemonError> {
    Ok(Arc::new(crate::store::etcd::EtcdStore::connect(cfg).await?))
}

#[cfg(not(feature = "etcd"))]
async fn etcd_store(
    _cfg: &crate::config::EtcdConfig,
) -> Result<Arc<dyn RoutingStore>, DaemonError> {
    Err(DaemonError::Store(StoreError::Backend(
        "an etcd routing store is configured, but this ballast-aggregator was built without \
         the etcd feature (build with `--features ballast-aggregator/etcd`)"
            .into(),
    )))
}

/// The cycle loop's tick at most: services may override the cycle length, so the loop
/// ticks finely and runs each service when its own cycle is due.
const CYCLE_TICK_MS: u64 = 100;

async fn cycle_loop(state: Arc<State>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let slack = u64::try_from(period.as_millis() / 2).unwrap_or(0);
    tick.tick().await;
    loop {
        tick.tick().await;
        // Readers, the store writer among them, take the publication from the watch.
        let _ = state.cycle_due(state.clock.now(), slack);
    }
}
