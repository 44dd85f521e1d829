//! A cluster's keys in etcd, as replicas write them and relays read them: the hashes
//! that put a service in a bucket and rank the members for it, the key names, and the
//! view that a reading of them amounts to. No I/O.
//!
//! Service names hash into a fixed number of buckets, and each bucket has at most one
//! owner at a time, the replica holding its owner key
//! (`<prefix>/cluster/<name>/owners/<bucket>`) under the lease that also keeps the
//! replica's member key (`<prefix>/cluster/<name>/members/<replica>`) alive.

use std::collections::BTreeMap;

/// FNV-1a over `bytes`: stable across replicas, platforms and releases, unlike the
/// standard library's hasher, since every replica must put a service in the same
/// bucket.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A finaliser that spreads FNV's low-entropy high bits (splitmix64's).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bucket of `service` among `buckets` (at least one).
pub fn bucket_of(service: &str, buckets: u32) -> u32 {
    let n = u64::from(buckets.max(1));
    u32::try_from(mix(fnv1a(service.as_bytes())) % n).unwrap_or(0)
}

/// The member that rendezvous hashing ranks first for `bucket`: the one with the
/// highest score of member and bucket. Ties (which need a 64-bit collision) go to the
/// smaller name, so every replica agrees.
pub fn preferred<'m>(members: impl IntoIterator<Item = &'m str>, bucket: u32) -> Option<&'m str> {
    members
        .into_iter()
        .map(|m| (mix(fnv1a(m.as_bytes()) ^ mix(u64::from(bucket) + 1)), m))
        .max_by(|(sa, ma), (sb, mb)| sa.cmp(sb).then(mb.cmp(ma)))
        .map(|(_, m)| m)
}

/// The key prefix of cluster `name`: `<prefix>/cluster/<name>/`.
pub fn cluster_prefix(prefix: &str, name: &str) -> String {
    format!("{prefix}/cluster/{name}/")
}

/// The key under which a member keeps its lease-bound presence.
pub fn member_key(prefix: &str, name: &str, replica: &str) -> String {
    format!("{}members/{replica}", cluster_prefix(prefix, name))
}

/// The key whose holder owns `bucket`.
pub fn owner_key(prefix: &str, name: &str, bucket: u32) -> String {
    format!("{}owners/{bucket:05}", cluster_prefix(prefix, name))
}

/// The key that holds the cluster's bucket count, set by its first replica: every
/// replica must hash services into the same number of buckets.
pub fn config_key(prefix: &str, name: &str) -> String {
    format!("{}config", cluster_prefix(prefix, name))
}

/// One key under a cluster's prefix as etcd holds it: what [`parse_view`] reads.
#[derive(Debug, Clone, Copy)]
pub struct ClusterKv<'a> {
    /// The whole key.
    pub key: &'a [u8],
    /// Its value.
    pub value: &'a [u8],
    /// The revision that created it: an owner key's fencing token.
    pub create_revision: i64,
    /// The lease it is bound to, 0 for none.
    pub lease: i64,
}

/// Who holds a bucket's owner key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerKey {
    /// The owning replica's name.
    pub replica: String,
    /// The key's create revision, the owner's fencing token.
    pub create_revision: i64,
    /// The lease the key is bound to.
    pub lease: i64,
}

/// What one reading of a cluster's keys says: who is a member and who owns what. Read by
/// the replicas to share the buckets out, and by anything that only needs to know
/// where a service is served.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct View {
    /// The bucket count the cluster hashes services into, if its config key was read
    /// and holds a number.
    pub buckets: Option<u32>,
    /// Live replicas and the QUIC address each takes agents at.
    pub members: BTreeMap<String, String>,
    /// Each held bucket's owner.
    pub owners: BTreeMap<u32, OwnerKey>,
}

/// The view that `kvs`, keys read under `cluster_prefix` (as [`cluster_prefix`] makes
/// it), amount to. Keys outside the prefix, keys or values that are not UTF-8, and
/// owner keys whose bucket is not a number are passed over.
pub fn parse_view<'a>(cluster_prefix: &str, kvs: impl IntoIterator<Item = ClusterKv<'a>>) -> View {
    let mut view = View::default();
    for kv in kvs {
        let (Ok(key), Ok(value)) = (std::str::from_utf8(kv.key), std::str::from_utf8(kv.value))
        else {
            continue;
        };
        let Some(rest) = key.strip_prefix(cluster_prefix) else {
            continue;
        };
        if let Some(member) = rest.strip_prefix("members/") {
            view.members.insert(member.to_string(), value.to_string());
        } else if let Some(bucket) = rest.strip_prefix("owners/") {
            if let Ok(b) = bucket.parse::<u32>() {
                let owner = OwnerKey {
                    replica: value.to_string(),
                    create_revision: kv.create_revision,
                    lease: kv.lease,
                };
                view.owners.insert(b, owner);
            }
        } else if rest == "config" {
            view.buckets = value.parse().ok();
        }
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_is_parsed_from_the_cluster_keys() {
        let prefix = cluster_prefix("/ballast", "main");
        let keys = [
            (config_key("/ballast", "main"), "64", 3, 0),
            (member_key("/ballast", "main", "r1"), "10.0.0.1:7400", 5, 11),
            (member_key("/ballast", "main", "r2"), "10.0.0.2:7400", 6, 12),
            (owner_key("/ballast", "main", 7), "r1", 8, 11),
            (owner_key("/ballast", "main", 12), "r2", 9, 12),
            // Another cluster's keys, an unknown key and an unreadable bucket: passed over.
            (
                member_key("/ballast", "other", "r9"),
                "10.0.0.9:7400",
                10,
                13,
            ),
            (format!("{prefix}owners/x"), "r1", 14, 11),
            (format!("{prefix}something"), "else", 15, 0),
        ];
        let kvs = keys
            .iter()
            .map(|(key, value, create_revision, lease)| ClusterKv {
                key: key.as_bytes(),
                value: value.as_bytes(),
                create_revision: *create_revision,
                lease: *lease,
            });
        let view = parse_view(&prefix, kvs);
        assert_eq!(view.buckets, Some(64));
        assert_eq!(
            view.members.iter().collect::<Vec<_>>(),
            [
                (&"r1".to_string(), &"10.0.0.1:7400".to_string()),
                (&"r2".to_string(), &"10.0.0.2:7400".to_string())
            ]
        );
        assert_eq!(view.owners.len(), 2);
        assert_eq!(
            view.owners.get(&7),
            Some(&OwnerKey {
                replica: "r1".into(),
                create_revision: 8,
                lease: 11
            })
        );
        assert_eq!(view.owners.get(&12).map(|o| o.replica.as_str()), Some("r2"));
        let config = config_key("/ballast", "main");
        let bad = [ClusterKv {
            key: config.as_bytes(),
            value: &[0xff],
            create_revision: 1,
            lease: 0,
        }];
        assert_eq!(parse_view(&prefix, bad), View::default());
    }
}
