//! Submits: admission by the core, the group-committed insert, and the answers.

use super::*;
pub use spindle_node_base::limits::STORED_REQUEST_BYTES_MAX;

async fn next_task_id(state: &SharedShard) -> Result<TaskId, StoreError> {
    if let Some(id) = state.borrow_mut().ids.next() {
        return Ok(TaskId(id));
    }
    let cp = state.borrow().pipes.submits.clone();
    let block = ask(&cp, |reply| CpMsg::TaskIds { reply }).await?;
    let mut s = state.borrow_mut();
    s.ids = block;
    Ok(TaskId(s.ids.next().expect("a fresh block has ids")))
}

const _: () = assert!(STORED_REQUEST_BYTES_MAX <= spindle_control::limits::PAYLOAD_BYTES_MAX);

/// The stored request of `t`: its JSON as `StoredRequest` writes it. The input, one JSON value
/// checked when it arrived (`spindle_wire`), is appended as it is — what the field, written
/// last, would write — rather than parsed again into a `RawValue` to be copied back out.
fn payload(t: &SubmitTask) -> Vec<u8> {
    let stored = StoredRequest {
        user: t.user.0,
        spec: t.spec,
        band_hint: t.band_hint,
        deadline_ms: t.deadline_ms,
        input: None,
    };
    let extra = t.input.as_ref().map_or(0, |i| i.len() + 10);
    let mut out = Vec::with_capacity(128 + extra);
    serde_json::to_writer(&mut out, &stored).expect("plain data serializes");
    if let Some(input) = &t.input {
        debug_assert_eq!(out.last(), Some(&b'}'));
        out.pop();
        out.extend_from_slice(b",\"input\":");
        out.extend_from_slice(input.as_bytes());
        out.push(b'}');
    }
    out
}

/// A frame's tasks decided by the core, with nothing awaited since: the answers so far (one
/// per task; the accepted ones wait for the group commit), and what goes to it.
pub(crate) struct Admitted {
    batch: bool,
    /// The policy version the tasks were admitted under.
    version: spindle_core::PolicyVersion,
    answers: Vec<Option<Admission>>,
    rows: Vec<NewTask>,
    /// Each row's place among the answers, and its task.
    commit: Vec<(usize, TaskId)>,
    /// The rows counted as waiting for the submit pipeline from the moment they were admitted
    /// (what the overload gate of the next frame sees), until the pipeline takes them.
    queued: spindle_node_base::overload::Queued,
    /// When the frame was admitted, and the wait its commit was predicted to take then: the
    /// gate learns from the wait it came to (`overload::Calibration`).
    admitted: (std::time::Instant, std::time::Duration),
}

/// What admission made of a submit frame.
pub(crate) enum Decided {
    /// Answered without PostgreSQL: refused whole, or no task accepted.
    Answered(Response),
    /// Accepted tasks wait for their group commit ([`commit`]).
    Commit(Admitted),
}

/// Admits a frame with no await, for the connection's task on the shard's own thread (a
/// rejection then leaves without a hop through the shard's inbox): `Err` gives the tasks back
/// when the shard's block of task ids is too short for them, and [`submit`] takes its turn.
pub(crate) fn decide_now(
    state: &SharedShard,
    tenant: TenantId,
    tasks: Vec<SubmitTask>,
    batch: bool,
) -> Result<Decided, Vec<SubmitTask>> {
    if let Some(response) = refused_whole(state, tenant, tasks.len(), batch) {
        return Ok(Decided::Answered(response));
    }
    let ids = {
        let mut s = state.borrow_mut();
        if (s.ids.end - s.ids.start) < tasks.len() as u64 {
            return Err(tasks);
        }
        (0..tasks.len())
            .map(|_| TaskId(s.ids.next().expect("counted above")))
            .collect()
    };
    Ok(decide(state, tenant, tasks, batch, ids))
}

/// A submit frame from the shard's inbox: ids taken (a new block awaited when this one is
/// spent), admitted, committed, answered.
pub(super) async fn submit(
    state: &SharedShard,
    tenant: TenantId,
    tasks: Vec<SubmitTask>,
    batch: bool,
    reply: oneshot::Sender<Response>,
) {
    if let Some(response) = refused_whole(state, tenant, tasks.len(), batch) {
        let _ = reply.send(response);
        return;
    }
    // Every id first, so that a batch is admitted and sent without an await in between.
    let mut ids = Vec::with_capacity(tasks.len());
    for _ in &tasks {
        match next_task_id(state).await {
            Ok(id) => ids.push(id),
            Err(e) => return answer_error(reply, ErrorCode::Unavailable, e.to_string()),
        }
    }
    match decide(state, tenant, tasks, batch, ids) {
        Decided::Answered(response) => {
            let _ = reply.send(response);
        }
        Decided::Commit(admitted) => {
            commit(state, admitted, |response| {
                let _ = reply.send(response);
            })
            .await
        }
    }
}

