//! Packages: the .deb and .rpm of both binaries, built once by `packaging/build` from
//! the binaries under test. The .debs are installed with `dpkg -i` into a scratch root
//! (a copy-on-write overlay of this machine, see `ScratchRoot`), so their maintainer
//! scripts run for real and the machine itself is left untouched; the .rpms are
//! inspected with Debian's `rpm`.

use ballast_tests::*;
use std::process::Command;
use std::time::Duration;

const AGENT_FILES: &[&str] = &[
    "/usr/bin/ballast-agent",
    "/usr/lib/systemd/system/ballast-agent.service",
    "/usr/lib/sysusers.d/ballast-agent.conf",
    "/etc/ballast/agent.toml",
    "/etc/default/ballast-agent",
    "/usr/share/man/man1/ballast-agent.1.gz",
    "/usr/share/man/man1/ballast-agent-check.1.gz",
    "/usr/share/bash-completion/completions/ballast-agent",
    "/usr/share/fish/vendor_completions.d/ballast-agent.fish",
    "/usr/share/doc/ballast-agent/README.tls",
];

const AGGREGATOR_FILES: &[&str] = &[
    "/usr/bin/ballast-aggregator",
    "/usr/bin/ballast-relay",
    "/usr/lib/systemd/system/ballast-aggregator.service",
    "/usr/lib/systemd/system/ballast-relay.service",
    "/usr/lib/sysusers.d/ballast-aggregator.conf",
    "/etc/ballast/aggregator.toml",
    "/etc/default/ballast-aggregator",
    "/usr/share/man/man1/ballast-aggregator.1.gz",
    "/usr/share/man/man1/ballast-aggregator-certs-init.1.gz",
    "/usr/share/bash-completion/completions/ballast-aggregator",
    "/usr/share/fish/vendor_completions.d/ballast-aggregator.fish",
    "/usr/share/man/man1/ballast-relay.1.gz",
    "/usr/share/bash-completion/completions/ballast-relay",
    "/usr/share/fish/vendor_completions.d/ballast-relay.fish",
    "/usr/share/doc/ballast-aggregator/README.tls",
    "/usr/share/ballast/prometheus/ballast-rules.yml",
    "/usr/share/ballast/grafana/ballast.json",
];

/// What an operator adds to the shipped agent.toml (README.tls): the three settings
/// without a default, at the top.
const AGENT_SETTINGS: &str = "service = \"web\"\nport = 8080\naggregators = [\"127.0.0.1:7400\"]\n";

fn require_deb_tools() {
    require_tool("dpkg", "apt-get install dpkg");
    require_tool("dpkg-deb", "apt-get install dpkg");
}

/// Installs `debs` (paths on this machine) in `root` with `dpkg -i`.
fn dpkg_install(root: &ScratchRoot, debs: &[&std::path::Path], extra: &[&str]) {
    let mut args = vec!["dpkg", "-i"];
    args.extend_from_slice(extra);
    let mut inside = Vec::new();
    for (i, deb) in debs.iter().enumerate() {
        let path = format!("/tmp/package-{i}.deb");
        root.copy_in(deb, &path);
        inside.push(path);
    }
    args.extend(inside.iter().map(String::as_str));
    root.ok(&args);
}

