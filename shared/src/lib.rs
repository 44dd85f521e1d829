//! Code that both ends of a Ballast deployment must agree on: the wire protocol and TLS
//! set-up. The load arithmetic and the sink mappings live in `ballast-balance`.

pub mod config;
pub mod frame;
#[cfg(feature = "gate-probe")]
pub mod gate_probe;
pub mod pki;
pub mod protocol;
pub mod reconnect;
pub mod session;
pub mod tls;
pub mod trunk;
pub mod wire;

/// The ALPN protocol name of the current agent protocol. Its suffix is the protocol
/// version, so an agent and an aggregator that cannot understand each other fail the
/// handshake instead of exchanging bytes neither can decode; agents offer the previous
/// version too, and aggregators accept both ([`protocol`]).
pub const ALPN: &[u8] = b"ballast/2";

/// The version of the Ballast software, carried in the agent's hello.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Milliseconds since the Unix epoch, for timestamps that cross machines.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// An error and its causes on one line, for people. Each cause is added unless its
/// text already appears: Ballast's own errors name their cause in their message, so
/// that a log line carries it, and a plain walk of the chain would say it twice.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_chain_states_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot bind: {source}")]
        struct Bind {
            source: std::io::Error,
        }
        let inner = std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use");
        let e = Bind { source: inner };
        assert_eq!(super::error_chain(&e), "cannot bind: address in use");
    }
}