/// What refuses a frame whole before its tasks take ids or reach the core: a draining node, a
/// partition gone to another node, and the overload gate (`spindle_node_base::overload`: the durable path
/// could not take the frame within `ack_budget_ms`) — which answers each task
/// `REJECT_PLATFORM_OVERLOADED` with its reason and a `retry_after_ms` hint, task id 0, without
/// PostgreSQL.
fn refused_whole(
    state: &SharedShard,
    tenant: TenantId,
    tasks: usize,
    batch: bool,
) -> Option<Response> {
    let mut s = state.borrow_mut();
    if s.metrics.stopping() {
        return Some(Response::Error(WireError::new(
            ErrorCode::Draining,
            "the node is draining; submit to another node",
        )));
    }
    let partition = spindle_node_base::config::partition_of(tenant.0, s.partitions);
    if !s.ownership.owns(partition) {
        // The partition moved to another node since this connection said Hello.
        s.metrics
            .wrong_node
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Some(Response::Error(s.ownership.refusal(tenant.0, partition)));
    }
    let weight = s.core.policy().tenants.get(&tenant).map_or(1, |t| t.weight);
    let refusal = s
        .gate
        .judge(std::time::Instant::now(), tenant, weight, tasks)?;
    let answers = (0..tasks)
        .map(|_| {
            Some(Admission {
                task: TaskId(0),
                decision: Decision::RejectPlatformOverloaded,
                reason: Some(refusal.reason.clone()),
                replay: false,
                queue_level: 0,
                expected_start_ms: 0,
                retry_after_ms: refusal.retry_after_ms,
            })
        })
        .collect();
    Some(respond(&s, answers, batch))
}

/// A hint for refusals that wait on something slower than a commit: PostgreSQL unreachable,
/// the event relay's backlog.
const RETRY_AFTER_UNAVAILABLE_MS: u32 = 1_000;
/// A hint for a refusal whose cause passes at the next lease renewal.
const RETRY_AFTER_LEASE_MS: u32 = 100;

/// Admission of a frame whose task ids are taken (after [`refused_whole`]): the event relay's
/// backlog, then each task in the core.
fn decide(
    state: &SharedShard,
    tenant: TenantId,
    tasks: Vec<SubmitTask>,
    batch: bool,
    ids: Vec<TaskId>,
) -> Decided {
    let refused =
        |code, message: String| Decided::Answered(Response::Error(WireError::new(code, message)));
    // Past the event relay's bound, new work is refused rather than added to the backlog.
    let backlog = {
        let m = &state.borrow().metrics;
        m.events_backlogged
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| m.events_pending.load(std::sync::atomic::Ordering::Relaxed))
    };
    // Decide every task in the core first; accepted ones go to the group commit.
    let mut answers: Vec<Option<Admission>> = Vec::with_capacity(tasks.len());
    // What goes to the group commit, and where each row's answer goes.
    let mut rows: Vec<NewTask> = Vec::new();
    let mut commit: Vec<(usize, TaskId)> = Vec::new();
    let mut s = state.borrow_mut();
    for ((i, t), id) in tasks.into_iter().enumerate().zip(ids) {
        if let Some(pending) = backlog {
            let why = format!("event relay backlog: {pending} events wait for the events endpoint");
            answers.push(Some(overloaded(id, why)));
            continue;
        }
        let now = s.now();
        let req = SubmitRequest {
            task: id,
            tenant,
            user: t.user,
            spec: t.spec,
            band_hint: t.band_hint,
            deadline: t
                .deadline_ms
                .map(|ms| now.plus_ns(u64::from(ms) * 1_000_000)),
        };
        let admission = match s.core.handle_submit(now, req) {
            Ok(a) => a,
            Err(e) => {
                // The frame is refused whole: the tasks admitted before this one are let go
                // again (queued in the core only: nothing was picked or sent since).
                for &(_, task) in &commit {
                    forget(&mut s, task);
                }
                return refused(ErrorCode::InvalidSpec, format!("task {i}: {e}"));
            }
        };
        if !admission.decision.is_accepted() {
            if let Some(spindle_core::RejectReason::Quota(e)) = admission.reason {
                s.metrics.quota_refused(e.scope, e.period);
            }
            answers.push(Some(wire_admission(&admission, false, now)));
            continue;
        }
        let partition = PartitionId(spindle_node_base::config::partition_of(
            tenant.0,
            s.partitions,
        ));
        s.meta.insert(
            id,
            Meta {
                tenant,
                db_version: 0,
                token: None,
                committed: false,
                estimate: None,
                queued_at: now,
                attempt: None,
                pending_reports: 0,
                spec: Some(t.spec),
                stored_stage: None,
            },
        );
        let payload = payload(&t);
        if let Some(input) = t.input {
            s.inputs.keep(id, input.into_boxed_str());
        }
        commit.push((i, id));
        rows.push(NewTask {
            task: id,
            tenant,
            user: t.user,
            idempotency_key: t.idempotency_key,
            payload,
            partition,
            lane: admission.lane,
            band: admission.band,
            cost_estimate_milli: admission.estimate.cost_milli,
            fairness_milli: admission.estimate.fairness.milli(),
        });
        answers.push(Some(wire_admission(&admission, false, now)));
    }
    if commit.is_empty() {
        return Decided::Answered(respond(&s, answers, batch));
    }
    let admitted = (std::time::Instant::now(), s.gate.predict(rows.len()));
    let queued = s.pipes.submit_gauge.enqueue(rows.len());
    Decided::Commit(Admitted {
        batch,
        version: s.core.policy().version,
        answers,
        rows,
        commit,
        queued,
        admitted,
    })
}

