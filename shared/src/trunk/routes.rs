//! The routes protocol: how a replica tells a relay where each service is served.
//!
//! A relay learns the cluster's members and bucket owners from the replicas, not from
//! etcd: it dials any replica with [`ROUTES_ALPN`] and its relay certificate (the
//! policy's `relays` list admits it, as it admits a trunk), opens one bidirectional
//! stream and sends [`crate::trunk::ToPrimary::Open`]. The replica answers with a
//! [`RoutesMessage::Routes`] frame whenever its reading of the cluster's keys changes,
//! and again at least every [`ROUTES_CONFIRM`] while the reading is current, so that a
//! relay can tell how far behind its routes are. Frames are the trunk's control frames
//! ([`crate::trunk::encode_control`], [`crate::trunk::ControlReader`]), each checked
//! against its limits before anything is trusted.
//!
//! The routes are a connection of their own, beside the trunks, with a version of
//! their own in the ALPN name: a relay of any trunk protocol version reads them. Their
//! frames share the trunk's layout and its version byte ([`crate::trunk::TRUNK_VERSION`],
//! 1); a change to either that a routes reader cannot take is a new routes ALPN
//! (`ballast-routes/2`), offered beside this one for a release, as the trunk's
//! versions are.

use super::codec::within;
use super::{ControlMessage, TrunkError, MAX_TEXT};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// The ALPN protocol name of the routes protocol.
pub const ROUTES_ALPN: &[u8] = b"ballast-routes/1";

/// How often a replica confirms an unchanged table.
pub const ROUTES_CONFIRM: Duration = Duration::from_secs(1);

/// The most members a table names.
pub const MAX_MEMBERS: usize = 64;

/// The most buckets a cluster has (`cluster.buckets`).
pub const MAX_BUCKETS: u32 = 128;

/// One member of the cluster, as a table names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteMember {
    /// The replica's name.
    pub name: String,
    /// The QUIC address it takes agents and trunks at.
    pub address: String,
}

/// One reading of the cluster's keys, as a replica made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteTable {
    /// The etcd revision the reading was made at: a relay keeps the newest reading
    /// when it hears from several replicas.
    pub revision: i64,
    /// The bucket count services hash into.
    pub buckets: u32,
    /// The live members, by name.
    pub members: Vec<RouteMember>,
    /// Each owned bucket and the index of its owner in `members`.
    pub owners: Vec<(u32, u16)>,
}

impl RouteTable {
    /// The table of a reading at `revision`: `members` by name with their addresses,
    /// and each owned bucket's owner. Owners that are no live member, and buckets
    /// outside the count, are left out (no service is routed to them).
    pub fn new<'a>(
        revision: i64,
        buckets: u32,
        members: &BTreeMap<String, String>,
        owners: impl IntoIterator<Item = (u32, &'a str)>,
    ) -> Self {
        let index: BTreeMap<&str, u16> = members
            .keys()
            .enumerate()
            .filter_map(|(i, name)| Some((name.as_str(), u16::try_from(i).ok()?)))
            .collect();
        RouteTable {
            revision,
            buckets,
            members: members
                .iter()
                .map(|(name, address)| RouteMember {
                    name: name.clone(),
                    address: address.clone(),
                })
                .collect(),
            owners: owners
                .into_iter()
                .filter(|(bucket, _)| *bucket < buckets)
                .filter_map(|(bucket, owner)| Some((bucket, *index.get(owner)?)))
                .collect(),
        }
    }

    /// Whether the table says the same as `other`, whatever the revisions.
    pub fn same_routes(&self, other: &RouteTable) -> bool {
        self.buckets == other.buckets
            && self.members == other.members
            && self.owners == other.owners
    }

    /// The members by name, with their addresses.
    pub fn member_map(&self) -> BTreeMap<String, String> {
        self.members
            .iter()
            .map(|m| (m.name.clone(), m.address.clone()))
            .collect()
    }

    /// Each owned bucket's owner, by name.
    pub fn owner_map(&self) -> BTreeMap<u32, String> {
        self.owners
            .iter()
            .filter_map(|(bucket, i)| {
                let member = self.members.get(usize::from(*i))?;
                Some((*bucket, member.name.clone()))
            })
            .collect()
    }
}

/// What a replica sends on a routes stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RoutesMessage {
    /// The cluster as the replica last read it.
    Routes(RouteTable),
    /// The replica serves no routes (it is no cluster member, or refuses this relay),
    /// and why; the connection closes after this frame.
    Closed(String),
}

impl ControlMessage for RoutesMessage {
    fn check(&self) -> Result<(), TrunkError> {
        match self {
            RoutesMessage::Routes(table) => table.check(),
            RoutesMessage::Closed(reason) => within("reason", reason.len(), MAX_TEXT),
        }
    }
}

