//! Operators' actions received by one replica of a cluster and applied by the owner of
//! their service, through etcd: an operator need not know which replica owns what.
//!
//! **The receiving replica** ([`EtcdRelay`], the door's [`Relay`]) writes the action as
//! a [`Request`] to a key of its own, `<prefix>/cluster/<name>/actions/<id>`, under a
//! lease of its own of [`REQUEST_TTL_S`], and reads the key until the owner has
//! answered in it, for at most [`ANSWER_WAIT`]. It never writes the service's key,
//! which only the owner writes, under its fence.
//!
//! **The owner** ([`Answerer`], a task of its own beside the replica's cluster task,
//! fed by it through a bounded queue, so that answering never holds up the renewal of
//! the lease) sees the request in its watch of the cluster's keys, or reads every
//! pending request, oldest made first, when it takes buckets over and whenever its
//! watch is made again, so that a request made while no replica held the service
//! (between an owner's death and its successor's takeover) is applied by the
//! successor. It checks that the request is genuine (its key is the receiving
//! replica's, the replica a live member, the value within [`MAX_REQUEST_BYTES`]),
//! then **claims** it (writes its name into it, only if the request is still the one
//! it read), and applies it only if the claim held: a request seen twice (in the
//! watch and in a scan) is applied once. It applies it through its cycle loop's door,
//! exactly as one its own API received (published at once, then stored with the
//! service, so that the action outlives the owner), audits it naming both replicas,
//! and writes its [`Outcome`] into the request, only if the request is still as it
//! claimed it. A refusal that is not final (the cycle loop gone at shutdown, the
//! service handed over between the check and the cycle loop) gives the claim back,
//! for the service's owner to apply.
//!
//! **At most once.** An owner that dies between its claim and its outcome leaves the
//! request claimed and unanswered. No other replica applies it: the action may have
//! been applied (and a replayed drain could undo a later undrain), so the request
//! says who claimed it, the receiving replica answers that it was only accepted, and
//! the request lapses with its lease.
//!
//! A request nobody answers lapses with its lease. An answered one stays until then,
//! so that another replica taking the service over does not apply it again.

use super::Ownership;
use crate::audit::{Audit, AuditRecord};
use crate::door::{Door, Handed, Outcome, Relay, RelayError, Relaying, Request};
use crate::metrics::Metrics;
use crate::store::etcd::EtcdStore;
use ballast_balance::ActError;
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

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

/// How many pending requests one scan reads from etcd, per read.
const SCAN_PAGE: i64 = 128;

/// How many pending requests one scan deals with at most: a flood of requests (or of
/// forged ones) costs the answering task a bounded time per scan. Those past it wait
/// for the next scan, or lapse.
const SCAN_MAX: usize = 1024;

/// How many requests seen in the watch wait for the answering task. When it is full,
/// the next scan reads them instead.
const QUEUE: usize = 256;

/// What the answering task is asked to do.
enum Job {
    /// Read every pending request and answer those on services this replica owns.
    Scan,
    /// Answer the request the watch showed written.
    Request {
        key: Vec<u8>,
        value: Vec<u8>,
        revision: i64,
    },
}

/// The cluster task's side of the answering task: it never waits, so that the task
/// that renews the lease is never held by requests.
#[derive(Clone)]
pub(crate) struct Answering {
    tx: mpsc::Sender<Job>,
    behind: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    requests: String,
}

impl Answering {
    /// Whether `key` is a request's.
    pub(crate) fn is_request(&self, key: &[u8]) -> bool {
        key.starts_with(self.requests.as_bytes())
    }

    /// Asks for every pending request to be read and answered.
    pub(crate) fn scan(&self) {
        self.send(Job::Scan);
    }

    /// Asks for the request `value` at `key`, written at `revision`, to be answered.
    pub(crate) fn request(&self, key: &[u8], value: &[u8], revision: i64) {
        self.send(Job::Request {
            key: key.to_vec(),
            value: value.to_vec(),
            revision,
        });
    }

    fn send(&self, job: Job) {
        if self.tx.try_send(job).is_err() {
            // Not lost: the answering task scans once it has caught up.
            self.behind.store(true, Ordering::Relaxed);
            self.metrics.action_request("queue_full");
        }
    }
}

/// Why a request was not, or was, answered here: the `outcome` label of
/// `ballast_cluster_action_requests_total`, or `None` for a request that is not this
/// replica's to answer (another's service, answered already), not counted.
type Dealt = Option<&'static str>;

