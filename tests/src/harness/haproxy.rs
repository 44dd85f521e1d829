//! A real HAProxy (Debian's `haproxy` package) in front of test backends, each server
//! weighted by an agent-check, with its runtime API on a Unix socket.
//!
//! The configuration is checked with `haproxy -c` first, then HAProxy runs in the
//! foreground (`-db`) with its output in a log file, and is killed on drop.

use super::ports;
use super::process::{run_bounded, Proc};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where Debian installs HAProxy.
pub const HAPROXY_BIN: &str = "/usr/sbin/haproxy";
/// How long a start may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// The `srv_admin_state` bit HAProxy sets when an agent answers `drain`
/// (`SRV_ADMF_DRAIN`-family flags: 0x08 forced drain, 0x10 inherited drain).
pub const ADMIN_DRAIN: u32 = 0x08 | 0x10;
/// The `srv_admin_state` bits of the maintenance modes.
pub const ADMIN_MAINT: u32 = 0x01 | 0x02 | 0x04 | 0x20 | 0x40;
/// `srv_op_state` of a server that is up.
pub const OP_RUNNING: u32 = 2;

/// How HAProxy runs.
#[derive(Debug, Clone)]
pub struct HaproxyOpts {
    /// `weight` of every server: the base the agent's percentage applies to.
    pub weight: u32,
    /// `agent-inter` in milliseconds.
    pub agent_inter_ms: u64,
    /// Health-check `inter` in milliseconds.
    pub check_inter_ms: u64,
    /// `balance` algorithm.
    pub balance: String,
    /// Extra lines for the backend section, such as `option http-server-close`.
    pub backend_lines: Vec<String>,
    /// `agent-send "SERVICE NAME\n"` on every server, naming it to an agent-check
    /// responder that answers for many (the aggregator's): the service's name.
    pub agent_send: Option<String>,
    /// `maxconn` in `global`: connections accepted at most (the frontend's limit too,
    /// which defaults to it). Each proxied connection takes two descriptors, and HAProxy
    /// (with `strict-limits`, its default since 2.4) refuses to start when it cannot
    /// raise its descriptor limit that far: within the hard limit of the process.
    pub maxconn: usize,
}

impl Default for HaproxyOpts {
    fn default() -> Self {
        HaproxyOpts {
            weight: 100,
            agent_inter_ms: 500,
            check_inter_ms: 500,
            balance: "roundrobin".to_string(),
            backend_lines: Vec::new(),
            agent_send: None,
            maxconn: 1024,
        }
    }
}

/// One server of the backend: its name, where it serves, and where its agent-check
/// responder listens.
#[derive(Debug, Clone)]
struct HaproxyServer {
    name: String,
    addr: SocketAddr,
    agent: SocketAddr,
}

/// One row of `show servers state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerState {
    /// `srv_name`.
    pub name: String,
    /// `srv_op_state`: 0 stopped, 1 starting, 2 running, 3 stopping.
    pub op_state: u32,
    /// `srv_admin_state`: bit flags, see [`ADMIN_DRAIN`] and [`ADMIN_MAINT`].
    pub admin_state: u32,
    /// `srv_uweight`: the weight in force, as the agent set it.
    pub uweight: u32,
    /// `srv_iweight`: the configured weight.
    pub iweight: u32,
    /// Every column by its header name.
    pub columns: BTreeMap<String, String>,
}

impl ServerState {
    /// In DRAIN: takes no new requests (except persistent ones).
    pub fn draining(&self) -> bool {
        self.admin_state & ADMIN_DRAIN != 0
    }

    /// Up and in no drain or maintenance mode.
    pub fn ready(&self) -> bool {
        self.op_state == OP_RUNNING && self.admin_state & (ADMIN_DRAIN | ADMIN_MAINT) == 0
    }

    /// The weight the balancer uses: 0 in drain, maintenance or down.
    pub fn effective_weight(&self) -> u32 {
        if self.ready() {
            self.uweight
        } else {
            0
        }
    }
}

