//! `[limits]`: how much a broken or hostile peer can make the aggregator hold. Every
//! limit has a default sized for a large fleet, and a metric that counts refusals when
//! it bites (`docs/security.md` lists them).

use crate::InvalidSetting;
use serde::{Deserialize, Serialize};

/// The `[limits]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Services in all; a hello that would create one more is refused.
    pub max_services: usize,
    /// Endpoints in one service.
    pub max_endpoints_per_service: usize,
    /// Services one node (certificate identity) may serve at once. A hello for one
    /// more first forgets the node's registrations in other services that have gone
    /// silent (a node moved to another service), and is refused if that is not enough.
    pub services_per_identity: usize,
    /// Agent connections open at once, handshakes included; more are refused before
    /// any cryptography.
    pub quic_max_connections: usize,
    /// Sessions one node may hold at once, its direct connections and its agents
    /// attached through relays' trunks together (a reconnecting agent briefly has
    /// two).
    pub quic_max_connections_per_identity: usize,
    /// Whether a new connection must first prove its source address with a QUIC Retry
    /// (one more round trip), so that spoofed floods cost no handshake.
    pub quic_retry: bool,
    /// Datagrams one connection may send per second, sustained (twice that in a
    /// burst); the rest are dropped unread, before they reach the balancer.
    pub quic_max_datagrams_per_second: u32,
    /// How long an established connection may go without a report before it is
    /// closed, in milliseconds; at least five report intervals are always allowed.
    pub quic_report_timeout_ms: u64,
    /// Agents one relay's trunk may hold attached at once; more attaches are refused
    /// (`limit_reached`).
    pub trunk_max_slots: u32,
    /// Attaches one relay's trunk may make per second, sustained; more are refused
    /// (`attach_rate`). Sized so that a relay re-attaches every agent of a dead owner
    /// within its failover hold.
    pub trunk_attach_rate: u32,
    /// Attaches one relay's trunk may make at once, above the sustained rate.
    pub trunk_attach_burst: u32,
    /// Open xDS (ADS) streams in all; more are refused with `RESOURCE_EXHAUSTED`.
    pub xds_max_streams: usize,
    /// Open xDS streams from one source address; more are refused with
    /// `RESOURCE_EXHAUSTED`.
    pub xds_max_streams_per_source: usize,
    /// TCP connections to the xDS listener in all; more are closed at once, before
    /// any TLS.
    pub xds_max_connections: usize,
    /// TCP connections to the xDS listener from one source address.
    pub xds_max_connections_per_source: usize,
    /// Concurrent HTTP/2 streams on one xDS connection.
    pub xds_max_streams_per_connection: u32,
    /// The largest xDS request accepted, in bytes.
    pub xds_max_request_bytes: usize,
    /// The most resource names one xDS request may subscribe to.
    pub xds_max_resource_names: usize,
    /// The most resource names one xDS stream may keep subscribed, over all types.
    pub xds_max_names_per_stream: usize,
    /// The most bytes one xDS stream may keep for its subscriptions and its client's
    /// node: each name's length and a fixed cost per name, the node id and zone.
    pub xds_max_stream_bytes: usize,
    /// The longest `node.id`, and the longest `node.locality.zone`, in bytes.
    pub xds_max_node_bytes: usize,
    /// Open HTTP API connections; more wait in the kernel's backlog.
    pub http_max_connections: usize,
    /// How long an HTTP connection may take to send its first request, in
    /// milliseconds: a client that trickles its headers is cut off.
    pub http_request_timeout_ms: u64,
    /// How long an HTTP connection may stay without a byte either way, in
    /// milliseconds. Watch streams send a keep-alive every 15 s, so a watcher that
    /// reads is never idle; one that stops reading is.
    pub http_idle_timeout_ms: u64,
    /// Open watch streams (`?watch=true`); more are refused with 503. Below
    /// `http_max_connections`, so that watchers cannot take every connection from
    /// `/healthz` and `/metrics`.
    pub watch_max_streams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        let ingest = ballast_ingest::Limits::default();
        Limits {
            // The balancing core's defaults (the aggregator's tests hold the two equal).
            max_services: 10_000,
            max_endpoints_per_service: 50_000,
            services_per_identity: 1,
            quic_max_connections: ingest.quic_max_connections,
            quic_max_connections_per_identity: ingest.quic_max_connections_per_identity,
            quic_retry: ingest.quic_retry,
            quic_max_datagrams_per_second: ingest.quic_max_datagrams_per_second,
            quic_report_timeout_ms: ingest.quic_report_timeout_ms,
            trunk_max_slots: ingest.trunk_max_slots,
            trunk_attach_rate: ingest.trunk_attach_rate,
            trunk_attach_burst: ingest.trunk_attach_burst,
            xds_max_streams: 10_000,
            xds_max_streams_per_source: 256,
            xds_max_connections: 4096,
            xds_max_connections_per_source: 64,
            xds_max_streams_per_connection: 16,
            xds_max_request_bytes: 1024 * 1024,
            xds_max_resource_names: 10_000,
            xds_max_names_per_stream: 10_000,
            xds_max_stream_bytes: 256 * 1024,
            xds_max_node_bytes: 1024,
            http_max_connections: 1024,
            http_request_timeout_ms: 10_000,
            http_idle_timeout_ms: 60_000,
            watch_max_streams: 768,
        }
    }
}

