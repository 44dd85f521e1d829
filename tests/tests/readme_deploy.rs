//! Scenario: the README's "Running it for real" block, as written, across hosts.
//!
//! The commands are read from `README.md` when the test runs, so that the README and
//! what is tested cannot drift apart. The hosts are network namespaces on one bridge
//! (10.77.1.0/24), each with a UTS namespace and a host name of its own, and an
//! `/etc/hosts` as Debian writes it: its own name at `127.0.1.1`, and `agg.example` at
//! the aggregator's address (`ip netns exec` reads `/etc/netns/NAME/hosts`).
//!
//! - `agg` runs the block's aggregator commands;
//! - `web-1` and `web-2`, the first two nodes `certs init` names, each run a real HTTP
//!   service on port 8080 (`ballast-lab-backend`) and the block's agent command, after
//!   their certificate directory was copied as the block's comment says;
//! - `web-4` joins once the block's `certs issue` made its certificate;
//! - `ops`, an operator's machine, runs the block's remote commands with the files
//!   their comment says to copy (the CA and the token `token new` wrote).
//!
//! Only directories are substituted: `/etc/ballast` and `/var/lib/ballast` become a
//! directory per host (in the commands' words, and for the agent's default TLS
//! directory, `BALLAST_TLS_DIR`), as does the agent's control socket under
//! `/run/ballast` (`BALLAST_CONTROL`); the binaries are the workspace's, on `PATH`.
//!
//! It requires:
//! 1. `ballast-agent check` says the node's address is its own, from the route to
//!    `agg.example:7400`;
//! 2. every node published by the aggregator (its API, read inside its host) with its
//!    own non-loopback address and port 8080, and the service there reached at that
//!    address from the aggregator's host;
//! 3. after `certs issue`, the new node published the same way;
//! 4. after `certs revoke`, what the README says: the revoked node's agent says
//!    `refused     revoked`, its endpoint goes missing, and the others stay serving;
//! 5. the API served off loopback over HTTPS to the token only: from `ops`, a request
//!    without it is refused (401), `endpoints` lists the nodes, and `drain` takes the
//!    node out (draining, weight 0).
//!
//! The test reads the API itself, on the aggregator's host, as the operator does: the
//! block's URL, the CA of `--http-tls-dir` and the token of `token new`.
//!
//! Needs root, `ip` (iproute2), `unshare` and `curl`; fails, naming what is missing.
//! Namespaces, `/etc/netns` entries and processes are removed on drop, failure included.

use ballast_tests::harness::netns::run_ip as ip;
use ballast_tests::harness::process::{binary, run_bounded, Proc, AGENT_BIN};
use ballast_tests::harness::wait::wait_for;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The address the README's agents dial the aggregator by.
const AGG_NAME: &str = "agg.example";
/// The service's port, as the README's agent command gives it.
const PORT: u16 = 8080;
/// How long a one-shot command may take.
const CMD: Duration = Duration::from_secs(30);
/// How long the fleet may take to show each expected state.
const SETTLE: Duration = Duration::from_secs(30);

/// The commands of the README's "Running it for real" block: continuation lines joined,
/// comments and blank lines left out, each split into words.
fn readme_commands() -> Vec<Vec<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = std::fs::read_to_string(&path).expect("README.md");
    let section = text
        .split("\n## Running it for real\n")
        .nth(1)
        .expect("README.md has a section \"Running it for real\"");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("the section opens with a ```sh block");
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(line);
                assert!(
                    !current.contains(['"', '\'', '$', '`', '|', ';', '&', '<', '>', '*']),
                    "the test runs plain words, and this README command has shell syntax: \
                     {current}"
                );
                commands.push(current.split_whitespace().map(str::to_string).collect());
                current.clear();
            }
        }
    }
    assert!(current.is_empty(), "the block ends in a continuation line");
    commands
}

/// `word` with the directories the test substitutes moved under `root`.
fn substitute(word: &str, root: &Path) -> String {
    for dir in ["/etc/ballast", "/var/lib/ballast"] {
        if let Some(rest) = word.strip_prefix(dir) {
            return format!("{}{dir}{rest}", root.display());
        }
    }
    word.to_string()
}

