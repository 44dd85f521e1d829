//! Scenarios: the per-service config directory of a running aggregator.
//!
//! Each service team owns one file. The aggregator merges the directory live: an edit
//! takes effect without a restart, a bad file is refused with its file and line while
//! its last good version stays in force, a deleted file leaves a tombstone that a
//! restored file revives, and the merged config is backed up and can be restored with
//! one command. `config check` validates a directory offline for CI pipelines.

use ballast_tests::harness::api::ServiceConfigView;
use ballast_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// Looks a service up in `GET /v1/config`; a trait because the view is the
/// aggregator's own type.
trait ServiceLookup {
    fn service(&self, name: &str) -> Option<&ServiceConfigView>;
}

impl ServiceLookup for ConfigView {
    fn service(&self, name: &str) -> Option<&ServiceConfigView> {
        self.services.iter().find(|s| s.name == name)
    }
}

/// A service's `missing_threshold` in force, as the API reports it.
fn threshold(agg: &Aggregator, service: &str) -> Option<f64> {
    Some(agg.config().service(service)?.params.missing_threshold)
}

/// An aggregator that rescans its directory every 200 ms (file events usually come
/// sooner) and keeps tombstones for `ttl_s`.
fn start(pki: &Pki, dir: &Path, ttl_s: u64) -> Aggregator {
    let opts = AggregatorOpts {
        config_toml: Some(format!(
            "[service_config]\nrescan_ms = 200\ntombstone_ttl_s = {ttl_s}\nbackup_interval_s = 60\n"
        )),
        ..AggregatorOpts::default().config_dir(dir)
    };
    Aggregator::start(pki, opts)
}

#[test]
fn an_edit_applies_live_and_a_bad_file_keeps_the_last_good_version() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("web.toml"),
        "[balance]\nmissing_threshold = 0.2\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("db.toml"), "").expect("write");
    let agg = start(&pki, dir.path(), 3600);

    let view = agg.config();
    assert_eq!(view.dir.as_deref(), dir.path().to_str());
    assert_eq!(threshold(&agg, "web"), Some(0.2), "{view:?}");
    assert_eq!(threshold(&agg, "db"), Some(0.15), "db follows the defaults");

    // An edit takes effect without a restart.
    std::fs::write(
        dir.path().join("web.toml"),
        "[balance]\nmissing_threshold = 0.25\n",
    )
    .expect("write");
    wait_until(WAIT, "the edit in force", || {
        (threshold(&agg, "web") == Some(0.25)).then_some(())
    });

    // A broken edit is refused with file, line and reason; the last good version stays,
    // and the other service's edit still applies.
    std::fs::write(
        dir.path().join("web.toml"),
        "[balance]\n# a typo\nmissing_treshold = 0.3\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("db.toml"),
        "[balance]\nmissing_threshold = 0.1\n",
    )
    .expect("write");
    let err = wait_until(WAIT, "web.toml refused", || {
        agg.config()
            .errors
            .into_iter()
            .find(|e| e.file == "web.toml")
    });
    assert_eq!(err.line, Some(3), "{err:?}");
    assert!(err.message.contains("missing_treshold"), "{err:?}");
    wait_until(WAIT, "db's edit in force", || {
        (threshold(&agg, "db") == Some(0.1)).then_some(())
    });
    let view = agg.config();
    let web = view.service("web").expect("web still configured");
    assert!(web.file_refused);
    assert_eq!(web.params.missing_threshold, 0.25);
    assert!(agg.counter("ballast_config_rejected_total", &[("file", "web.toml")]) >= 1.0);
    assert!(
        agg.log().contains("web.toml"),
        "the refusal is logged with the file"
    );

    // Hostile input: a huge file and a file for an invalid service name.
    std::fs::write(dir.path().join("huge.toml"), vec![b'#'; 1 << 20]).expect("write");
    std::fs::write(dir.path().join("bad name.toml"), "").expect("write");
    wait_until(WAIT, "both refused", || {
        let errors = agg.config().errors;
        let files: Vec<&str> = errors.iter().map(|e| e.file.as_str()).collect();
        (files.contains(&"huge.toml") && files.contains(&"bad name.toml")).then_some(())
    });
    assert!(agg.get("/healthz").0 == 200, "still serving");

    // Fixed: the error goes and the new version is in force.
    std::fs::write(
        dir.path().join("web.toml"),
        "[balance]\nmissing_threshold = 0.3\n",
    )
    .expect("write");
    wait_until(WAIT, "the fix in force", || {
        let view = agg.config();
        let ok = view.service("web").is_some_and(|s| !s.file_refused)
            && !view.errors.iter().any(|e| e.file == "web.toml");
        (ok && threshold(&agg, "web") == Some(0.3)).then_some(())
    });
    assert!(agg.counter("ballast_config_reloads_total", &[("reason", "applied")]) >= 3.0);
}