impl RouteTable {
    fn check(&self) -> Result<(), TrunkError> {
        if self.buckets == 0 || self.buckets > MAX_BUCKETS {
            return Err(TrunkError::Malformed(format!(
                "a bucket count of {} (1 to {MAX_BUCKETS})",
                self.buckets
            )));
        }
        within("route members", self.members.len(), MAX_MEMBERS)?;
        for m in &self.members {
            within("replica name", m.name.len(), MAX_TEXT)?;
            within("replica address", m.address.len(), MAX_TEXT)?;
            if m.name.is_empty() || !crate::wire::is_valid_name(&m.name) {
                return Err(TrunkError::Malformed(format!(
                    "{:?} is not a replica name",
                    m.name
                )));
            }
        }
        if !self.members.windows(2).all(|w| match w {
            [a, b] => a.name < b.name,
            _ => true,
        }) {
            return Err(TrunkError::Malformed(
                "the members are not in order of name, or one is named twice".into(),
            ));
        }
        within("route owners", self.owners.len(), MAX_BUCKETS as usize)?;
        let mut last = None;
        for (bucket, member) in &self.owners {
            if *bucket >= self.buckets || usize::from(*member) >= self.members.len() {
                return Err(TrunkError::Malformed(format!(
                    "bucket {bucket} owned by member {member} of a table of {} buckets and {} members",
                    self.buckets,
                    self.members.len()
                )));
            }
            if last.is_some_and(|l| l >= *bucket) {
                return Err(TrunkError::Malformed(
                    "the owned buckets are not in order, or one is named twice".into(),
                ));
            }
            last = Some(*bucket);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode_control, encode_control, ControlReader};
    use super::*;

    fn members(n: usize) -> BTreeMap<String, String> {
        (0..n)
            .map(|i| (format!("agg-{i:02}"), format!("10.0.0.{i}:7400")))
            .collect()
    }

    #[test]
    fn a_table_names_each_owned_bucket_by_a_live_member() {
        let members = members(3);
        let owners = [(0, "agg-00"), (1, "agg-02"), (2, "gone"), (9, "agg-01")];
        let table = RouteTable::new(42, 4, &members, owners);
        // The bucket of a replica that is no member, and one past the count, are not
        // routes.
        assert_eq!(table.owners, vec![(0, 0), (1, 2)]);
        let owner_map = table.owner_map();
        assert_eq!(owner_map.get(&1).map(String::as_str), Some("agg-02"));
        assert_eq!(table.member_map(), members);
        let frame = encode_control(&RoutesMessage::Routes(table.clone())).expect("encodes");
        let mut reader = ControlReader::<RoutesMessage>::new();
        // In chunks of any size.
        let mut got = Vec::new();
        for chunk in frame.chunks(3) {
            got.extend(reader.push(chunk).expect("reads"));
        }
        assert_eq!(got, vec![RoutesMessage::Routes(table.clone())]);
        let moved = RouteTable::new(43, 4, &members, [(0, "agg-00"), (1, "agg-02")]);
        assert!(moved.same_routes(&table));
        let other = RouteTable::new(43, 4, &members, [(0, "agg-01"), (1, "agg-02")]);
        assert!(!other.same_routes(&table));
    }

    #[test]
    fn a_whole_cluster_of_the_largest_size_fits_a_frame() {
        // 64 members with realistic names and addresses, every one of 128 buckets owned.
        let members: BTreeMap<String, String> = (0..MAX_MEMBERS)
            .map(|i| {
                (
                    format!("aggregator-{i:02}.region-1.example.com-7400"),
                    format!("aggregator-{i:02}.region-1.example.com:7400"),
                )
            })
            .collect();
        let names: Vec<String> = members.keys().cloned().collect();
        let owners: Vec<(u32, &str)> = (0..MAX_BUCKETS)
            .map(|b| (b, names[b as usize % names.len()].as_str()))
            .collect();
        let table = RouteTable::new(1, MAX_BUCKETS, &members, owners);
        let frame = encode_control(&RoutesMessage::Routes(table)).expect("fits");
        assert!(
            frame.len() < super::super::MAX_CONTROL_FRAME,
            "{}",
            frame.len()
        );
    }

    #[test]
    fn tables_that_break_their_rules_are_refused() {
        let good = RouteTable::new(1, 4, &members(2), [(0, "agg-00"), (3, "agg-01")]);
        let decode = |t: &RouteTable| -> Result<RoutesMessage, TrunkError> {
            // Encoded without the checks (as a hostile replica would), then decoded.
            let body = bincode::serde::encode_to_vec(
                RoutesMessage::Routes(t.clone()),
                bincode::config::standard(),
            )
            .expect("encodes");
            let mut frame = vec![super::super::TRUNK_VERSION];
            frame.extend_from_slice(&body);
            decode_control(&frame)
        };
        assert!(decode(&good).is_ok());
        let mut bad = good.clone();
        bad.owners = vec![(0, 5)];
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "an owner that is no member"
        );
        let mut bad = good.clone();
        bad.owners = vec![(4, 0)];
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "a bucket past the count"
        );
        let mut bad = good.clone();
        bad.owners = vec![(3, 0), (0, 1)];
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "buckets out of order"
        );
        let mut bad = good.clone();
        bad.members.reverse();
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "members out of order"
        );
        let mut bad = good.clone();
        bad.members[0].name = "agg 0/../".into();
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "a name no replica has"
        );
        let mut bad = good.clone();
        bad.buckets = 0;
        assert!(
            matches!(decode(&bad), Err(TrunkError::Malformed(_))),
            "no buckets"
        );
        let mut bad = good.clone();
        bad.members = (0..=MAX_MEMBERS)
            .map(|i| RouteMember {
                name: format!("m{i:03}"),
                address: "a:1".into(),
            })
            .collect();
        bad.owners.clear();
        assert!(
            matches!(decode(&bad), Err(TrunkError::TooLarge { .. })),
            "too many members"
        );
        let closed = RoutesMessage::Closed("x".repeat(MAX_TEXT + 1));
        assert!(encode_control(&closed).is_err());
    }
}
