//! The services a cluster replica serves but does not balance, and the moves of
//! services between its balancer and that overlay: a takeover (stored weights into the
//! balancer), a hand-over (out of it, served as last published), and following (other
//! replicas' services as they stored them).
//!
//! No I/O and no state of the daemon: each move takes the balancer, held by its
//! caller (the cycle loop), and a `publish` that publishes the balancer with the
//! overlay beside it, so that a move and its publication happen under one hold of the
//! balancer.

use crate::config::locality::Localities;
use crate::store::Restored;
use ballast_balance::{Balancer, Millis, Published, PublishedService, ServiceSnapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Services served beside the balancer's own, by name.
pub type Followed = BTreeMap<String, Arc<PublishedService>>;

/// The cluster overlay of one replica.
#[derive(Debug, Default)]
pub struct Overlay {
    /// The services it serves but does not balance: as their owners last stored them
    /// in etcd, or as this replica last published them before it lost them. Every
    /// publication carries them beside the balancer's own, so that every replica's
    /// feeds serve every service, and a lost service keeps its last weights rather
    /// than vanishing from the load balancers.
    followed: Followed,
    /// The services a takeover restored from the store, as they were published then:
    /// what the store already holds, so that its writer does not write the same value
    /// again once their buckets are owned. Shared with the writer, which takes them.
    restored: Restored,
}

impl Overlay {
    /// An empty overlay whose takeovers the store's writer learns of through
    /// `restored`.
    pub fn new(restored: Restored) -> Self {
        Overlay {
            followed: Followed::new(),
            restored,
        }
    }

    /// The services served beside the balancer's own.
    pub fn followed(&self) -> &Followed {
        &self.followed
    }

    /// Takes over the services of `stored` that the balancer does not hold, as a
    /// replica that just won them does: restored with their stored weights and cycle
    /// numbers, served as they were until their agents arrive, and published. Returns
    /// how many were restored.
    pub fn take_over(
        &mut self,
        b: &mut Balancer,
        stored: &BTreeMap<String, ServiceSnapshot>,
        now: Millis,
        publish: impl FnOnce(&Balancer, &BTreeSet<String>, &Followed) -> Arc<Published>,
    ) -> usize {
        let fresh: BTreeMap<String, ServiceSnapshot> = stored
            .iter()
            .filter(|(name, _)| b.service(name).is_none())
            .map(|(name, snap)| (name.clone(), snap.clone()))
            .collect();
        b.restore(now, &fresh);
        for name in fresh.keys() {
            self.followed.remove(name);
        }
        // Published afresh, not from the previous publication's copy (the followed
        // one, which may lag what was just restored).
        let ran: BTreeSet<String> = fresh.keys().cloned().collect();
        let published = publish(b, &ran, &self.followed);
        for name in fresh.keys() {
            if let Some(service) = published.services.get(name) {
                self.restored.insert(name.clone(), Arc::clone(service));
            }
        }
        fresh.len()
    }

    /// Lets go of the services `gone` picks, as a replica that lost them to another
    /// does: the balancer forgets them, and they are served as `last` published them
    /// until their new owner's weights arrive ([`Overlay::follow`]). Returns their
    /// names.
    pub fn hand_over(
        &mut self,
        b: &mut Balancer,
        gone: &dyn Fn(&str) -> bool,
        last: &Published,
        publish: impl FnOnce(&Balancer, &BTreeSet<String>, &Followed) -> Arc<Published>,
    ) -> Vec<String> {
        let names: Vec<String> = b
            .services()
            .filter(|s| gone(&s.name))
            .map(|s| s.name.clone())
            .collect();
        if names.is_empty() {
            return names;
        }
        for name in &names {
            self.restored.remove(name);
            b.remove_service(name);
            if let Some(p) = last.services.get(name) {
                self.followed.insert(name.clone(), Arc::clone(p));
            }
        }
        publish(b, &BTreeSet::new(), &self.followed);
        names
    }

    /// Serves `stored` services, as their owners wrote them, where this replica does
    /// not balance them itself; publishes if any changed. Returns how many it took.
    pub fn follow(
        &mut self,
        b: &Balancer,
        stored: &BTreeMap<String, ServiceSnapshot>,
        now: Millis,
        localities: &Localities,
        publish: impl FnOnce(&Balancer, &BTreeSet<String>, &Followed) -> Arc<Published>,
    ) -> usize {
        let mut taken = 0;
        for (name, snap) in stored {
            if b.service(name).is_some() {
                continue;
            }
            // Versions only grow; an older value (a watch event from before a read)
            // never replaces a newer one.
            let known = self.followed.get(name).is_some_and(|p| {
                p.version > snap.version
                    || (p.version == snap.version && p.weights_cycle >= snap.cycle)
            });
            if known {
                continue;
            }
            let mut svc = ballast_balance::service::Service::new(name, b.params(name).clone());
            svc.restore(now, snap);
            let locality = localities.services.get(name).cloned().unwrap_or_default();
            self.followed.insert(
                name.clone(),
                Arc::new(PublishedService::of(&svc, now, locality)),
            );
            taken += 1;
        }
        if taken > 0 {
            publish(b, &BTreeSet::new(), &self.followed);
        }
        taken
    }
}