/// A task the node refuses before its core sees it, for `why`.
fn overloaded(task: TaskId, why: String) -> Admission {
    Admission {
        task,
        decision: Decision::RejectPlatformOverloaded,
        reason: Some(why),
        replay: false,
        queue_level: 0,
        expected_start_ms: 0,
        retry_after_ms: RETRY_AFTER_UNAVAILABLE_MS,
    }
}

/// The frame's answer, every task's decision counted.
fn respond(s: &ShardState, answers: Vec<Option<Admission>>, batch: bool) -> Response {
    let answers: Vec<Admission> = answers
        .into_iter()
        .map(|a| a.expect("every row answered"))
        .collect();
    for a in &answers {
        s.metrics.admitted(a.decision);
    }
    if batch {
        Response::SubmitBatch(answers)
    } else if let Some(only) = answers.into_iter().next() {
        Response::Admission(only)
    } else {
        Response::Error(WireError::new(ErrorCode::Internal, "empty submit"))
    }
}

/// The group commit of a frame's accepted tasks (their claims with them where the shard picked
/// them at once), then the frame's answer and the attempts that start. `reply` takes the
/// answer as soon as it is known, before the attempts start: a connection's own commit writes
/// it to the socket's queue from there, with no other task to wake.
pub(crate) async fn commit(state: &SharedShard, admitted: Admitted, reply: impl FnOnce(Response)) {
    let Admitted {
        batch,
        version,
        mut answers,
        rows,
        commit,
        queued,
        admitted: (admitted_at, predicted),
    } = admitted;
    let mut started = Vec::new();
    // The tasks just admitted are picked now. One that starts at once carries its claim in
    // its own submit: taken in the same transaction when the whole batch can be, else held
    // until the commit is in and sent at once after it, as a claim of a task picked later
    // is. (Left to the pump that follows the message which brought them, the pick came
    // too late when this submit awaited before admitting — a new block of task ids: its
    // tasks waited for the next message or tick, and a shard found backlogged at a tick
    // took the node's shared provider limits from one that was not: docs/benchmarks/journal.md,
    // "Tenth round".)
    pump(state).await;
    let (cp, rows) = {
        let s = state.borrow();
        let rows: Vec<(NewTask, Option<ClaimRequest>)> = rows
            .into_iter()
            .map(|t| {
                let claim = s.held_claims.get(&t.task).cloned();
                (t, claim)
            })
            .collect();
        (s.pipes.submits.clone(), rows)
    };
    let outcome = ask(&cp, |reply| CpMsg::Submit {
        tasks: rows,
        version,
        reply,
        queued,
    })
    .await;
    // Only a batch in doubt needs its tasks' ids apart.
    let ids = || commit.iter().map(|&(_, t)| t).collect::<Vec<TaskId>>();
    // A batch whose answer was lost: the rows tell which tasks it made (and claimed), if
    // PostgreSQL is back soon enough (the client waits for this answer).
    let heads = match &outcome {
        Err(e) if e.is_in_doubt() => {
            count_in_doubt(state);
            look_up(&cp, ids(), IN_DOUBT_ANSWER_LOOKUPS).await
        }
        _ => None,
    };
    let response = {
        let mut s = state.borrow_mut();
        let now = s.now();
        match (outcome, heads) {
            (Ok(rows), _) => {
                s.gate.observe(predicted, admitted_at.elapsed());
                for (&(i, task), row) in commit.iter().zip(rows) {
                    let answer = &mut answers[i];
                    started.extend(apply_submit_outcome(&mut s, now, task, row, answer));
                }
            }
            (Err(e), None) if e.is_in_doubt() => {
                // Still unknown: the tasks stay as they are (uncommitted, their claims held)
                // until their rows tell, and the client learns each outcome by submitting
                // again with the same idempotency keys.
                drop(s);
                resolve_submits_later(state.clone(), ids());
                return reply(Response::Error(WireError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the submit may have committed ({e}); submit again with the same \
                         idempotency keys to learn each task's outcome"
                    ),
                )));
            }
            (Err(e), heads) => {
                // Not committed — nothing of the batch, or (in doubt, now read back) the tasks
                // without a row: forget them and refuse as overloaded (paid work is not
                // buffered while PostgreSQL is away).
                let heads = heads.unwrap_or_else(|| vec![None; commit.len()]);
                for (&(i, task), head) in commit.iter().zip(heads) {
                    if let Some(head) = head {
                        started.extend(made(&mut s, now, task, &head));
                        continue;
                    }
                    forget(&mut s, task);
                    answers[i] = Some(Admission {
                        task,
                        decision: Decision::RejectPlatformOverloaded,
                        reason: Some(format!("not stored: {e}")),
                        replay: false,
                        queue_level: 0,
                        expected_start_ms: 0,
                        retry_after_ms: RETRY_AFTER_UNAVAILABLE_MS,
                    });
                }
            }
        }
        respond(&s, answers, batch)
    };
    reply(response);
    start_attempts(state, started).await;
    // Claims held for these tasks can go now.
    if !state.borrow().ready_claims.is_empty() {
        pump(state).await;
    }
}

