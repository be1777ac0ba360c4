//! Fenced reports from running work: state advances, releases, requeues and terminal finishes.
//! Every one carries the attempt's fencing token; a stale token changes nothing and says so.
//! Releases go ACTIVE → RELEASED once; only that transition gives capacity back.

use spindle_core::state::Actor;
use spindle_core::{FencingToken, TaskId, TaskState};

use crate::db::{Call, Db};
use crate::error::{check_answered, check_batch_len, to_i64, BatchTasks, InputError, StoreError};
use crate::limits::{REASON_BYTES_MAX, RESULT_BYTES_MAX};
use crate::types::parse_state;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub task: TaskId,
    /// The current attempt's token; `None` for a task that has no attempt (a queued cancel).
    pub token: Option<FencingToken>,
    /// States the task passed through, in order, before the action's own (each hop is checked
    /// against the whitelist): several steps that happened between two flushes in one row.
    /// Empty for a single step.
    pub via: Vec<TaskState>,
    pub action: ReportAction,
}

impl Report {
    /// A single-step report.
    pub fn new(task: TaskId, token: Option<FencingToken>, action: ReportAction) -> Report {
        Report {
            task,
            token,
            via: Vec::new(),
            action,
        }
    }

    /// Folds `later`, the next report of the same task and attempt, into this one when this
    /// one only advanced the state: the result carries both steps. `Err(later)` when they do
    /// not fold (a release, another token, another task).
    pub fn then(&mut self, later: Report) -> Result<(), Report> {
        let ReportAction::Advance(passed) = self.action else {
            return Err(later);
        };
        if later.task != self.task
            || later.token != self.token
            || matches!(later.action, ReportAction::Release)
            || self.via.len() + 1 + later.via.len() > VIA_MAX
        {
            return Err(later);
        }
        self.via.push(passed);
        self.via.extend(later.via);
        self.action = later.action;
        Ok(())
    }
}

