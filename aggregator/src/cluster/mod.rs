//! Aggregator replicas sharing the work through etcd.
//!
//! Who owns which service, and the hashes and key names that decide it, are
//! [`crate::ownership`] (re-exported here), which the routing store reads too. This
//! module holds what only the cluster needs: the view of a cluster's keys, the overlay
//! of the services a replica serves but does not balance ([`overlay`]), and the etcd
//! side that claims, renews and resigns ([`etcd`]), and answers operators' actions
//! other replicas received for the services it owns (`requests`). It reads the state of the daemon
//! nowhere: the etcd side asks the cycle loop for each move through [`crate::door`],
//! and the loop makes it with [`overlay`].

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod overlay;
#[cfg(feature = "etcd")]
pub(crate) mod requests;

pub use crate::ownership::{
    bucket_of, cluster_prefix, config_key, member_key, owner_key, preferred, Ownership,
    FEED_BEHIND_AFTER,
};
pub use ballast_etcd::cluster::{parse_view, ClusterKv, OwnerKey, View};
