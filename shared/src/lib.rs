//! Code that both ends of a Ballast deployment must agree on: the wire protocol, the
//! load arithmetic, the integer mappings for each load-balancer sink, and TLS set-up.

pub mod config;
pub mod frame;
pub mod load;
pub mod pki;
pub mod tls;
pub mod wire;

/// The ALPN protocol name. Its suffix is the protocol version, so an agent and an
/// aggregator that cannot understand each other fail the handshake instead of
/// exchanging bytes neither can decode.
pub const ALPN: &[u8] = b"ballast/1";

/// The version of the Ballast software, carried in the agent's hello.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Milliseconds since the Unix epoch, for timestamps that cross machines.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
