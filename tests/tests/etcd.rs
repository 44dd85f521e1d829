//! Scenario: the etcd routing store, against a real etcd (Debian's `etcd-server`).
//!
//! Each test starts its own etcd on free loopback ports with a temporary data directory,
//! and aggregators that keep their weights there (`--etcd`, `--etcd-prefix`):
//!
//! - a watcher (`etcdctl watch`) sees the service's key change as the fleet converges,
//!   each value a full snapshot with a higher version, equal to what the API served;
//! - an aggregator started afresh (empty local directory) on the same etcd serves the
//!   stored weights right away;
//! - etcd killed mid-run stops nothing: the API and the agents keep getting new
//!   weights, `/healthz` and the write counter report the failure, and once etcd is
//!   back the key catches up with what changed while it was away (a drain).
//!
//! - against an etcd secured as production runs it (`https://`, client certificates
//!   required, users), an aggregator with the CA, a client certificate and a user stores
//!   and restores weights; one without the certificate, or with a wrong password,
//!   starts, writes nothing, and `/healthz` says why;
//! - a corrupt key is skipped, logged and counted, and the other services restore;
//! - an aggregator started while etcd is down starts, serves its local copy, says so
//!   in `/healthz`, and writes to etcd once etcd is back;
//! - a service near etcd's request limit is written whole, one over it in chunks
//!   behind a manifest (the previous generation's chunks deleted, the value restored
//!   whole after a restart), and one over the largest value stored is refused, counted
//!   and shown, holding back no other.
//!
//! The aggregator binary must be built with the feature:
//! `cargo build --workspace --bins --features ballast-aggregator/etcd`.

use ballast_aggregator::store::chunks::{chunks_prefix, generation_prefix, Manifest};
use ballast_tests::*;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Duration;

const NODES: usize = 4;
const SPEEDS: &[f64] = &[0.6, 1.0, 1.5];

fn key(prefix: &str, service: &str) -> String {
    format!("{prefix}/services/{service}")
}

/// Starts an aggregator on `etcd` under `prefix`, failing clearly if the binary lacks
/// the etcd feature.
fn start_aggregator(pki: &Pki, etcd: &Etcd, prefix: &str, opts: AggregatorOpts) -> Aggregator {
    let opts = opts.etcd(&etcd.endpoint(), prefix);
    match std::panic::catch_unwind(AssertUnwindSafe(|| Aggregator::start(pki, opts))) {
        Ok(agg) => agg,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            if msg.contains("without the etcd feature") || msg.contains("unexpected argument") {
                panic!(
                    "the ballast-aggregator binary was built without the etcd feature; build \
                     it with `cargo build --workspace --bins --features ballast-aggregator/etcd`\n\
                     {msg}"
                );
            }
            std::panic::resume_unwind(panic)
        }
    }
}

/// A stored snapshot: version and the endpoints' (weight, draining, address).
#[derive(Debug, Clone, PartialEq)]
struct Stored {
    version: u64,
    cycle: u64,
    endpoints: BTreeMap<String, (f64, bool, String)>,
}

/// Parses a value the store wrote; `Err` says what is wrong with it.
fn parse_stored(value: &str) -> Result<Stored, String> {
    let v: serde_json::Value =
        serde_json::from_str(value).map_err(|e| format!("not JSON ({e}): {value}"))?;
    let version = v["version"].as_u64().ok_or("no version")?;
    let cycle = v["cycle"].as_u64().ok_or("no cycle")?;
    let mut endpoints = BTreeMap::new();
    for (node, e) in v["endpoints"].as_object().ok_or("no endpoints")? {
        let weight = e["weight"].as_f64().ok_or("no weight")?;
        let draining = e["draining"].as_bool().ok_or("no draining")?;
        let address = e["address"].as_str().ok_or("no address")?.to_string();
        e["zone"].as_str().ok_or("no zone")?;
        endpoints.insert(node.clone(), (weight, draining, address));
    }
    Ok(Stored {
        version,
        cycle,
        endpoints,
    })
}

