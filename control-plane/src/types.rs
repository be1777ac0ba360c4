//! Names shared by the store's paths: partitions, pool shards, and the text forms of core enums.

use std::fmt;

use serde::{Deserialize, Serialize};
use spindle_core::TaskState;

use crate::error::StoreError;

/// Ids in one block of `reserve_task_ids` (the sequence's increment in the baseline schema).
pub const TASK_ID_BLOCK: u64 = 4096;

/// Tenants hash into partitions; a node owns partitions through leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PartitionId(pub u32);

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "partition {}", self.0)
    }
}

/// One shard of a pooled resource, e.g. `provider:acme/veo` shard 3.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolShard {
    pub pool: String,
    pub shard: u16,
}

impl PoolShard {
    pub fn new(pool: impl Into<String>, shard: u16) -> PoolShard {
        PoolShard {
            pool: pool.into(),
            shard,
        }
    }
}

impl fmt::Display for PoolShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.pool, self.shard)
    }
}

/// The core's state from its stored name.
pub fn parse_state(name: &str) -> Result<TaskState, StoreError> {
    TaskState::ALL
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| StoreError::Corrupt(format!("task state {name:?}")))
}