/// A running HAProxy. Killed on drop.
pub struct Haproxy {
    frontend: SocketAddr,
    admin: PathBuf,
    config: String,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

/// One plain HTTP/1.1 request to `frontend` with `Connection: close`; returns the backend's name
/// from the body of a 200.
pub fn request(frontend: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&frontend, Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .and_then(|_| s.set_write_timeout(Some(Duration::from_secs(5))))
        .map_err(|e| format!("timeouts: {e}"))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: ballast-test\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut resp = Vec::new();
    s.take(64 * 1024)
        .read_to_end(&mut resp)
        .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&resp);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no end of head: {text:?}"))?;
    let status = head.lines().next().unwrap_or("");
    if !status.starts_with("HTTP/1.1 200") {
        return Err(status.to_string());
    }
    Ok(body.trim().to_string())
}

/// Fails the test, naming the package, unless HAProxy is installed.
pub fn require_haproxy() {
    assert!(
        Path::new(HAPROXY_BIN).is_file(),
        "{HAPROXY_BIN} not found: the HAProxy test runs the real HAProxy. Install Debian's \
         package `haproxy` (`apt-get install haproxy`; tests/run does)."
    );
}

fn haproxy_command() -> Command {
    let mut cmd = Command::new(HAPROXY_BIN);
    cmd.stdin(std::process::Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

impl Haproxy {
    /// Starts HAProxy with a frontend on `127.0.0.1:frontend_port` (0: a free port,
    /// retried if another process takes it first) balancing over `servers`, each given
    /// as (server name, backend address, agent-check address), and waits until its
    /// runtime API and frontend answer.
    pub fn start(
        frontend_port: u16,
        servers: &[(&str, SocketAddr, SocketAddr)],
        opts: &HaproxyOpts,
    ) -> Haproxy {
        require_haproxy();
        let servers: Vec<HaproxyServer> = servers
            .iter()
            .map(|&(name, addr, agent)| HaproxyServer {
                name: name.to_string(),
                addr,
                agent,
            })
            .collect();
        assert!(!servers.is_empty(), "HAProxy needs at least one server");
        for s in &servers {
            assert!(
                s.addr.ip().is_loopback() && s.agent.ip().is_loopback(),
                "loopback only: {s:?}"
            );
        }
        // Short path: a Unix socket path must fit in 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("hap-")
            .tempdir()
            .expect("temporary directory for HAProxy");
        let admin = dir.path().join("admin.sock");
        let attempts = if frontend_port == 0 { 5 } else { 1 };
        let mut last = String::new();
        for attempt in 1..=attempts {
            let port = if frontend_port == 0 {
                ports::free_tcp()
            } else {
                frontend_port
            };
            let frontend = SocketAddr::from(([127, 0, 0, 1], port));
            let config = config_text(frontend, &admin, &servers, opts);
            let cfg = dir.path().join("haproxy.cfg");
            std::fs::write(&cfg, &config).expect("write haproxy.cfg");

            let mut check = haproxy_command();
            check.arg("-c").arg("-f").arg(&cfg);
            let out = run_bounded(check, Duration::from_secs(20));
            assert!(
                out.status.success(),
                "`haproxy -c` rejects the configuration ({}):\n{}{}\n--- haproxy.cfg ---\n{config}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );

            let _ = std::fs::remove_file(&admin);
            let log = dir.path().join(format!("haproxy-{attempt}.log"));
            let mut cmd = haproxy_command();
            cmd.arg("-db").arg("-f").arg(&cfg);
            let mut proc = Proc::spawn(cmd, "haproxy", &log, 30);
            match wait_ready(&mut proc, frontend, &admin) {
                Ok(()) => {
                    return Haproxy {
                        frontend,
                        admin,
                        config,
                        proc: Some(proc),
                        dir,
                    }
                }
                Err(tail) if tail.contains("cannot bind") && attempt < attempts => {
                    last = tail;
                }
                Err(tail) => {
                    panic!("HAProxy did not start:\n{tail}\n--- haproxy.cfg ---\n{config}")
                }
            }
        }
        panic!("HAProxy could not bind a free frontend port: {last}");
    }

    /// The frontend clients send requests to.
    pub fn frontend(&self) -> SocketAddr {
        self.frontend
    }

    /// The runtime API's Unix socket.
    pub fn admin_socket(&self) -> &Path {
        &self.admin
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &str {
        &self.config
    }

    /// Its temporary directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The end of its log (warnings such as "enters drain state" are there).
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc
            .as_ref()
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::is_running)
    }

    /// One runtime-API command (e.g. `show info`); returns the whole answer.
    pub fn try_command(&self, cmd: &str) -> Result<String, String> {
        admin_command(&self.admin, cmd)
    }

    /// One runtime-API command; panics if the socket does not answer.
    pub fn command(&self, cmd: &str) -> String {
        self.try_command(cmd).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `show servers state`, parsed: each server's state by name.
    pub fn try_show_servers_state(&self) -> Result<BTreeMap<String, ServerState>, String> {
        parse_servers_state(&self.try_command("show servers state")?)
    }

    /// `show servers state`, parsed; panics if the runtime API fails.
    pub fn show_servers_state(&self) -> BTreeMap<String, ServerState> {
        self.try_show_servers_state()
            .unwrap_or_else(|e| panic!("show servers state: {e}"))
    }

    /// One column of `show stat` (such as `agent_status`) for every server, by server
    /// name; the frontend's and the backend's own rows are left out.
    pub fn stat_column(&self, column: &str) -> Result<BTreeMap<String, String>, String> {
        parse_stat_column(&self.try_command("show stat")?, column)
    }

    /// The weights in force (`srv_uweight`) by server name.
    pub fn weights(&self) -> BTreeMap<String, u32> {
        self.show_servers_state()
            .into_iter()
            .map(|(k, v)| (k, v.uweight))
            .collect()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        self.proc.take();
    }
}

fn config_text(
    frontend: SocketAddr,
    admin: &Path,
    servers: &[HaproxyServer],
    opts: &HaproxyOpts,
) -> String {
    let mut text = format!(
        "# Written by the Ballast test harness.\n\
         global\n\
         \x20   stats socket {admin} mode 600 level admin\n\
         \x20   maxconn {maxconn}\n\
         \n\
         defaults\n\
         \x20   mode http\n\
         \x20   timeout connect 2s\n\
         \x20   timeout client 10s\n\
         \x20   timeout server 10s\n\
         \x20   timeout check 2s\n\
         \n\
         frontend fe\n\
         \x20   bind {frontend}\n\
         \x20   default_backend be\n\
         \n\
         backend be\n\
         \x20   balance {balance}\n",
        admin = admin.display(),
        balance = opts.balance,
        maxconn = opts.maxconn,
    );
    for line in &opts.backend_lines {
        text.push_str(&format!("    {line}\n"));
    }
    for s in servers {
        // HAProxy reads `\n` inside double quotes as a newline.
        let send = opts
            .agent_send
            .as_ref()
            .map(|service| format!(" agent-send \"{service} {}\\n\"", s.name))
            .unwrap_or_default();
        text.push_str(&format!(
            "    server {name} {addr} weight {weight} agent-check agent-addr {aip} \
             agent-port {aport}{send} agent-inter {ai}ms check inter {ci}ms\n",
            name = s.name,
            addr = s.addr,
            weight = opts.weight,
            aip = s.agent.ip(),
            aport = s.agent.port(),
            ai = opts.agent_inter_ms,
            ci = opts.check_inter_ms,
        ));
    }
    text
}

fn wait_ready(proc: &mut Proc, frontend: SocketAddr, admin: &Path) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(status) = proc.exit_status() {
            return Err(format!("haproxy exited ({status}):\n{}", proc.log_tail(30)));
        }
        let api = admin_command(admin, "show info")
            .is_ok_and(|info| info.contains(&format!("Pid: {}", proc.pid())));
        if api && TcpStream::connect_timeout(&frontend, Duration::from_secs(1)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "haproxy did not answer on {} and {frontend} within {START_TIMEOUT:?}:\n{}",
                admin.display(),
                proc.log_tail(30)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One column of `show stat`'s CSV for every server row, by server name. Fails when
/// the header has no such column or a row is short of it.
pub fn parse_stat_column(text: &str, column: &str) -> Result<BTreeMap<String, String>, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = lines
        .next()
        .and_then(|h| h.strip_prefix("# "))
        .ok_or_else(|| format!("show stat: no header in {text:?}"))?;
    let names: Vec<&str> = header.split(',').collect();
    let col = |name: &str| {
        names
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| format!("show stat: no column {name} in {header:?}"))
    };
    let (sv, want) = (col("svname")?, col(column)?);
    let mut out = BTreeMap::new();
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let (Some(name), Some(value)) = (cells.get(sv), cells.get(want)) else {
            return Err(format!("show stat: a short row {line:?}"));
        };
        if *name != "FRONTEND" && *name != "BACKEND" {
            out.insert(name.to_string(), value.to_string());
        }
    }
    Ok(out)
}

/// Sends one command to a runtime-API socket and reads the answer to its end.
pub fn admin_command(socket: &Path, cmd: &str) -> Result<String, String> {
    let what = format!("HAProxy runtime API {} `{cmd}`", socket.display());
    super::process::unix_request(socket, &format!("{cmd}\n"), 4 << 20, &what)
}

/// Parses `show servers state` (format version 1): a version line, a `#` header that
/// names the columns, then one row per server.
pub fn parse_servers_state(text: &str) -> Result<BTreeMap<String, ServerState>, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let version = lines.next().ok_or("empty answer")?;
    if version != "1" {
        return Err(format!("unknown format version {version:?}: {text}"));
    }
    let header: Vec<&str> = lines
        .next()
        .and_then(|h| h.strip_prefix('#'))
        .ok_or_else(|| format!("no header line: {text}"))?
        .split_whitespace()
        .collect();
    let mut out = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < header.len() {
            return Err(format!("short row {line:?} for header {header:?}"));
        }
        let columns: BTreeMap<String, String> = header
            .iter()
            .zip(&fields)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let num = |k: &str| -> Result<u32, String> {
            columns
                .get(k)
                .ok_or_else(|| format!("no column {k} in {header:?}"))?
                .parse()
                .map_err(|e| format!("column {k} of {line:?}: {e}"))
        };
        let state = ServerState {
            name: columns
                .get("srv_name")
                .ok_or_else(|| format!("no column srv_name in {header:?}"))?
                .clone(),
            op_state: num("srv_op_state")?,
            admin_state: num("srv_admin_state")?,
            uweight: num("srv_uweight")?,
            iweight: num("srv_iweight")?,
            columns,
        };
        out.insert(state.name.clone(), state);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_show_servers_state() {
        // As HAProxy 2.6 prints it, one server drained by its agent.
        let text = "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state \
            srv_uweight srv_iweight srv_time_since_last_change srv_check_status \
            srv_check_result srv_check_health srv_check_state srv_agent_state bk_f_forced_id \
            srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port \
            srv_check_addr srv_agent_addr srv_agent_port\n\
            3 be 1 s1 127.0.0.1 2 8 58 100 1 6 3 4 6 22 0 0 - 18081 - 0 0 - 127.0.0.1 18091\n\
            3 be 2 s2 127.0.0.1 2 0 256 100 2 6 3 4 6 22 0 0 - 18082 - 0 0 - 127.0.0.1 18092\n\n";
        let s = parse_servers_state(text).expect("parses");
        assert_eq!(s.len(), 2);
        assert_eq!(s["s1"].uweight, 58);
        assert!(s["s1"].draining() && !s["s1"].ready());
        assert_eq!(s["s1"].effective_weight(), 0);
        assert_eq!(s["s2"].uweight, 256);
        assert_eq!(s["s2"].iweight, 100);
        assert!(s["s2"].ready());
        assert_eq!(s["s2"].columns["srv_agent_port"], "18092");
        assert!(parse_servers_state("2\n# x\n").is_err());
    }

    #[test]
    fn parses_a_column_of_show_stat() {
        // The head of HAProxy 2.6's CSV, cut short: a frontend, two servers (one whose
        // agent cannot be reached), the backend.
        let text = "# pxname,svname,qcur,status,agent_status,agent_code\n\
            fe,FRONTEND,,OPEN,,\n\
            be,s1,0,UP,L7OK,\n\
            be,s2,0,UP,L4CON,\n\
            be,BACKEND,0,UP,,\n\n";
        let c = parse_stat_column(text, "agent_status").expect("parses");
        assert_eq!(c.len(), 2);
        assert_eq!(c["s1"], "L7OK");
        assert_eq!(c["s2"], "L4CON");
        assert!(parse_stat_column(text, "no_such_column").is_err());
        assert!(parse_stat_column("be,s1\n", "svname").is_err());
        assert!(parse_stat_column("# pxname,svname,x\nbe,s1\n", "x").is_err());
    }
}