fn stored_in(etcd: &Etcd, prefix: &str, service: &str) -> Result<Stored, String> {
    let value = etcd
        .try_ctl(&["get", &key(prefix, service), "--print-value-only"])?
        .trim_end()
        .to_string();
    if value.is_empty() {
        return Err("no key yet".into());
    }
    parse_stored(&value)
}

/// The API's weights as the store would hold them.
fn served(agg: &Aggregator, service: &str) -> Stored {
    try_served(agg, service).unwrap_or_else(|e| panic!("{e}"))
}

/// [`served`], or why not (the service is not published yet).
fn try_served(agg: &Aggregator, service: &str) -> Result<Stored, String> {
    let w = agg.try_weights(service)?;
    Ok(Stored {
        version: w.version,
        cycle: w.cycle,
        endpoints: w
            .weights
            .into_iter()
            .map(|(n, e)| (n, (e.weight, e.draining, e.address)))
            .collect(),
    })
}

fn same_endpoints(a: &Stored, b: &Stored) -> Result<(), String> {
    if a.endpoints.len() != b.endpoints.len()
        || a.endpoints
            .keys()
            .zip(b.endpoints.keys())
            .any(|(x, y)| x != y)
    {
        return Err(format!("different nodes: {a:?} vs {b:?}"));
    }
    for (node, (wa, da, aa)) in &a.endpoints {
        let (wb, db, ab) = &b.endpoints[node];
        if (wa - wb).abs() > 1e-9 || da != db || aa != ab {
            return Err(format!("{node}: {wa} {da} {aa} vs {wb} {db} {ab}"));
        }
    }
    Ok(())
}

#[test]
fn a_watcher_sees_each_cycles_changes() {
    const SERVICE: &str = "watched";
    let prefix = "/ballast-watch";
    let etcd = Etcd::start();
    let watch = etcd.watch(&format!("{prefix}/services/"));
    let pki = Pki::new();
    let agg = start_aggregator(&pki, &etcd, prefix, AggregatorOpts::default());
    let agents = start_fleet(&pki, &agg, SERVICE, NODES, SPEEDS);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }

    // The fleet converges: cycle after cycle the weights move, and each move is a put.
    let events = wait_for(Duration::from_secs(20), "6 puts of the service key", || {
        let events: Vec<WatchEvent> = watch
            .events()
            .into_iter()
            .filter(|e| e.key == key(prefix, SERVICE))
            .collect();
        if events.len() >= 6 {
            Ok(events)
        } else {
            Err(format!(
                "{} so far; etcdctl: {}",
                events.len(),
                watch.errors()
            ))
        }
    });
    let mut last_version = 0;
    for e in &events {
        assert_eq!(e.kind, "PUT", "{e:?}");
        let s = parse_stored(&e.value).unwrap_or_else(|m| panic!("bad stored value: {m}"));
        // Strictly increasing: only material changes are written, never one twice.
        assert!(
            s.version > last_version,
            "version {} after {last_version}: {events:?}",
            s.version
        );
        last_version = s.version;
        assert!(s.endpoints.len() <= NODES);
    }
    let keys: Vec<String> = watch.events().into_iter().map(|e| e.key).collect();
    assert!(
        keys.iter().all(|k| *k == key(prefix, SERVICE)),
        "one key per service and nothing else: {keys:?}"
    );

    // What the API served at some version is exactly what was stored at that version.
    let api = served(&agg, SERVICE);
    assert_eq!(api.endpoints.len(), NODES);
    let stored = wait_for(
        Duration::from_secs(5),
        "the watcher to see the version the API served",
        || {
            watch
                .events()
                .iter()
                .filter(|e| e.key == key(prefix, SERVICE))
                .filter_map(|e| parse_stored(&e.value).ok())
                .find(|s| s.version == api.version)
                .ok_or_else(|| format!("version {} not seen", api.version))
        },
    );
    same_endpoints(&stored, &api).unwrap_or_else(|e| panic!("stored vs served: {e}"));
}