/// One host: a network namespace on the bridge, a host name, a root for its files.
struct Host {
    name: String,
    netns: String,
    ip: Ipv4Addr,
    root: PathBuf,
}

impl Host {
    /// `words` as a command run on this host: in its network namespace (with its
    /// `/etc/hosts`), a UTS namespace with its host name, the workspace's binaries
    /// first on `PATH`, and no `BALLAST_*` variable but the directories substituted.
    fn command(&self, words: &[String]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns, "unshare", "--uts", "--"])
            .args(["sh", "-c", "hostname \"$0\" && exec \"$@\"", &self.name]);
        cmd.args(words.iter().map(|w| substitute(w, &self.root)));
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("BALLAST_") {
                cmd.env_remove(&key);
            }
        }
        let bin_dir = binary(AGENT_BIN)
            .parent()
            .expect("binary directory")
            .to_path_buf();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![bin_dir];
        paths.extend(std::env::split_paths(&path));
        // Relative paths (the operator's `ca.pem`, `ops.token`) are the host's root.
        cmd.current_dir(&self.root);
        cmd.env("PATH", std::env::join_paths(paths).expect("PATH"))
            .env("BALLAST_TLS_DIR", self.root.join("etc/ballast/tls"))
            .env("BALLAST_CONTROL", self.root.join("run/ballast/agent.sock"))
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(std::process::Stdio::null());
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd
    }

    /// Runs `words` here to completion; panics with its output unless it succeeds.
    fn run(&self, words: &[String]) -> String {
        let out = self.try_run(words);
        assert!(
            out.status.success(),
            "on {}: `{}` failed ({}): {}{}",
            self.name,
            words.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn try_run(&self, words: &[String]) -> Output {
        run_bounded(self.command(words), CMD)
    }
}

/// The hosts and their processes; removes every process, namespace and `/etc/netns`
/// entry on drop.
struct Lan {
    lan_ns: String,
    hosts: Vec<Host>,
    procs: Vec<Proc>,
    dir: tempfile::TempDir,
}

impl Lan {
    /// The bridge's namespace; hosts are added with [`Lan::host`].
    fn new() -> Lan {
        // SAFETY: a plain syscall.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test needs root: it makes network namespaces"
        );
        match Command::new("ip").arg("-V").output() {
            Ok(o) if o.status.success() => {}
            other => panic!("this test needs `ip` (iproute2), which does not run: {other:?}"),
        }
        let lan = Lan {
            lan_ns: format!("ballast-deploy-{}-lan", std::process::id()),
            hosts: Vec::new(),
            procs: Vec::new(),
            dir: tempfile::Builder::new()
                .prefix("ballast-deploy-")
                .tempdir()
                .expect("temporary directory"),
        };
        ip(&["netns", "add", &lan.lan_ns]);
        ip(&["-n", &lan.lan_ns, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &lan.lan_ns, "link", "set", "br0", "up"]);
        lan
    }

    /// A host called `name` at 10.77.1.`last` on the bridge, whose `/etc/hosts` names
    /// itself at 127.0.1.1 and `agg.example` at `agg`.
    fn host(&mut self, name: &str, last: u8, agg: Ipv4Addr) -> usize {
        let netns = format!("ballast-deploy-{}-{name}", std::process::id());
        let ip_addr = Ipv4Addr::new(10, 77, 1, last);
        let root = self.dir.path().join(name);
        std::fs::create_dir_all(root.join("run/ballast")).expect("host root");
        ip(&["netns", "add", &netns]);
        self.hosts.push(Host {
            name: name.to_string(),
            netns: netns.clone(),
            ip: ip_addr,
            root,
        });
        let etc = Path::new("/etc/netns").join(&netns);
        std::fs::create_dir_all(&etc).expect("/etc/netns/NAME");
        std::fs::write(
            etc.join("hosts"),
            format!("127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n{agg}\t{AGG_NAME}\n"),
        )
        .expect("hosts file");
        let port = format!("v-{name}");
        ip(&[
            "link",
            "add",
            "eth0",
            "netns",
            &netns,
            "type",
            "veth",
            "peer",
            "name",
            &port,
            "netns",
            &self.lan_ns,
        ]);
        ip(&[
            "-n",
            &self.lan_ns,
            "link",
            "set",
            &port,
            "master",
            "br0",
            "up",
        ]);
        ip(&[
            "-n",
            &netns,
            "addr",
            "add",
            &format!("{ip_addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &netns, "link", "set", "eth0", "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        self.hosts.len() - 1
    }

    /// Starts `words` on host `h` in the background, its output in a log.
    fn spawn(&mut self, h: usize, label: &str, words: &[String]) {
        let host = &self.hosts[h];
        let log = self.dir.path().join(format!("{}-{label}.log", host.name));
        let name = format!("{label} on {}", host.name);
        self.procs
            .push(Proc::spawn(host.command(words), &name, &log, 40));
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        self.procs.clear();
        for host in &self.hosts {
            let _ = Command::new("ip")
                .args(["netns", "del", &host.netns])
                .status();
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(&host.netns));
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.lan_ns])
            .status();
    }
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

/// How the aggregator's host reaches its own API, in the block's words: the URL the
/// operator's commands use, the CA of `run --http-tls-dir`, the token `token new` wrote.
#[derive(Default)]
struct ApiAccess {
    url: Option<String>,
    ca: Option<String>,
    token: Option<String>,
}

impl ApiAccess {
    /// `command` (a client subcommand) with the flags to reach the API from its host.
    fn words(&self, command: &str) -> Vec<String> {
        let mut out = words(command);
        let flag = |name: &str, v: &Option<String>| {
            let v = v
                .clone()
                .unwrap_or_else(|| panic!("the block gives no {name} before it is needed"));
            [format!("--{name}"), v]
        };
        out.extend(flag("url", &self.url));
        out.extend(flag("ca", &self.ca));
        out.extend(flag("token-file", &self.token));
        out
    }
}

/// The value after `flag` in `command`.
fn flag_value<'c>(command: &'c [String], flag: &str) -> Option<&'c str> {
    let at = command.iter().position(|w| w == flag)?;
    command.get(at + 1).map(String::as_str)
}

