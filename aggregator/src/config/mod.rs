//! The aggregator's configuration: the global file (`ballast-config`, with the
//! balancing defaults as this crate's balancer takes them), and the per-service files
//! of the config directory.

pub mod dir;
pub mod locality;
pub mod service;

use ballast_balance::Params;
pub use ballast_config::*;
use serde::{Deserialize, Serialize};

/// The aggregator's whole configuration file.
pub type Config = ballast_config::Config<BalanceDefaults>;

/// `[balance]`: the balancing defaults for every service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BalanceDefaults(pub Params);

impl std::ops::Deref for BalanceDefaults {
    type Target = Params;
    fn deref(&self) -> &Params {
        &self.0
    }
}

impl std::ops::DerefMut for BalanceDefaults {
    fn deref_mut(&mut self) -> &mut Params {
        &mut self.0
    }
}

impl BalanceTable for BalanceDefaults {
    fn validate(&self) -> Result<(), InvalidSetting> {
        self.0
            .validate()
            .map_err(|e| InvalidSetting::new(format!("balance.{}", e.field), e.reason))
    }
}

/// The core's share of `[limits]`: what registrations may create. Empty services are
/// kept for `empty_service_ttl_ms`.
pub fn core_limits(limits: &limits::Limits, empty_service_ttl_ms: u64) -> ballast_balance::Limits {
    ballast_balance::Limits {
        max_services: limits.max_services,
        max_endpoints_per_service: limits.max_endpoints_per_service,
        services_per_node: limits.services_per_identity,
        empty_service_ttl_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_file_limits_default_to_the_cores() {
        let file = limits::Limits::default();
        let core = ballast_balance::Limits::default();
        assert_eq!(
            (file.max_services, file.max_endpoints_per_service),
            (core.max_services, core.max_endpoints_per_service)
        );
    }

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(Config::parse("", "t").expect("parses"), Config::default());
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let err = Config::parse("quic = \"0.0.0.0:7400\"\nbogus = 1\n", "agg.toml")
            .expect_err("unknown key");
        let msg = err.to_string();
        assert!(msg.contains("agg.toml") && msg.contains("line 2"), "{msg}");
        let err =
            Config::parse("[balance]\nmissing_threshold = 2.0\n", "agg.toml").expect_err("range");
        assert!(err.to_string().contains("missing_threshold"), "{err}");
    }

    #[test]
    fn a_relay_reads_its_replicas_and_no_etcd() {
        let cfg = Config::parse(
            "[relay]\nname = \"relay-1\"\nreplicas = [\"agg-1:7400\", \"[fd00::1]:7400\"]\n",
            "t",
        )
        .expect("parses");
        let relay = cfg.relay.expect("relay");
        assert_eq!(relay.name.as_deref(), Some("relay-1"));
        assert_eq!(relay.replicas, ["agg-1:7400", "[fd00::1]:7400"]);
        assert_eq!(
            (
                relay.batch_delay_ms,
                relay.attach_timeout_ms,
                relay.failover_hold_ms
            ),
            (25, 2000, 10_000)
        );
        for (body, why) in [
            (
                "[relay]\nattach_timeout_ms = 5\n",
                "relay.attach_timeout_ms",
            ),
            ("[relay]\nname = \"a b\"\n", "relay.name"),
            ("[relay]\nreplicas = [\"agg-1\"]\n", "relay.replicas"),
            ("[relay]\nreplicas = [\":7400\"]\n", "relay.replicas"),
            ("[relay]\nreplicas = [\"agg-1:0\"]\n", "relay.replicas"),
            ("[relay]\nreplicas = [\"agg-1:http\"]\n", "relay.replicas"),
        ] {
            let err = Config::parse(body, "t").expect_err(why).to_string();
            assert!(err.contains(why), "{why}: {err}");
        }
        // The previous release's relay file, a cluster name with its own etcd table
        // and no [store.etcd], still reads: the table is unread now.
        let cfg = Config::parse(
            "[cluster]\nname = \"p\"\n[relay]\nreplicas = [\"a:1\"]\n[relay.etcd]\nprefix = \"/r\"\n",
            "t",
        )
        .expect("parses");
        assert!(cfg.store.etcd.is_none() && cfg.relay.is_some_and(|r| r.etcd.is_some()));
        // A cluster without etcd and without a relay is a replica's mistake.
        let err = Config::parse("[cluster]\nname = \"p\"\n", "t").expect_err("no etcd");
        assert!(err.to_string().contains("[store.etcd]"), "{err}");
    }

    #[test]
    fn the_etcd_store_is_off_unless_configured() {
        assert_eq!(Config::default().store.etcd, None);
        let cfg = Config::parse(
            "[store.etcd]\nendpoints = [\"http://10.0.0.1:2379\"]\nprefix = \"/w\"\n",
            "t",
        )
        .expect("parses");
        let etcd = cfg.store.etcd.expect("etcd configured");
        assert_eq!(etcd.endpoints, ["http://10.0.0.1:2379"]);
        assert_eq!(
            (etcd.prefix.as_str(), etcd.request_timeout_ms),
            ("/w", 2000)
        );
        let err = Config::parse("[store.etcd]\nprefix = \"/w/\"\n", "t").expect_err("slash");
        assert!(err.to_string().contains("store.etcd.prefix"), "{err}");
        let err = Config::parse("[store.etcd]\nendpoints = []\n", "t").expect_err("empty");
        assert!(err.to_string().contains("store.etcd.endpoints"), "{err}");
    }

    #[test]
    fn etcd_tls_and_authentication_come_in_usable_combinations() {
        let parse = |body: &str| Config::parse(&format!("[store.etcd]\n{body}"), "t");
        let tls = "endpoints = [\"https://10.0.0.1:2379\", \"https://10.0.0.2:2379\"]\n";
        let cfg = parse(&format!(
            "{tls}ca_file = \"/etc/ballast/etcd/ca.pem\"\ncert_file = \"c.pem\"\n\
             key_file = \"c.key\"\nuser = \"ballast\"\npassword_file = \"pw\"\n"
        ))
        .expect("a full TLS and user setup parses");
        let etcd = cfg.store.etcd.expect("etcd");
        assert!(etcd.uses_tls());
        assert_eq!(etcd.user.as_deref(), Some("ballast"));
        assert_eq!(
            etcd.local_copy_path(Path::new("/var/lib/ballast/weights.json")),
            Path::new("/var/lib/ballast/weights.etcd-copy.json")
        );
        for (body, setting, why) in [
            (tls.to_string(), "store.etcd.ca_file", "https without a CA"),
            (
                format!("{tls}ca_file = \"ca.pem\"\ncert_file = \"c.pem\"\n"),
                "store.etcd.key_file",
                "a certificate without its key",
            ),
            (
                format!("{tls}ca_file = \"ca.pem\"\nkey_file = \"c.key\"\n"),
                "store.etcd.cert_file",
                "a key without its certificate",
            ),
            (
                "user = \"ballast\"\n".to_string(),
                "store.etcd.password_file",
                "a user without a password",
            ),
            (
                "password_file = \"pw\"\n".to_string(),
                "store.etcd.user",
                "a password without a user",
            ),
            (
                "user = \"\"\npassword_file = \"pw\"\n".to_string(),
                "store.etcd.user",
                "an empty user",
            ),
            (
                "ca_file = \"ca.pem\"\n".to_string(),
                "store.etcd.ca_file",
                "a CA for http://",
            ),
            (
                "endpoints = [\"https://a:2379\", \"http://b:2379\"]\n".to_string(),
                "store.etcd.endpoints",
                "a mix of schemes",
            ),
            (
                "endpoints = [\"10.0.0.1:2379\"]\n".to_string(),
                "store.etcd.endpoints",
                "no scheme",
            ),
        ] {
            let err = parse(&body).expect_err(why).to_string();
            assert!(err.contains(setting), "{why}: {err}");
        }
    }
}
