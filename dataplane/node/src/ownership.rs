//! Which tenant partitions this node owns. The control-plane thread leases them in PostgreSQL
//! and writes here; connections and shards read here to refuse tenants another node serves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

use spindle_control::lease::PartitionOwner;
use spindle_control::PartitionId;

pub struct Ownership {
    owned: Vec<AtomicBool>,
    /// Live nodes of the cluster (this one included), from their heartbeats.
    live_nodes: AtomicU32,
    /// Partitions other nodes hold, with "node at address", for the WrongNode answer.
    elsewhere: Mutex<HashMap<u32, String>>,
}

impl Ownership {
    pub fn new(partitions: u32) -> Ownership {
        Ownership {
            owned: (0..partitions).map(|_| AtomicBool::new(false)).collect(),
            live_nodes: AtomicU32::new(1),
            elsewhere: Mutex::new(HashMap::new()),
        }
    }

    pub fn live_nodes(&self) -> u32 {
        self.live_nodes.load(Ordering::Acquire)
    }

    pub fn set_live_nodes(&self, n: u32) {
        self.live_nodes.store(n.max(1), Ordering::Release);
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
