//! The relay (`ballast-relay`): agents connect to it exactly as to an aggregator, and
//! it hands each one on to the cluster replica that owns the agent's service, over one
//! QUIC connection per replica (a trunk) that carries many agents' hellos and reports,
//! batched, and brings their replies back.
//!
//! The agent-facing side is `ballast-ingest`'s driver (hello, certificate and policy,
//! rate limit, silence rule, revocation and expiry) with the relay's
//! [`upstream::RelayUpstream`]; where each service is served comes from the replicas
//! ([`routes`]), so that a relay needs no etcd credential; the trunks are [`trunks`]'s. It reads the aggregator's configuration
//! file (`ballast-config`), and links no balancer, xDS or charts.

pub mod cli;
mod http;
pub mod metrics;
pub mod routes;
mod trunks;
mod upstream;

use ballast_ingest::supervise::TaskEnd;
use std::net::SocketAddr;

/// The configuration a relay reads: the aggregator's file, its `[balance]` table unread.
pub type Config = ballast_config::Config<toml::Table>;

/// Why the relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The configuration names no replica to learn the routes from.
    #[error("a relay needs {0} in its configuration")]
    Missing(&'static str),
    /// A TLS file is unusable.
    #[error("{what}: {source}")]
    Tls {
        /// Which identity.
        what: &'static str,
        /// The cause.
        source: ballast_shared::tls::TlsError,
    },
    /// The agent-facing ingest could not be set up.
    #[error(transparent)]
    Ingest(#[from] ballast_ingest::IngestError),
    /// The QUIC threads could not start.
    #[error(transparent)]
    Threads(#[from] ballast_ingest::ThreadsError),
    /// A socket could not be bound.
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        /// Which socket.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The HTTP port's TLS (`[http_tls]`, `http_auth.crl`) is unusable.
    #[error("the HTTP port's TLS: {0}")]
    HttpTls(ballast_ingest::IngestError),
    /// The HTTP port's token file is unusable.
    #[error("the HTTP port's credentials: {0}")]
    HttpAuth(#[from] ballast_http_auth::AuthError),
}

/// A running relay.
pub struct Relay {
    /// The bound QUIC address agents connect to.
    pub quic_addr: SocketAddr,
    /// The bound HTTP address (`/healthz`, open, and `/metrics`, which takes a
    /// credential of the `scrape` role when `[http_auth]` has any).
    pub http_addr: SocketAddr,
    running: running::Running,
}

impl Relay {
    /// Starts the relay `cfg` describes (its `[relay]` table, whose `replicas` it
    /// learns the routes from, and the agent-facing `[tls]`, `[quic]` and limits).
    pub async fn start(cfg: &Config) -> Result<Relay, RelayError> {
        running::start(cfg).await
    }

    /// Waits until a task the relay needs ends (it must not before shutdown), and
    /// says which and how.
    pub async fn failed(&mut self) -> TaskEnd {
        self.running.ends.next().await
    }

    /// Stops: agents see their connections close, and go to their next address.
    pub async fn shutdown(self) {
        self.running.shutdown().await;
    }
}

mod running {
    use super::http::{router, Status};
    use super::metrics::RelayMetrics;
    use super::trunks::{trunk_alpns, Dialer, Trunks};
    use super::upstream::{RelayUpstream, Settings};
    use super::{Config, Relay, RelayError};
    use ballast_ingest::supervise::{Ends, Supervisor};
    use ballast_ingest::threads::Threads;
    use ballast_shared::tls::live::LiveTls;
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    /// What a running relay holds.
    pub(super) struct Running {
        pub(super) ends: Ends,
        supervisor: Supervisor,
        quic: Arc<Threads>,
        client: quinn::Endpoint,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    }

    pub(super) async fn start(cfg: &Config) -> Result<Relay, RelayError> {
        let relay = cfg.relay.clone().unwrap_or_default();
        if relay.replicas.is_empty() {
            return Err(RelayError::Missing(
                "the replicas to learn the routes from ([relay] replicas, or --replica)",
            ));
        }
        if relay.etcd.is_some() {
            tracing::warn!(
                "[relay.etcd] is no longer read: the relay learns the routes from the \
                 replicas of [relay] replicas; its etcd user can be removed"
            );
        }
        let name = relay
            .name
            .clone()
            .unwrap_or_else(|| ballast_config::default_replica_name(cfg.quic.port()));
        let tls = |what, source| RelayError::Tls { what, source };
        let identity = cfg
            .tls
            .identity()
            .map_err(|e| tls("the agent-facing identity (tls)", e))?;
        let client_ca = cfg
            .tls
            .ca_certs()
            .map_err(|e| tls("the agent-facing identity (tls)", e))?;
        let relay_identity = relay
            .tls
            .identity()
            .map_err(|e| tls("the relay's identity (relay.tls)", e))?;
        let relay_ca = relay
            .tls
            .ca_certs()
            .map_err(|e| tls("the relay's CA (relay.tls.ca)", e))?;
        // Watched below: a trunk dialled after a renewal presents the new certificate.
        let relay_tls = LiveTls::client_from(&relay.tls, relay_identity, relay_ca)
            .map_err(|e| tls("the relay's identity (relay.tls)", e))?;
        let client = ballast_shared::tls::client_config_live(&relay_tls, &trunk_alpns()?)
            .map_err(|e| tls("the relay's client configuration", e))?;
        let routes_client = ballast_shared::tls::client_config_live(
            &relay_tls,
            &[ballast_shared::trunk::routes::ROUTES_ALPN],
        )
        .map_err(|e| tls("the relay's client configuration", e))?;
        let (server, ingest) = ballast_ingest::setup_with(
            &cfg.ingest(),
            identity,
            &client_ca,
            &ballast_ingest::agent_alpns()?,
        )?;
        // The HTTP port's TLS: on the files of [tls], the agents' listener's
        // certificate and verifier (authorization.crl included); on files of its own,
        // with the revocation list of [http_auth] crl, watched below.
        let http_tls = match &cfg.http_tls {
            Some(files) => Some(
                ballast_ingest::http_listener::http_tls(
                    files,
                    cfg.http_auth.crl.clone(),
                    Duration::from_millis(cfg.http_auth.crl_check_ms),
                    &cfg.tls,
                    &ingest,
                )
                .map_err(RelayError::HttpTls)?,
            ),
            None => None,
        };

        let (supervisor, ends) = ballast_ingest::supervise::supervisor();
        let metrics = Arc::new(RelayMetrics::new());
        let any: SocketAddr = if cfg.quic.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let endpoint = quinn::Endpoint::client(any).map_err(|source| RelayError::Bind {
            what: "the trunks' QUIC client",
            addr: any,
            source,
        })?;
        let (follower, routes, freshness) = super::routes::follower(
            super::routes::Dial {
                relay: name.clone(),
                endpoint: endpoint.clone(),
                client: routes_client,
                server_name: relay.server_name.clone(),
                seeds: relay.replicas.clone(),
            },
            metrics.clone(),
        );
        let mut tasks = vec![supervisor.spawn("cluster routes", follower.run())];
        tasks.push(supervisor.spawn(
            "relay TLS files",
            relay_tls.watch(
                ballast_shared::tls::live::CHECK_EVERY,
                ballast_ingest::metrics::tls_reload_counter(&metrics.ingest, "relay_"),
            ),
        ));

        let trunks = Trunks::new(Dialer {
            relay: name.clone(),
            endpoint: endpoint.clone(),
            client,
            server_name: relay.server_name.clone(),
            batch_delay: Duration::from_millis(relay.batch_delay_ms),
            attach_timeout: Duration::from_millis(relay.attach_timeout_ms),
            routes: routes.clone(),
            metrics: metrics.clone(),
        });
        let upstream = Arc::new(RelayUpstream::new(
            routes.clone(),
            trunks.clone(),
            metrics.clone(),
            Settings {
                attach_timeout: Duration::from_millis(relay.attach_timeout_ms),
                failover_hold: Duration::from_millis(relay.failover_hold_ms),
            },
        ));
        let quic = Arc::new(
            ballast_ingest::threads::start(
                server,
                cfg.quic,
                cfg.quic_threads,
                metrics.ingest.clone(),
                ingest,
                upstream,
                &supervisor,
            )
            .await?,
        );
        // The trunks run beside the agents' connections, on the (first) QUIC thread:
        // a report then reaches its trunk, and a reply its agent, with no wake-up of
        // another thread (with several QUIC threads, the others' agents still hop).
        let running = match quic.runtime() {
            Some(rt) => rt.spawn(trunks.clone().run()),
            None => tokio::spawn(trunks.clone().run()),
        };
        tasks.push(supervisor.spawn("trunks", async move {
            if let Err(e) = running.await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }));
        let quic_addr = quic.addr;
        let threads = quic.clone();
        tasks.push(supervisor.spawn("QUIC ingest", async move {
            threads.ended().await;
        }));

        let bind = |source| RelayError::Bind {
            what: "HTTP",
            addr: cfg.http,
            source,
        };
        let listener = tokio::net::TcpListener::bind(cfg.http)
            .await
            .map_err(bind)?;
        let http_addr = listener.local_addr().map_err(bind)?;
        let mut auth = ballast_http_auth::Auth::new(&cfg.http_auth, metrics.clone())?;
        if let Some(tls) = &http_tls {
            auth = auth.with_revocation(tls.revocation.clone());
        }
        let auth = Arc::new(auth);
        if let Some(watch) = auth.watch_tokens() {
            tasks.push(supervisor.spawn("HTTP token file", watch));
        }
        tracing::info!(
            tls = cfg.http_tls.is_some(),
            tokens = auth.takes_tokens(),
            certificates = auth.takes_certificates(),
            "HTTP credentials"
        );
        let app = router(
            Arc::new(Status {
                name: name.clone(),
                metrics: metrics.clone(),
                routes,
                freshness,
                trunks,
            }),
            auth,
        )
        .into_make_service_with_connect_info::<ballast_ingest::http_listener::Peer>();
        let mut listener = ballast_ingest::http_listener::Limited::new(
            listener,
            metrics.clone(),
            cfg.limits.http(),
        );
        if let Some(tls) = http_tls {
            tasks.extend(tls.spawn_watches(&supervisor, &metrics.ingest));
            listener = listener.with_tls(tls.config);
        }
        tasks.push(supervisor.spawn("HTTP", async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "HTTP stopped");
            }
        }));
        tracing::info!(%name, replicas = ?relay.replicas, %quic_addr, %http_addr, "relay serving");
        Ok(Relay {
            quic_addr,
            http_addr,
            running: Running {
                ends,
                supervisor,
                quic,
                client: endpoint,
                tasks,
            },
        })
    }

    impl Running {
        pub(super) async fn shutdown(self) {
            self.supervisor.stop();
            self.quic
                .close(ballast_ingest::quic::close::NORMAL, b"shutting down");
            for t in &self.tasks {
                t.abort();
            }
            self.client.close(
                quinn::VarInt::from_u32(ballast_ingest::quic::close::NORMAL),
                b"relay stopping",
            );
            self.quic.stopped().await;
        }
    }
}
