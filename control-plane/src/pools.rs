//! Pooled resources (provider accounts, platform cost per minute, …) as sharded rows. The sum of
//! a pool's shard capacities is its capacity; claims charge one shard each.

use crate::db::{Call, Db};
use crate::error::{check_text, InputError, StoreError};
use crate::limits::{POOL_KEY_BYTES_MAX, POOL_SHARDS_MAX};
use crate::types::PoolShard;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardUsage {
    pub shard: PoolShard,
    pub capacity: u64,
    pub used: u64,
}

/// Shard `i`'s part of `capacity` split over `shards`: equal parts, the remainder to the first.
pub fn shard_capacity(capacity: u64, shards: u16, i: u16) -> u64 {
    let n = u64::from(shards);
    capacity / n + u64::from(u64::from(i) < capacity % n)
}

impl Db {
    /// Creates or resizes `pool` as `shards` rows whose capacities sum to `capacity`. Usage is
    /// kept: a shrunk shard may sit above its new capacity until releases bring it down, and
    /// grants never push it further.
    pub async fn set_pool(&self, pool: &str, capacity: u64, shards: u16) -> Result<(), StoreError> {
        check_text(0, "pool", pool, POOL_KEY_BYTES_MAX)?;
        if shards == 0 || shards > POOL_SHARDS_MAX {
            return Err(InputError::OutOfRange {
                row: 0,
                field: "shards",
                value: shards.to_string(),
            }
            .into());
        }
        crate::error::to_i64(0, "capacity", capacity)?;
        let idx: Vec<i16> = (0..shards).map(|i| i as i16).collect();
        let caps: Vec<i64> = (0..shards)
            .map(|i| shard_capacity(capacity, shards, i) as i64)
            .collect();
        self.answered(
            Call::Writes,
            self.client().execute(
                "INSERT INTO resource_pool_shard (pool_key, shard, capacity)
                 SELECT $1, s, c FROM unnest($2::smallint[], $3::bigint[]) AS d (s, c)
                 ON CONFLICT (pool_key, shard) DO UPDATE
                    SET capacity = EXCLUDED.capacity, version = resource_pool_shard.version + 1",
                &[&pool, &idx, &caps],
            ),
        )
        .await?;
        // Shards beyond the new count keep their usage but get no new grants.
        self.answered(
            Call::Writes,
            self.client().execute(
                "UPDATE resource_pool_shard SET capacity = 0
                  WHERE pool_key = $1 AND shard >= $2",
                &[&pool, &(shards as i16)],
            ),
        )
        .await?;
        Ok(())
    }

    /// Every shard of `pool` with its capacity and usage.
    pub async fn pool_usage(&self, pool: &str) -> Result<Vec<ShardUsage>, StoreError> {
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT shard, capacity, used FROM resource_pool_shard
                        WHERE pool_key = $1 ORDER BY shard",
                    &[&pool],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ShardUsage {
                shard: PoolShard::new(pool, r.get::<_, i16>(0) as u16),
                capacity: r.get::<_, i64>(1) as u64,
                used: r.get::<_, i64>(2) as u64,
            })
            .collect())
    }
}