#[test]
fn a_restarted_aggregator_restores_its_weights_from_etcd() {
    const SERVICE: &str = "restored";
    let prefix = "/ballast-restart";
    let etcd = Etcd::start();
    let pki = Pki::new();
    let mut first = start_aggregator(&pki, &etcd, prefix, AggregatorOpts::default());
    let agents = start_fleet(&pki, &first, SERVICE, NODES, SPEEDS);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    // Far enough from round robin that restored weights cannot be mistaken for new ones.
    wait_for(Duration::from_secs(25), "weights that follow speed", || {
        let w = try_served(&first, SERVICE)?;
        let (lo, hi) = w
            .endpoints
            .values()
            .fold((f64::MAX, f64::MIN), |(l, h), (x, _, _)| {
                (l.min(*x), h.max(*x))
            });
        if w.endpoints.len() == NODES && lo < 0.9 && hi > 1.1 {
            Ok(())
        } else {
            Err(format!("{w:?}"))
        }
    });
    let (status, killed) = first.stop();
    assert!(
        status.success() && !killed,
        "stop: {status}, killed {killed}"
    );
    drop(agents);
    let stored = stored_in(&etcd, prefix, SERVICE).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stored.endpoints.len(), NODES, "{stored:?}");

    // A new aggregator with a new, empty local directory, on the same etcd. The long
    // grace period keeps it from changing anything before we look.
    let second = start_aggregator(
        &pki,
        &etcd,
        prefix,
        AggregatorOpts::default().grace_ms(10_000),
    );
    assert!(
        !second.store_path().exists(),
        "the new aggregator must not have a local store file"
    );
    let health = second.health();
    assert_eq!(
        health.store,
        format!("etcd {} {prefix}", etcd.endpoint()),
        "{health:?}"
    );
    let restored = served(&second, SERVICE);
    assert_eq!(
        restored.version, stored.version,
        "{restored:?} vs {stored:?}"
    );
    assert_eq!(restored.cycle, stored.cycle, "{restored:?} vs {stored:?}");
    same_endpoints(&restored, &stored)
        .unwrap_or_else(|e| panic!("the API does not serve the weights from etcd: {e}"));
}

#[test]
fn etcd_going_away_does_not_stop_the_aggregator() {
    // "busy" keeps converging, so its weights change cycle after cycle. "solo" has one
    // node, whose weight is always the mean: it changes only when drained, so only the
    // catch-up of what failed can bring its drain to etcd.
    const BUSY: &str = "busy";
    const SOLO: &str = "solo";
    let prefix = "/ballast-outage";
    let mut etcd = Etcd::start();
    let pki = Pki::new();
    let agg = start_aggregator(&pki, &etcd, prefix, AggregatorOpts::default());
    let busy = start_fleet(&pki, &agg, BUSY, NODES, SPEEDS);
    let solo = start_fleet(&pki, &agg, SOLO, 1, &[1.0]).remove(0);
    for a in busy.iter().chain([&solo]) {
        a.wait_weight(Duration::from_secs(15));
    }
    for service in [BUSY, SOLO] {
        wait_for(Duration::from_secs(15), "a first write to etcd", || {
            stored_in(&etcd, prefix, service).map(|_| ())
        });
    }
    let ok = |agg: &Aggregator| agg.counter("ballast_store_writes_total", &[("reason", "ok")]);
    let errors =
        |agg: &Aggregator| agg.counter("ballast_store_writes_total", &[("reason", "error")]);
    assert!(ok(&agg) >= 1.0);
    assert_eq!(errors(&agg), 0.0, "no failed write while etcd is up");

    etcd.kill();
    let version_at_kill = agg.weights(BUSY).version;
    let replies_at_kill = busy[0].status().weight_unix_ms.unwrap_or(0);
    let solo_at_kill = served(&agg, SOLO);
    assert!(solo.drain().ok, "drain refused");

    // The store reports the failure; everything else goes on.
    let health = wait_for(
        Duration::from_secs(10),
        "/healthz to report the store",
        || {
            let h = agg.health();
            match &h.store_error {
                Some(e) if e.contains("etcd") => Ok(h),
                _ => Err(format!("{h:?}")),
            }
        },
    );
    assert_eq!(health.status, HealthStatus::Ok, "{health:?}");
    let errors_seen = errors(&agg);
    assert!(errors_seen >= 1.0, "no failed write counted");
    wait_for(
        Duration::from_secs(10),
        "new weights while etcd is down",
        || {
            let w = served(&agg, BUSY);
            let replies = busy[0].status().weight_unix_ms.unwrap_or(0);
            let drained = served(&agg, SOLO).endpoints[solo.node()].1;
            let more_errors = errors(&agg) > errors_seen;
            if w.version > version_at_kill && replies > replies_at_kill && drained && more_errors {
                Ok(())
            } else {
                Err(format!(
                    "{BUSY} version {} (at kill {version_at_kill}); agent's last weight at \
                 {replies} (at kill {replies_at_kill}); {SOLO} drained: {drained}; \
                 failed writes {} (first seen {errors_seen})",
                    w.version,
                    errors(&agg)
                ))
            }
        },
    );
    let solo_drained = served(&agg, SOLO);
    assert!(solo_drained.version > solo_at_kill.version);

    // etcd comes back on the same port and data directory. Both keys catch up: "busy"
    // through its next changes, "solo", which does not change again, through the
    // writes that failed being carried forward.
    etcd.restart();
    wait_for(Duration::from_secs(10), "the keys to catch up", || {
        let api = served(&agg, BUSY);
        let stored = stored_in(&etcd, prefix, BUSY)?;
        if stored.version < api.version {
            return Err(format!(
                "{BUSY}: stored {} < served {}",
                stored.version, api.version
            ));
        }
        let stored = stored_in(&etcd, prefix, SOLO)?;
        if stored.version != solo_drained.version {
            return Err(format!(
                "{SOLO}: stored {:?} vs served {solo_drained:?}",
                stored
            ));
        }
        same_endpoints(&stored, &solo_drained)
    });
    assert_eq!(
        served(&agg, SOLO).version,
        solo_drained.version,
        "{SOLO} changed again: the test would not show the catch-up"
    );

    // Writes succeed again and clear the reported error.
    let ok_before = ok(&agg);
    assert!(solo.undrain().ok, "undrain refused");
    wait_for(
        Duration::from_secs(10),
        "good writes to clear /healthz",
        || {
            let h = agg.health();
            if h.store_error.is_none() && ok(&agg) > ok_before {
                Ok(())
            } else {
                Err(format!("{h:?}"))
            }
        },
    );
}