/// The endpoints of `web` as the aggregator's API gives them, read on its host.
fn endpoints(agg: &Host, api: &ApiAccess) -> Result<Vec<serde_json::Value>, String> {
    let out = agg.try_run(&api.words("ballast-aggregator endpoints web --json"));
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("not JSON: {e}"))?;
    let list = v.get("endpoints").unwrap_or(&v);
    list.as_array()
        .cloned()
        .ok_or_else(|| format!("no endpoint list in {v}"))
}

/// Waits until `node` is published at its own address and not missing, then checks
/// the service answers there from the aggregator's host.
fn require_published(agg: &Host, api: &ApiAccess, node: &Host) {
    let want = format!("{}:{PORT}", node.ip);
    wait_for(
        SETTLE,
        &format!("{} published at {want}", node.name),
        || {
            let list = endpoints(agg, api)?;
            let found = list.iter().find(|e| e["node"] == node.name.as_str());
            match found {
                Some(e) if e["address"] == want.as_str() && e["state"] != "missing" => Ok(()),
                _ => Err(format!("{list:?}")),
            }
        },
    );
    let out = agg.run(&words(&format!(
        "curl -sS -m 5 -o /dev/null -D - http://{want}/work"
    )));
    assert!(
        out.to_ascii_lowercase()
            .contains(&format!("x-backend: {}", node.name)),
        "the service at the published address {want} is not {}'s: {out}",
        node.name
    );
}

