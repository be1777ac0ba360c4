//! What this node holds of its cluster: the tenant partitions it owns, and its part of each
//! limit the nodes share. The control-plane thread leases the partitions and allots the parts in
//! PostgreSQL and writes here; connections and shards read here to refuse tenants another node
//! serves, and to run the shared limits at the node's part.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use spindle_control::lease::PartitionOwner;
use spindle_control::PartitionId;
use spindle_wire::{ErrorCode, WireError};

pub struct Ownership {
    owned: Vec<AtomicBool>,
    /// Partitions other nodes hold, with the node and its client address, for the WrongNode
    /// answer.
    elsewhere: Mutex<HashMap<u32, Owner>>,
    /// The limits this node runs a part of (the cluster's), once the board of node limits
    /// exists.
    shares: OnceLock<ClusterShares>,
    /// A shared limit was added: allot it now rather than at the next round.
    shares_added: tokio::sync::Notify,
}

/// Another node holding a partition.
#[derive(Debug, Clone)]
struct Owner {
    node: String,
    /// Where its clients connect ("host:port").
    address: String,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {} at {}", self.node, self.address)
    }
}

/// A node limit the cluster's nodes share (`spindle_control::cluster_shares`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLimit {
    /// Its place on the board of node limits.
    pub place: usize,
    /// Its name across the cluster.
    pub name: String,
    /// A rate (its part in millionths) rather than slots (its part in slots).
    pub rate: bool,
}

/// The node's parts of the limits it shares with the cluster, one per place of the board: 0
/// until the first allotment (a starting node holds nothing of what the others may be using
/// whole); [`NOT_SHARED`] for a limit the node has to itself.
struct ClusterShares {
    parts: Box<[AtomicU64]>,
    limits: Mutex<Vec<SharedLimit>>,
}

/// The part of a limit the node does not share.
const NOT_SHARED: u64 = u64::MAX;

impl Ownership {
    pub fn new(partitions: u32) -> Ownership {
        Ownership {
            owned: (0..partitions).map(|_| AtomicBool::new(false)).collect(),
            elsewhere: Mutex::new(HashMap::new()),
            shares: OnceLock::new(),
            shares_added: tokio::sync::Notify::new(),
        }
    }

    /// Gives the node its `places` board places, of which `shared` are the cluster's; once,
    /// before the shards start.
    pub fn init_shares(&self, places: usize, shared: Vec<SharedLimit>) {
        let parts: Box<[AtomicU64]> = (0..places).map(|_| AtomicU64::new(NOT_SHARED)).collect();
        for l in &shared {
            if let Some(p) = parts.get(l.place) {
                p.store(0, Ordering::Release);
            }
        }
        let fresh = ClusterShares {
            parts,
            limits: Mutex::new(shared),
        };
        let _ = self.shares.set(fresh);
    }

    /// A shared limit added while the node runs (a new provider account's).
    pub fn add_shared(&self, limit: SharedLimit) {
        if let Some(s) = self.shares.get() {
            if let Some(p) = s.parts.get(limit.place) {
                p.store(0, Ordering::Release);
            }
            if let Ok(mut limits) = s.limits.lock() {
                limits.push(limit);
            }
            self.shares_added.notify_one();
        }
    }

    /// Returns when a shared limit was added since the last call returned.
    pub async fn shared_added(&self) {
        self.shares_added.notified().await;
    }

    /// The limits the node shares with the cluster.
    pub fn shared_limits(&self) -> Vec<SharedLimit> {
        self.shares
            .get()
            .and_then(|s| s.limits.lock().ok().map(|l| l.clone()))
            .unwrap_or_default()
    }

    /// This node's part of the limit at board place `k` (of a rate in millionths, of slots in
    /// slots); `None` when the node has it to itself.
    pub fn share(&self, k: usize) -> Option<u64> {
        let part = self
            .shares
            .get()
            .and_then(|s| s.parts.get(k))
            .map_or(NOT_SHARED, |p| p.load(Ordering::Acquire));
        (part != NOT_SHARED).then_some(part)
    }

    pub fn set_share(&self, k: usize, part: u64) {
        if let Some(p) = self.shares.get().and_then(|s| s.parts.get(k)) {
            p.store(part.min(NOT_SHARED - 1), Ordering::Release);
        }
    }

    pub fn owns(&self, partition: u32) -> bool {
        self.owned
            .get(partition as usize)
            .is_some_and(|o| o.load(Ordering::Acquire))
    }

    pub fn set(&self, partition: PartitionId, owned: bool) {
        if let Some(o) = self.owned.get(partition.0 as usize) {
            o.store(owned, Ordering::Release);
        }
    }

    pub fn owned(&self) -> Vec<PartitionId> {
        (0..self.owned.len() as u32)
            .filter(|&p| self.owns(p))
            .map(PartitionId)
            .collect()
    }

    /// Records who holds the partitions this node does not.
    pub fn set_owners(&self, owners: &[PartitionOwner], me: &str) {
        let map = owners
            .iter()
            .filter(|o| o.node != me)
            .map(|o| {
                let owner = Owner {
                    node: o.node.clone(),
                    address: o.address.clone(),
                };
                (o.partition.0, owner)
            })
            .collect();
        if let Ok(mut slot) = self.elsewhere.lock() {
            *slot = map;
        }
    }

    /// "node N at ADDR" for a partition another node holds, when one does.
    pub fn owner_of(&self, partition: u32) -> Option<String> {
        self.owner(partition).map(|o| o.to_string())
    }

    fn owner(&self, partition: u32) -> Option<Owner> {
        self.elsewhere
            .lock()
            .ok()
            .and_then(|m| m.get(&partition).cloned())
    }

    /// The WrongNode answer to `tenant` of `partition`: why, naming the owner when one is
    /// known, and its address to reconnect to.
    pub fn refusal(&self, tenant: u32, partition: u32) -> WireError {
        match self.owner(partition) {
            Some(o) => {
                let e = WireError::new(
                    ErrorCode::WrongNode,
                    format!("tenant {tenant} (partition {partition}) is served by {o}"),
                );
                // A wildcard (a node listening on 0.0.0.0 without `advertise`) would send the
                // client to itself: named, never a redirect.
                let wildcard = o
                    .address
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_unspecified());
                if wildcard {
                    e
                } else {
                    e.redirecting_to(o.address)
                }
            }
            None => WireError::new(
                ErrorCode::WrongNode,
                format!(
                    "tenant {tenant} (partition {partition}) has no live owner now; retry shortly"
                ),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_redirects_to_the_owner_but_never_to_a_wildcard() {
        let ownership = Ownership::new(4);
        let owner = |partition, node: &str, address: &str| PartitionOwner {
            partition: PartitionId(partition),
            node: node.into(),
            address: address.into(),
        };
        ownership.set_owners(
            &[
                owner(1, "a", "10.0.0.7:7070"),
                owner(2, "b", "0.0.0.0:7070"),
                owner(3, "c", "spindled-2.spindled:7070"),
            ],
            "me",
        );
        let redirect = |p| ownership.refusal(p, p).redirect;
        assert_eq!(redirect(1).as_deref(), Some("10.0.0.7:7070"));
        assert_eq!(
            redirect(2),
            None,
            "a wildcard would send the client to itself"
        );
        assert_eq!(redirect(3).as_deref(), Some("spindled-2.spindled:7070"));
        assert_eq!(redirect(0), None, "no owner known");
        let named = ownership.refusal(2, 2);
        assert_eq!(named.code, ErrorCode::WrongNode);
        assert!(named.message.contains("node b at 0.0.0.0:7070"), "{named}");
    }
}