#[test]
fn both_debs_install_into_a_scratch_root_with_files_users_enabled_units_and_a_working_check() {
    require_deb_tools();
    require_tool("systemd-analyze", "apt-get install systemd");
    let pkgs = packages();
    let root = ScratchRoot::mount();
    dpkg_install(&root, &[&pkgs.agent_deb, &pkgs.aggregator_deb], &[]);

    // Every documented file is where docs/packaging.md says, and dpkg owns it.
    let owned = root.ok(&["dpkg", "-L", "ballast-agent", "ballast-aggregator"]);
    for file in AGENT_FILES.iter().chain(AGGREGATOR_FILES) {
        assert!(root.exists(file), "{file} is not installed");
        assert!(
            owned.lines().any(|l| l == *file),
            "dpkg does not own {file}"
        );
    }
    let conffiles = root.ok(&["dpkg-query", "-W", "-f", "${Conffiles}\n", "ballast-agent"]);
    assert!(conffiles.contains("/etc/ballast/agent.toml"), "{conffiles}");
    assert!(
        conffiles.contains("/etc/default/ballast-agent"),
        "{conffiles}"
    );

    // Each service has its own system user, created by the package from sysusers.d.
    for user in ["ballast-agent", "ballast-aggregator"] {
        let entry = root.ok(&["getent", "passwd", user]);
        assert!(entry.trim_end().ends_with(":/usr/sbin/nologin"), "{entry}");
    }

    // Debian's convention: enabled on install. Nothing was started: no systemd runs in
    // the scratch root (its /run is empty), as on a machine being imaged.
    for unit in ["ballast-agent.service", "ballast-aggregator.service"] {
        let wants = format!("/etc/systemd/system/multi-user.target.wants/{unit}");
        assert!(root.exists(&wants), "{unit} is not enabled: no {wants}");
    }
    // The relay's unit is there for the hosts of a cluster's relay tier, and left off:
    // beside the aggregator it would take the same ports.
    let relay_wants = "/etc/systemd/system/multi-user.target.wants/ballast-relay.service";
    assert!(
        !root.exists(relay_wants),
        "the relay's unit was enabled on install: {relay_wants}"
    );

    // The installed binaries run.
    let version = root.ok(&["ballast-agent", "--version"]);
    assert_eq!(
        version.trim(),
        format!("ballast-agent {}", env!("CARGO_PKG_VERSION"))
    );
    root.ok(&["ballast-aggregator", "--version"]);
    let version = root.ok(&["ballast-relay", "--version"]);
    assert_eq!(
        version.trim(),
        format!("ballast-relay {}", env!("CARGO_PKG_VERSION"))
    );

    // The units pass systemd's own checks, with their binaries and man pages in place.
    root.ok(&[
        "systemd-analyze",
        "verify",
        "/usr/lib/systemd/system/ballast-agent.service",
        "/usr/lib/systemd/system/ballast-aggregator.service",
        "/usr/lib/systemd/system/ballast-relay.service",
    ]);

    // And their sandboxes stay tight: systemd's exposure score (0 to 10, where "OK" is
    // below 4.5) was 1.6 for the agent and 1.2 for the aggregator when written.
    for unit in [
        "ballast-agent.service",
        "ballast-aggregator.service",
        "ballast-relay.service",
    ] {
        let path = format!("/usr/lib/systemd/system/{unit}");
        let report = root.ok(&["systemd-analyze", "security", "--offline=true", &path]);
        let exposure: f64 = report
            .lines()
            .find_map(|l| {
                l.split_once("Overall exposure level for ")?
                    .1
                    .split(": ")
                    .nth(1)
            })
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no exposure level in:\n{report}"));
        assert!(exposure <= 2.0, "{unit} exposure {exposure}:\n{report}");
    }

    // The aggregator's shipped config passes the unit's ExecStartPre as it is.
    root.ok(&[
        "ballast-aggregator",
        "check",
        "--config",
        "/etc/ballast/aggregator.toml",
    ]);

    // The agent's does not until the operator sets service, port and aggregators, and
    // says what is missing: the unit stays stopped rather than report nonsense.
    let unconfigured = root.run(
        &[
            "ballast-agent",
            "check",
            "--config",
            "/etc/ballast/agent.toml",
        ],
        Duration::from_secs(30),
    );
    assert!(!unconfigured.status.success(), "check passed unconfigured");
    let why = String::from_utf8_lossy(&unconfigured.stderr);
    assert!(why.contains("service is not set"), "{why}");

    // README.tls, step by step: certificates, the node's files, the three settings.
    let node = root.ok(&["hostname"]).trim().to_string();
    root.ok(&[
        "ballast-aggregator",
        "certs",
        "init",
        "/etc/ballast/tls",
        "--nodes",
        &node,
    ]);
    let node_dir = format!("/etc/ballast/tls/nodes/{node}");
    root.ok(&[
        "install",
        "-m",
        "0644",
        &format!("{node_dir}/node.pem"),
        "/etc/ballast/tls/",
    ]);
    root.ok(&[
        "install",
        "-m",
        "0640",
        "-g",
        "ballast-agent",
        &format!("{node_dir}/node.key"),
        "/etc/ballast/tls/",
    ]);
    let shipped = root.read("/etc/ballast/agent.toml");
    root.write(
        "/etc/ballast/agent.toml",
        &format!("{AGENT_SETTINGS}{shipped}"),
    );
    // As the unit runs it: as the service's user, who can read the key only through
    // the group README.tls gives it.
    let checked = root.ok(&[
        "runuser",
        "-u",
        "ballast-agent",
        "--",
        "ballast-agent",
        "check",
        "--config",
        "/etc/ballast/agent.toml",
    ]);
    assert!(
        checked.contains(&format!("ok: node {node} of service web")),
        "{checked}"
    );

    // Purge takes everything away, the aggregator's state directory included.
    root.ok(&["mkdir", "-p", "/var/lib/ballast"]);
    root.write("/var/lib/ballast/weights.json", "{}");
    root.ok(&["dpkg", "--purge", "ballast-agent", "ballast-aggregator"]);
    for file in AGENT_FILES.iter().chain(AGGREGATOR_FILES) {
        assert!(!root.exists(file), "{file} survived the purge");
    }
    assert!(
        !root.exists("/var/lib/ballast"),
        "the state survived the purge"
    );
    assert!(
        !root.exists("/etc/systemd/system/multi-user.target.wants/ballast-agent.service"),
        "the unit is still enabled after the purge"
    );
}

