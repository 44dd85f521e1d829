//! Operators' actions received by one replica of a cluster and applied by the owner of
//! their service, through etcd: an operator need not know which replica owns what.
//!
//! **The receiving replica** ([`EtcdRelay`], the door's [`Relay`]) writes the action as
//! a [`Request`] to a key of its own, `<prefix>/cluster/<name>/actions/<id>`, under a
//! lease of its own of [`REQUEST_TTL_S`], and reads the key until the owner has
//! answered in it, for at most [`ANSWER_WAIT`]. It never writes the service's key,
//! which only the owner writes, under its fence.
//!
//! **The owner** ([`Answerer`], in the replica's cluster task) sees the request in its
//! watch of the cluster's keys, or reads every pending request when it takes buckets
//! over and whenever its watch is made again, so that a request made while no replica
//! held the service (between an owner's death and its successor's takeover) is applied
//! by the successor. It applies the action through its cycle loop's door, exactly as
//! one its own API received (published at once, then stored with the service, so that
//! the action outlives the owner), audits it naming both replicas, and writes its
//! [`Outcome`] into the request, only if the request is still the one it read.
//!
//! A request nobody answers lapses with its lease. An answered one stays until then,
//! so that another replica taking the service over does not apply it again.

use super::Ownership;
use crate::audit::{Audit, AuditRecord};
use crate::door::{Door, Handed, Outcome, Relay, RelayError, Relaying, Request};
use crate::metrics::Metrics;
use crate::store::etcd::EtcdStore;
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a request waits in etcd for an owner to apply it, in seconds: long
/// enough for a failover (a lease of a few seconds, then a takeover), short enough
/// that an action nobody could apply does not surprise anyone much later.
pub(crate) const REQUEST_TTL_S: u64 = 120;

/// How long the receiving replica waits for the owner's answer before it answers
/// that the action is only accepted.
pub(crate) const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// How often the receiving replica reads the request while it waits.
const ANSWER_POLL: Duration = Duration::from_millis(50);

/// The largest request, as JSON: reasons are bounded (1024 characters), and so are
/// names; a request past this is refused rather than stored.
const MAX_REQUEST_BYTES: usize = 32 * 1024;

/// The keys requests are written under: `<prefix>/cluster/<name>/actions/`.
pub(crate) fn requests_prefix(prefix: &str, cluster: &str) -> String {
    format!("{}actions/", super::cluster_prefix(prefix, cluster))
}

/// The receiving replica's side: hands actions on services it does not own to their
/// owners.
pub(crate) struct EtcdRelay {
    store: Arc<EtcdStore>,
    ownership: Arc<Ownership>,
    requests: String,
    seq: AtomicU64,
}

impl EtcdRelay {
    /// The relay of the replica `ownership` names, writing requests to `store`'s etcd
    /// under cluster `cluster`'s keys.
    pub(crate) fn new(store: Arc<EtcdStore>, ownership: Arc<Ownership>, cluster: &str) -> Self {
        let requests = requests_prefix(store.prefix(), cluster);
        EtcdRelay {
            store,
            ownership,
            requests,
            seq: AtomicU64::new(0),
        }
    }

