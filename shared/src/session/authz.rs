//! What a connection may claim in its hello, as values: the driver works out a
//! [`Peer`] from the handshake (the certificate's identity and services, the
//! aggregator's policy, the connection's source address) and the session checks each
//! hello against it.
//!
//! - A hello may name only a service its [`Grant`] allows.
//! - The advertised address must be the connection's source address, or in a network
//!   the grant allows (an agent that reports for a node behind NAT, say). A host name
//!   cannot be checked against anything, so it is refused unless the grant allows it
//!   by name.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// A network: an address and a prefix length, such as `10.0.0.0/8` or `fd00::/8`.
/// A bare address is a network of that one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// Why a network did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a network (an address, or address/prefix such as 10.0.0.0/8)")]
pub struct CidrError(pub String);

impl Cidr {
    /// Every address of both families: `0.0.0.0/0` and `::/0`.
    pub fn any() -> [Cidr; 2] {
        [
            Cidr {
                addr: IpAddr::from([0u8; 4]),
                prefix: 0,
            },
            Cidr {
                addr: IpAddr::from([0u16; 8]),
                prefix: 0,
            },
        ]
    }

    /// Whether `ip` is in the network. An IPv4 address mapped into IPv6
    /// (`::ffff:a.b.c.d`) is the IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let full = usize::from(prefix / 8);
    let rest = prefix % 8;
    if a.get(..full) != b.get(..full) {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    match (a.get(full), b.get(full)) {
        (Some(x), Some(y)) => x & mask == y & mask,
        _ => false,
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CidrError(s.to_string());
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.trim().parse().map_err(|_| bad())?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().map_err(|_| bad())?,
            None => max,
        };
        if prefix > max {
            return Err(bad());
        }
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Whether `text` matches the glob `pattern`: `*` is any run of characters (none
/// included), `?` any one character, everything else itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matching with backtracking to the last star: linear in practice and
    // never worse than O(p·t), whatever the pattern.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// What a connection's hellos may claim, besides the node its certificate names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    /// The services it may serve: names, or glob patterns such as `web-*`. None: it
    /// may serve nothing.
    pub services: Vec<String>,
    /// Networks its advertised address may be in, besides the connection's own source
    /// address (which is always allowed).
    pub networks: Vec<Cidr>,
    /// Host names (glob patterns, compared without regard to case) its advertised
    /// address may name. None: only IP addresses are accepted.
    pub hostnames: Vec<String>,
}

impl Grant {
    /// A grant of any service, any address and any host name: the behaviour of a
    /// deployment that authorizes nothing beyond the node's identity.
    pub fn anything() -> Self {
        Grant {
            services: vec!["*".to_string()],
            networks: Cidr::any().to_vec(),
            hostnames: vec!["*".to_string()],
        }
    }

    /// Whether it allows serving `service`.
    pub fn allows_service(&self, service: &str) -> bool {
        self.services.iter().any(|p| glob_match(p, service))
    }

    /// Whether it allows advertising `address` (`host:port` or `[v6]:port`) on a
    /// connection from `source`; why not, if it does not.
    pub fn check_address(&self, address: &str, source: IpAddr) -> Result<(), AddressRefusal> {
        let host = address
            .rsplit_once(':')
            .map_or(address, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        match host.parse::<IpAddr>() {
            Ok(ip) => {
                let ip = ip.to_canonical();
                let source = source.to_canonical();
                if ip == source || self.networks.iter().any(|n| n.contains(ip)) {
                    Ok(())
                } else {
                    Err(AddressRefusal::NotSource { ip, from: source })
                }
            }
            Err(_) => {
                let lower = host.to_ascii_lowercase();
                if self
                    .hostnames
                    .iter()
                    .any(|p| glob_match(&p.to_ascii_lowercase(), &lower))
                {
                    Ok(())
                } else {
                    Err(AddressRefusal::HostName(host.to_string()))
                }
            }
        }
    }
}

/// Why an advertised address is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressRefusal {
    /// An IP address that is neither the connection's source nor in an allowed network.
    #[error(
        "address {ip} is not the connection's source address {from}, nor in a network \
         the policy allows for this node"
    )]
    NotSource {
        /// The advertised IP.
        ip: IpAddr,
        /// Where the connection comes from.
        from: IpAddr,
    },
    /// A host name the policy does not allow: it could point anywhere.
    #[error(
        "address {0:?} is a host name, which cannot be checked against the connection; \
         advertise an IP address, or allow the name in the policy"
    )]
    HostName(String),
}

