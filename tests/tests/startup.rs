//! Scenario: an operator starts the binaries with edge-case settings.
//!
//! - The agent's `--control ""` is documented as "no control socket", and an empty
//!   `BALLAST_CONTROL` (as a unit file or container environment may carry) is the same
//!   setting: the agent must start and report either way.
//! - Start-up failures (a busy port, missing TLS files, no daemon behind the control
//!   socket) exit non-zero with a message that names what failed and states the cause
//!   once.

use ballast_tests::harness::process::Proc;
use ballast_tests::*;
use std::time::Duration;

const SERVICE: &str = "boot";

#[test]
fn agent_runs_without_a_control_socket() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(500));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut procs = Vec::new();
    // Each its own address: two live nodes never share one.
    for (node, address, by_env) in [
        ("quiet-flag", "127.0.0.1:8080", false),
        ("quiet-env", "127.0.0.1:8081", true),
    ] {
        let mut cmd = command(AGENT_BIN);
        cmd.args(["run", "--service", SERVICE, "--node", node])
            .args(["--address", address, "--cpu", "none"])
            .args(["--inflight", "synthetic", "--interval-ms", "500"])
            .arg("--aggregator")
            .arg(agg.quic_addr().to_string())
            .arg("--tls-dir")
            .arg(pki.node_tls_dir_for(node, &[SERVICE]));
        if by_env {
            cmd.env("BALLAST_CONTROL", "");
        } else {
            cmd.args(["--control", ""]);
        }
        let log = dir.path().join(format!("{node}.log"));
        procs.push((node, Proc::spawn(cmd, node, &log, 10)));
    }
    wait_for(
        Duration::from_secs(15),
        "both agents reporting without a control socket",
        || {
            for (node, p) in procs.iter_mut() {
                if let Some(status) = p.exit_status() {
                    panic!(
                        "ballast-agent {node} with an empty control socket setting exited \
                         ({status}) instead of running without one (agent/src/main.rs: \
                         `Flags::control` is an Option<PathBuf>, whose clap parser refuses \
                         the empty value documented as \"none\"):\n{}",
                        p.log_tail(10)
                    );
                }
            }
            let fresh: Vec<String> = agg
                .try_get_json::<Vec<EndpointView>>(&format!("/v1/services/{SERVICE}/endpoints"))
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.state != EndpointState::Missing)
                .map(|e| e.node)
                .collect();
            if fresh.len() == 2 {
                Ok(())
            } else {
                Err(format!("fresh endpoints {fresh:?}"))
            }
        },
    );
}

/// How many times the OS error text appears in `text`.
fn os_errors(text: &str) -> usize {
    text.matches("(os error").count()
}

#[test]
fn start_up_errors_name_the_problem_and_state_the_cause_once() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("weights.json");
    let mut problems = Vec::new();
    let mut check = |what: &str, out: std::process::Output, must_name: &[&str]| {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{what}: exited 0\n{stderr}");
        for name in must_name {
            assert!(
                stderr.contains(name),
                "{what}: the message does not name {name:?}: {stderr}"
            );
        }
        if os_errors(&stderr) != 1 {
            problems.push(format!("{what}: {}", stderr.trim()));
        }
    };

    // A QUIC port that is taken.
    let busy = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let busy_addr = busy.local_addr().expect("addr").to_string();
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(["run", "--quic", &busy_addr, "--http", "127.0.0.1:0"])
        .arg("--tls-dir")
        .arg(pki.dir())
        .arg("--store")
        .arg(&store);
    let out = run_bounded(cmd, Duration::from_secs(20));
    check("aggregator on a busy QUIC port", out, &[&busy_addr, "QUIC"]);

    // TLS files that do not exist.
    let missing = dir.path().join("no-tls");
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(["run", "--quic", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .arg("--tls-dir")
        .arg(&missing)
        .arg("--store")
        .arg(&store);
    let out = run_bounded(cmd, Duration::from_secs(20));
    check(
        "aggregator without TLS files",
        out,
        &["no-tls", "certs init"],
    );

    // No daemon behind the control socket.
    let sock = dir.path().join("nobody.sock");
    let mut cmd = command(AGENT_BIN);
    cmd.args(["status", "--control"]).arg(&sock);
    let out = run_bounded(cmd, Duration::from_secs(20));
    check("agent status without a daemon", out, &["nobody.sock"]);

    assert!(
        problems.is_empty(),
        "error messages repeat their cause: a thiserror `source` field is both printed \
         by the message (\"...: {{source}}\") and chained again by main's `{{e:#}}` \
         (aggregator/src/daemon.rs DaemonError::Bind, shared/src/tls.rs TlsError::Read, \
         agent/src/control.rs ControlError::Connect):\n{}",
        problems.join("\n")
    );
}