/// `[store.etcd]` for a secured etcd: its endpoint and CA, the client certificate
/// unless `client_cert` is false, and `user` with the password in `password_file`.
/// (The file is checked on its own, so it names the https:// endpoint too.)
fn secured_toml(etcd: &Etcd, client_cert: bool, user: &str, password_file: &Path) -> String {
    let tls = etcd.tls();
    let mut toml = format!(
        "[store.etcd]\nendpoints = [{:?}]\nca_file = {:?}\nuser = {user:?}\n\
         password_file = {:?}\n",
        etcd.endpoint(),
        tls.ca,
        password_file
    );
    if client_cert {
        toml.push_str(&format!(
            "cert_file = {:?}\nkey_file = {:?}\n",
            tls.client_cert, tls.client_key
        ));
    }
    toml
}

/// A secured etcd with authentication on and user `ballast` (password `PASSWORD`)
/// allowed to read and write under `prefix`; the password is in the returned file.
fn secured_etcd(prefix: &str) -> (Etcd, PathBuf) {
    let mut etcd = Etcd::start_tls();
    etcd.enable_auth("root-password");
    etcd.add_user("ballast", PASSWORD, prefix);
    let password = etcd.scratch_dir().join("ballast.password");
    std::fs::write(&password, format!("{PASSWORD}\n")).expect("write the password file");
    std::fs::set_permissions(&password, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the password file");
    (etcd, password)
}

const PASSWORD: &str = "s3cret-for-ballast";

/// `/healthz` once its `store_error` contains `needle`.
fn wait_store_error(agg: &Aggregator, needle: &str, timeout: Duration) -> Health {
    wait_for(timeout, &format!("/healthz to report {needle:?}"), || {
        let h = agg.health();
        match &h.store_error {
            Some(e) if e.contains(needle) => Ok(h),
            _ => Err(format!("{h:?}")),
        }
    })
}

#[test]
fn a_secured_etcd_stores_and_restores_weights() {
    const SERVICE: &str = "secure";
    let prefix = "/ballast-tls";
    let (etcd, password) = secured_etcd(prefix);
    assert!(etcd.endpoint().starts_with("https://"));
    let pki = Pki::new();
    let toml = secured_toml(&etcd, true, "ballast", &password);
    let opts = AggregatorOpts {
        config_toml: Some(toml.clone()),
        ..AggregatorOpts::default()
    };
    let mut first = start_aggregator(&pki, &etcd, prefix, opts);
    let agents = start_fleet(&pki, &first, SERVICE, 2, SPEEDS);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(
        Duration::from_secs(15),
        "both endpoints stored in etcd over TLS",
        || {
            let s = stored_in(&etcd, prefix, SERVICE)?;
            if s.endpoints.len() == 2 {
                Ok(())
            } else {
                Err(format!("{s:?}"))
            }
        },
    );
    let health = first.health();
    assert!(health.store_error.is_none(), "{health:?}");
    let (status, killed) = first.stop();
    assert!(
        status.success() && !killed,
        "stop: {status}, killed {killed}"
    );
    drop(agents);
    let stored = stored_in(&etcd, prefix, SERVICE).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        stored.version >= 1 && stored.endpoints.len() == 2,
        "{stored:?}"
    );

    // A new aggregator with an empty local directory restores them from etcd.
    let second = start_aggregator(
        &pki,
        &etcd,
        prefix,
        AggregatorOpts {
            config_toml: Some(toml),
            ..AggregatorOpts::default().grace_ms(10_000)
        },
    );
    let restored = served(&second, SERVICE);
    assert_eq!(
        restored.version, stored.version,
        "{restored:?} vs {stored:?}"
    );
    same_endpoints(&restored, &stored)
        .unwrap_or_else(|e| panic!("the API does not serve the weights from etcd: {e}"));
    let health = second.health();
    assert!(health.store_error.is_none(), "{health:?}");
}