/// Who is at the other end of a connection, as the handshake and the aggregator's
/// policy say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The node identity its certificate names.
    pub identity: String,
    /// The connection's source address.
    pub source: IpAddr,
    /// What its hellos may claim.
    pub grant: Grant,
}

impl Peer {
    /// A peer whose hellos may claim anything but another node: for callers that
    /// authorize nothing beyond identity (tests, tools).
    pub fn trusted(identity: impl Into<String>, source: IpAddr) -> Self {
        Peer {
            identity: identity.into(),
            source,
            grant: Grant::anything(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn networks_contain_their_addresses_only() {
        let net: Cidr = "10.1.0.0/16".parse().expect("cidr");
        assert!(net.contains(ip("10.1.2.3")));
        assert!(net.contains(ip("::ffff:10.1.2.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(!net.contains(ip("fd00::1")));
        let odd: Cidr = "192.168.0.128/25".parse().expect("cidr");
        assert!(odd.contains(ip("192.168.0.200")));
        assert!(!odd.contains(ip("192.168.0.127")));
        let one: Cidr = "fd00::7".parse().expect("cidr");
        assert!(one.contains(ip("fd00::7")) && !one.contains(ip("fd00::8")));
        for all in Cidr::any() {
            assert!(all.contains(ip("1.2.3.4")) || all.contains(ip("2001:db8::1")));
        }
        for bad in ["10.0.0.0/33", "::/129", "10.0.0/8", "x", "10.0.0.0/-1", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert_eq!(net.to_string(), "10.1.0.0/16");
    }

    #[test]
    fn globs() {
        assert!(glob_match("web-*", "web-7"));
        assert!(glob_match("web-*", "web-"));
        assert!(!glob_match("web-*", "batch-7"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*-7", "batch-7"));
        assert!(glob_match("a*b*c", "axxbyyc"));
        assert!(!glob_match("a*b*c", "axxbyy"));
        assert!(glob_match("payments", "payments"));
        assert!(!glob_match("payments", "payments-eu"));
        // A hostile pattern stays quick.
        let long = "a".repeat(2000);
        assert!(!glob_match(&format!("{}b", "*a".repeat(100)), &long));
    }

    #[test]
    fn the_source_address_is_always_allowed_and_nothing_else_by_default() {
        let g = Grant {
            services: vec!["web".into()],
            ..Grant::default()
        };
        let src = ip("10.0.0.7");
        assert_eq!(g.check_address("10.0.0.7:8080", src), Ok(()));
        assert_eq!(
            g.check_address("10.0.0.7:8080", ip("::ffff:10.0.0.7")),
            Ok(())
        );
        assert!(matches!(
            g.check_address("10.6.6.6:443", src),
            Err(AddressRefusal::NotSource { .. })
        ));
        assert!(matches!(
            g.check_address("web-7.example:443", src),
            Err(AddressRefusal::HostName(h)) if h == "web-7.example"
        ));
        assert_eq!(g.check_address("[::1]:80", ip("::1")), Ok(()));
        assert!(g.check_address("[::2]:80", ip("::1")).is_err());
    }

    #[test]
    fn a_grant_widens_addresses_by_network_and_host_name() {
        let g = Grant {
            services: vec!["web-*".into()],
            networks: vec!["192.168.0.0/16".parse().expect("cidr")],
            hostnames: vec!["*.svc.example".into()],
        };
        let src = ip("10.0.0.7");
        assert_eq!(g.check_address("192.168.4.4:80", src), Ok(()));
        assert!(g.check_address("172.16.0.1:80", src).is_err());
        assert_eq!(g.check_address("Web-1.SVC.example:80", src), Ok(()));
        assert!(g.check_address("web-1.other.example:80", src).is_err());
        assert!(g.allows_service("web-eu") && !g.allows_service("payments"));
        assert!(!Grant::default().allows_service("web"));
        assert!(Grant::anything().allows_service("anything"));
        assert_eq!(Grant::anything().check_address("10.6.6.6:1", src), Ok(()));
    }
}