#[test]
fn a_deleted_file_leaves_a_tombstone_that_revives_or_expires() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let text = "[balance]\nmissing_threshold = 0.2\n";
    std::fs::write(dir.path().join("web.toml"), text).expect("write");
    std::fs::write(dir.path().join("db.toml"), text).expect("write");
    let agg = start(&pki, dir.path(), 3);

    std::fs::remove_file(dir.path().join("web.toml")).expect("rm");
    let web = wait_until(WAIT, "web tombstoned", || {
        agg.config()
            .services
            .into_iter()
            .find(|s| s.name == "web" && s.status == "tombstone")
    });
    assert!(web.expires_unix_ms.is_some());
    assert_eq!(
        web.params.missing_threshold, 0.2,
        "a tombstone keeps its config in force"
    );

    // Put back within the period: revived.
    std::fs::write(dir.path().join("web.toml"), text).expect("write");
    wait_until(WAIT, "web revived", || {
        agg.config()
            .service("web")
            .is_some_and(|s| s.status == "active")
            .then_some(())
    });

    // Deleted and left: after the 3 s period the entry is gone and defaults apply.
    std::fs::remove_file(dir.path().join("db.toml")).expect("rm");
    wait_until(WAIT, "db tombstoned", || {
        agg.config()
            .service("db")
            .is_some_and(|s| s.status == "tombstone")
            .then_some(())
    });
    wait_until(WAIT, "db's tombstone expired", || {
        agg.config().service("db").is_none().then_some(())
    });
    assert!(agg.log().contains("tombstone expired"));

    // A file deleted while the aggregator was down is a tombstone after the restart:
    // the merged config persists.
    let mut agg = agg;
    agg.stop();
    std::fs::remove_file(dir.path().join("web.toml")).expect("rm");
    agg.restart();
    let view = agg.config();
    let web = view.service("web").expect("web kept across the restart");
    assert_eq!(web.status, "tombstone");
}

#[test]
fn a_backup_restores_the_directory_with_one_command() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let web = "# owned by team web\n[balance]\nmissing_threshold = 0.2\n";
    std::fs::write(dir.path().join("web.toml"), web).expect("write");
    let agg = start(&pki, dir.path(), 3600);
    let backups = agg
        .store_path()
        .parent()
        .expect("store dir")
        .join("config-backups");
    let backup = wait_until(WAIT, "a backup at start", || {
        std::fs::read_dir(&backups)
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "json"))
    });

    // Somebody wipes the directory; one command puts it back, comments and all.
    std::fs::remove_file(dir.path().join("web.toml")).expect("rm");
    std::fs::write(dir.path().join("stray.toml"), "").expect("write");
    let out = run_bounded(
        {
            let mut c = command(AGGREGATOR_BIN);
            c.args(["config", "restore"])
                .arg(&backup)
                .arg("--to")
                .arg(dir.path())
                .arg("--exact");
            c
        },
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{out:?}");
    let restored = std::fs::read_to_string(dir.path().join("web.toml")).expect("restored");
    assert_eq!(restored, web);
    assert!(
        !dir.path().join("stray.toml").exists(),
        "--exact removes the rest"
    );
    wait_until(WAIT, "web active again", || {
        agg.config()
            .service("web")
            .is_some_and(|s| s.status == "active")
            .then_some(())
    });
}

#[test]
fn config_check_gives_exit_codes_for_ci() {
    let dir = tempfile::tempdir().expect("tempdir");
    let check = |path: &Path| {
        let mut c = command(AGGREGATOR_BIN);
        c.args(["config", "check"]).arg(path);
        run_bounded(c, Duration::from_secs(20))
    };
    std::fs::write(
        dir.path().join("web.toml"),
        "[balance]\npid = { kp = 0.5 }\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("README.md"), "not a service file").expect("write");
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("web.toml"));

    std::fs::write(dir.path().join("db.toml"), "[locality.z]\na = 0\n").expect("write");
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("db.toml") && text.contains("line 1"),
        "{text}"
    );

    let out = check(&dir.path().join("missing"));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// One endpoint in the store: its published weight, its PID weight and its round-robin
