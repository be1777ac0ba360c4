//! A client's commands other than submits, on the shard that holds its tenant: a task's status
//! (from memory while it is live, else from PostgreSQL within the tenant's rate of such
//! reads), subscriptions to its events, and cancels — the client's, within its tenant's cancel
//! rate, and an operator's — each stored before it is carried out.

use super::*;

/// Spends one of `tenant`'s tokens for a `command` that is about to cost PostgreSQL a call;
/// the refusal, counted, names the rate and when to try again.
fn charge(s: &mut ShardState, tenant: TenantId, command: Command) -> Result<(), String> {
    let now = s.now();
    s.core
        .charge_command(now, tenant, command)
        .map_err(|limited| {
            s.metrics.commands_limited[command as usize]
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            limited.to_string()
        })
}

pub(super) async fn get(
    state: &SharedShard,
    tenant: TenantId,
    task: TaskId,
    reply: oneshot::Sender<Response>,
) {
    // A live task is answered from memory; a finished one (or another node's) from PostgreSQL,
    // within the tenant's rate of such reads.
    let (live, reads) = {
        let s = state.borrow();
        let live = s
            .meta
            .get(&task)
            .filter(|m| m.tenant == tenant && m.committed)
            .and_then(|m| {
                s.core.task_state(task).map(|st| TaskStatus {
                    task,
                    state: st,
                    version: m.db_version,
                    attempt_no: s.core.task_attempt_no(task).unwrap_or(0),
                    // Its state's milestone, as its subscribers were told.
                    progress_pct: progress_of(st),
                    cost_estimate_milli: m.estimate.as_ref().map_or(0, |e| e.cost_milli),
                    cost_actual_milli: 0,
                    failure_reason: None,
                    result: None,
                    expected_start_ms: s
                        .core
                        .expected_wait_ms(task, s.now())
                        .map_or(0, |ms| u32::try_from(ms).unwrap_or(u32::MAX)),
                })
            });
        (live, s.reads.clone())
    };
    if let Some(status) = live {
        let _ = reply.send(Response::Status(status));
        return;
    }
    if let Err(limited) = charge(&mut state.borrow_mut(), tenant, Command::StoreRead) {
        return answer_error(reply, ErrorCode::RateLimited, limited);
    }
    let (tx, rx) = oneshot::channel();
    if reads
        .send(ReadMsg::Status {
            tenant,
            task,
            reply: tx,
        })
        .await
        .is_err()
    {
        return answer_error(
            reply,
            ErrorCode::Unavailable,
            "control plane stopped".into(),
        );
    }
    let response = match rx.await {
        Ok(Ok(Some(t))) => Response::Status(TaskStatus {
            task,
            state: t.state,
            version: t.version,
            attempt_no: t.attempt_no,
            progress_pct: if t.state == TaskState::Succeeded {
                100
            } else {
                0
            },
            cost_estimate_milli: t.cost_estimate_milli,
            cost_actual_milli: t.cost_actual_milli.unwrap_or(0),
            failure_reason: t.failure_reason,
            result: t.result,
            expected_start_ms: 0,
        }),
        Ok(Ok(None)) => Response::Error(WireError::new(
            ErrorCode::NotFound,
            format!("task {task} not found"),
        )),
        Ok(Err(e)) => Response::Error(WireError::new(ErrorCode::Unavailable, e.to_string())),
        Err(_) => Response::Error(WireError::new(
            ErrorCode::Unavailable,
            "control plane stopped",
        )),
    };
    let _ = reply.send(response);
}

pub(super) fn subscribe(
    state: &SharedShard,
    tenant: TenantId,
    task: TaskId,
    request_id: u64,
    out: mpsc::Sender<Vec<u8>>,
    reply: oneshot::Sender<Response>,
) {
    let mut s = state.borrow_mut();
    let live = s
        .meta
        .get(&task)
        .is_some_and(|m| m.tenant == tenant && m.committed);
    let current = live.then(|| s.core.task_state(task)).flatten();
    // Ended here and its end not yet stored: the end is told once it is.
    let ending = s.ending.get(&task) == Some(&tenant);
    if current.is_none() && !ending {
        drop(s);
        return answer_error(
            reply,
            ErrorCode::NotFound,
            format!("task {task} is not live here (finished or unknown): use GetTask"),
        );
    };
    let sub = Subscriber {
        request_id,
        out,
        tenant,
    };
    if let Err(why) = s.subs.add(task, sub) {
        drop(s);
        return answer_error(reply, ErrorCode::TooManySubscriptions, why);
    }
    // The answer, and the current state as the first event (either may reach the client first).
    let _ = reply.send(Response::Subscribed(task));
    if let Some(current) = current {
        notify(&mut s, task, current);
    }
}

/// Whether `task` is `tenant`'s and held by this shard with its submit committed.
fn cancelable(s: &ShardState, tenant: TenantId, task: TaskId) -> bool {
    s.meta
        .get(&task)
        .is_some_and(|m| m.tenant == tenant && m.committed)
}