#[test]
fn a_secured_etcd_refuses_a_missing_client_certificate_and_a_wrong_password() {
    let prefix = "/ballast-refused";
    let (etcd, password) = secured_etcd(prefix);
    let wrong = etcd.scratch_dir().join("wrong.password");
    std::fs::write(&wrong, "not-the-password\n").expect("write");
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let pki = Pki::new();
    let cases = [
        (
            "no-cert",
            secured_toml(&etcd, false, "ballast", &password),
            "client certificate",
        ),
        (
            "wrong-password",
            secured_toml(&etcd, true, "ballast", &wrong),
            "wrong user or password",
        ),
    ];
    for (service, toml, why) in cases {
        let agg = start_aggregator(
            &pki,
            &etcd,
            prefix,
            AggregatorOpts {
                config_toml: Some(toml),
                ..AggregatorOpts::default()
            },
        );
        // It starts, and balances; the store says why it cannot write.
        let agent = start_fleet(&pki, &agg, service, 1, &[1.0]).remove(0);
        agent.wait_weight(Duration::from_secs(15));
        let health = wait_store_error(&agg, why, Duration::from_secs(15));
        assert_eq!(health.status, HealthStatus::Ok, "{health:?}");
        assert_eq!(
            health.store_writer.status,
            StoreCondition::Error,
            "{health:?}"
        );
        wait_for(Duration::from_secs(10), "a failed write counted", || {
            let errors = agg.counter("ballast_store_writes_total", &[("reason", "error")]);
            if errors >= 1.0 {
                Ok(())
            } else {
                Err(format!("{errors}"))
            }
        });
        assert_eq!(
            etcd.get(&key(prefix, service)),
            None,
            "{service}: etcd took a write it should have refused"
        );
    }
}