#[test]
fn an_upgrade_keeps_the_operators_edited_config() {
    require_deb_tools();
    let pkgs = packages();
    let root = ScratchRoot::mount();
    dpkg_install(&root, &[&pkgs.agent_deb], &[]);
    let shipped = root.read("/etc/ballast/agent.toml");
    let edited = format!("{AGENT_SETTINGS}{shipped}");
    root.write("/etc/ballast/agent.toml", &edited);
    root.write("/etc/default/ballast-agent", "BALLAST_ZONE=eu-1\n");

    // A second build with the same default config: dpkg keeps the edits without asking
    // (stdin is closed, so a prompt would fail the install).
    let builds = tempfile::tempdir().expect("tempdir");
    let second = rebuilt(&pkgs.agent_deb, "2", None, builds.path());
    dpkg_install(&root, &[&second], &[]);
    let installed = root.ok(&["dpkg-query", "-W", "-f", "${Version}", "ballast-agent"]);
    assert!(
        installed.ends_with("-2"),
        "version after upgrade: {installed}"
    );
    assert_eq!(root.read("/etc/ballast/agent.toml"), edited);
    assert_eq!(
        root.read("/etc/default/ballast-agent"),
        "BALLAST_ZONE=eu-1\n"
    );

    // A third whose default config changed: unattended upgrades keep the operator's file
    // (--force-confold) and put the new default beside it.
    let third = rebuilt(
        &pkgs.agent_deb,
        "3",
        Some("# a new default\n"),
        builds.path(),
    );
    dpkg_install(&root, &[&third], &["--force-confdef", "--force-confold"]);
    assert_eq!(root.read("/etc/ballast/agent.toml"), edited);
    let new_default = root.read("/etc/ballast/agent.toml.dpkg-dist");
    assert!(new_default.ends_with("# a new default\n"), "{new_default}");
}

