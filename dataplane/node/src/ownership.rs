//! What this node holds of its cluster: the tenant partitions it owns, and its part of each
//! rate the nodes share. The control-plane thread leases the partitions and allots the parts in
//! PostgreSQL and writes here; connections and shards read here to refuse tenants another node
//! serves, and to run their rates at the node's part.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use spindle_control::lease::PartitionOwner;
use spindle_control::PartitionId;

pub struct Ownership {
    owned: Vec<AtomicBool>,
    /// Partitions other nodes hold, with "node at address", for the WrongNode answer.
    elsewhere: Mutex<HashMap<u32, String>>,
    /// The cluster's rates this node runs a part of, once the board of node limits exists.
    rates: OnceLock<ClusterRates>,
    rates_ready: tokio::sync::Notify,
    /// A rate was added: allot it now rather than at the next round.
    rates_added: tokio::sync::Notify,
}

/// The node's parts of the cluster's rates (`spindle_control::rate_parts`), one slot per node
/// limit of the board: a rate's part in millionths of the cluster's rate, 0 until its first
/// allotment (a starting node holds nothing of a rate the other nodes may be running at whole).
struct ClusterRates {
    parts: Box<[AtomicU32]>,
    /// The board's places of the rates (the others are slots, which PostgreSQL's pools or the
    /// node alone bound), with their names across the cluster.
    names: Mutex<Vec<(usize, String)>>,
}

impl Ownership {
    pub fn new(partitions: u32) -> Ownership {
        Ownership {
            owned: (0..partitions).map(|_| AtomicBool::new(false)).collect(),
            elsewhere: Mutex::new(HashMap::new()),
            rates: OnceLock::new(),
            rates_ready: tokio::sync::Notify::new(),
            rates_added: tokio::sync::Notify::new(),
        }
    }

    /// Gives the node its `limits` board places, of which `rates` (place, name) are the
    /// cluster's rates; once, before the shards start.
    pub fn init_rates(&self, limits: usize, rates: Vec<(usize, String)>) {
        let fresh = ClusterRates {
            parts: (0..limits).map(|_| AtomicU32::new(0)).collect(),
            names: Mutex::new(rates),
        };
        if self.rates.set(fresh).is_ok() {
            self.rates_ready.notify_waiters();
        }
    }

    /// Returns once [`Ownership::init_rates`] was called.
    pub async fn rates_ready(&self) {
        let ready = self.rates_ready.notified();
        tokio::pin!(ready);
        ready.as_mut().enable();
        if self.rates.get().is_none() {
            ready.await;
        }
    }

    /// A rate added while the node runs (a new provider account's RPM) at board place `k`.
    pub fn add_rate(&self, k: usize, name: String) {
        if let Some(r) = self.rates.get() {
            if let Ok(mut names) = r.names.lock() {
                names.push((k, name));
            }
            self.rates_added.notify_one();
        }
    }

    /// Returns when a rate was added since the last call returned.
    pub async fn rate_added(&self) {
        self.rates_added.notified().await;
    }

    /// The cluster's rates by board place and name.
    pub fn rate_names(&self) -> Vec<(usize, String)> {
        self.rates
            .get()
            .and_then(|r| r.names.lock().ok().map(|n| n.clone()))
            .unwrap_or_default()
    }

    /// This node's part of the rate at board place `k`, in millionths.
    pub fn rate_part(&self, k: usize) -> u32 {
        self.rates
            .get()
            .and_then(|r| r.parts.get(k))
            .map_or(0, |p| p.load(Ordering::Acquire))
    }

    pub fn set_rate_part(&self, k: usize, ppm: u32) {
        if let Some(p) = self.rates.get().and_then(|r| r.parts.get(k)) {
            p.store(
                ppm.min(spindle_control::rate_parts::WHOLE),
                Ordering::Release,
            );
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
            .map(|o| (o.partition.0, format!("node {} at {}", o.node, o.address)))
            .collect();
        if let Ok(mut slot) = self.elsewhere.lock() {
            *slot = map;
        }
    }

    /// "node N at ADDR" for a partition another node holds, when one does.
    pub fn owner_of(&self, partition: u32) -> Option<String> {
        self.elsewhere
            .lock()
            .ok()
            .and_then(|m| m.get(&partition).cloned())
    }

    /// Why this node refuses `tenant` of `partition`, naming the owner when one is known.
    pub fn refusal(&self, tenant: u32, partition: u32) -> String {
        match self.owner_of(partition) {
            Some(o) => format!("tenant {tenant} (partition {partition}) is served by {o}"),
            None => format!(
                "tenant {tenant} (partition {partition}) has no live owner now; retry shortly"
            ),
        }
    }
}