/// A row of a committed submit: its task committed (and claimed with it, then the attempt to
/// start is returned), or answered as a replay, a conflict or a refusal and forgotten.
fn apply_submit_outcome(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    row: ClaimedSubmit,
    answer: &mut Option<Admission>,
) -> Option<Started> {
    if let (SubmitOutcome::Created, Some(claim)) = (&row.outcome, row.claim) {
        return claimed(s, now, task, claim);
    }
    let a = answer.as_mut().expect("accepted rows have an admission");
    match row.outcome {
        SubmitOutcome::Created => committed(s, task),
        SubmitOutcome::Replay { task: original, .. } => {
            forget(s, task);
            // A replay of a task whose own submit is in doubt shows that it committed.
            if s.meta.get(&original).is_some_and(|m| !m.committed) {
                committed(s, original);
            }
            a.task = original;
            a.replay = true;
            a.decision = Decision::Accepted;
            a.reason = None;
        }
        SubmitOutcome::Conflict { task: original } => {
            forget(s, task);
            a.task = original;
            a.decision = Decision::RejectIdempotencyConflict;
            a.reason = Some(format!(
                "idempotency key already used for task {original} with a different request"
            ));
        }
        SubmitOutcome::QuotaExceeded { remaining_milli } => {
            forget(s, task);
            a.decision = Decision::RejectCostBudget;
            a.reason = Some(format!("cost budget: {remaining_milli} milli-units left"));
        }
        SubmitOutcome::PartitionNotOwned(partition) => {
            // Its lease lapsed or moved since this node last renewed it: the task is not
            // written, and the lease loop finds out at its next renewal.
            forget(s, task);
            a.decision = Decision::RejectPlatformOverloaded;
            a.reason = Some(format!(
                "partition {} is not leased to this node now; submit again shortly",
                partition.0
            ));
            a.retry_after_ms = RETRY_AFTER_LEASE_MS;
        }
    }
    None
}

/// A task whose submit committed with its claim taken: the held claim is spent, and the
/// attempt starts unless the task was canceled meanwhile.
fn claimed(s: &mut ShardState, now: Time, task: TaskId, claim: ClaimResult) -> Option<Started> {
    s.held_claims.remove(&task);
    committed(s, task);
    grant(s, now, task, claim)
}