    /// Bounds a call to etcd by the store's request timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RelayError> {
        let timeout = self.store.request_timeout();
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| RelayError::Store(format!("{what} timed out after {timeout:?}")))?
            .map_err(|e| RelayError::Store(format!("{what}: {e}")))
    }

    async fn hand_over(&self, request: Request) -> Result<Handed, RelayError> {
        let value = serde_json::to_vec(&request).map_err(|e| RelayError::Store(e.to_string()))?;
        if value.len() > MAX_REQUEST_BYTES {
            return Err(RelayError::TooLarge(value.len()));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let key = format!(
            "{}{}-{:013}-{seq}",
            self.requests,
            self.ownership.replica(),
            request.at_ms
        );
        let mut client = self.store.client().await.map_err(RelayError::Store)?;
        let ttl = i64::try_from(REQUEST_TTL_S).unwrap_or(i64::MAX);
        let lease = self
            .bounded("request lease", client.lease_grant(ttl, None))
            .await?;
        let put = PutOptions::new().with_lease(lease.id());
        self.bounded("request", client.put(key.clone(), value, Some(put)))
            .await?;
        tracing::info!(%key, service = %request.service, action = request.action.label(),
            "an operator's action is handed to the service's owner");
        let started = Instant::now();
        loop {
            tokio::time::sleep(ANSWER_POLL).await;
            let read = self.bounded("request", client.get(key.clone(), None)).await;
            // A failed read is not the end: the request is stored, and the owner may
            // answer it; the next read may work.
            let answered = read.ok().and_then(|r| {
                let kv = r.kvs().first()?;
                serde_json::from_slice::<Request>(kv.value()).ok()?.outcome
            });
            if let Some(outcome) = answered {
                return match outcome.result {
                    Ok(operator) => Ok(Handed::Applied {
                        by: outcome.by,
                        operator,
                    }),
                    Err(error) => Err(RelayError::Refused {
                        by: outcome.by,
                        error,
                    }),
                };
            }
            if started.elapsed() >= ANSWER_WAIT {
                return Ok(Handed::Accepted {
                    lapses_s: REQUEST_TTL_S,
                });
            }
        }
    }
}

impl Relay for EtcdRelay {
    fn replica(&self) -> &str {
        self.ownership.replica()
    }

    fn owns(&self, service: &str) -> bool {
        self.ownership.owns(service)
    }

    fn hand(&self, request: Request) -> Relaying<'_> {
        Box::pin(self.hand_over(request))
    }
}

/// The owner's side: applies the requests on the services this replica owns.
pub(crate) struct Answerer {
    door: Door,
    audit: Arc<Audit>,
    ownership: Arc<Ownership>,
    metrics: Arc<Metrics>,
    requests: String,
    timeout: Duration,
}

impl Answerer {
    /// The answerer of the replica `ownership` names, in cluster `cluster` under
    /// `prefix`, applying through `door` and auditing in `audit`.
    pub(crate) fn new(
        door: Door,
        audit: Arc<Audit>,
        ownership: Arc<Ownership>,
        metrics: Arc<Metrics>,
        store: &EtcdStore,
        cluster: &str,
    ) -> Self {
        Answerer {
            door,
            audit,
            ownership,
            metrics,
            requests: requests_prefix(store.prefix(), cluster),
            timeout: store.request_timeout(),
        }
    }

    /// Whether `key` is a request's.
    pub(crate) fn is_request(&self, key: &[u8]) -> bool {
        key.starts_with(self.requests.as_bytes())
    }