/// States one report may pass through (more than any path of the state machine).
pub const VIA_MAX: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportAction {
    /// A state change that keeps the reservations (RUNNING, SUBMIT_UNKNOWN, PROVIDER_SUCCEEDED…).
    Advance(TaskState),
    /// Give the attempt's reservations back, state unchanged (e.g. the provider slot after the
    /// provider finished while media work continues on its own slots).
    Release,
    /// Back to QUEUED after a retryable failure: release, end the attempt, eligible after
    /// `delay_ms`.
    Requeue { delay_ms: u64, reason: String },
    /// A terminal state: release, end the attempt, settle the budget with the actual cost
    /// (SUCCEEDED) or refund it (FAILED, CANCELED, EXPIRED).
    Finish {
        state: TaskState,
        cost_actual_milli: Option<u64>,
        reason: Option<String>,
        /// What the task produced (SUCCEEDED): stored with it, fenced by the report's token,
        /// before the finish (`task.result`, read by `GetTask`). At most `RESULT_BYTES_MAX`.
        result: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportResult {
    Applied {
        state: TaskState,
        version: u32,
        /// Reservations this report moved ACTIVE → RELEASED (0 on a repeated release).
        released: u32,
    },
    /// The token is not the task's current one: a stale writer, fenced. `state` is the
    /// task's now (a repeat of a finish that was applied unheard finds it in that state).
    StaleToken {
        current: Option<FencingToken>,
        state: TaskState,
    },
    IllegalTransition {
        from: TaskState,
        to: TaskState,
    },
    TaskGone,
}

impl ReportAction {
    fn mode(&self) -> &'static str {
        match self {
            ReportAction::Advance(_) => "ADVANCE",
            ReportAction::Release => "RELEASE",
            ReportAction::Requeue { .. } => "REQUEUE",
            ReportAction::Finish { .. } => "FINISH",
        }
    }

    fn target(&self) -> Option<TaskState> {
        match self {
            ReportAction::Advance(s) => Some(*s),
            ReportAction::Release => None,
            ReportAction::Requeue { .. } => Some(TaskState::Queued),
            ReportAction::Finish { state, .. } => Some(*state),
        }
    }
}

pub(crate) fn validate(batch: &[Report]) -> Result<(), InputError> {
    check_batch_len(batch.len())?;
    let mut tasks = BatchTasks::default();
    for (row, r) in batch.iter().enumerate() {
        tasks.check(row, r.task)?;
        if r.via.len() > VIA_MAX {
            return Err(InputError::Illegal {
                row,
                reason: format!("{} states on the way (at most {VIA_MAX})", r.via.len()),
            });
        }
        if let Some(s) = r.via.iter().find(|s| s.is_terminal()) {
            return Err(InputError::Illegal {
                row,
                reason: format!("passes through terminal state {}", s.name()),
            });
        }
        if !r.via.is_empty() && matches!(r.action, ReportAction::Release) {
            return Err(InputError::Illegal {
                row,
                reason: "a release carries no states on the way".into(),
            });
        }
        let reason = match &r.action {
            ReportAction::Advance(s) if s.is_terminal() || *s == TaskState::Queued => {
                return Err(InputError::Illegal {
                    row,
                    reason: format!("advance to {} must be a Finish or a Requeue", s.name()),
                })
            }
            ReportAction::Finish { state, .. } if !state.is_terminal() => {
                return Err(InputError::Illegal {
                    row,
                    reason: format!("finish in non-terminal state {}", state.name()),
                })
            }
            ReportAction::Requeue { delay_ms, reason } => {
                to_i64(row, "delay_ms", *delay_ms)?;
                Some(reason)
            }
            ReportAction::Finish {
                reason,
                cost_actual_milli,
                result,
                ..
            } => {
                if let Some(c) = cost_actual_milli {
                    to_i64(row, "cost_actual_milli", *c)?;
                }
                if let Some(result) = result {
                    if r.token.is_none() {
                        return Err(InputError::Illegal {
                            row,
                            reason: "a result comes from an attempt: it needs its token".into(),
                        });
                    }
                    if result.len() > RESULT_BYTES_MAX {
                        return Err(InputError::TooLong {
                            row,
                            field: "result",
                            len: result.len(),
                            max: RESULT_BYTES_MAX,
                        });
                    }
                }
                reason.as_ref()
            }
            _ => None,
        };
        if let Some(reason) = reason {
            if reason.len() > REASON_BYTES_MAX {
                return Err(InputError::TooLong {
                    row,
                    field: "reason",
                    len: reason.len(),
                    max: REASON_BYTES_MAX,
                });
            }
        }
    }
    Ok(())
}

/// A stored result (`task.result`) as the JSON value it holds; one that is not JSON (written
/// around this crate) as a string, so that a reader never fails on it.
pub fn result_value(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_string()))
}

impl Db {
    /// The results the finishes of `batch` carry, each written to its task while the report's
    /// token is the task's current one (a stale attempt writes nothing), ahead of the finishes
    /// themselves: a finish that then fails leaves a result its next attempt overwrites, and a
    /// repeat writes the same again. No call when no finish carries one.
    pub(crate) async fn store_results(&self, batch: &[Report]) -> Result<(), StoreError> {
        let mut task = Vec::new();
        let mut token = Vec::new();
        let mut result = Vec::new();
        for r in batch {
            if let (
                ReportAction::Finish {
                    result: Some(x), ..
                },
                Some(t),
            ) = (&r.action, r.token)
            {
                task.push(r.task.0 as i64);
                token.push(t.0 as i64);
                result.push(x.as_str());
            }
        }
        if task.is_empty() {
            return Ok(());
        }
        self.answered(
            Call::Writes,
            self.client().execute(
                "UPDATE task t SET result = r.result
                   FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS r (task, token, result)
                  WHERE t.task_id = r.task AND t.current_fencing = r.token",
                &[&task, &token, &result],
            ),
        )
        .await?;
        Ok(())
    }