/// The owner's side: applies the requests on the services this replica owns, in a
/// task of its own ([`Answerer::run`]) fed by [`Answering`].
pub(crate) struct Answerer {
    door: Door,
    audit: Arc<Audit>,
    ownership: Arc<Ownership>,
    metrics: Arc<Metrics>,
    store: Arc<EtcdStore>,
    /// The store's prefix and the cluster's name, for its member keys.
    prefix: String,
    name: String,
    requests: String,
    timeout: Duration,
    jobs: mpsc::Receiver<Job>,
    answering: Answering,
    /// The cycle loop is gone (the daemon is stopping): nothing more is answered here.
    gone: AtomicBool,
}

impl Answerer {
    /// The answerer of the replica `ownership` names, in cluster `cluster` of
    /// `store`'s etcd, applying through `door` and auditing in `audit`.
    pub(crate) fn new(
        door: Door,
        audit: Arc<Audit>,
        ownership: Arc<Ownership>,
        metrics: Arc<Metrics>,
        store: &Arc<EtcdStore>,
        cluster: &str,
    ) -> Self {
        let requests = requests_prefix(store.prefix(), cluster);
        let (tx, jobs) = mpsc::channel(QUEUE);
        let answering = Answering {
            tx,
            behind: Arc::new(AtomicBool::new(false)),
            metrics: metrics.clone(),
            requests: requests.clone(),
        };
        Answerer {
            door,
            audit,
            ownership,
            metrics,
            store: store.clone(),
            prefix: store.prefix().to_string(),
            name: cluster.to_string(),
            requests,
            timeout: store.request_timeout(),
            jobs,
            answering,
            gone: AtomicBool::new(false),
        }
    }

    /// The way to ask this answerer for work, for the cluster task.
    pub(crate) fn answering(&self) -> Answering {
        self.answering.clone()
    }