#[test]
fn the_readme_deployment_works_across_hosts_as_written() {
    let commands = readme_commands();
    let mut lan = Lan::new();
    let agg_ip = Ipv4Addr::new(10, 77, 1, 1);
    let agg = lan.host("agg", 1, agg_ip);
    let mut nodes: Vec<usize> = Vec::new();
    let mut agent_words: Option<Vec<String>> = None;
    let mut revoked = None;
    let mut api = ApiAccess::default();
    let mut ops: Option<usize> = None;
    let mut drained = None;
    let mut steps = Vec::new();
    for command in &commands {
        let program = command[0].as_str();
        let sub = command.get(1).map(String::as_str).unwrap_or("");
        steps.push(format!("{program} {sub}"));
        match (program, sub) {
            ("ballast-aggregator", "certs") => {
                let out = lan.hosts[agg].run(command);
                eprintln!("{}:\n{out}", command.join(" "));
                match command.get(2).map(String::as_str) {
                    Some("init") => {
                        let at = command
                            .iter()
                            .position(|w| w == "--nodes")
                            .expect("certs init names its nodes");
                        let names: Vec<String> =
                            command[at + 1].split(',').map(str::to_string).collect();
                        assert!(names.len() >= 2, "the README issues at least two nodes");
                        for (i, name) in names.iter().take(2).enumerate() {
                            let last = u8::try_from(i + 2).expect("small");
                            nodes.push(lan.host(name, last, agg_ip));
                        }
                    }
                    Some("issue") => {
                        let name = command.get(4).expect("certs issue DIR NODE");
                        let agent = agent_words.as_ref().expect("an agent command before");
                        let h = lan.host(name, 5, agg_ip);
                        start_node(&mut lan, agg, h, agent);
                        require_published(&lan.hosts[agg], &api, &lan.hosts[h]);
                        nodes.push(h);
                    }
                    Some("revoke") => {
                        let name = command.get(4).expect("certs revoke DIR NODE");
                        revoked = Some(
                            *nodes
                                .iter()
                                .find(|&&h| lan.hosts[h].name == *name)
                                .expect("the README revokes a node that runs"),
                        );
                    }
                    other => panic!("a `certs` command this test does not know: {other:?}"),
                }
            }
            ("ballast-aggregator", "token") => {
                let out = lan.hosts[agg].run(command);
                eprintln!("{}:\n{out}", command.join(" "));
                let token = flag_value(command, "--out").expect("token new --out FILE");
                api.token = Some(substitute(token, &lan.hosts[agg].root));
            }
            ("ballast-aggregator", "run") => {
                let http = flag_value(command, "--http").expect("run serves the API off loopback");
                let port = http.rsplit(':').next().expect("--http ADDRESS:PORT");
                api.url = Some(format!("https://{AGG_NAME}:{port}"));
                let tls = flag_value(command, "--http-tls-dir").expect("run --http-tls-dir");
                api.ca = Some(substitute(&format!("{tls}/ca.pem"), &lan.hosts[agg].root));
                lan.spawn(agg, "aggregator", command);
                wait_for(SETTLE, "the aggregator's API on its host", || {
                    let out = lan.hosts[agg].try_run(&api.words("ballast-aggregator services"));
                    out.status
                        .success()
                        .then_some(())
                        .ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
                });
            }
            ("ballast-agent", _) => {
                agent_words = Some(command.clone());
                for &h in &nodes.clone() {
                    start_node(&mut lan, agg, h, command);
                }
                for &h in &nodes {
                    require_published(&lan.hosts[agg], &api, &lan.hosts[h]);
                }
            }
            ("ballast-aggregator", "endpoints" | "drain") => {
                let h = *ops.get_or_insert_with(|| operator_host(&mut lan, agg_ip, &api, command));
                let out = lan.hosts[h].run(command);
                eprintln!("on the operator's host, {}:\n{out}", command.join(" "));
                if sub == "endpoints" {
                    for &n in &nodes {
                        let name = &lan.hosts[n].name;
                        assert!(
                            out.contains(name.as_str()),
                            "{name} not in the table:\n{out}"
                        );
                    }
                } else {
                    drained = Some(command.get(2).expect("drain NODE").clone());
                }
            }
            _ => panic!(
                "the README's block has a command this test does not know how to place on \
                 a host: {}",
                command.join(" ")
            ),
        }
    }
    assert_eq!(
        steps,
        [
            "ballast-aggregator certs",
            "ballast-aggregator token",
            "ballast-aggregator run",
            "ballast-agent --service",
            "ballast-aggregator certs",
            "ballast-aggregator certs",
            "ballast-aggregator endpoints",
            "ballast-aggregator drain",
        ],
        "the block's commands, in order"
    );
    let revoked = revoked.expect("the README revokes a node");
    let (agg, revoked) = (&lan.hosts[agg], &lan.hosts[revoked]);
    wait_for(
        SETTLE,
        &format!("{}'s agent to say it is refused as revoked", revoked.name),
        || {
            let out = revoked.try_run(&words("ballast-agent status"));
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.contains("refused     revoked")
                .then_some(())
                .ok_or(text)
        },
    );
    wait_for(
        SETTLE,
        &format!("{}'s endpoint missing, the others serving", revoked.name),
        || {
            let list = endpoints(agg, &api)?;
            let missing = |e: &serde_json::Value| e["state"] == "missing";
            let ok = list.iter().all(|e| {
                let is_revoked = e["node"] == revoked.name.as_str();
                missing(e) == is_revoked
            }) && list.len() == nodes.len();
            ok.then_some(()).ok_or_else(|| format!("{list:?}"))
        },
    );
    let drained = drained.expect("the README drains a node from the operator's host");
    wait_for(
        SETTLE,
        &format!("{drained} drained from the operator's host, at weight 0"),
        || {
            let list = endpoints(agg, &api)?;
            let e = list.iter().find(|e| e["node"] == drained.as_str());
            match e {
                Some(e) if e["state"] == "draining" && e["weight"] == 0.0 => Ok(()),
                _ => Err(format!("{e:?}")),
            }
        },
    );
}

