//! Free loopback ports. The kernel picks them; a process-wide set makes sure two tests
//! of one binary, running in parallel threads, never get the same one.

use std::collections::BTreeSet;
use std::net::{TcpListener, UdpSocket};
use std::sync::Mutex;

static HANDED_OUT: Mutex<BTreeSet<(bool, u16)>> = Mutex::new(BTreeSet::new());

fn pick(udp: bool) -> u16 {
    for _ in 0..100 {
        let port = if udp {
            UdpSocket::bind("127.0.0.1:0")
                .and_then(|s| s.local_addr())
                .map(|a| a.port())
        } else {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|s| s.local_addr())
                .map(|a| a.port())
        }
        .expect("bind a loopback socket to find a free port");
        let mut handed = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        if handed.insert((udp, port)) {
            return port;
        }
    }
    panic!("no fresh free port after 100 tries");
}

/// A UDP port on 127.0.0.1 that was free a moment ago.
pub fn free_udp() -> u16 {
    pick(true)
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_tcp() -> u16 {
    pick(false)
}
