//! Leases: the node registry with heartbeats, partition leases (owner, lease_until, epoch) that
//! move a dead node's tenants to a live one, and batched renewal of running attempts.

use spindle_core::{AttemptId, FencingToken, TaskId};

use crate::db::{Call, Db};
use crate::error::{check_batch_len, check_text, StoreError};
use crate::limits::{NAME_BYTES_MAX, PARTITIONS_MAX};
use crate::types::PartitionId;

/// A partition this node now holds, with the epoch its writes are fenced by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PartitionLease {
    pub partition: PartitionId,
    pub epoch: u64,
}

/// A partition held under a live lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionOwner {
    pub partition: PartitionId,
    pub node: String,
    /// The owner's client protocol address, as it registered.
    pub address: String,
}

/// `acquire_partitions`: takes or renews, among $2, every partition free, expired or held by
/// $1, for $3 ms; a change of owner bumps the epoch.
const ACQUIRE: &str = "UPDATE partition_lease l
    SET epoch = l.epoch + CASE WHEN l.owner_node IS DISTINCT FROM $1 THEN 1 ELSE 0 END,
        owner_node = $1,
        lease_until = now() + $3::float8 * interval '1 millisecond'
  WHERE l.partition = ANY ($2)
    AND (l.owner_node IS NULL OR l.owner_node = $1 OR l.lease_until < now())
 RETURNING l.partition, l.epoch";

impl Db {
    /// Registers (or re-registers) a node as UP; also its heartbeat.
    pub async fn register_node(&self, node: &str, address: &str) -> Result<(), StoreError> {
        check_text(0, "node", node, NAME_BYTES_MAX)?;
        self.answered(
            Call::Writes,
            self.client().execute(
                "INSERT INTO node (node_id, address) VALUES ($1, $2)
                 ON CONFLICT (node_id) DO UPDATE
                    SET address = EXCLUDED.address, heartbeat_at = now(), state = 'UP',
                        started_at = now()",
                &[&node, &address],
            ),
        )
        .await?;
        Ok(())
    }

    /// Records whether `node` relays the cluster's events (its `[events]`), and with what
    /// bound on the events left waiting (`pending_max`; `None`: it runs no relay), which every
    /// node reads ([`Db::relaying_nodes`]).
    pub async fn set_relay(&self, node: &str, pending_max: Option<u64>) -> Result<(), StoreError> {
        let bound = pending_max.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let sql = "UPDATE node SET relay_pending_max = $2 WHERE node_id = $1";
        self.answered(Call::Writes, self.client().execute(sql, &[&node, &bound]))
            .await?;
        Ok(())
    }