    /// Answers what it is asked until every [`Answering`] is dropped.
    pub(crate) async fn run(mut self) {
        // Its own sender would keep the channel open forever.
        let behind = self.answering.behind.clone();
        let (closed, _) = mpsc::channel(1);
        self.answering.tx = closed;
        while let Some(job) = self.jobs.recv().await {
            let mut client = match self.store.client().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach etcd to answer operators' actions");
                    self.metrics.action_request("scan_failed");
                    behind.store(true, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            match job {
                Job::Scan => self.scan_logged(&mut client).await,
                Job::Request {
                    key,
                    value,
                    revision,
                } => {
                    self.answer(&mut client, &key, &value, revision).await;
                }
            }
            if behind.swap(false, Ordering::Relaxed) {
                self.scan_logged(&mut client).await;
            }
        }
    }

    async fn scan_logged(&self, client: &mut Client) {
        match self.scan(client).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                requests = n,
                "operators' actions handed on while this replica was not watching answered"
            ),
            Err(e) => {
                self.metrics.action_request("scan_failed");
                tracing::warn!(error = %e, "reading operators' pending actions failed");
            }
        }
    }

    /// Bounds a call to etcd by the store's request timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, String> {
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| format!("{what} timed out after {:?}", self.timeout))?
            .map_err(|e| format!("{what}: {e}"))
    }

    /// Reads the pending requests, oldest made first (by creation, not by key, which
    /// sorts by receiving replica), at most [`SCAN_MAX`], and answers those on
    /// services this replica owns that no owner has taken: how many it answered.
    pub(crate) async fn scan(&self, client: &mut Client) -> Result<usize, String> {
        let mut answered = 0;
        let mut read = 0;
        let mut from = 0;
        loop {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_min_create_revision(from)
                .with_limit(SCAN_PAGE);
            let resp = self
                .bounded(
                    "reading requests",
                    client.get(self.requests.clone(), Some(options)),
                )
                .await?;
            for kv in resp.kvs() {
                read += 1;
                from = kv.create_revision() + 1;
                let dealt = self
                    .answer(client, kv.key(), kv.value(), kv.mod_revision())
                    .await;
                if matches!(dealt, Some("applied" | "refused")) {
                    answered += 1;
                }
            }
            if !resp.more() || resp.kvs().is_empty() {
                return Ok(answered);
            }
            if read >= SCAN_MAX {
                self.metrics.action_request("scan_truncated");
                tracing::warn!(
                    read,
                    "more operators' actions are pending than one scan \
                    reads: the rest wait for the next scan"
                );
                return Ok(answered);
            }
        }
    }

    /// Answers the request `value` stored at `key` (at `revision`), and counts what
    /// became of it.
    pub(crate) async fn answer(
        &self,
        client: &mut Client,
        key: &[u8],
        value: &[u8],
        revision: i64,
    ) -> Dealt {
        let dealt = self.deal(client, key, value, revision).await;
        if let Some(outcome) = dealt {
            self.metrics.action_request(outcome);
        }
        dealt
    }

    /// If the request is genuine, on a service this replica owns, and nobody has
    /// taken it: claims it (only if it is still as read), applies it only if the
    /// claim held, audits it, and writes the outcome into it (only if it is still
    /// as claimed). A refusal that is not final (the cycle loop gone, the service
    /// handed over meanwhile) gives the claim back, for the owner to apply.
    async fn deal(&self, client: &mut Client, key: &[u8], value: &[u8], revision: i64) -> Dealt {
        if self.gone.load(Ordering::Relaxed) {
            return None;
        }
        let name = String::from_utf8_lossy(key).into_owned();
        if value.len() > MAX_REQUEST_BYTES {
            tracing::warn!(key = %name, bytes = value.len(),
                "a request under the cluster's actions larger than any replica writes is refused");
            return Some("refused_too_large");
        }
        let mut request: Request = match serde_json::from_slice(value) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(key = %name, error = %e,
                    "a request under the cluster's actions that is not one is passed over");
                return Some("unparseable");
            }
        };
        if request.outcome.is_some() || !self.ownership.owns(&request.service) {
            return None;
        }
        if let Some(by) = &request.claimed_by {
            if *by == self.ownership.replica() {
                // Its own claim, seen in the watch: being answered (or its outcome
                // write failed, counted then).
                return None;
            }
            // Taken by an owner that died before it answered: it may or may not have
            // applied it, and it is not applied twice.
            tracing::warn!(key = %name, claimed_by = %by, service = %request.service,
                "an operator's action claimed by an earlier owner that never answered \
                 is not applied again: it lapses with its lease");
            return Some("claimed_unanswered");
        }
        if let Err(why) = self.genuine(client, key, &request).await {
            tracing::warn!(key = %name, error = %why,
                "a request under the cluster's actions that no member made is refused");
            return Some("refused_forged");
        }
        let me = self.ownership.replica().to_string();
        request.claimed_by = Some(me.clone());
        let Ok(claim) = serde_json::to_vec(&request) else {
            return Some("unparseable");
        };
        let claimed = match self.put_if(client, key, claim, revision, "claim").await {
            Ok(Some(rev)) => rev,
            Ok(None) => return Some("claim_lost"),
            Err(e) => {
                tracing::warn!(key = %name, error = %e, "claiming a request failed");
                return Some("claim_failed");
            }
        };
        let label = request.action.label();
        let result = self.door.act(request.service.clone(), request.act()).await;
        let temporary = match &result {
            Err(ActError::Unavailable) => {
                self.gone.store(true, Ordering::Relaxed);
                true
            }
            Err(ActError::UnknownService(_)) => !self.ownership.owns(&request.service),
            _ => false,
        };
        if temporary {
            // Not applied: as it was made, for whoever owns the service.
            let put = self
                .put_if(client, key, value.to_vec(), claimed, "claim release")
                .await;
            if !matches!(put, Ok(Some(_))) {
                tracing::warn!(key = %name, "giving back the claim of a request failed: \
                    the action is not applied, and lapses with the request");
            }
            return Some("left_for_owner");
        }
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
        let dealt = if result.is_ok() { "applied" } else { "refused" };
        request.outcome = Some(Outcome {
            by: me,
            at_ms,
            result,
        });
        let Ok(answer) = serde_json::to_vec(&request) else {
            return Some("outcome_write_failed");
        };
        // Into the request as claimed: the receiving replica reads the outcome from it.
        match self.put_if(client, key, answer, claimed, "outcome").await {
            Ok(Some(_)) => Some(dealt),
            Ok(None) => {
                tracing::warn!(key = %name, "a request changed or lapsed before its outcome \
                    was written: applied, and not answered");
                Some("outcome_lost")
            }
            Err(e) => {
                tracing::warn!(key = %name, error = %e, "writing a request's outcome failed: \
                    applied, and not answered");
                Some("outcome_write_failed")
            }
        }
    }

    /// Whether `request`, stored at `key`, was made by the replica it names: the key
    /// is that replica's (`<replica>-<at_ms>-<seq>`), and the replica is a live member
    /// of the cluster.
    async fn genuine(
        &self,
        client: &mut Client,
        key: &[u8],
        request: &Request,
    ) -> Result<(), String> {
        let id = key
            .strip_prefix(self.requests.as_bytes())
            .and_then(|id| std::str::from_utf8(id).ok())
            .ok_or("not a request's key")?;
        let mut parts = id.rsplitn(3, '-');
        let (_seq, at, replica) = (parts.next(), parts.next(), parts.next());
        if replica != Some(request.received_by.as_str())
            || at.and_then(|a| a.parse::<u64>().ok()) != Some(request.at_ms)
        {
            return Err(format!(
                "its key is not one replica {:?} writes for an action received at {}",
                request.received_by, request.at_ms
            ));
        }
        let member = super::member_key(&self.prefix, &self.name, &request.received_by);
        let resp = self
            .bounded(
                "reading the member",
                client.get(member, Some(GetOptions::new().with_count_only())),
            )
            .await?;
        if resp.count() == 0 {
            return Err(format!(
                "replica {:?} is not a live member of the cluster",
                request.received_by
            ));
        }
        Ok(())
    }

    /// Puts `value` at `key`, keeping its lease, if its mod revision is still
    /// `revision`: the new revision, or `None` when it was not.
    async fn put_if(
        &self,
        client: &mut Client,
        key: &[u8],
        value: Vec<u8>,
        revision: i64,
        what: &str,
    ) -> Result<Option<i64>, String> {
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.to_vec(),
                CompareOp::Equal,
                revision,
            )])
            .and_then(vec![TxnOp::put(
                key.to_vec(),
                value,
                Some(PutOptions::new().with_ignore_lease()),
            )]);
        let resp = self.bounded(what, client.txn(txn)).await?;
        Ok(resp
            .succeeded()
            .then(|| resp.header().map_or(0, |h| h.revision())))
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
            claimed_by: None,
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

    use crate::config::EtcdConfig;
    use crate::door::Command;
    use crate::store::etcd::tests::RealEtcd;
    use std::sync::Mutex;

    /// What the fake cycle loop answers an action with.
    type Reply = Arc<dyn Fn(&Ownership, &Act) -> Result<Actions, ActError> + Send + Sync>;

    /// An owner `r1` of every service (its cycle loop a fake that records each action
    /// it is asked to apply), on a real etcd, with members `r2` and `r3`.
    struct Rig {
        _etcd: RealEtcd,
        _dir: tempfile::TempDir,
        raw: Client,
        answerer: Answerer,
        metrics: Arc<Metrics>,
        applied: Arc<Mutex<Vec<(String, String)>>>,
    }

    use ballast_balance::Act;

    async fn rig(reply: Reply) -> Rig {
        let etcd = RealEtcd::start();
        let mut raw = None;
        for _ in 0..100 {
            if let Ok(mut c) = Client::connect([etcd.url.as_str()], None).await {
                if c.get("/", None).await.is_ok() {
                    raw = Some(c);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut raw = raw.expect("etcd answers within 10 s");
        for member in ["r2", "r3"] {
            raw.put(
                crate::ownership::member_key("/t", "c", member),
                "addr",
                None,
            )
            .await
            .expect("member");
        }
        let ownership = Arc::new(Ownership::new("r1", 8));
        ownership.valid_until(Instant::now() + Duration::from_secs(600));
        for b in 0..8 {
            ownership.gained(b, 1);
        }
        let dir = tempfile::tempdir().expect("dir");
        let cfg = EtcdConfig {
            endpoints: vec![etcd.url.clone()],
            prefix: "/t".into(),
            ..EtcdConfig::default()
        };
        let store =
            Arc::new(EtcdStore::open(&cfg, dir.path().join("copy.json"), None).expect("opens"));
        let (door, mut inbox) = Door::new();
        let applied = Arc::new(Mutex::new(Vec::new()));
        let seen = applied.clone();
        let owned = ownership.clone();
        tokio::spawn(async move {
            while let Some(command) = inbox.recv().await {
                if let Command::Act(_, act, tx) = command {
                    let result = reply(&owned, &act);
                    if result.is_ok() {
                        seen.lock()
                            .expect("lock")
                            .push((act.action.label().to_string(), act.reason.clone()));
                    }
                    let _ = tx.send(result);
                }
            }
        });
        let metrics = Arc::new(Metrics::new());
        let answerer = Answerer::new(
            door,
            Arc::new(Audit::new(100)),
            ownership,
            metrics.clone(),
            &store,
            "c",
        );
        Rig {
            _etcd: etcd,
            _dir: dir,
            raw,
            answerer,
            metrics,
            applied,
        }
    }

    fn applies() -> Reply {
        Arc::new(|_, _| Ok(Actions::default()))
    }

    fn request(received_by: &str, action: Action, reason: &str, at_ms: u64) -> Request {
        Request {
            service: "web".into(),
            action,
            by: "alice".into(),
            via: "token".into(),
            from: None,
            reason: reason.into(),
            at_ms,
            received_by: received_by.into(),
            claimed_by: None,
            outcome: None,
        }
    }

    /// Writes `request` as replica `replica` would: its key, and the revision written.
    async fn write(raw: &mut Client, replica: &str, request: &Request) -> (String, i64) {
        let key = format!(
            "{}{replica}-{:013}-0",
            requests_prefix("/t", "c"),
            request.at_ms
        );
        let value = serde_json::to_vec(request).expect("json");
        let put = raw.put(key.clone(), value, None).await.expect("put");
        (key, put.header().expect("header").revision())
    }

    async fn stored(raw: &mut Client, key: &str) -> Request {
        let got = raw.get(key, None).await.expect("get");
        serde_json::from_slice(got.kvs().first().expect("stored").value()).expect("json")
    }

    fn drain() -> Action {
        Action::Drain { node: "n1".into() }
    }

    /// A request seen twice as first written (a watch event queued while a scan
    /// answered it, or a scan after an outcome write that failed) is applied once.
    #[tokio::test]
    async fn a_request_seen_twice_is_applied_once() {
        let mut rig = rig(applies()).await;
        let r = request("r2", drain(), "disk", 1);
        let value = serde_json::to_vec(&r).expect("json");
        let (key, rev) = write(&mut rig.raw, "r2", &r).await;
        let mut client = rig.raw.clone();
        let _ = rig
            .answerer
            .answer(&mut client, key.as_bytes(), &value, rev)
            .await;
        let _ = rig
            .answerer
            .answer(&mut client, key.as_bytes(), &value, rev)
            .await;
        assert_eq!(rig.applied.lock().expect("lock").len(), 1, "applied twice");
        let back = stored(&mut rig.raw, &key).await;
        assert!(back.outcome.is_some_and(|o| o.result.is_ok()), "answered");
    }

    /// Pending requests are applied in the order they were made, not their keys'.
    #[tokio::test]
    async fn pending_requests_are_applied_in_the_order_they_were_made() {
        let mut rig = rig(applies()).await;
        // Made first by r3, then by r2: r2's key sorts first.
        write(&mut rig.raw, "r3", &request("r3", drain(), "first", 2)).await;
        write(
            &mut rig.raw,
            "r2",
            &request("r2", Action::Undrain { node: "n1".into() }, "second", 2),
        )
        .await;
        let mut client = rig.raw.clone();
        let _ = rig.answerer.scan(&mut client).await;
        let reasons: Vec<String> = rig
            .applied
            .lock()
            .expect("lock")
            .iter()
            .map(|(_, r)| r.clone())
            .collect();
        assert_eq!(reasons, ["first", "second"]);
    }

    /// A refusal that only says the cycle loop is gone, or that the service was
    /// handed over meanwhile, is not an answer: the request stays for its owner.
    #[tokio::test]
    async fn a_temporary_refusal_leaves_the_request_for_the_owner() {
        for reply in [
            Arc::new(|_: &Ownership, _: &Act| Err(ActError::Unavailable)) as Reply,
            Arc::new(|o: &Ownership, _: &Act| {
                o.lost(o.bucket("web"));
                Err(ActError::UnknownService("web".into()))
            }),
        ] {
            let mut rig = rig(reply).await;
            let r = request("r2", drain(), "disk", 3);
            let value = serde_json::to_vec(&r).expect("json");
            let (key, rev) = write(&mut rig.raw, "r2", &r).await;
            let mut client = rig.raw.clone();
            let _ = rig
                .answerer
                .answer(&mut client, key.as_bytes(), &value, rev)
                .await;
            let back = stored(&mut rig.raw, &key).await;
            assert_eq!(back, r, "left as it was made, for the owner to apply");
        }
    }

    /// Requests that claim to come from another replica than the key's, from a
    /// replica that is not a member, or larger than a request may be, are refused.
    #[tokio::test]
    async fn forged_and_oversized_requests_are_refused() {
        let mut rig = rig(applies()).await;
        let forged = [
            ("r2", request("r3", drain(), "not r2's", 4)),
            ("r9", request("r9", drain(), "no member", 5)),
            (
                "r2",
                request("r2", drain(), &"x".repeat(MAX_REQUEST_BYTES), 6),
            ),
        ];
        let mut client = rig.raw.clone();
        for (replica, r) in forged {
            let value = serde_json::to_vec(&r).expect("json");
            let (key, rev) = write(&mut rig.raw, replica, &r).await;
            let _ = rig
                .answerer
                .answer(&mut client, key.as_bytes(), &value, rev)
                .await;
        }
        assert!(
            rig.applied.lock().expect("lock").is_empty(),
            "a forged request was applied"
        );
        assert_eq!(count(&rig.metrics, "refused_forged"), 2);
        assert_eq!(count(&rig.metrics, "refused_too_large"), 1);
    }

    fn count(metrics: &Metrics, outcome: &str) -> u64 {
        metrics
            .cluster_action_requests
            .get_or_create(&crate::metrics::RequestOutcome {
                outcome: outcome.into(),
            })
            .get()
    }

    /// What goes wrong with a request is counted: a value that is not a request, a
    /// claim that lost its compare, a request claimed by an owner that died before
    /// it answered (which is not applied again).
    #[tokio::test]
    async fn what_becomes_of_each_request_is_counted() {
        let mut rig = rig(applies()).await;
        let mut client = rig.raw.clone();
        let key = format!("{}r2-0000000000007-0", requests_prefix("/t", "c"));
        let put = rig
            .raw
            .put(key.clone(), "{not json", None)
            .await
            .expect("put");
        let rev = put.header().expect("header").revision();
        rig.answerer
            .answer(&mut client, key.as_bytes(), b"{not json", rev)
            .await;
        assert_eq!(count(&rig.metrics, "unparseable"), 1);

        // Seen as first written after it changed: its claim loses the compare.
        let r = request("r2", drain(), "stale", 8);
        let value = serde_json::to_vec(&r).expect("json");
        let (key, rev) = write(&mut rig.raw, "r2", &r).await;
        write(&mut rig.raw, "r2", &r).await;
        rig.answerer
            .answer(&mut client, key.as_bytes(), &value, rev)
            .await;
        assert_eq!(count(&rig.metrics, "claim_lost"), 1);

        let mut r = request("r2", drain(), "claimed", 9);
        r.claimed_by = Some("r3".into());
        let value = serde_json::to_vec(&r).expect("json");
        let (key, rev) = write(&mut rig.raw, "r2", &r).await;
        rig.answerer
            .answer(&mut client, key.as_bytes(), &value, rev)
            .await;
        assert_eq!(count(&rig.metrics, "claimed_unanswered"), 1);
        // Its own claim, seen in its watch, is not an owner that died.
        let mut r = request("r2", drain(), "mine", 12);
        r.claimed_by = Some("r1".into());
        let value = serde_json::to_vec(&r).expect("json");
        let (key, rev) = write(&mut rig.raw, "r2", &r).await;
        rig.answerer
            .answer(&mut client, key.as_bytes(), &value, rev)
            .await;
        assert_eq!(count(&rig.metrics, "claimed_unanswered"), 1);
        assert!(rig.applied.lock().expect("lock").is_empty(), "applied");
        assert_eq!(count(&rig.metrics, "applied"), 0);
    }

    /// The cluster task never waits for the answering task: past the queue's bound,
    /// requests are left for a scan, which the answering task makes once it has
    /// caught up, and each is applied once.
    #[tokio::test]
    async fn a_flood_of_requests_never_holds_the_cluster_task() {
        let mut rig = rig(applies()).await;
        let r = request("r2", drain(), "flood", 10);
        let value = serde_json::to_vec(&r).expect("json");
        let (key, rev) = write(&mut rig.raw, "r2", &r).await;
        let answering = rig.answerer.answering();
        let started = Instant::now();
        for _ in 0..QUEUE + 10 {
            answering.request(key.as_bytes(), &value, rev);
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(count(&rig.metrics, "queue_full"), 10);
        let r2 = request("r3", drain(), "left for the scan", 11);
        write(&mut rig.raw, "r3", &r2).await;
        let task = tokio::spawn(rig.answerer.run());
        drop(answering);
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the answering task ends with its senders")
            .expect("it does not panic");
        let reasons: Vec<String> = rig
            .applied
            .lock()
            .expect("lock")
            .iter()
            .map(|(_, r)| r.clone())
            .collect();
        assert_eq!(reasons, ["flood", "left for the scan"]);
    }
}