/// weight.
type StoredWeights = (f64, f64, f64);

/// The store's view of one service at a version: each endpoint's published weight and
/// its per-strategy weights.
fn store_weights(
    agg: &Aggregator,
    service: &str,
) -> Option<(u64, BTreeMap<String, StoredWeights>)> {
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(agg.store_path()).ok()?).ok()?;
    let svc = &doc["services"][service];
    let eps = svc["endpoints"].as_object()?;
    let weights = eps
        .iter()
        .map(|(node, e)| {
            let sw = &e["strategy_weights"];
            Some((
                node.clone(),
                (
                    e["weight"].as_f64()?,
                    sw["pid"].as_f64()?,
                    sw["round_robin"].as_f64()?,
                ),
            ))
        })
        .collect::<Option<_>>()?;
    Some((svc["version"].as_u64()?, weights))
}

#[test]
fn a_strategy_mixture_publishes_the_gated_sum_in_every_feed() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let agg = start(&pki, dir.path(), 3600);
    let agents = start_fleet(&pki, &agg, "mix", 3, &[0.6, 1.0, 1.5]);
    // PID alone first: the weights spread with the speeds.
    wait_for(Duration::from_secs(30), "PID weights spread", || {
        // A service is in the API from the first cycle after its agents' hellos.
        let w: WeightSet = agg.try_get_json("/v1/services/mix/weights")?;
        let ws: Vec<f64> = w.weights.values().map(|e| e.weight).collect();
        let spread =
            ws.iter().cloned().fold(0.0, f64::max) - ws.iter().cloned().fold(9.0, f64::min);
        if ws.len() == 3 && spread > 0.3 {
            Ok(())
        } else {
            Err(format!("{ws:?}"))
        }
    });

    // A migration gate: 30 % PID, 70 % round robin.
    std::fs::write(
        dir.path().join("mix.toml"),
        "[balance]\nstrategies = [\n  { strategy = \"pid\", gate = 0.3 },\n  \
         { strategy = \"round_robin\", gate = 0.7 },\n]\n",
    )
    .expect("write");

    // The store keeps each strategy's weight apart, and the published weight is the
    // gated sum of them.
    let (version, stored) = wait_for(WAIT, "the mixture in the store", || {
        let (v, s) = store_weights(&agg, "mix").ok_or("no stored service yet")?;
        for (node, (w, pid, rr)) in &s {
            if (w - (0.3 * pid + 0.7 * rr)).abs() > 1e-9 {
                return Err(format!("{node}: {w} ≠ 0.3×{pid} + 0.7×{rr}"));
            }
        }
        Ok((v, s))
    });
    let spread: Vec<f64> = stored.values().map(|(w, ..)| *w).collect();
    assert!(
        spread.iter().all(|w| (0.7..1.3).contains(w)),
        "round robin's 70 % pulls every weight toward 1: {spread:?}"
    );

    // The API serves the same numbers at the same version, and every agent is told
    // its own.
    wait_for(WAIT, "API and store agree", || {
        let api = agg.weights("mix");
        let (v, s) = store_weights(&agg, "mix").ok_or("store unreadable")?;
        if api.version != v {
            return Err(format!("API at {} and store at {v}", api.version));
        }
        for (node, e) in &api.weights {
            let (w, ..) = s.get(node).ok_or(format!("{node} not stored"))?;
            if (e.weight - w).abs() > 1e-9 {
                return Err(format!("{node}: API {} store {w}", e.weight));
            }
        }
        Ok(())
    });
    assert!(version >= 1);
    for a in &agents {
        wait_for(WAIT, "the agent's weight is the API's", || {
            let s = a.status();
            let api = agg.weights("mix");
            let want = api.weights.get(&s.node).map(|e| e.weight);
            match (s.weight, want) {
                // The reply carries the live weight, which may drift below the
                // material-change step (0.01) from the published version's.
                (Some(got), Some(want)) if (got - want).abs() <= 0.011 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        });
    }
}