#[test]
fn a_corrupt_key_is_skipped_and_the_other_services_restore() {
    let prefix = "/ballast-corrupt";
    let etcd = Etcd::start();
    let good = serde_json::json!({
        "version": 7,
        "cycle": 40,
        "endpoints": {
            "g1": {"address": "127.0.0.1:8001", "zone": "z1", "draining": false,
                   "weight": 1.4, "strategy_weights": {"pid": 1.4, "round_robin": 1.0}},
            "g2": {"address": "127.0.0.1:8002", "zone": "z1", "draining": false,
                   "weight": 0.6, "strategy_weights": {"pid": 0.6, "round_robin": 1.0}},
        }
    });
    let with = |path: &[&str], value: serde_json::Value| {
        let mut v = good.clone();
        let mut at = &mut v;
        for p in path {
            at = &mut at[*p];
        }
        *at = value;
        v.to_string()
    };
    let mut renamed = good.clone();
    let g1 = renamed["endpoints"]["g1"].take();
    renamed["endpoints"] = serde_json::json!({ "g 1": g1 });
    let keys = [
        ("good", good.to_string(), None),
        (
            "bad-json",
            "{\"version\": 3, \"endpoints\": {".to_string(),
            Some("unparseable"),
        ),
        (
            "bad-weight",
            with(&["endpoints", "g1", "weight"], (-1.0).into()),
            Some("weight"),
        ),
        (
            "bad-address",
            with(&["endpoints", "g2", "address"], "nowhere".into()),
            Some("address"),
        ),
        ("bad-node", renamed.to_string(), Some("node")),
        ("bad name", good.to_string(), Some("service")),
    ];
    for (service, value, _) in &keys {
        etcd.try_ctl(&["put", &key(prefix, service), value])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let pki = Pki::new();
    // The long grace period keeps the restored weights as they are while we look.
    let agg = start_aggregator(
        &pki,
        &etcd,
        prefix,
        AggregatorOpts::default().grace_ms(10_000),
    );
    let names: Vec<String> = agg.services().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["good"], "only the valid service is restored");
    let restored = served(&agg, "good");
    assert_eq!((restored.version, restored.cycle), (7, 40), "{restored:?}");
    assert_eq!(restored.endpoints["g1"].0, 1.4);
    assert_eq!(restored.endpoints["g2"].0, 0.6);
    for (service, _, reason) in &keys {
        let Some(reason) = reason else { continue };
        assert_eq!(
            agg.counter("ballast_store_corrupt_total", &[("reason", reason)]),
            1.0,
            "{service}: {reason}"
        );
        let k = key(prefix, service);
        assert!(
            agg.log()
                .lines()
                .any(|l| l.contains("corrupt key") && l.contains(&k)),
            "no log line names {k}:\n{}",
            agg.log()
        );
    }
    assert_eq!(agg.counter("ballast_store_corrupt_total", &[]), 5.0);
    let health = agg.health();
    assert!(health.store_error.is_none(), "{health:?}");
}

#[test]
fn an_aggregator_started_while_etcd_is_down_serves_its_local_copy() {
    const KEPT: &str = "kept";
    const LATE: &str = "late";
    let prefix = "/ballast-down";
    let mut etcd = Etcd::start();
    let pki = Pki::new();
    let mut agg = start_aggregator(&pki, &etcd, prefix, AggregatorOpts::default());
    let copy_path = agg.store_path().with_extension("etcd-copy.json");
    let agents = start_fleet(&pki, &agg, KEPT, 2, SPEEDS);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(
        Duration::from_secs(15),
        "both endpoints in etcd and in the local copy",
        || {
            let stored = stored_in(&etcd, prefix, KEPT)?;
            let copy: serde_json::Value = std::fs::read_to_string(&copy_path)
                .map_err(|e| format!("{}: {e}", copy_path.display()))
                .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))?;
            let copied = copy["services"][KEPT]["version"].as_u64();
            if stored.endpoints.len() == 2 && copied == Some(stored.version) {
                Ok(())
            } else {
                Err(format!("etcd {stored:?}, copy {copy}"))
            }
        },
    );
    let (status, killed) = agg.stop();
    assert!(
        status.success() && !killed,
        "stop: {status}, killed {killed}"
    );
    drop(agents);
    let stored = stored_in(&etcd, prefix, KEPT).unwrap_or_else(|e| panic!("{e}"));

    // etcd goes down; the aggregator restarts (as systemd would) and must not exit.
    etcd.kill();
    agg.restart();
    let restored = served(&agg, KEPT);
    assert_eq!(
        restored.version, stored.version,
        "{restored:?} vs {stored:?}"
    );
    same_endpoints(&restored, &stored)
        .unwrap_or_else(|e| panic!("the local copy is not what is served: {e}"));
    let health = wait_store_error(&agg, "local copy", Duration::from_secs(5));
    assert_eq!(health.status, HealthStatus::Ok, "{health:?}");
    assert_eq!(
        health.store_writer.status,
        StoreCondition::Error,
        "{health:?}"
    );

    // A service that starts during the outage is balanced, and waits for etcd.
    let late = start_fleet(&pki, &agg, LATE, 1, &[1.0]).remove(0);
    late.wait_weight(Duration::from_secs(15));
    let late_served = wait_for(
        Duration::from_secs(10),
        "the late service published",
        || try_served(&agg, LATE),
    );

    // etcd comes back: the aggregator reads it, and writes what it holds.
    etcd.restart();
    wait_for(Duration::from_secs(15), "the late service in etcd", || {
        let s = stored_in(&etcd, prefix, LATE)?;
        if s.version >= late_served.version {
            Ok(())
        } else {
            Err(format!("{s:?} vs served {late_served:?}"))
        }
    });
    wait_for(Duration::from_secs(10), "/healthz to clear", || {
        let h = agg.health();
        if h.store_error.is_none() {
            Ok(())
        } else {
            Err(format!("{h:?}"))
        }
    });
    let kept = stored_in(&etcd, prefix, KEPT).unwrap_or_else(|e| panic!("{e}"));
    assert!(kept.version >= stored.version, "{kept:?} vs {stored:?}");
}