    /// Reads every request and answers those on services this replica owns that no
    /// owner has answered: how many.
    pub(crate) async fn scan(&self, client: &mut Client) -> Result<usize, String> {
        let resp = tokio::time::timeout(
            self.timeout,
            client.get(self.requests.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| format!("reading requests timed out after {:?}", self.timeout))?
        .map_err(|e| format!("reading requests: {e}"))?;
        let mut answered = 0;
        for kv in resp.kvs() {
            if self
                .answer(client, kv.key(), kv.value(), kv.mod_revision())
                .await
            {
                answered += 1;
            }
        }
        Ok(answered)
    }

    /// Answers the request `value` stored at `key` (at `revision`) if it is on a service
    /// this replica owns and no owner has answered it: applies it, audits it, and
    /// writes the outcome into it. Whether it did.
    pub(crate) async fn answer(
        &self,
        client: &mut Client,
        key: &[u8],
        value: &[u8],
        revision: i64,
    ) -> bool {
        let name = String::from_utf8_lossy(key).into_owned();
        let mut request: Request = match serde_json::from_slice(value) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(key = %name, error = %e,
                    "a request under the cluster's actions that is not one is passed over");
                return false;
            }
        };
        if request.outcome.is_some() || !self.ownership.owns(&request.service) {
            return false;
        }
        let label = request.action.label();
        let me = self.ownership.replica().to_string();
        let result = self.door.act(request.service.clone(), request.act()).await;
        let at_ms = wall_ms();
        match &result {
            Ok(_) => {
                self.metrics.act(label, "relayed_applied");
                self.audit.record(AuditRecord {
                    seq: 0,
                    at_ms,
                    who: request.by.clone(),
                    via: request.via.clone(),
                    from: request.from.clone(),
                    action: label.to_string(),
                    service: request.service.clone(),
                    node: request.action.node().map(str::to_string),
                    weight: match request.action {
                        ballast_balance::Action::Pin { weight, .. } => Some(weight),
                        _ => None,
                    },
                    until_ms: match request.action {
                        ballast_balance::Action::Hold { until_ms }
                        | ballast_balance::Action::Pin { until_ms, .. } => until_ms,
                        _ => None,
                    },
                    reason: request.reason.clone(),
                    received_by: Some(request.received_by.clone()),
                    applied_by: Some(me.clone()),
                });
            }
            Err(e) => {
                self.metrics.act(label, &format!("relayed_{}", e.label()));
                tracing::info!(key = %name, service = %request.service, action = label,
                    error = %e, "an operator's action handed on by another replica is refused");
            }
        }
        request.outcome = Some(Outcome {
            by: me,
            at_ms,
            result,
        });
        let Ok(answer) = serde_json::to_vec(&request) else {
            return true;
        };
        // Into the request as read, and only if it is still that (not lapsed, not
        // answered by another): the receiving replica reads the outcome from it.
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.to_vec(),
                CompareOp::Equal,
                revision,
            )])
            .and_then(vec![TxnOp::put(
                key.to_vec(),
                answer,
                Some(PutOptions::new().with_ignore_lease()),
            )]);
        match tokio::time::timeout(self.timeout, client.txn(txn)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(key = %name, error = %e, "writing a request's outcome failed")
            }
            Err(_) => tracing::warn!(key = %name, "writing a request's outcome timed out"),
        }
        true
    }
}

/// Milliseconds since the Unix epoch, now.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_balance::{ActError, Action, Actions};

    #[test]
    fn requests_live_under_the_clusters_keys_where_views_pass_them_over() {
        let p = requests_prefix("/ballast", "main");
        assert_eq!(p, "/ballast/cluster/main/actions/");
        let key = format!("{p}r1-0000000000001-0");
        let view = super::super::parse_view(
            &super::super::cluster_prefix("/ballast", "main"),
            [super::super::ClusterKv {
                key: key.as_bytes(),
                value: b"{}",
                create_revision: 1,
                lease: 0,
            }],
        );
        assert_eq!(view, super::super::View::default());
    }

    #[test]
    fn a_request_and_its_outcome_read_back_as_written() {
        let mut r = Request {
            service: "web".into(),
            action: Action::Drain { node: "n1".into() },
            by: "alice".into(),
            via: "token".into(),
            from: Some("10.0.0.1:5000".into()),
            reason: "disk".into(),
            at_ms: 7,
            received_by: "r2".into(),
            outcome: None,
        };
        let back: Request =
            serde_json::from_slice(&serde_json::to_vec(&r).expect("json")).expect("reads");
        assert_eq!(back, r);
        for result in [
            Ok(Actions::default()),
            Err(ActError::NotInForce("not drained".into())),
            Err(ActError::UnknownService("web".into())),
        ] {
            r.outcome = Some(Outcome {
                by: "r1".into(),
                at_ms: 9,
                result,
            });
            let back: Request =
                serde_json::from_slice(&serde_json::to_vec(&r).expect("json")).expect("reads");
            assert_eq!(back, r);
        }
    }
}
