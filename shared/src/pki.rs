//! A small certificate authority, so that a first run needs no openssl: the
//! aggregator's `certs init`, `certs issue` and `certs revoke`, the demo and the tests
//! all issue certificates and revocation lists here.
//!
//! A node certificate names its node (a DNS subject alternative name and the common
//! name) and the services the node may serve, one URI subject alternative name
//! [`SERVICE_URI_PREFIX`]`NAME` each, and it expires ([`DEFAULT_VALIDITY`] unless told
//! otherwise).
//!
//! A relay certificate ([`Ca::issue_relay`]) names a relay and carries the role
//! [`ROLE_URI_PREFIX`]`relay`: a relay dials aggregators as a TLS client on behalf of
//! the agents that connect to it, and may serve no service of its own.
//!
//! The certificate authority itself ([`Ca`], with rcgen) is behind the `pki` feature:
//! the aggregator, its tools and the tests issue certificates; the agent only reads
//! them, and links neither rcgen nor its dependencies.

use std::time::Duration;

/// How a node certificate names a service it may serve: this prefix, then the
/// service's name, as a URI subject alternative name.
pub const SERVICE_URI_PREFIX: &str = "ballast://service/";

/// How a certificate names a role its holder plays: this prefix, then the role's name,
/// as a URI subject alternative name. A certificate without one is a node's.
pub const ROLE_URI_PREFIX: &str = "ballast://role/";

/// The role of a relay's certificate ([`ROLE_URI_PREFIX`]`relay`).
pub const RELAY_ROLE: &str = "relay";

/// How long a node certificate is valid unless told otherwise: one year.
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

#[cfg(feature = "pki")]
mod ca;
#[cfg(feature = "pki")]
pub use ca::{Ca, Issued, NodeSpec, Pem, PkiError, RelaySpec, RevocationList, Revoked};

/// `unix_s` as an RFC 3339 UTC time, e.g. `2027-05-01T12:00:00Z`, for people.
pub fn rfc3339(unix_s: i64) -> String {
    // Days to civil date: Howard Hinnant's algorithm, proleptic Gregorian calendar.
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// Whether `name` may be named as a service in a certificate.
pub fn is_valid_service(name: &str) -> bool {
    !name.is_empty() && name.len() <= crate::wire::MAX_SERVICE && crate::wire::is_valid_name(name)
}

/// Whether `name` may be named as a role in a certificate: the rules of service names.
pub fn is_valid_role(name: &str) -> bool {
    is_valid_service(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
        assert_eq!(rfc3339(-86_400), "1969-12-31T00:00:00Z");
    }
}
