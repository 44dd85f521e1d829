//! A map from node name to a value, kept as one vector in node order.
//!
//! A publication lists every endpoint of a service by node, and is built once per
//! cycle from the balancer's arrays, which are in node order already. A search tree
//! would spend most of that cycle allocating its nodes and, a cycle later, freeing
//! them; a vector is one allocation built by appending, searched by bisection, and
//! read in order. It serialises as the map it stands for, so the stored and served
//! form is the same as a `BTreeMap`'s.

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, SerializeMap, Serializer};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Values by node name, in node order, each node once.
#[derive(Clone, PartialEq)]
pub struct ByNode<V> {
    entries: Vec<(Arc<str>, V)>,
}

impl<V> Default for ByNode<V> {
    fn default() -> Self {
        ByNode {
            entries: Vec::new(),
        }
    }
}

impl<V> ByNode<V> {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// From entries already in strictly increasing node order, as a walk of a
    /// service's endpoints yields them, taken as they are: checking the order would
    /// compare every pair of neighbouring names, which costs a large service more than
    /// building the list. Entries out of order make lookups miss (never anything
    /// worse); a debug build checks.
    pub(crate) fn from_node_order(entries: Vec<(Arc<str>, V)>) -> Self {
        debug_assert!(
            entries.windows(2).all(|w| w[0].0 < w[1].0),
            "entries out of node order"
        );
        ByNode { entries }
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn position(&self, node: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(n, _)| (**n).cmp(node))
    }

    /// The value of `node`.
    pub fn get(&self, node: &str) -> Option<&V> {
        let i = self.position(node).ok()?;
        self.entries.get(i).map(|(_, v)| v)
    }

    /// The value of `node`, to change.
    pub fn get_mut(&mut self, node: &str) -> Option<&mut V> {
        let i = self.position(node).ok()?;
        self.entries.get_mut(i).map(|(_, v)| v)
    }

    /// Whether `node` is here.
    pub fn contains_key(&self, node: &str) -> bool {
        self.position(node).is_ok()
    }

    /// Sets the value of `node`, in its place; the value it replaces, if any. It moves
    /// the entries after it, so it suits a few changes, not a whole build.
    pub fn insert(&mut self, node: Arc<str>, value: V) -> Option<V> {
        match self.position(&node) {
            Ok(i) => self
                .entries
                .get_mut(i)
                .map(|(_, v)| std::mem::replace(v, value)),
            Err(i) => {
                self.entries.insert(i, (node, value));
                None
            }
        }
    }

    /// Takes `node` out; its value, if it was here.
    pub fn remove(&mut self, node: &str) -> Option<V> {
        let i = self.position(node).ok()?;
        Some(self.entries.remove(i).1)
    }

    /// Nodes and values, in node order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&Arc<str>, &V)> + ExactSizeIterator {
        self.entries.iter().map(|(n, v)| (n, v))
    }

    /// Nodes and values to change, in node order.
    pub fn iter_mut(
        &mut self,
    ) -> impl DoubleEndedIterator<Item = (&Arc<str>, &mut V)> + ExactSizeIterator {
        self.entries.iter_mut().map(|(n, v)| (&*n, v))
    }

    /// The nodes, in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &Arc<str>> + ExactSizeIterator {
        self.entries.iter().map(|(n, _)| n)
    }

    /// The values, in node order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator {
        self.entries.iter().map(|(_, v)| v)
    }

    /// The values to change, in node order.
    pub fn values_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut V> + ExactSizeIterator {
        self.entries.iter_mut().map(|(_, v)| v)
    }
}

