//! A connection's warm-up: a task's hot path run once and rolled back, before the connection
//! serves.
//!
//! PostgreSQL compiles a PL/pgSQL function the first time a session calls it, and plans each
//! statement in it the first time that statement runs. On this project's machine the first
//! claimed submit of a session took 10–14 ms, and the calls after it 0.4–0.6 ms. Half of that
//! was the compile (a call with empty arrays took 2.5–4.8 ms) and half the plans
//! (docs/benchmarks/journal.md, "A connection's first calls"). A node paid that on each connection
//! for its first frames, and again after every reconnect. Now a connection that will carry the hot
//! path first runs that path on made-up tasks, inside a transaction it rolls back:
//!
//! - a claimed submit and an unclaimed one in one batch;
//! - the second task's claim and its lease renewed;
//! - the first task's result and its finish through every state on the way;
//! - the second task's requeue and then its cancel.
//!
//! Nothing of it stays, with one exception: the fencing tokens it drew leave a gap in their
//! sequence, and a token only needs to grow. While it runs (~20 ms) it holds the locks a claimed
//! submit takes: one pool shard's row and the partition's lease row. Another node's claims on
//! that shard therefore wait that long, once, when this node starts or reconnects. It waits
//! for a lock itself no longer than `WARM_LOCK_WAIT` (200 ms), and fails past it.

use crate::db::Call;
use spindle_core::{Band, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

use crate::claim::{ClaimRequest, ClaimResult, Demand};
use crate::report::{Report, ReportAction, ReportResult};
use crate::submit::NewTask;
use crate::types::{PartitionId, PoolShard};
use crate::{Db, StoreError};

/// What a warm-up runs on: the node's name and attempt lease, a partition the node holds (a
/// submit into one it does not hold takes another path, which then goes unwarmed), and a
/// provider account with one of its pool's shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmUp {
    pub node: String,
    pub lease_ms: u32,
    pub partition: PartitionId,
    pub provider: String,
    pub pool: PoolShard,
    pub policy_version: PolicyVersion,
}

/// How far a warm-up went: the claims it took (of two) and the reports applied (of three); a
/// pool without room or a partition not held stops it early, with what ran warm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Warmed {
    pub claims: u32,
    pub reports_applied: u32,
}

/// The longest a warm-up waits for a row lock (a pool shard's, a partition lease's).
const WARM_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The made-up tasks' ids: the top of the range, far above any block the id sequence hands
/// out (and rolled back in any case).
const TASKS: [TaskId; 2] = [TaskId(i64::MAX as u64 - 1), TaskId(i64::MAX as u64)];
/// Their tenant: none of a deployment's (tenant ids are `u32`, so this one cannot be one that
/// has a budget; the budget statements are then planned at the first real call).
const TENANT: TenantId = TenantId(u32::MAX);

impl Db {
    /// Runs the hot path once on made-up tasks and rolls it all back (see the module's text).
    /// An error leaves the connection in an unknown state: drop it and open another.
    pub async fn warm_up(&self, w: &WarmUp) -> Result<Warmed, StoreError> {
        // A lock another session holds past the bound fails the warm-up (the connection then
        // serves cold) instead of holding back the node's start or reconnect.
        let begin = format!(
            "BEGIN; SET LOCAL lock_timeout = {}",
            WARM_LOCK_WAIT.as_millis()
        );
        self.answered(Call::Reads, self.client().batch_execute(&begin))
            .await?;
        let ran = self.hot_path(w).await;
        // Rolled back whatever happened above; a failed statement has aborted the
        // transaction, which the rollback ends too.
        let rolled_back = self
            .answered(Call::Reads, self.client().batch_execute("ROLLBACK"))
            .await;
        rolled_back?;
        ran
    }

    async fn hot_path(&self, w: &WarmUp) -> Result<Warmed, StoreError> {
        let [a, b] = TASKS;
        let new = |task: TaskId, key: &str| NewTask {
            task,
            tenant: TENANT,
            user: UserId(0),
            idempotency_key: key.to_string(),
            payload: b"spindle warm-up".to_vec(),
            partition: w.partition,
            lane: Lane::Standard,
            band: Band::P2,
            cost_estimate_milli: 1,
            fairness_milli: 1,
        };
        let claim = |task: TaskId| ClaimRequest {
            task,
            expected_version: 0,
            provider: w.provider.clone(),
            demands: vec![Demand {
                shard: w.pool.clone(),
                amount: 1,
            }],
        };
        let submitted = self
            .submit_claim_batch_as(
                &w.node,
                w.lease_ms,
                &[new(a, "spindle-warm-up-a"), new(b, "spindle-warm-up-b")],
                &[Some(claim(a)), None],
                w.policy_version,
            )
            .await?;
        let claimed = self.claim_batch(&w.node, w.lease_ms, &[claim(b)]).await?;
        let token = |claim: Option<&ClaimResult>| match claim {
            Some(ClaimResult::Granted { token, .. }) => Some(*token),
            _ => None,
        };
        let tokens = (
            token(submitted.first().and_then(|s| s.claim.as_ref())),
            token(claimed.first()),
        );
        let mut warmed = Warmed {
            claims: u32::from(tokens.0.is_some()) + u32::from(tokens.1.is_some()),
            reports_applied: 0,
        };
        let (Some(ta), Some(tb)) = tokens else {
            // A pool without room, or a partition not held: the paths that ran are warm.
            return Ok(warmed);
        };
        let mut count = |results: Vec<ReportResult>| {
            warmed.reports_applied += results
                .iter()
                .filter(|r| matches!(r, ReportResult::Applied { .. }))
                .count() as u32;
        };
        self.renew_attempts(&[(b, tb)], w.lease_ms).await?;
        count(
            self.report_batch(&[
                Report {
                    task: a,
                    token: Some(ta),
                    via: vec![
                        TaskState::Running,
                        TaskState::ProviderSucceeded,
                        TaskState::MediaProcessing,
                    ],
                    action: ReportAction::Finish {
                        state: TaskState::Succeeded,
                        cost_actual_milli: Some(1),
                        reason: None,
                        result: Some("{}".to_string()),
                    },
                },
                Report::new(
                    b,
                    Some(tb),
                    ReportAction::Requeue {
                        delay_ms: 0,
                        reason: "spindle warm-up".to_string(),
                    },
                ),
            ])
            .await?,
        );
        count(
            self.report_batch(&[Report::new(
                b,
                None,
                ReportAction::Finish {
                    state: TaskState::Canceled,
                    cost_actual_milli: None,
                    reason: Some("spindle warm-up".to_string()),
                    result: None,
                },
            )])
            .await?,
        );
        Ok(warmed)
    }
}