    /// Applies `batch` in one transaction — after the results its finishes carry, in a statement
    /// of their own (`Db::store_results`) — one result per row, in order.
    pub async fn report_batch(&self, batch: &[Report]) -> Result<Vec<ReportResult>, StoreError> {
        validate(batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.store_results(batch).await?;
        let columns = ReportColumns::new(batch);
        let rows = self
            .answered(
                Call::Writes,
                self.client().query(&self.stmts.report, &columns.params()),
            )
            .await?;
        check_answered("report", &rows, batch.len())?;
        rows.iter()
            .map(|r| report_result(r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
            .collect()
    }
}

/// A batch of reports as `spindle_report`'s array arguments (and `spindle_work`'s first
/// eight).
pub(crate) struct ReportColumns<'a> {
    task: Vec<i64>,
    token: Vec<Option<i64>>,
    mode: Vec<&'a str>,
    to: Vec<Option<&'a str>>,
    cost: Vec<Option<i64>>,
    delay: Vec<i64>,
    reason: Vec<Option<&'a str>>,
    via: Vec<Option<String>>,
}

impl<'a> ReportColumns<'a> {
    pub(crate) fn new(batch: &'a [Report]) -> ReportColumns<'a> {
        ReportColumns {
            task: batch.iter().map(|r| r.task.0 as i64).collect(),
            token: batch.iter().map(|r| r.token.map(|t| t.0 as i64)).collect(),
            mode: batch.iter().map(|r| r.action.mode()).collect(),
            to: batch
                .iter()
                .map(|r| r.action.target().map(TaskState::name))
                .collect(),
            cost: batch
                .iter()
                .map(|r| match &r.action {
                    ReportAction::Finish {
                        cost_actual_milli, ..
                    } => cost_actual_milli.map(|c| c as i64),
                    _ => None,
                })
                .collect(),
            delay: batch
                .iter()
                .map(|r| match &r.action {
                    ReportAction::Requeue { delay_ms, .. } => *delay_ms as i64,
                    _ => 0,
                })
                .collect(),
            reason: batch
                .iter()
                .map(|r| match &r.action {
                    ReportAction::Requeue { reason, .. } => Some(reason.as_str()),
                    ReportAction::Finish { reason, .. } => reason.as_deref(),
                    _ => None,
                })
                .collect(),
            via: batch
                .iter()
                .map(|r| {
                    (!r.via.is_empty())
                        .then(|| r.via.iter().map(|s| s.name()).collect::<Vec<_>>().join(">"))
                })
                .collect(),
        }
    }

    pub(crate) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 8] {
        [
            &self.task,
            &self.token,
            &self.mode,
            &self.to,
            &self.cost,
            &self.delay,
            &self.reason,
            &self.via,
        ]
    }
}

/// One report's row: its outcome, the state and version it left, the units it released and
/// the detail of a refusal.
pub(crate) fn report_result(
    outcome: &str,
    state: Option<&str>,
    version: Option<i32>,
    released: i32,
    detail: Option<&str>,
) -> Result<ReportResult, StoreError> {
    let corrupt = || StoreError::Corrupt(format!("report {outcome} / {detail:?}"));
    Ok(match outcome {
        "APPLIED" => ReportResult::Applied {
            state: parse_state(state.ok_or_else(corrupt)?)?,
            version: version.ok_or_else(corrupt)? as u32,
            released: released as u32,
        },
        "STALE_TOKEN" => ReportResult::StaleToken {
            current: detail.and_then(|d| d.parse::<u64>().ok()).map(FencingToken),
            state: parse_state(state.ok_or_else(corrupt)?)?,
        },
        "ILLEGAL_TRANSITION" => {
            let (from, to) = detail
                .and_then(|d| d.split_once(" -> "))
                .ok_or_else(corrupt)?;
            ReportResult::IllegalTransition {
                from: parse_state(from)?,
                to: parse_state(to)?,
            }
        }
        "TASK_GONE" => ReportResult::TaskGone,
        _ => return Err(corrupt()),
    })
}

/// The whitelist the store enforces, as (from, to, operator_only) rows, from the core.
pub fn core_transitions() -> Vec<(TaskState, TaskState, bool)> {
    let mut rows = Vec::new();
    for from in TaskState::ALL {
        for to in TaskState::ALL {
            if from.may_become(to, Actor::System) {
                rows.push((from, to, false));
            } else if from.may_become(to, Actor::Operator) {
                rows.push((from, to, true));
            }
        }
    }
    rows
}