#[test]
fn a_service_over_etcds_request_limit_is_stored_in_chunks_and_one_too_large_holds_back_no_other() {
    let prefix = "/ballast-large";
    let mut etcd = Etcd::start();
    // Values put by hand: one near etcd's 1.5 MiB request limit, one over it, and one
    // over the largest value the store is configured to write (2 MB here), put
    // through an etcd whose limit is raised for the purpose and then restarted with
    // its default, as after a change of settings. (`etcdctl` sends at most 2 MiB.) The
    // aggregator's own values are about 13 % larger than these (every strategy's
    // weight, at full precision): over's becomes 1.87 MB, under the limit, and huge's
    // 2.1 MB, over it.
    const MAX_VALUE: usize = 2_000_000;
    let near = endpoints_for(1_150_000);
    let over = endpoints_for(1_650_000);
    let huge = endpoints_for(1_860_000);
    etcd.kill();
    etcd.restart_with(&["--max-request-bytes", "4194304"]);
    for (service, n) in [("near", near), ("over", over), ("huge", huge)] {
        etcd.put_large(&key(prefix, service), &snapshot_value(n, 7));
    }
    etcd.kill();
    etcd.restart_with(&[]);
    let huge_before = etcd.get(&key(prefix, "huge")).expect("the huge value");
    eprintln!(
        "stored by hand: near {near} endpoints, over {over}, huge {huge} ({} bytes)",
        huge_before.len()
    );

    let pki = Pki::new();
    let opts = AggregatorOpts {
        config_toml: Some(format!("[store.etcd]\nmax_value_bytes = {MAX_VALUE}\n")),
        ..AggregatorOpts::default()
    };
    let mut agg = start_aggregator(&pki, &etcd, prefix, opts);
    // All three are restored whole and served.
    for (service, n) in [("near", near), ("over", over), ("huge", huge)] {
        let w = wait_for(
            Duration::from_secs(20),
            &format!("{service} restored"),
            || try_served(&agg, service),
        );
        assert_eq!(w.endpoints.len(), n, "{service}: restored endpoints");
    }
    // An agent joins each, and one more serves a small service.
    let mut agents = Vec::new();
    for service in ["near", "over", "huge", "small"] {
        pki.issue_nodes_for(service, &[&format!("{service}-agent")]);
        agents.push(Agent::start(
            &pki,
            &agg,
            AgentOpts::new(service, &format!("{service}-agent")),
        ));
    }
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }

    // The service near the limit is written whole with its new endpoint (1.3 MB in one
    // request), the one over it in chunks, and the small one beside them.
    let with_agent = |service: &str, n: usize| -> Result<Stored, String> {
        let s = parse_stored(&etcd.get_service(prefix, service)?)?;
        if s.endpoints.len() == n && s.endpoints.contains_key(&format!("{service}-agent")) {
            Ok(s)
        } else {
            Err(format!("{} endpoints", s.endpoints.len()))
        }
    };
    for (service, n) in [("near", near + 1), ("over", over + 1), ("small", 1)] {
        wait_for(
            Duration::from_secs(20),
            &format!("etcd to hold {service} with its agent"),
            || with_agent(service, n),
        );
    }
    let near_key = etcd.get(&key(prefix, "near")).expect("near");
    assert!(
        Manifest::parse(near_key.as_bytes()).is_none() && near_key.len() > 1_000_000,
        "near is stored whole in its key"
    );
    let manifest = Manifest::parse(etcd.get(&key(prefix, "over")).expect("over").as_bytes())
        .expect("over's key holds a manifest");
    assert_eq!(manifest.chunks, 2, "{manifest:?}");
    assert!(manifest.bytes > 1_650_000, "{manifest:?}");

    // The one over the largest value stored is refused, counted and shown, and etcd
    // keeps its last value; the aggregator still serves it with its new endpoint, and
    // the store is healthy.
    let health = wait_for(
        Duration::from_secs(20),
        "the refusal to be shown in /healthz",
        || {
            let h = agg.health();
            let size = h.store_writer.too_large.get("huge").copied().unwrap_or(0);
            if size > MAX_VALUE {
                Ok(h)
            } else {
                Err(format!("{h:?}"))
            }
        },
    );
    assert_eq!(
        health.store_writer.status,
        StoreCondition::Ok,
        "one service too large is not a failing store: {health:?}"
    );
    let too_large = &health.store_writer.too_large;
    assert_eq!(too_large.len(), 1, "only huge is too large: {health:?}");
    assert!(agg.counter("ballast_store_refused_total", &[("reason", "too_large")]) >= 1.0);
    assert_eq!(agg.counter("ballast_store_too_large", &[]), 1.0);
    assert_eq!(
        etcd.get(&key(prefix, "huge")).as_deref(),
        Some(huge_before.as_str()),
        "etcd keeps the last value that fitted"
    );
    let served_huge = served(&agg, "huge");
    assert_eq!(served_huge.endpoints.len(), huge + 1);
    assert!(served_huge.endpoints.contains_key("huge-agent"));
    // The refusal is logged once, as an error naming the service.
    let log = agg.log();
    assert_eq!(
        log.matches("service too large for etcd").count(),
        1,
        "logged once:\n{log}"
    );

    // Written again in chunks (its agent drains), the previous generation's chunks
    // are gone: one generation is kept a service.
    assert!(agents[1].drain().ok, "drain refused");
    let last = wait_for(
        Duration::from_secs(20),
        "a second chunked write of over",
        || {
            let m = Manifest::parse(etcd.get(&key(prefix, "over")).ok_or("gone")?.as_bytes())
                .ok_or("not a manifest")?;
            (m.generation != manifest.generation)
                .then_some(m)
                .ok_or("the same generation".to_string())
        },
    );
    let chunk_keys = etcd
        .try_ctl(&[
            "get",
            "--prefix",
            "--keys-only",
            &chunks_prefix(prefix, "over"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    let chunk_keys: Vec<&str> = chunk_keys.lines().filter(|l| !l.is_empty()).collect();
    let first = generation_prefix(prefix, "over", &manifest.generation);
    assert!(
        !chunk_keys.is_empty() && !chunk_keys.iter().any(|k| k.starts_with(&first)),
        "the first generation's chunks are still there after {}: {chunk_keys:?}",
        last.generation
    );

    // A restart restores the chunked service whole, with its agent.
    agg.restart();
    let restored = wait_for(Duration::from_secs(20), "over restored", || {
        try_served(&agg, "over")
    });
    assert!(
        restored.endpoints.len() >= over,
        "over restored with {} endpoints",
        restored.endpoints.len()
    );
    wait_for(
        Duration::from_secs(20),
        "over served with its agent after the restart",
        || {
            let s = try_served(&agg, "over")?;
            (s.endpoints.len() == over + 1 && s.endpoints.contains_key("over-agent"))
                .then_some(())
                .ok_or(format!("{} endpoints", s.endpoints.len()))
        },
    );
}