impl<V> FromIterator<(Arc<str>, V)> for ByNode<V> {
    /// In any order; of two entries for one node the later stands, as in a map.
    fn from_iter<I: IntoIterator<Item = (Arc<str>, V)>>(iter: I) -> Self {
        let mut entries: Vec<(Arc<str>, V)> = iter.into_iter().collect();
        if entries.windows(2).all(|w| w[0].0 < w[1].0) {
            return ByNode { entries };
        }
        // Stable, so equal nodes keep their order and the last one is kept below.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<(Arc<str>, V)> = Vec::with_capacity(entries.len());
        for entry in entries {
            match out.last_mut() {
                Some(last) if last.0 == entry.0 => *last = entry,
                _ => out.push(entry),
            }
        }
        ByNode { entries: out }
    }
}

impl<'a, V> IntoIterator for &'a ByNode<V> {
    type Item = (&'a Arc<str>, &'a V);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Arc<str>, V)>,
        fn(&'a (Arc<str>, V)) -> (&'a Arc<str>, &'a V),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(n, v)| (n, v))
    }
}

impl<V> IntoIterator for ByNode<V> {
    type Item = (Arc<str>, V);
    type IntoIter = std::vec::IntoIter<(Arc<str>, V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

impl<V> std::ops::Index<&str> for ByNode<V> {
    type Output = V;

    /// The value of `node`; panics if it is not here, as a map's index does. For tests
    /// and for callers that just found the node; product code uses [`ByNode::get`].
    fn index(&self, node: &str) -> &V {
        match self.get(node) {
            Some(v) => v,
            None => panic!("no node {node:?}"),
        }
    }
}

impl<V: std::fmt::Debug> std::fmt::Debug for ByNode<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V: Serialize> Serialize for ByNode<V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.len()))?;
        for (node, value) in self {
            map.serialize_entry(&**node, value)?;
        }
        map.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for ByNode<V> {
    /// As a map: in any order, and of two entries for one node the later stands.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<Arc<str>, V>::deserialize(deserializer)?;
        Ok(ByNode {
            entries: map.into_iter().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever entries it is built from, it answers as a `BTreeMap` built from
        /// them would, and serialises the same.
        #[test]
        fn it_is_the_map_it_stands_for(
            entries in proptest::collection::vec(("[a-e]{0,3}", any::<u16>()), 0..40),
            probes in proptest::collection::vec("[a-e]{0,3}", 0..10),
        ) {
            let map: BTreeMap<Arc<str>, u16> =
                entries.iter().map(|(n, v)| (Arc::from(n.as_str()), *v)).collect();
            let by: ByNode<u16> =
                entries.iter().map(|(n, v)| (Arc::from(n.as_str()), *v)).collect();
            prop_assert_eq!(by.len(), map.len());
            prop_assert!(by.iter().eq(map.iter()));
            for p in &probes {
                prop_assert_eq!(by.get(p), map.get(p.as_str()));
                prop_assert_eq!(by.contains_key(p), map.contains_key(p.as_str()));
            }
            let json = serde_json::to_string(&by).expect("serialises");
            prop_assert_eq!(&json, &serde_json::to_string(&map).expect("serialises"));
            let back: ByNode<u16> = serde_json::from_str(&json).expect("deserialises");
            prop_assert!(back == by);
            let mut edited = by.clone();
            let mut map = map;
            for (i, p) in probes.iter().enumerate() {
                let v = u16::try_from(i).unwrap_or(0);
                prop_assert_eq!(edited.insert(Arc::from(p.as_str()), v), map.insert(Arc::from(p.as_str()), v));
            }
            prop_assert!(edited.iter().eq(map.iter()));
            if let Some(p) = probes.first() {
                prop_assert_eq!(edited.remove(p), map.remove(p.as_str()));
                prop_assert!(edited.iter().eq(map.iter()));
            }
        }
    }

    #[test]
    fn a_map_with_a_node_twice_keeps_the_later() {
        let json = r#"{"b":1,"a":2,"b":3}"#;
        let by: ByNode<u8> = serde_json::from_str(json).expect("deserialises");
        assert_eq!(by.keys().map(|k| &**k).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(by["b"], 3);
    }
}