pub(super) fn cancel(
    state: &SharedShard,
    tenant: TenantId,
    task: TaskId,
    reply: oneshot::Sender<Response>,
) {
    if !cancelable(&state.borrow(), tenant, task) {
        return answer_error(
            reply,
            ErrorCode::NotFound,
            format!("task {task} not found or not cancelable"),
        );
    }
    if let Err(limited) = charge(&mut state.borrow_mut(), tenant, Command::Cancel) {
        return answer_error(reply, ErrorCode::RateLimited, limited);
    }
    let state = state.clone();
    glommio::spawn_local(async move { cancel_stored(&state, tenant, task, reply).await }).detach();
}

/// An operator's cancel: each task held here live, whatever its tenant, canceled as its
/// client's cancel is, one after another (each is stored before it is done).
pub(super) async fn admin_cancel(
    state: &SharedShard,
    tasks: Vec<TaskId>,
    reply: oneshot::Sender<Vec<Option<Response>>>,
) {
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        let tenant = state
            .borrow()
            .meta
            .get(&task)
            .filter(|m| m.committed)
            .map(|m| m.tenant);
        let Some(tenant) = tenant else {
            answers.push(None);
            continue;
        };
        let (tx, rx) = oneshot::channel();
        cancel_stored(state, tenant, task, tx).await;
        answers.push(rx.await.ok());
    }
    let _ = reply.send(answers);
}

/// Stores the cancel (`Db::request_cancel`: a node that puts the task back cancels it), then
/// cancels the task here and answers: an answered cancel outlives this node.
async fn cancel_stored(
    state: &SharedShard,
    tenant: TenantId,
    task: TaskId,
    reply: oneshot::Sender<Response>,
) {
    let work = state.borrow().pipes.work.clone();
    let (tx, rx) = oneshot::channel();
    let msg = CpMsg::Cancel {
        tasks: vec![task],
        reply: tx,
    };
    let stopped = || "control plane stopped".to_string();
    if work.send(msg).await.is_err() {
        return answer_error(reply, ErrorCode::Unavailable, stopped());
    }
    match rx.await {
        Ok(Ok(marked)) if marked.first() == Some(&true) => {}
        Ok(Ok(_)) => {
            return answer_error(reply, ErrorCode::NotFound, format!("task {task} has ended"))
        }
        Ok(Err(e)) => {
            // In doubt or not, nothing is canceled here: asked again, it is stored (once).
            let why = format!("the cancel of {task} was not stored, or not known to be: {e}");
            return answer_error(reply, ErrorCode::Unavailable, why);
        }
        Err(_) => return answer_error(reply, ErrorCode::Unavailable, stopped()),
    }
    let mut s = state.borrow_mut();
    // The task may have ended here while the cancel was stored.
    if !cancelable(&s, tenant, task) {
        drop(s);
        return answer_error(reply, ErrorCode::NotFound, format!("task {task} has ended"));
    }
    match cancel_held(&mut s, task) {
        Ok(()) => {
            let _ = reply.send(Response::Canceled {
                task,
                state: TaskState::Canceled,
            });
        }
        Err(e) => {
            drop(s);
            answer_error(reply, ErrorCode::NotFound, format!("task {task}: {e}"));
        }
    }
}

/// Cancels `task`, held by this shard. A queued task is gone at once and its end is reported.
/// One at the provider or media stage is CANCELED here and keeps its reservations until that
/// step ends: a submit not sent yet is withdrawn, a job at the provider is asked to stop, a
/// media job stops; the step's end reports the task's.
pub(super) fn cancel_held(
    s: &mut ShardState,
    task: TaskId,
) -> Result<(), spindle_core::ShardError> {
    s.core.handle_cancel(task)?;
    // Nothing is sent to a provider for it again.
    s.inputs.release(task);
    let running = s.meta.get(&task).is_some_and(|m| m.token.is_some());
    let attempt = s.meta.get(&task).and_then(|m| m.attempt.as_ref());
    if let Some(a) = attempt.filter(|a| a.job_id.is_none()) {
        // A submit not sent yet is not sent at all; one already out is stopped once its job
        // is known (`provider::accepted`).
        a.withdrawn
            .store(true, std::sync::atomic::Ordering::Release);
    }
    let at_provider = attempt.and_then(|a| Some((a.account.clone(), a.job_id.clone()?)));
    if s.core.task_state(task) == Some(TaskState::Canceled) {
        if let Some(pool) = &s.media {
            // A media job of this task, queued or running, stops and cleans up.
            pool.cancel(task);
        }
    }
    if let (Some(d), Some((account, job_id))) = (&s.dispatch, at_provider) {
        let call = spindle_node_workers::dispatch::Call::Cancel { account, job_id };
        if d.calls.try_send(call).is_err() {
            task_event!(
                warn,
                s,
                task,
                "{task}: provider cancel not sent (queue full); it runs out"
            );
        }
    }
    if !running {
        remove_meta(s, &task);
        send_reports(s, [finish(task, None, TaskState::Canceled, None)]);
    }
    Ok(())
}