/// A copy of `deb` in `dir` with the Debian revision `revision` and, if given, `append`
/// added to its /etc/ballast/agent.toml: what a later build of the package would be.
fn rebuilt(
    deb: &std::path::Path,
    revision: &str,
    append: Option<&str>,
    dir: &std::path::Path,
) -> std::path::PathBuf {
    let tree = dir.join(format!("tree-{revision}"));
    let mut unpack = Command::new("dpkg-deb");
    unpack.arg("-R").arg(deb).arg(&tree);
    assert!(run_bounded(unpack, Duration::from_secs(120))
        .status
        .success());
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).expect("control");
    let text: String = text
        .lines()
        .map(|l| match l.strip_prefix("Version: ") {
            Some(v) => format!(
                "Version: {}-{revision}\n",
                v.rsplit_once('-').map_or(v, |p| p.0)
            ),
            None => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&control, text).expect("write control");
    if let Some(extra) = append {
        let config = tree.join("etc/ballast/agent.toml");
        let mut text = std::fs::read_to_string(&config).expect("agent.toml");
        text.push_str(extra);
        std::fs::write(&config, text).expect("write agent.toml");
    }
    let out = dir.join(format!("ballast-agent-{revision}.deb"));
    let mut build = Command::new("dpkg-deb");
    build
        .args(["-Znone", "--root-owner-group", "-b"])
        .arg(&tree)
        .arg(&out);
    let built = run_bounded(build, Duration::from_secs(120));
    assert!(
        built.status.success(),
        "dpkg-deb -b: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    out
}

#[test]
fn lintian_finds_no_errors_in_either_deb() {
    require_tool("lintian", "apt-get install lintian");
    let pkgs = packages();
    let mut cmd = Command::new("lintian");
    cmd.args(["--fail-on", "error"])
        .arg(&pkgs.agent_deb)
        .arg(&pkgs.aggregator_deb);
    let out = run_bounded(cmd, Duration::from_secs(300));
    let report = String::from_utf8_lossy(&out.stdout);
    // Warnings are allowed (docs/packaging.md lists them); errors are not.
    assert!(
        out.status.success() && !report.lines().any(|l| l.starts_with("E: ")),
        "lintian ({}):\n{report}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_rpms_hold_the_documented_files_config_and_systemd_scriptlets() {
    require_tool("rpm", "apt-get install rpm");
    let pkgs = packages();
    let rpm = |args: &[&str], file: &std::path::Path| {
        let mut cmd = Command::new("rpm");
        cmd.args(args).arg(file);
        let out = run_bounded(cmd, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "rpm {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for (name, file, files) in [
        ("ballast-agent", &pkgs.agent_rpm, AGENT_FILES),
        ("ballast-aggregator", &pkgs.aggregator_rpm, AGGREGATOR_FILES),
    ] {
        let listed = rpm(&["-qlp"], file);
        for f in files {
            assert!(listed.lines().any(|l| l == *f), "{name}.rpm lacks {f}");
        }
        // Config files are %config(noreplace): an upgrade keeps the operator's edits.
        let flags = rpm(
            &["-qp", "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]"],
            file,
        );
        for config in files.iter().filter(|f| f.starts_with("/etc/")) {
            let line = flags
                .lines()
                .find(|l| l.ends_with(&format!(" {config}")))
                .unwrap_or_else(|| panic!("{config} not in {name}.rpm"));
            assert!(line.starts_with("cn "), "{config} is not noreplace: {line}");
        }
        // Fedora's conventions: the user made in %pre, the unit preset (not started) on
        // install, stopped and disabled on erase, restarted after an upgrade.
        let scripts = rpm(&["-qp", "--scripts"], file);
        for expected in [
            format!("useradd -r -g {name}"),
            format!("systemctl --no-reload preset {name}.service"),
            format!("systemctl --no-reload disable --now {name}.service"),
            format!("systemctl try-restart {name}.service"),
        ] {
            assert!(
                scripts.contains(&expected),
                "{name}.rpm: no `{expected}` in\n{scripts}"
            );
        }
        assert!(
            !scripts.contains(" start "),
            "{name}.rpm starts its unit:\n{scripts}"
        );
    }
}

#[test]
fn an_rpm_upgrade_keeps_the_operators_edited_config_and_erase_saves_it() {
    require_tool("rpm", "apt-get install rpm");
    require_tool(
        "cargo-generate-rpm",
        "cargo install --locked cargo-generate-rpm",
    );
    let pkgs = packages();
    let root = ScratchRoot::mount();
    // --nodeps: Debian's rpm database knows none of the libraries dpkg installed.
    root.copy_in(&pkgs.agent_rpm, "/tmp/agent-1.rpm");
    root.ok(&["rpm", "-i", "--nodeps", "/tmp/agent-1.rpm"]);
    let entry = root.ok(&["getent", "passwd", "ballast-agent"]);
    assert!(
        entry.contains(":Ballast host agent:"),
        "%pre made no user: {entry}"
    );
    let edited = format!("{AGENT_SETTINGS}{}", root.read("/etc/ballast/agent.toml"));
    root.write("/etc/ballast/agent.toml", &edited);

    // A second build, release 2, with the same default config.
    let builds = tempfile::tempdir().expect("tempdir");
    let mut build = Command::new("cargo");
    build
        .args(["generate-rpm", "-p", "agent", "--profile", "dev"])
        .args(["--payload-compress", "none", "-s", "release = \"2\"", "-o"])
        .arg(builds.path())
        .current_dir(repo_root());
    let built = run_bounded(build, Duration::from_secs(300));
    assert!(
        built.status.success(),
        "cargo generate-rpm: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let second = std::fs::read_dir(builds.path())
        .expect("read builds")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "rpm"))
        .expect("the second rpm");
    root.copy_in(&second, "/tmp/agent-2.rpm");
    root.ok(&["rpm", "-U", "--nodeps", "/tmp/agent-2.rpm"]);
    let installed = root.ok(&["rpm", "-q", "ballast-agent"]);
    assert!(
        installed.contains("0.1.0-2"),
        "after the upgrade: {installed}"
    );
    assert_eq!(root.read("/etc/ballast/agent.toml"), edited);
    assert!(!root.exists("/etc/ballast/agent.toml.rpmnew"));

    // Erasing keeps the operator's edit as .rpmsave.
    root.ok(&["rpm", "-e", "--nodeps", "ballast-agent"]);
    assert!(!root.exists("/usr/bin/ballast-agent"));
    assert_eq!(root.read("/etc/ballast/agent.toml.rpmsave"), edited);
}
