//! Certificate revocation: the list in force, its file watched for changes, and the
//! verdict on a live connection's certificate when the list changes.
//!
//! The handshake's verifier ([`ClientVerifier`]) refuses revoked certificates from
//! the moment a new list is set. Connections made before then are told through a
//! generation counter: each connection task checks its own certificate again when it
//! changes, and closes itself if the certificate is now revoked.

use super::IngestError;
use crate::metrics::{IngestMetrics, Reason};
use ballast_shared::tls::{self, CertificateDer, CertificateRevocationListDer, ClientVerifier};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;

/// What a certificate is worth now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Still good.
    Valid,
    /// On the revocation list in force.
    Revoked,
    /// Past its validity period.
    Expired,
}

/// The revocation list in force and where it comes from.
pub struct Revocation {
    verifier: Arc<ClientVerifier>,
    path: Option<PathBuf>,
    check_every: Duration,
    generation: watch::Sender<u64>,
}

/// What identifies a version of the file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        inode: m.ino(),
    })
}

fn read_crls(
    path: &Path,
) -> Result<(Vec<u8>, Vec<CertificateRevocationListDer<'static>>), IngestError> {
    let err = |source| IngestError::Crl {
        path: path.display().to_string(),
        source,
    };
    let bytes = std::fs::read(path).map_err(|source| {
        err(tls::TlsError::Read {
            path: path.display().to_string(),
            source,
        })
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let crls = tls::crls_from_pem(&text, &path.display().to_string()).map_err(err)?;
    Ok((bytes, crls))
}

impl Revocation {
    /// The verifier for certificates from `client_ca`, with the list in `path` if one
    /// is configured, checked for changes every `check_every`.
    pub fn load(
        client_ca: &[CertificateDer<'static>],
        path: Option<PathBuf>,
        check_every: Duration,
    ) -> Result<Self, IngestError> {
        let crls = match &path {
            Some(p) => {
                let (_, crls) = read_crls(p)?;
                tracing::info!(crl = %p.display(), lists = crls.len(), "certificate revocation list loaded");
                crls
            }
            None => Vec::new(),
        };
        let verifier = ClientVerifier::new(client_ca, crls).map_err(|source| match &path {
            Some(p) => IngestError::Crl {
                path: p.display().to_string(),
                source,
            },
            None => IngestError::Tls(source),
        })?;
        Ok(Revocation {
            verifier: Arc::new(verifier),
            path,
            check_every,
            generation: watch::channel(0).0,
        })
    }

    /// The handshake's verifier.
    pub fn verifier(&self) -> Arc<ClientVerifier> {
        self.verifier.clone()
    }

    /// A receiver that sees every change of the list from now on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// What `chain` (leaf first) is worth under the list in force now.
    pub fn verdict(&self, chain: &[CertificateDer<'static>]) -> Verdict {
        self.judge(chain).unwrap_or_else(|e| {
            // Nothing else can have changed since the handshake: the CAs stay.
            tracing::debug!(error = %e, "a live certificate checked again");
            Verdict::Valid
        })
    }

    /// What `chain` (leaf first), checked as a handshake would check it now, is worth;
    /// or why no handshake would take it at all (another CA, a certificate that does
    /// not parse or is not for a client): for a chain that no handshake here has
    /// checked, a relayed agent's.
    pub fn judge(
        &self,
        chain: &[CertificateDer<'static>],
    ) -> Result<Verdict, quinn::rustls::Error> {
        use quinn::rustls::{CertificateError as C, Error as E};
        let now = ballast_shared::unix_ms() / 1000;
        match self.verifier.check(chain, now) {
            Ok(()) => Ok(Verdict::Valid),
            Err(E::InvalidCertificate(C::Revoked)) => Ok(Verdict::Revoked),
            Err(E::InvalidCertificate(
                C::Expired
                | C::ExpiredContext { .. }
                | C::NotValidYet
                | C::NotValidYetContext { .. },
            )) => Ok(Verdict::Expired),
            Err(e) => Err(e),
        }
    }

    /// Watches the list's file until the task ends: a changed file is read and put in
    /// force, then every live connection checks its certificate again. A file that is
    /// unusable, or gone, leaves the list in force as it was. Reloads are counted in
    /// `crl_reloads`.
    pub async fn watch(self: Arc<Self>, metrics: Arc<IngestMetrics>) {
        self.watch_counting(metrics.crl_reloads.clone()).await
    }

    /// [`Revocation::watch`], its reloads counted by outcome in `reloads` (the HTTP
    /// listener's own list has a family of its own).
    pub async fn watch_counting(self: Arc<Self>, reloads: Family<Reason, Counter>) {
        let metrics = &reloads;
        let Some(path) = self.path.clone() else {
            return std::future::pending().await;
        };
        let mut last_stamp = stamp(&path).ok();
        let mut last_bytes = std::fs::read(&path).unwrap_or_default();
        let mut tick = tokio::time::interval(self.check_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut complained = false;
        loop {
            tick.tick().await;
            let now = match stamp(&path) {
                Ok(s) => s,
                Err(e) => {
                    if !complained {
                        tracing::warn!(crl = %path.display(), error = %e,
                            "cannot read the certificate revocation list; the list in force stays");
                        count(metrics, "error");
                        complained = true;
                    }
                    continue;
                }
            };
            if last_stamp.as_ref() == Some(&now) {
                continue;
            }
            let p = path.clone();
            let read = tokio::task::spawn_blocking(move || read_crls(&p)).await;
            let (bytes, crls) = match read {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    // Written in several steps, perhaps: tried again at the next tick
                    // whatever the stamp says.
                    if !complained {
                        tracing::error!(error = %e, "certificate revocation list refused; the list in force stays");
                        count(metrics, "error");
                        complained = true;
                    }
                    last_stamp = None;
                    continue;
                }
                Err(_) => continue,
            };
            last_stamp = Some(now);
            complained = false;
            if bytes == last_bytes {
                continue;
            }
            // Checking and indexing a list of many entries takes a while: not on the
            // thread that serves connections.
            let verifier = self.verifier.clone();
            let applied = match tokio::task::spawn_blocking(move || verifier.set_crls(crls)).await {
                Ok(applied) => applied,
                Err(_) => continue,
            };
            if let Err(e) = applied {
                tracing::error!(crl = %path.display(), error = %e,
                    "certificate revocation list refused; the list in force stays");
                count(metrics, "error");
                last_bytes = bytes;
                continue;
            }
            last_bytes = bytes;
            tracing::info!(crl = %path.display(), "certificate revocation list reloaded; live connections are checked again");
            count(metrics, "applied");
            self.generation.send_modify(|g| *g = g.wrapping_add(1));
        }
    }
}

fn count(reloads: &Family<Reason, Counter>, outcome: &str) {
    reloads
        .get_or_create(&Reason {
            reason: outcome.to_string(),
        })
        .inc();
}
