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
    /// `task` if it belongs to `tenant`; another tenant's task is `None`, like a missing one.
    pub async fn task_status(
        &self,
        tenant: TenantId,
        task: TaskId,
    ) -> Result<Option<StoredTask>, StoreError> {
        let row = self
            .client()
            .query_opt(
                "SELECT state, version, attempt_no, cost_estimate_milli, cost_actual_milli,
                        failure_reason
                   FROM task WHERE task_id = $1 AND tenant_id = $2",
                &[&(task.0 as i64), &(tenant.0 as i32)],
            )
            .await?;
        row.map(|r| {
            Ok(StoredTask {
                task,
                state: parse_state(r.get(0))?,
                version: r.get::<_, i32>(1) as u32,
                attempt_no: r.get::<_, i32>(2) as u32,
                cost_estimate_milli: r.get::<_, i64>(3) as u64,
                cost_actual_milli: r.get::<_, Option<i64>>(4).map(|c| c as u64),
                failure_reason: r.get(5),
            })
        })
        .transpose()
    }
}
