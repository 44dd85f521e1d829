//! The authorization policy: what each connection's hellos may claim.
//!
//! By default a node may serve the services its certificate names (URI subject
//! alternative names `ballast://service/NAME`), at its connection's source address
//! only. An optional policy file adds rules for identity patterns, for deployments
//! whose certificates come from another CA or whose nodes sit behind NAT:
//!
//! ```toml
//! # Whether the services a certificate names are granted (default true). Set it to
//! # false when the CA that signs node certificates is not yours alone: then only the
//! # rules below grant services.
//! certificate_services = true
//!
//! # The relays whose trunks are accepted, by their certificate's identity (globs);
//! # each must also have the relay role (`ballast://role/relay`, from `certs relay`).
//! # Without this key (or a [[relay]] table naming it) no relay is accepted.
//! relays = ["relay-*"]
//!
//! # Whether agents that cannot prove they hold their certificate's key through a
//! # relay (behind a relay of the previous release, or speaking ballast/1) are
//! # admitted: only while such a relay or agent is being upgraded. Default false.
//! admit_unproven_relayed_agents = false
//!
//! [[relay]]
//! names = ["relay-eu-*"]            # relays this table applies to (and accepts)
//! services = ["web", "api-*"]       # the services their agents may serve (globs)
//! networks = ["10.1.0.0/16"]        # the source addresses their agents may have
//!
//! [[rule]]
//! nodes = ["batch-*"]               # glob patterns on the certificate's node identity
//! services = ["batch", "batch-eu"]  # services they may serve (globs)
//! networks = ["10.20.0.0/16"]       # advertised addresses may be in these networks
//! hostnames = ["*.batch.example"]   # advertised host names they may use (globs)
//! zones = ["eu-west-1*"]            # the zones their hellos may name (globs)
//!
//! [[rule]]
//! # glob patterns on the certificate's whole SPIFFE ID (`*` also crosses `/`)
//! spiffe_ids = ["spiffe://prod.example/ns/web/sa/*"]
//! services = ["web"]
//! ```
//!
//! Every rule whose `nodes` or `spiffe_ids` match adds its grants; nothing in the
//! policy takes away what another rule or the certificate grants. `zones` is the one
//! bound: a node that a rule with `zones` matches may name only those zones (of every
//! such rule) in its hello, and a node no such rule matches may name any. A certificate whose
//! identity is a SPIFFE ID is node `NAME` for the last path segment `NAME` of that ID
//! ([`ballast_shared::tls::spiffe_node_name`]), which `nodes` patterns match.

use ballast_shared::session::{Cidr, Grant};
use serde::Deserialize;
use std::path::Path;

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The file could not be read.
    #[error("authorization policy {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Not valid TOML for the policy's schema; the message carries line and column.
    #[error("authorization policy {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What and where.
        message: String,
    },
    /// A top-level key's value is unusable.
    #[error("authorization policy {path}: {field}: {reason}")]
    InvalidKey {
        /// The file.
        path: String,
        /// The key.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A rule's value is unusable.
    #[error("authorization policy {path}: rule {rule}: {field}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// The rule, counted from 1 in the order of the file.
        rule: usize,
        /// The key.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The policy file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default = "yes")]
    certificate_services: bool,
    relays: Option<Vec<String>>,
    #[serde(default)]
    admit_unproven_relayed_agents: bool,
    #[serde(default)]
    relay: Vec<RelayFile>,
    #[serde(default)]
    rule: Vec<RuleFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RelayFile {
    names: Vec<String>,
    #[serde(default)]
    services: Vec<String>,
    #[serde(default)]
    networks: Vec<String>,
}

/// What the agents behind the relays a `[[relay]]` table names may be.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RelayRule {
    names: Vec<String>,
    /// Service globs; empty: any.
    services: Vec<String>,
    /// Source networks; empty: any.
    networks: Vec<Cidr>,
}

/// What the agents behind one relay may be: every `[[relay]]` table that names it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RelayScope {
    /// Service globs, or `None`: any service.
    services: Option<Vec<String>>,
    /// Source networks, or `None`: any source.
    networks: Option<Vec<Cidr>>,
}

