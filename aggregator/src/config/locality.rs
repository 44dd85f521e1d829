//! The locality config: for each client zone, how its traffic splits across
//! destination zones, as in Robinhood's `zone_1` / `zone_2` example.
//!
//! ```toml
//! [locality.zone_1]
//! zone_1 = 100
//!
//! [locality.zone_2]
//! zone_2 = 50
//! zone_1 = 50
//! ```
//!
//! Clients in `zone_1` send everything to `zone_1`; clients in `zone_2` split evenly.
//! Failing a data centre over is a one-file change.

use super::InvalidSetting;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Client zone → destination zone → relative share (the core publishes it with the
/// weights). Shares are relative: `{a = 1, b = 3}` sends a quarter to `a`.
pub use ballast_balance::publish::LocalitySplit;

/// The largest share one destination may have; xDS locality weights are `uint32` and
/// their sum must fit too.
pub(crate) const MAX_SHARE: u32 = 1_000_000;

/// Checks a split: names non-empty, shares within bounds, and every client zone sends
/// somewhere.
pub fn validate(split: &LocalitySplit) -> Result<(), InvalidSetting> {
    for (client, dests) in split {
        if client.trim().is_empty() {
            return Err(InvalidSetting::new(
                "locality",
                "a client zone name is empty",
            ));
        }
        if dests.keys().any(|d| d.trim().is_empty()) {
            return Err(InvalidSetting::new(
                format!("locality.{client}"),
                "a destination zone name is empty",
            ));
        }
        if let Some((d, s)) = dests.iter().find(|(_, s)| **s > MAX_SHARE) {
            return Err(InvalidSetting::new(
                format!("locality.{client}.{d}"),
                format!("share {s} is above the limit of {MAX_SHARE}"),
            ));
        }
        if dests.values().all(|s| *s == 0) {
            return Err(InvalidSetting::new(
                format!("locality.{client}"),
                "every share is 0, so its clients would get no endpoints",
            ));
        }
    }
    Ok(())
}

/// A service's effective configuration as the feeds read it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Localities {
    /// Per service, the split in force; a service without one spreads evenly.
    pub services: BTreeMap<String, LocalitySplit>,
}

impl Localities {
    /// The destination shares for clients of `service` in `client_zone`, if configured.
    #[cfg(test)]
    pub(crate) fn split_for(
        &self,
        service: &str,
        client_zone: &str,
    ) -> Option<&BTreeMap<String, u32>> {
        self.services.get(service)?.get(client_zone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_example_validates_and_looks_up() {
        let split: LocalitySplit =
            toml::from_str("[zone_1]\nzone_1 = 100\n[zone_2]\nzone_2 = 50\nzone_1 = 50\n")
                .expect("parses");
        assert_eq!(validate(&split), Ok(()));
        let l = Localities {
            services: [("svc".to_string(), split)].into(),
        };
        let z2 = l.split_for("svc", "zone_2").expect("configured");
        assert_eq!(z2.get("zone_1"), Some(&50));
        assert_eq!(l.split_for("svc", "zone_3"), None);
        assert_eq!(l.split_for("other", "zone_1"), None);
    }

    #[test]
    fn an_all_zero_split_is_refused() {
        let split: LocalitySplit = toml::from_str("[z]\na = 0\n").expect("parses");
        assert_eq!(validate(&split).unwrap_err().setting, "locality.z");
    }
}