/// The operator's machine, made for the block's first remote command: the files its
/// `--ca` and `--token-file` name, copied from the aggregator's host as the block's
/// comment says (the CA of `--http-tls-dir`, the token `token new` wrote). From there,
/// the API refuses a request without the token.
fn operator_host(lan: &mut Lan, agg_ip: Ipv4Addr, api: &ApiAccess, command: &[String]) -> usize {
    let h = lan.host("ops", 9, agg_ip);
    let root = lan.hosts[h].root.clone();
    let copies = [
        (flag_value(command, "--ca"), &api.ca),
        (flag_value(command, "--token-file"), &api.token),
    ];
    for (to, from) in copies {
        let to = to.expect("the remote command names its --ca and --token-file");
        let from = from.as_ref().expect("made on the aggregator's host before");
        std::fs::copy(from, root.join(to)).unwrap_or_else(|e| panic!("copy {from}: {e}"));
    }
    let url = flag_value(command, "--url").expect("the remote command has --url");
    let ca = flag_value(command, "--ca").expect("--ca");
    let bare = lan.hosts[h].try_run(&words(&format!(
        "ballast-aggregator services --url {url} --ca {ca}"
    )));
    let said = String::from_utf8_lossy(&bare.stderr);
    assert!(
        !bare.status.success() && said.contains("401"),
        "the API answered the operator's host without a token: {said}"
    );
    h
}

/// Node host `h`: its certificate directory copied from the aggregator's host as the
/// README says, the service on port 8080, `ballast-agent check`, then the agent.
fn start_node(lan: &mut Lan, agg: usize, h: usize, agent: &[String]) {
    let (name, ip_addr, root) = {
        let host = &lan.hosts[h];
        (host.name.clone(), host.ip, host.root.clone())
    };
    let from = lan.hosts[agg]
        .root
        .join("etc/ballast/tls/nodes")
        .join(&name);
    let to = root.join("etc/ballast/tls");
    std::fs::create_dir_all(&to).expect("the node's /etc/ballast/tls");
    for file in ["ca.pem", "node.pem", "node.key"] {
        std::fs::copy(from.join(file), to.join(file))
            .unwrap_or_else(|e| panic!("copy {}/{file}: {e}", from.display()));
    }
    lan.spawn(
        h,
        "service",
        &words(&format!(
            "ballast-lab-backend --listen 0.0.0.0:{PORT} --name {name} --rounds 1000"
        )),
    );
    // `check` with the agent's own flags: where its address comes from.
    let mut check = vec![agent[0].clone(), "check".to_string()];
    check.extend(agent[1..].iter().cloned());
    let out = lan.hosts[h].run(&check);
    let want = format!("at {ip_addr}:{PORT} (route to {AGG_NAME}:7400)");
    assert!(
        out.contains(&want),
        "`ballast-agent check` on {name}: {out}"
    );
    lan.spawn(h, "agent", agent);
}
