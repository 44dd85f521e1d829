//! The `/proc` files the agent's samplers read: `/proc/PID/stat` (process trees),
//! `/proc/stat` (host CPU) and `/proc/net/tcp{,6}` (connections), each on the input
//! (real files in the seeds) and on text rendered from values drawn from it, as the
//! kernel formats it.
//!
//! Invariants: nothing panics; busy ≤ total; utilization within [0, 1]; owed ≤
//! established; a rendered line parses back to its values (a command name with spaces
//! and parentheses included, the nice value too), and a rendered table counts exactly
//! its sockets.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use ballast_agent::fuzzing::{proc_net_tcp, proc_pid_stat, proc_stat};
use ballast_agent::sample::host::{utilization, CpuTimes};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Socket {
    local_port: u16,
    remote_port: u16,
    state: u8,
    tx_queue: u32,
    rx_queue: u32,
    v6: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    which: u8,
    ports: Vec<u16>,
    // /proc/PID/stat
    pid: u32,
    comm: String,
    state: char,
    ppid: u32,
    times: [u64; 4],
    negative_child_times: bool,
    nice: i8,
    start: u64,
    // /proc/stat
    counters: [u64; 10],
    // /proc/net/tcp
    sockets: Vec<Socket>,
}

fuzz_target!(|data: &[u8]| {
    // The input as each file: each parser refuses the others' formats.
    let text = String::from_utf8_lossy(data);
    if let Ok(s) = proc_pid_stat(&text) {
        assert!(!s.state.is_whitespace());
    }
    let host = proc_stat(&text);
    if let Ok(t) = host {
        assert!(t.busy <= t.total, "{t:?}");
    }
    let ports = [80, 8080, 7400];
    if let Ok(c) = proc_net_tcp(data, &ports) {
        assert!(c.owed <= c.established);
    }
    // Files rendered from values drawn from the input.
    let Ok(input) = Unstructured::new(data).arbitrary::<Input>() else {
        return;
    };
    match input.which % 3 {
        0 => pid_stat(&input),
        1 => host_stat(&input, host.ok()),
        _ => net_tcp(&input),
    }
});

fn pid_stat(input: &Input) {
    // The kernel's state is a letter.
    if !input.state.is_ascii_alphabetic() {
        return;
    }
    let [ut, st, cut, cst] = input.times;
    let (cut_text, cst_text, children) = if input.negative_child_times {
        // Signed in the kernel's format; a negative one counts as 0.
        (format!("-{cut}"), format!("-{cst}"), 0u64)
    } else {
        (cut.to_string(), cst.to_string(), cut.saturating_add(cst))
    };
    let (pid, comm, state, ppid, start) =
        (input.pid, &input.comm, input.state, input.ppid, input.start);
    // The kernel's nice values, and the priority it prints beside them.
    let nice = i64::from(input.nice.clamp(-20, 19));
    let prio = 20 + nice;
    let line = format!(
        "{pid} ({comm}) {state} {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 {ut} {st} {cut_text} {cst_text} \
         {prio} {nice} 1 0 {start} 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n"
    );
    // A negative child time must fit the kernel's signed field.
    let fits = |x: u64| x <= 1u64 << 63;
    if input.negative_child_times && !(fits(cut) && fits(cst)) {
        assert!(proc_pid_stat(&line).is_err(), "{line:?}");
        return;
    }
    let s = proc_pid_stat(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(s.state, state);
    assert_eq!(s.ppid, ppid);
    assert_eq!(s.start_time, start);
    assert_eq!(s.nice, nice);
    assert_eq!(s.own_ticks, ut.saturating_add(st), "{line:?}");
    assert_eq!(
        s.ticks,
        ut.saturating_add(st).saturating_add(children),
        "{line:?}"
    );
}

fn host_stat(input: &Input, before: Option<CpuTimes>) {
    let c = input.counters;
    let text = format!(
        "cpu  {} {} {} {} {} {} {} {} {} {}\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2 3\nctxt 100\n",
        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9]
    );
    let t = proc_stat(&text).expect("a well-formed /proc/stat");
    // Niced time (c[1]) is idle to the service: in the total, not in busy.
    let busy = [c[0], c[2], c[5], c[6], c[7]]
        .iter()
        .fold(0u64, |a, x| a.saturating_add(*x));
    assert_eq!(t.busy, busy);
    assert_eq!(
        t.total,
        busy.saturating_add(c[1])
            .saturating_add(c[3])
            .saturating_add(c[4])
    );
    if let Some(x) = before.and_then(|u| utilization(u, t)) {
        assert!((0.0..=1.0).contains(&x), "{x}");
    }
}

fn net_tcp(input: &Input) {
    let ports = &input.ports;
    let mut text = String::from(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n",
    );
    let (mut established, mut owed) = (0u32, 0u32);
    for (i, s) in input.sockets.iter().take(256).enumerate() {
        let (local, remote) = if s.v6 {
            (
                "0000000000000000FFFF00000100007F",
                "00000000000000000000000001000000",
            )
        } else {
            ("0100007F", "0A000001")
        };
        text.push_str(&format!(
            "{i:4}: {local}:{:04X} {remote}:{:04X} {:02X} {:08X}:{:08X} 00:00000000 00000000     0        0 {} 1 0000000000000000 20 4 30 10 -1\n",
            s.local_port, s.remote_port, s.state, s.tx_queue, s.rx_queue, 1000 + i
        ));
        if s.state == 1 && ports.contains(&s.local_port) {
            established += 1;
            owed += u32::from(s.rx_queue > 0);
        }
    }
    let c = proc_net_tcp(text.as_bytes(), ports).expect("a well-formed table");
    assert_eq!((c.established, c.owed), (established, owed), "{text}");
}