impl RelayScope {
    /// Whether an agent at `source` may be carried: `Err` with the reason if not.
    pub(crate) fn source_allowed(&self, source: std::net::IpAddr) -> Result<(), String> {
        match &self.networks {
            Some(nets) if !nets.iter().any(|n| n.contains(source)) => Err(format!(
                "the relay may not carry agents from {source} (the policy's [[relay]] networks)"
            )),
            _ => Ok(()),
        }
    }

    /// Whether an agent of `service` may be carried: `Err` with the reason if not.
    pub(crate) fn service_allowed(&self, service: &str) -> Result<(), String> {
        use ballast_shared::session::authz::glob_match;
        match &self.services {
            Some(globs) if !globs.iter().any(|g| glob_match(g, service)) => Err(format!(
                "the relay may not carry service {service:?} (the policy's [[relay]] services)"
            )),
            _ => Ok(()),
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    #[serde(default)]
    nodes: Vec<String>,
    #[serde(default)]
    spiffe_ids: Vec<String>,
    #[serde(default)]
    services: Vec<String>,
    #[serde(default)]
    networks: Vec<String>,
    #[serde(default)]
    hostnames: Vec<String>,
    #[serde(default)]
    zones: Vec<String>,
}

/// One rule: identities it applies to, and what it grants them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    nodes: Vec<String>,
    spiffe_ids: Vec<String>,
    grant: Grant,
    /// The zones its nodes may name (globs); empty: the rule says nothing of zones.
    zones: Vec<String>,
}

/// The zones a node's hellos may name: those of every rule that matches it and names
/// zones, or any when none does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Zones(Option<Vec<String>>);

impl Zones {
    /// Whether node `node` may say it is in `zone`: `Err` with the reason if not.
    pub(crate) fn check(&self, node: &str, zone: &str) -> Result<(), String> {
        use ballast_shared::session::authz::glob_match;
        match &self.0 {
            Some(globs) if !globs.iter().any(|g| glob_match(g, zone)) => Err(format!(
                "node {node:?} may not say it is in zone {zone:?}: the policy allows it {}",
                globs.join(", ")
            )),
            _ => Ok(()),
        }
    }
}

/// What connections may claim, beyond the node their certificate names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Policy {
    certificate_services: bool,
    /// Identity patterns of the relays allowed; `None`: none.
    relays: Option<Vec<String>>,
    /// Whether agents that cannot prove their key through a relay are admitted.
    admit_unproven_relayed_agents: bool,
    /// What each relay's agents may be.
    relay_rules: Vec<RelayRule>,
    rules: Vec<Rule>,
}

impl Default for Policy {
    /// No file: certificates' services, source addresses only.
    fn default() -> Self {
        Policy {
            certificate_services: true,
            relays: None,
            admit_unproven_relayed_agents: false,
            relay_rules: Vec::new(),
            rules: Vec::new(),
        }
    }
}

/// `texts` as networks, or why one is not.
fn networks(texts: &[String]) -> Result<Vec<Cidr>, String> {
    texts
        .iter()
        .map(|n| n.parse::<Cidr>().map_err(|e| e.to_string()))
        .collect()
}

/// The first of `patterns` that is not a name glob, as the reason it is refused.
pub fn bad_glob(patterns: &[String]) -> Option<String> {
    patterns.iter().find(|p| !is_name_glob(p)).map(|bad| {
        format!(
            "{bad:?} is not a name pattern (letters, digits, '.', '_', '-', \
             and the wildcards '*' and '?')"
        )
    })
}

/// Whether `pattern` is usable as a glob of names: the name characters, `*` and `?`.
fn is_name_glob(pattern: &str) -> bool {
    !pattern.is_empty()
        && pattern.len() <= 256
        && pattern
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'*' | b'?'))
}

/// The first of `patterns` that is not a SPIFFE ID glob, as the reason it is refused.
fn bad_spiffe_glob(patterns: &[String]) -> Option<String> {
    patterns.iter().find(|p| !is_spiffe_glob(p)).map(|bad| {
        format!(
            "{bad:?} is not a SPIFFE ID pattern (spiffe://, then letters, digits, '.', '_', \
             '-', '/', and the wildcards '*' and '?')"
        )
    })
}

