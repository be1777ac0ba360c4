//! Reads for clients: a task's status as PostgreSQL has it, scoped to its tenant.

use spindle_core::{TaskId, TaskState, TenantId};

use crate::db::Db;
use crate::error::StoreError;
use crate::types::parse_state;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTask {
    pub task: TaskId,
    pub state: TaskState,
    pub version: u32,
    pub attempt_no: u32,
    pub cost_estimate_milli: u64,
    pub cost_actual_milli: Option<u64>,
    pub failure_reason: Option<String>,
}

impl Db {
    /// Many tasks at once (a read batch), each with its owning tenant; missing ones are absent.
    pub async fn task_statuses(
        &self,
        tasks: &[TaskId],
    ) -> Result<Vec<(TenantId, StoredTask)>, StoreError> {
        crate::error::check_batch_len(tasks.len())?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        let rows = self
            .client()
            .query(
                "SELECT task_id, tenant_id, state, version, attempt_no, cost_estimate_milli,
                        cost_actual_milli, failure_reason
                   FROM task WHERE task_id = ANY ($1)",
                &[&ids],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    TenantId(r.get::<_, i32>(1) as u32),
                    StoredTask {
                        task: TaskId(r.get::<_, i64>(0) as u64),
                        state: parse_state(r.get(2))?,
                        version: r.get::<_, i32>(3) as u32,
                        attempt_no: r.get::<_, i32>(4) as u32,
                        cost_estimate_milli: r.get::<_, i64>(5) as u64,
                        cost_actual_milli: r.get::<_, Option<i64>>(6).map(|c| c as u64),
                        failure_reason: r.get(7),
                    },
                ))
            })
            .collect()
    }

    /// `task` if it belongs to `tenant`; another tenant's task is `None`, like a missing one.
    pub async fn task_status(
        &self,
        tenant: TenantId,
        task: TaskId,
    ) -> Result<Option<StoredTask>, StoreError> {
        Ok(self
            .task_statuses(&[task])
            .await?
            .into_iter()
            .find(|(owner, _)| *owner == tenant)
            .map(|(_, t)| t))
    }
}