/// A task whose submit was in doubt and whose row is there: committed — and claimed too when
/// the row shows its claim taken (DISPATCHING at version 1 with an attempt of this node: the
/// answer a lost claim would have had, [`lost_claim`]); otherwise its held claim goes as usual.
fn made(s: &mut ShardState, now: Time, task: TaskId, head: &TaskHead) -> Option<Started> {
    match lost_claim(task, Some(head), &s.node, 0) {
        Some(claim @ ClaimResult::Granted { .. }) => claimed(s, now, task, claim),
        _ => {
            committed(s, task);
            None
        }
    }
}

/// A task's submit committed: what waited for that goes on.
fn committed(s: &mut ShardState, task: TaskId) {
    if let Some(m) = s.meta.get_mut(&task) {
        m.committed = true;
    }
    if let Some(claim) = s.held_claims.remove(&task) {
        s.ready_claims.push(claim);
    }
    if s.expired_uncommitted.remove(&task) {
        send_reports(s, [expired(task)]);
    }
}

/// How many times a submit in doubt is read back before its answer goes out (the rest of the
/// reading goes on after it, [`resolve_submits_later`]).
const IN_DOUBT_ANSWER_LOOKUPS: u32 = 4;

/// Reads back the rows of a submit still in doubt after its answer went out: the tasks with a
/// row committed, the others are forgotten.
fn resolve_submits_later(state: SharedShard, tasks: Vec<TaskId>) {
    glommio::spawn_local(async move {
        let cp = state.borrow().pipes.submits.clone();
        let Some(heads) = look_up(&cp, tasks.clone(), IN_DOUBT_LOOKUPS_MAX).await else {
            tracing::error!(
                "submits of {} tasks stay in doubt: PostgreSQL did not answer; a restart or a \
                 takeover resolves them",
                tasks.len()
            );
            return;
        };
        let mut started = Vec::new();
        {
            let mut s = state.borrow_mut();
            let now = s.now();
            for (task, head) in tasks.into_iter().zip(heads) {
                match head {
                    Some(head) => started.extend(made(&mut s, now, task, &head)),
                    None => forget(&mut s, task),
                }
            }
        }
        start_attempts(&state, started).await;
        if !state.borrow().ready_claims.is_empty() {
            pump(&state).await;
        }
    })
    .detach();
}

/// The core's admission as the client reads it: the expected start in ms from `now` (the
/// answer), not the shard's clock.
fn wire_admission(a: &spindle_core::Admission, replay: bool, now: Time) -> Admission {
    Admission {
        task: a.task,
        decision: a.decision,
        reason: a.reason.map(|r| r.to_string()),
        replay,
        queue_level: a.queue_level.map_or(0, |l| l as u8),
        expected_start_ms: a.estimated_start_at.map_or(0, |t| {
            u32::try_from(t.since(now) / 1_000_000).unwrap_or(u32::MAX)
        }),
        retry_after_ms: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spindle_wire::limits::{
        DEADLINE_MS_MAX, DIMENSION_MAX, DURATION_MS_MAX, FPS_MAX, INPUT_BYTES_MAX, KEY_BYTES_MAX,
        REFERENCES_MAX,
    };

    /// Every field at its widest and the largest input: the stored request stays within
    /// `STORED_REQUEST_BYTES_MAX`, and so within what the store takes.
    #[test]
    fn the_largest_request_fits_the_store() {
        let input = format!("[\"{}\"]", "x".repeat(INPUT_BYTES_MAX - 4));
        let t = SubmitTask {
            idempotency_key: "k".repeat(KEY_BYTES_MAX),
            user: spindle_core::UserId(u32::MAX),
            spec: spindle_core::TaskSpec {
                model: spindle_core::ModelId(u16::MAX),
                width: DIMENSION_MAX,
                height: DIMENSION_MAX,
                duration_ms: DURATION_MS_MAX,
                fps: FPS_MAX,
                audio: true,
                references: REFERENCES_MAX,
            },
            band_hint: Some(spindle_core::Band::P4),
            deadline_ms: Some(DEADLINE_MS_MAX),
            input: Some(input.clone()),
        };
        let stored = payload(&t);
        assert!(
            stored.len() <= STORED_REQUEST_BYTES_MAX,
            "{} bytes",
            stored.len()
        );
        // The input is embedded as it came — the bytes serde writes for the whole request —
        // and read back the same.
        let back: StoredRequest = serde_json::from_slice(&stored).unwrap();
        assert_eq!(serde_json::to_vec(&back).unwrap(), stored);
        assert_eq!(back.input.map(|i| i.get().to_string()), Some(input));
        // Without one, the field is absent: the payload of before inputs existed.
        let plain = payload(&SubmitTask { input: None, ..t });
        assert!(!String::from_utf8(plain).unwrap().contains("input"));
    }
}