/// Whether `pattern` is usable as a glob of SPIFFE IDs.
fn is_spiffe_glob(pattern: &str) -> bool {
    pattern.len() <= 2048
        && pattern
            .strip_prefix(ballast_shared::tls::SPIFFE_SCHEME)
            .is_some_and(|rest| {
                !rest.is_empty()
                    && rest.bytes().all(|b| {
                        b.is_ascii_alphanumeric()
                            || matches!(b, b'.' | b'_' | b'-' | b'/' | b'*' | b'?')
                    })
            })
}

impl Policy {
    /// Reads and checks a policy file.
    pub(crate) fn load(path: &Path) -> Result<Policy, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks policy text; `origin` names it in errors.
    pub(crate) fn parse(text: &str, origin: &str) -> Result<Policy, PolicyError> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| PolicyError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        if let Some(reason) = file.relays.as_deref().and_then(bad_glob) {
            return Err(PolicyError::InvalidKey {
                path: origin.to_string(),
                field: "relays",
                reason,
            });
        }
        let mut relay_rules = Vec::with_capacity(file.relay.len());
        for (i, r) in file.relay.into_iter().enumerate() {
            let invalid = |field: &'static str, reason: String| PolicyError::InvalidKey {
                path: origin.to_string(),
                field,
                reason: format!("[[relay]] {}: {reason}", i + 1),
            };
            if r.names.is_empty() {
                return Err(invalid(
                    "names",
                    "must name at least one relay pattern".into(),
                ));
            }
            for (field, patterns) in [("names", &r.names), ("services", &r.services)] {
                if let Some(reason) = bad_glob(patterns) {
                    return Err(invalid(field, reason));
                }
            }
            let networks = networks(&r.networks).map_err(|e| invalid("networks", e))?;
            relay_rules.push(RelayRule {
                names: r.names,
                services: r.services,
                networks,
            });
        }
        let mut rules = Vec::with_capacity(file.rule.len());
        for (i, r) in file.rule.into_iter().enumerate() {
            let invalid = |field: &'static str, reason: String| PolicyError::Invalid {
                path: origin.to_string(),
                rule: i + 1,
                field,
                reason,
            };
            if r.nodes.is_empty() && r.spiffe_ids.is_empty() {
                return Err(invalid(
                    "nodes",
                    "must name at least one pattern (or give spiffe_ids)".into(),
                ));
            }
            if let Some(reason) = bad_spiffe_glob(&r.spiffe_ids) {
                return Err(invalid("spiffe_ids", reason));
            }
            for (field, patterns) in [
                ("nodes", &r.nodes),
                ("services", &r.services),
                ("hostnames", &r.hostnames),
                ("zones", &r.zones),
            ] {
                if let Some(reason) = bad_glob(patterns) {
                    return Err(invalid(field, reason));
                }
            }
            let networks = networks(&r.networks).map_err(|e| invalid("networks", e))?;
            if r.services.is_empty()
                && networks.is_empty()
                && r.hostnames.is_empty()
                && r.zones.is_empty()
            {
                return Err(invalid(
                    "services",
                    "the rule grants nothing: give services, networks, hostnames or zones".into(),
                ));
            }
            rules.push(Rule {
                nodes: r.nodes,
                spiffe_ids: r.spiffe_ids,
                grant: Grant {
                    services: r.services,
                    networks,
                    hostnames: r.hostnames,
                },
                zones: r.zones,
            });
        }
        Ok(Policy {
            certificate_services: file.certificate_services,
            relays: file.relays,
            admit_unproven_relayed_agents: file.admit_unproven_relayed_agents,
            relay_rules,
            rules,
        })
    }

    /// What a connection whose certificate names `identity`, the SPIFFE ID
    /// `spiffe_id` if any, and `cert_services` may claim: the certificate's services
    /// (unless the policy ignores them) and every matching rule's grants.
    pub(crate) fn grant(
        &self,
        identity: &str,
        spiffe_id: Option<&str>,
        cert_services: &[String],
    ) -> Grant {
        let mut grant = Grant::default();
        if self.certificate_services {
            grant.services.extend(cert_services.iter().cloned());
        }
        for rule in self.matching(identity, spiffe_id) {
            grant.services.extend(rule.grant.services.iter().cloned());
            grant.networks.extend(rule.grant.networks.iter().copied());
            grant.hostnames.extend(rule.grant.hostnames.iter().cloned());
        }
        let mut seen = std::collections::BTreeSet::new();
        grant.services.retain(|s| seen.insert(s.clone()));
        grant
    }

    /// The zones a node whose certificate names `identity` and the SPIFFE ID
    /// `spiffe_id`, if any, may name in its hellos.
    pub(crate) fn zones(&self, identity: &str, spiffe_id: Option<&str>) -> Zones {
        let mut zones: Option<Vec<String>> = None;
        for rule in self.matching(identity, spiffe_id) {
            if !rule.zones.is_empty() {
                zones
                    .get_or_insert_with(Vec::new)
                    .extend(rule.zones.iter().cloned());
            }
        }
        Zones(zones)
    }

    /// The rules whose `nodes` match `identity` or whose `spiffe_ids` match
    /// `spiffe_id`.
    fn matching<'a>(
        &'a self,
        identity: &'a str,
        spiffe_id: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Rule> + 'a {
        use ballast_shared::session::authz::glob_match;
        self.rules.iter().filter(move |rule| {
            rule.nodes.iter().any(|p| glob_match(p, identity))
                || spiffe_id.is_some_and(|id| rule.spiffe_ids.iter().any(|p| glob_match(p, id)))
        })
    }

    /// Whether a relay whose certificate names `identity` (and the relay role, which
    /// the caller checks) may open a trunk: only if `relays` or a `[[relay]]` table
    /// names it.
    pub(crate) fn relay_allowed(&self, identity: &str) -> bool {
        use ballast_shared::session::authz::glob_match;
        let listed = self
            .relays
            .iter()
            .flatten()
            .any(|p| glob_match(p, identity));
        listed
            || self
                .relay_rules
                .iter()
                .any(|r| r.names.iter().any(|p| glob_match(p, identity)))
    }

    /// What the agents behind relay `identity` may be: the services and networks of
    /// every `[[relay]]` table that names it; anything when none does, or when one
    /// that does leaves a key out.
    pub(crate) fn relay_scope(&self, identity: &str) -> RelayScope {
        use ballast_shared::session::authz::glob_match;
        let mut scope = RelayScope::default();
        let mut any_services = false;
        let mut any_networks = false;
        for r in &self.relay_rules {
            if !r.names.iter().any(|p| glob_match(p, identity)) {
                continue;
            }
            if r.services.is_empty() {
                any_services = true;
            } else {
                scope
                    .services
                    .get_or_insert_with(Vec::new)
                    .extend(r.services.iter().cloned());
            }
            if r.networks.is_empty() {
                any_networks = true;
            } else {
                scope
                    .networks
                    .get_or_insert_with(Vec::new)
                    .extend(r.networks.iter().copied());
            }
        }
        if any_services {
            scope.services = None;
        }
        if any_networks {
            scope.networks = None;
        }
        scope
    }

    /// Whether relayed agents that cannot prove their key are admitted.
    pub(crate) fn admit_unproven_relayed_agents(&self) -> bool {
        self.admit_unproven_relayed_agents
    }

    /// How many rules it has, for the start-up log.
    pub(crate) fn rules(&self) -> usize {
        self.rules.len()
    }

    /// Whether certificates' service names are granted.
    pub(crate) fn certificate_services(&self) -> bool {
        self.certificate_services
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn without_a_file_a_certificate_grants_its_own_services() {
        let p = Policy::default();
        let g = p.grant("web-1", None, &names(&["web"]));
        assert_eq!(g.services, ["web"]);
        assert!(g.networks.is_empty() && g.hostnames.is_empty());
        assert_eq!(p.grant("web-1", None, &[]), Grant::default());
    }

    #[test]
    fn matching_rules_add_their_grants() {
        let p = Policy::parse(
            r#"
            [[rule]]
            nodes = ["batch-*"]
            services = ["batch"]
            networks = ["10.20.0.0/16", "fd00::/8"]

            [[rule]]
            nodes = ["*-7"]
            hostnames = ["*.example"]
            "#,
            "p.toml",
        )
        .expect("parses");
        assert_eq!(p.rules(), 2);
        let g = p.grant("batch-7", None, &names(&["etl"]));
        assert_eq!(g.services, ["etl", "batch"]);
        assert_eq!(g.networks.len(), 2);
        assert_eq!(g.hostnames, ["*.example"]);
        let g = p.grant("web-1", None, &[]);
        assert_eq!(g, Grant::default());
    }

    #[test]
    fn certificate_services_can_be_ignored() {
        let p = Policy::parse(
            "certificate_services = false\n[[rule]]\nnodes = [\"*\"]\nservices = [\"web\"]\n",
            "p.toml",
        )
        .expect("parses");
        assert!(!p.certificate_services());
        assert_eq!(p.grant("x", None, &names(&["payments"])).services, ["web"]);
    }

    #[test]
    fn spiffe_rules_match_the_whole_spiffe_id() {
        let p = Policy::parse(
            r#"
            certificate_services = false
            [[rule]]
            spiffe_ids = ["spiffe://prod.example/ns/web/sa/*"]
            services = ["web"]
            networks = ["10.20.0.0/16"]

            [[rule]]
            nodes = ["web-*"]
            hostnames = ["*.web.example"]
            "#,
            "p.toml",
        )
        .expect("parses");
        let id = "spiffe://prod.example/ns/web/sa/web-1";
        let g = p.grant("web-1", Some(id), &[]);
        assert_eq!(g.services, ["web"]);
        assert_eq!(g.networks.len(), 1);
        assert_eq!(g.hostnames, ["*.web.example"], "the node name matches too");
        // Another namespace or trust domain, with the same last segment.
        for other in [
            "spiffe://prod.example/ns/batch/sa/web-1",
            "spiffe://evil.example/ns/web/sa/web-1",
        ] {
            let g = p.grant("web-1", Some(other), &[]);
            assert!(g.services.is_empty() && g.networks.is_empty(), "{other}");
        }
        assert!(p.grant("web-1", None, &[]).services.is_empty());
        for (bad, want) in [
            (
                "[[rule]]\nspiffe_ids = [\"prod.example/*\"]\nservices = [\"a\"]\n",
                "spiffe_ids",
            ),
            (
                "[[rule]]\nspiffe_ids = [\"spiffe://a b\"]\nservices = [\"a\"]\n",
                "spiffe_ids",
            ),
            ("[[rule]]\nservices = [\"a\"]\n", "rule 1: nodes"),
        ] {
            let e = Policy::parse(bad, "policy.toml").expect_err(bad);
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    #[test]
    fn a_relay_table_accepts_its_relays_and_bounds_their_agents() {
        let p = Policy::parse(
            "admit_unproven_relayed_agents = true\n\
             [[relay]]\nnames = [\"relay-eu-*\"]\nservices = [\"web\", \"api-*\"]\nnetworks = [\"10.1.0.0/16\"]\n\
             [[relay]]\nnames = [\"relay-eu-2\"]\nservices = [\"batch\"]\n",
            "p.toml",
        )
        .expect("parses");
        assert!(p.admit_unproven_relayed_agents());
        assert!(p.relay_allowed("relay-eu-1") && !p.relay_allowed("relay-us-1"));
        let one = p.relay_scope("relay-eu-1");
        assert!(one.service_allowed("web").is_ok() && one.service_allowed("api-x").is_ok());
        assert!(one.service_allowed("batch").is_err());
        assert!(one.source_allowed([10, 1, 2, 3].into()).is_ok());
        assert!(one.source_allowed([10, 2, 0, 1].into()).is_err());
        // Two tables: their services add up; the second leaves networks to the first.
        let two = p.relay_scope("relay-eu-2");
        assert!(two.service_allowed("batch").is_ok() && two.service_allowed("web").is_ok());
        assert!(
            two.source_allowed([10, 2, 0, 1].into()).is_ok(),
            "a table without networks allows any"
        );
        // A relay no table names is bound by nothing but the grants of its agents.
        assert_eq!(p.relay_scope("relay-us-1"), RelayScope::default());
        assert!(Policy::parse("[[relay]]\nnames = []\n", "p.toml").is_err());
        assert!(
            Policy::parse("[[relay]]\nnames = [\"r\"]\nnetworks = [\"x\"]\n", "p.toml").is_err()
        );
    }

    #[test]
    fn zones_are_bound_where_a_matching_rule_names_them() {
        let p = Policy::parse(
            r#"
            [[rule]]
            nodes = ["eu-*"]
            zones = ["eu-west-1a", "eu-west-1b"]

            [[rule]]
            nodes = ["eu-9"]
            zones = ["eu-central-*"]

            [[rule]]
            nodes = ["*"]
            networks = ["10.0.0.0/8"]
            "#,
            "p.toml",
        )
        .expect("parses");
        let eu1 = p.zones("eu-1", None);
        assert!(eu1.check("eu-1", "eu-west-1a").is_ok());
        let e = eu1.check("eu-1", "us-east-1a").expect_err("another zone");
        assert!(
            e.contains("\"us-east-1a\"") && e.contains("eu-west-1a, eu-west-1b"),
            "{e}"
        );
        assert!(
            eu1.check("eu-1", "").is_err(),
            "no zone is not an allowed one"
        );
        // Two rules that name zones add theirs up.
        let eu9 = p.zones("eu-9", None);
        assert!(eu9.check("eu-9", "eu-west-1b").is_ok());
        assert!(eu9.check("eu-9", "eu-central-1").is_ok());
        assert!(eu9.check("eu-9", "us-east-1a").is_err());
        // A node no rule with zones matches may name any, or none.
        let us = p.zones("us-1", None);
        assert_eq!(us, Zones::default());
        assert!(us.check("us-1", "anything").is_ok() && us.check("us-1", "").is_ok());
        assert!(Policy::default()
            .zones("eu-1", None)
            .check("eu-1", "x")
            .is_ok());
        // A rule of zones alone is a rule; a bad zone pattern is refused.
        assert!(Policy::parse("[[rule]]\nnodes = [\"a\"]\nzones = [\"z\"]\n", "p.toml").is_ok());
        let e = Policy::parse("[[rule]]\nnodes = [\"a\"]\nzones = [\"a b\"]\n", "p.toml")
            .expect_err("bad zone");
        assert!(e.to_string().contains("rule 1: zones"), "{e}");
    }

    #[test]
    fn relays_are_refused_unless_listed() {
        assert!(
            !Policy::default().relay_allowed("relay-1"),
            "no relay by default"
        );
        assert!(!Policy::default().admit_unproven_relayed_agents());
        let p = Policy::parse("relays = [\"relay-eu-*\", \"edge\"]\n", "p.toml").expect("parses");
        assert!(p.relay_allowed("relay-eu-3") && p.relay_allowed("edge"));
        assert!(!p.relay_allowed("relay-us-1") && !p.relay_allowed("edge-2"));
        let none = Policy::parse("relays = []\n", "p.toml").expect("parses");
        assert!(!none.relay_allowed("relay-1"), "an empty list allows none");
    }

    #[test]
    fn bad_files_are_refused_with_where_and_why() {
        let cases: [(&str, &str); 8] = [
            ("relays = [\"a/b\"]\n", "policy.toml: relays: \"a/b\""),
            ("relays = \"relay-*\"\n", "line 1"),
            ("[[rule]]\nnodes = [\"a\"]\nservices = [\"a/b\"]\n", "rule 1: services"),
            ("[[rule]]\nnodes = []\nservices = [\"a\"]\n", "rule 1: nodes"),
            (
                "[[rule]]\nnodes = [\"a\"]\nservices = [\"a\"]\n[[rule]]\nnodes = [\"b\"]\nnetworks = [\"10.0.0.0/40\"]\n",
                "rule 2: networks",
            ),
            ("[[rule]]\nnodes = [\"a\"]\n", "grants nothing"),
            ("[[rule]]\nnodes = [\"a\"]\nservice = [\"x\"]\n", "line 3"),
            ("certificate_services = \"yes\"\n", "line 1"),
        ];
        for (text, want) in cases {
            let e = Policy::parse(text, "policy.toml").expect_err(text);
            let msg = e.to_string();
            assert!(msg.contains("policy.toml") && msg.contains(want), "{msg}");
        }
        let e = Policy::load(Path::new("/nonexistent/policy.toml")).expect_err("missing");
        assert!(matches!(e, PolicyError::Read { .. }), "{e}");
    }
}