    /// The nodes other than `except` that relay events and were heard from (a heartbeat, up
    /// or not) within `within` (`None`: ever), by name, each with its relay's backlog bound.
    /// While there is one, no node prunes what a relay has yet to send.
    pub async fn relaying_nodes(
        &self,
        except: &str,
        within: Option<std::time::Duration>,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let within_ms = within.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let sql = "SELECT node_id, relay_pending_max FROM node
                    WHERE relay_pending_max IS NOT NULL AND node_id <> $1
                      AND ($2::bigint IS NULL
                           OR heartbeat_at > now() - $2::bigint * interval '1 millisecond')
                    ORDER BY node_id";
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(sql, &[&except, &within_ms]),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get::<_, i64>(1) as u64))
            .collect())
    }

    pub async fn heartbeat(&self, node: &str) -> Result<(), StoreError> {
        let sql = "UPDATE node SET heartbeat_at = now() WHERE node_id = $1";
        self.answered(Call::Writes, self.client().execute(sql, &[&node]))
            .await?;
        Ok(())
    }

    /// Makes sure partitions `0..count` exist (idempotent; the first node to start creates them).
    pub async fn ensure_partitions(&self, count: u32) -> Result<(), StoreError> {
        if count == 0 || count > PARTITIONS_MAX {
            return Err(crate::error::InputError::OutOfRange {
                row: 0,
                field: "partitions",
                value: count.to_string(),
            }
            .into());
        }
        self.answered(
            Call::Writes,
            self.client().execute(
                "INSERT INTO partition_lease (partition)
                 SELECT generate_series(0, $1 - 1) ON CONFLICT DO NOTHING",
                &[&(count as i32)],
            ),
        )
        .await?;
        Ok(())
    }

    /// Takes or renews, among `wanted`, every partition that is free, expired or already ours,
    /// for `ttl_ms`. A change of owner bumps the epoch. Returns what this node now holds.
    pub async fn acquire_partitions(
        &self,
        node: &str,
        wanted: &[PartitionId],
        ttl_ms: u32,
    ) -> Result<Vec<PartitionLease>, StoreError> {
        check_text(0, "node", node, NAME_BYTES_MAX)?;
        check_batch_len(wanted.len())?;
        let wanted: Vec<i32> = wanted.iter().map(|p| p.0 as i32).collect();
        let ttl = f64::from(ttl_ms);
        let rows = self
            .answered(
                Call::Writes,
                self.client().query(ACQUIRE, &[&node, &wanted, &ttl]),
            )
            .await?;
        let mut held: Vec<PartitionLease> = rows
            .iter()
            .map(|r| PartitionLease {
                partition: PartitionId(r.get::<_, i32>(0) as u32),
                epoch: r.get::<_, i64>(1) as u64,
            })
            .collect();
        held.sort();
        Ok(held)
    }

    /// Gives partitions back at once (a drain): their next owner need not wait for expiry.
    /// Every partition with its owner (if its lease is live) and that owner's client address.
    pub async fn partition_owners(&self) -> Result<Vec<PartitionOwner>, StoreError> {
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT l.partition, l.owner_node, n.address
                   FROM partition_lease l
                   LEFT JOIN node n ON n.node_id = l.owner_node
                  WHERE l.owner_node IS NOT NULL AND l.lease_until > now()
                  ORDER BY l.partition",
                    &[],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| PartitionOwner {
                partition: PartitionId(r.get::<_, i32>(0) as u32),
                node: r.get(1),
                address: r.get::<_, Option<String>>(2).unwrap_or_default(),
            })
            .collect())
    }

    /// Nodes that are up and heartbeated within `within_ms`.
    pub async fn live_nodes(&self, within_ms: u32) -> Result<u32, StoreError> {
        let within = f64::from(within_ms);
        let sql = "SELECT count(*) FROM node
                    WHERE state = 'UP'
                      AND heartbeat_at > now() - $1::float8 * interval '1 millisecond'";
        let row = self
            .answered(Call::Reads, self.client().query_one(sql, &[&within]))
            .await?;
        Ok(row.get::<_, i64>(0) as u32)
    }

    pub async fn release_partitions(&self, node: &str) -> Result<u64, StoreError> {
        let sql = "UPDATE partition_lease SET lease_until = '-infinity', owner_node = NULL
                    WHERE owner_node = $1";
        self.answered(Call::Writes, self.client().execute(sql, &[&node]))
            .await
    }

    /// Marks a node DOWN after a drain.
    pub async fn deregister_node(&self, node: &str) -> Result<(), StoreError> {
        self.answered(
            Call::Writes,
            self.client().execute(
                "UPDATE node SET state = 'DOWN' WHERE node_id = $1",
                &[&node],
            ),
        )
        .await?;
        Ok(())
    }

    /// Extends the leases of live attempts, named by task and fencing token, in one statement;
    /// returns the attempts renewed (an attempt that ended or whose token moved on is not).
    pub async fn renew_attempts(
        &self,
        attempts: &[(TaskId, FencingToken)],
        ttl_ms: u32,
    ) -> Result<Vec<AttemptId>, StoreError> {
        check_batch_len(attempts.len())?;
        let ids: Vec<i64> = attempts.iter().map(|(t, _)| t.0 as i64).collect();
        let tokens: Vec<i64> = attempts.iter().map(|(_, t)| t.0 as i64).collect();
        let rows = self
            .answered(
                Call::Writes,
                self.client()
                    .query(&self.stmts.renew, &[&ids, &tokens, &i64::from(ttl_ms)]),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| AttemptId(r.get::<_, i64>(0) as u64))
            .collect())
    }
}