impl Limits {
    /// The limits ingest holds agents' connections and relays' trunks to.
    pub fn ingest(&self) -> ballast_ingest::Limits {
        ballast_ingest::Limits {
            quic_max_connections: self.quic_max_connections,
            quic_max_connections_per_identity: self.quic_max_connections_per_identity,
            quic_retry: self.quic_retry,
            quic_max_datagrams_per_second: self.quic_max_datagrams_per_second,
            quic_report_timeout_ms: self.quic_report_timeout_ms,
            trunk_max_slots: self.trunk_max_slots,
            trunk_attach_rate: self.trunk_attach_rate,
            trunk_attach_burst: self.trunk_attach_burst,
        }
    }

    /// The limits the HTTP listener holds its connections to.
    pub fn http(&self) -> ballast_ingest::http_listener::HttpLimits {
        ballast_ingest::http_listener::HttpLimits {
            max_connections: self.http_max_connections,
            request_timeout: std::time::Duration::from_millis(self.http_request_timeout_ms),
            idle_timeout: std::time::Duration::from_millis(self.http_idle_timeout_ms),
        }
    }

    /// Checks that every limit admits something.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let positive: [(&str, u64); 24] = [
            ("max_services", self.max_services as u64),
            (
                "max_endpoints_per_service",
                self.max_endpoints_per_service as u64,
            ),
            ("services_per_identity", self.services_per_identity as u64),
            ("quic_max_connections", self.quic_max_connections as u64),
            (
                "quic_max_connections_per_identity",
                self.quic_max_connections_per_identity as u64,
            ),
            (
                "quic_max_datagrams_per_second",
                u64::from(self.quic_max_datagrams_per_second),
            ),
            ("quic_report_timeout_ms", self.quic_report_timeout_ms),
            ("trunk_max_slots", u64::from(self.trunk_max_slots)),
            ("trunk_attach_rate", u64::from(self.trunk_attach_rate)),
            ("trunk_attach_burst", u64::from(self.trunk_attach_burst)),
            ("xds_max_streams", self.xds_max_streams as u64),
            (
                "xds_max_streams_per_source",
                self.xds_max_streams_per_source as u64,
            ),
            ("xds_max_connections", self.xds_max_connections as u64),
            (
                "xds_max_connections_per_source",
                self.xds_max_connections_per_source as u64,
            ),
            (
                "xds_max_names_per_stream",
                self.xds_max_names_per_stream as u64,
            ),
            ("xds_max_stream_bytes", self.xds_max_stream_bytes as u64),
            ("xds_max_node_bytes", self.xds_max_node_bytes as u64),
            (
                "xds_max_streams_per_connection",
                u64::from(self.xds_max_streams_per_connection),
            ),
            ("xds_max_request_bytes", self.xds_max_request_bytes as u64),
            ("xds_max_resource_names", self.xds_max_resource_names as u64),
            ("http_max_connections", self.http_max_connections as u64),
            ("http_request_timeout_ms", self.http_request_timeout_ms),
            ("http_idle_timeout_ms", self.http_idle_timeout_ms),
            ("watch_max_streams", self.watch_max_streams as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(InvalidSetting::new(
                    format!("limits.{name}"),
                    "must be at least 1",
                ));
            }
        }
        if self.xds_max_request_bytes < 1024 {
            return Err(InvalidSetting::new(
                "limits.xds_max_request_bytes",
                "must be at least 1024",
            ));
        }
        if self.watch_max_streams >= self.http_max_connections {
            return Err(InvalidSetting::new(
                "limits.watch_max_streams",
                format!(
                    "must be below http_max_connections ({}): watch streams hold their \
                     connections, and /healthz and /metrics need one",
                    self.http_max_connections
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_zero_is_refused() {
        assert_eq!(Limits::default().validate(), Ok(()));
        let l = Limits {
            watch_max_streams: 0,
            ..Limits::default()
        };
        assert_eq!(
            l.validate().map_err(|e| e.setting),
            Err("limits.watch_max_streams".to_string())
        );
    }

    #[test]
    fn watch_streams_must_leave_connections_for_the_rest_of_the_api() {
        let at = Limits {
            http_max_connections: 64,
            watch_max_streams: 64,
            ..Limits::default()
        };
        let err = at.validate().expect_err("as many watches as connections");
        assert_eq!(err.setting, "limits.watch_max_streams");
        assert!(err.reason.contains("http_max_connections (64)"), "{err}");
        let below = Limits {
            watch_max_streams: 63,
            ..at
        };
        assert_eq!(below.validate(), Ok(()));
        let d = Limits::default();
        assert!(d.watch_max_streams < d.http_max_connections);
    }
}
