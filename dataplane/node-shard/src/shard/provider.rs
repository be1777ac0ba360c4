//! The provider stage of a shard's tasks: submits to the HTTP provider after a claim, its
//! answers (accepted, refused, unknown, found by request key, finished), attempts in doubt,
//! failures and retries, and the in-process local provider.

use super::*;

/// The inputs of `started` attempts whose shard left them in their stored requests
/// (`shard/inputs.rs`), read in one call on the read connection; an error (PostgreSQL
/// unreachable) is every one's answer.
pub(super) async fn stored_inputs(
    state: &SharedShard,
    started: &[super::claims::Started],
) -> RunMap<TaskId, StoredInput> {
    let (tasks, reads) = {
        let s = state.borrow();
        let tasks: Vec<TaskId> = started
            .iter()
            .map(|a| a.0)
            .filter(|&t| s.inputs.get(t) == Input::Stored)
            .collect();
        (tasks, s.reads.clone())
    };
    if tasks.is_empty() {
        return RunMap::default();
    }
    let asked = tasks.clone();
    let answer = match ask(&reads, |reply| ReadMsg::Inputs {
        tasks: asked,
        reply,
    })
    .await
    {
        Ok(inputs) => inputs,
        Err(e) => vec![Err(InputUnread::Read(e.to_string())); tasks.len()],
    };
    tasks.into_iter().zip(answer).collect()
}

/// Sends a granted attempt to the HTTP provider (nothing is sent before the claim committed:
/// this runs on its answer), with the task's model by name and its client's input as sent
/// (held by the shard, or `stored`: read back for it by [`stored_inputs`]). The request key is
/// the attempt's: a repeat is the same job. A task canceled since its grant is not sent at all:
/// its attempt ends here; so does one whose input could not be read (retryable when the read
/// failed, not when what is stored cannot give it).
pub(super) async fn submit_to_provider(
    state: &SharedShard,
    d: &spindle_node_workers::dispatch::DispatchHandle,
    task: TaskId,
    token: FencingToken,
    request_key: String,
    stored: Option<StoredInput>,
) {
    let call = {
        let mut s = state.borrow_mut();
        let index = s.index;
        if !s.meta.contains_key(&task) {
            return;
        }
        if canceled_before_sent(&mut s, task, token) {
            return;
        }
        // Checked to be one JSON value of bounded depth when it arrived (`spindle_wire`); one
        // that does not parse all the same is never sent as something else.
        let parse = |i: &str| serde_json::from_str::<serde_json::Value>(i);
        let parsed = match (s.inputs.get(task), stored) {
            (Input::None, _) => Ok(serde_json::Value::Null),
            (Input::Held(i), _) => parse(i),
            (Input::Stored, Some(Ok(i))) => i.as_deref().map_or(Ok(serde_json::Value::Null), parse),
            (Input::Stored, read) => {
                use spindle_core::shard::Failure;
                let now = s.now();
                let unread = match read {
                    Some(Err(unread)) => unread,
                    _ => InputUnread::Read("it was not read".into()),
                };
                let failure = if unread.retryable() {
                    Failure::Retryable
                } else {
                    Failure::NonRetryable
                };
                let why =
                    format!("its input is left in PostgreSQL and could not be read: {unread}");
                failed(&mut s, now, task, token, failure, &why);
                return;
            }
        };
        let input = match parsed {
            Ok(input) => input,
            Err(e) => {
                use spindle_core::shard::Failure;
                let now = s.now();
                let why = format!("its input cannot be sent to the provider: {e}");
                failed(&mut s, now, task, token, Failure::NonRetryable, &why);
                return;
            }
        };
        let Some(provider) = s.core.task_provider(task) else {
            task_event!(warn, s, task, "{task}: granted without a provider");
            return;
        };
        let policy = s.core.policy();
        let account = policy.providers[provider.0 as usize].name.clone();
        let model = s.meta[&task]
            .spec
            .and_then(|spec| policy.models.get(usize::from(spec.model.0)))
            .map_or_else(String::new, |m| m.name.clone());
        let meta = s.meta.get_mut(&task).expect("checked above");
        let withdrawn = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        meta.attempt = Some(Box::new(ProviderAttempt {
            account: account.clone(),
            request_key: request_key.clone(),
            job_id: None,
            withdrawn: withdrawn.clone(),
            output_url: None,
            started: std::time::Instant::now(),
        }));
        // Paced where it leaves at this shard's part of the account's RPM now (a burst of at
        // least one, as a shard with work waiting is given).
        let pace = s
            .provider_rpm
            .iter()
            .find(|(_, name)| *name == account)
            .and_then(|&(id, _)| s.core.ledger().rate(id))
            .filter(|r| r.per_minute > 0)
            .map(|r| spindle_core::policy::RateSpec {
                burst: r.burst.max(1),
                ..r
            });
        spindle_node_workers::dispatch::Call::Submit {
            shard: index,
            task,
            token,
            pace,
            withdrawn,
            submission: spindle_providers::Submission {
                account,
                request_key,
                model,
                input,
                callback_url: Some(d.callback_url().to_string()),
            },
        }
    };
    if d.calls.send(call).await.is_err() {
        tracing::warn!(task = %task, "{task}: the provider thread stopped; the reconciler resolves it");
    }
}

/// Ends the attempt of a task canceled between its grant and its start, which is then never
/// sent to a provider (design.md §8); false when the task was not canceled.
fn canceled_before_sent(s: &mut ShardState, task: TaskId, token: FencingToken) -> bool {
    if s.core.task_state(task) != Some(TaskState::Canceled) {
        return false;
    }
    let now = s.now();
    let failure = spindle_core::shard::Failure::Retryable;
    failed(s, now, task, token, failure, "canceled before it was sent");
    true
}

/// What the provider thread answered about an attempt.
pub(super) async fn provider_event(
    state: &SharedShard,
    event: spindle_node_workers::dispatch::ProviderEvent,
) {
    use spindle_core::shard::Failure;
    use spindle_node_workers::dispatch::{Call, ProviderEvent};
    use spindle_providers::{JobState, Lookup, SubmitError};
    let Some(d) = state.borrow().dispatch.clone() else {
        return;
    };
    let follow_up: Option<Call> = {
        let mut s = state.borrow_mut();
        let s = &mut *s;
        let now = s.now();
        let index = s.index;
        match event {
            ProviderEvent::Submitted {
                task,
                token,
                result: Ok(view),
            }
            | ProviderEvent::Resolved {
                task,
                token,
                lookup: Some(Lookup::Found(view)),
            } => accepted(s, index, task, token, view),
            ProviderEvent::Submitted {
                task,
                token,
                result: Err(e),
            } => {
                let failure = match &e {
                    SubmitError::RateLimited { .. } => Some(Failure::RateLimited),
                    SubmitError::Refused { .. } => Some(Failure::NonRetryable),
                    // Withdrawn: canceled before it was sent; the core ends it CANCELED.
                    SubmitError::NotSent(_) | SubmitError::Withdrawn => Some(Failure::Retryable),
                    SubmitError::Unknown(_) => None,
                };
                match failure {
                    Some(f) => {
                        failed(s, now, task, token, f, &e.to_string());
                        None
                    }
                    None => unknown(s, index, task, token),
                }
            }
            ProviderEvent::Resolved {
                task,
                token,
                lookup: Some(Lookup::NotFound),
            } => {
                // A definite "never accepted": release and run it again as a new attempt
                // (a new request key), counted against the lane's retries so that a provider
                // that keeps failing this way ends the task instead of cycling forever.
                failed(
                    s,
                    now,
                    task,
                    token,
                    Failure::Retryable,
                    "no answer to the submit, and the provider never accepted it",
                );
                None
            }
            ProviderEvent::Resolved {
                task,
                token,
                lookup: None,
            } => {
                ask_again(state, s, &d, task, token);
                None
            }
            ProviderEvent::Finished { task, token, view } => {
                match view.state {
                    JobState::Succeeded => {
                        if let Some(a) = s.meta.get_mut(&task).and_then(|m| m.attempt.as_mut()) {
                            a.output_url = view.output_url.clone();
                        }
                        provider_succeeded(s, now, task, token, view.cost_milli);
                    }
                    JobState::Failed | JobState::Canceled => {
                        let f = if view.retryable || view.state == JobState::Canceled {
                            Failure::Retryable
                        } else {
                            Failure::NonRetryable
                        };
                        let why = view.error.unwrap_or_else(|| format!("{:?}", view.state));
                        failed(s, now, task, token, f, &format!("provider: {why}"));
                    }
                    _ => {
                        task_event!(
                            warn,
                            s,
                            task,
                            "{task}: a non-final job reported as finished"
                        )
                    }
                }
                None
            }
        }
    };
    if let Some(call) = follow_up {
        if d.calls.send(call).await.is_err() {
            tracing::warn!("the provider thread stopped");
        }
    }
    pump(state).await;
}

/// A round of queries found nothing about an attempt in doubt: it keeps every reservation and
/// is asked about again after the last polling stage.
fn ask_again(
    state: &SharedShard,
    s: &ShardState,
    d: &spindle_node_workers::dispatch::DispatchHandle,
    task: TaskId,
    token: FencingToken,
) {
    s.metrics
        .provider_unresolved
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let again = d.resolve_again_after();
    task_event!(
        warn,
        s,
        task,
        "{task}: outcome still unknown; asked again in {again:?}"
    );
    let state = state.clone();
    let d = d.clone();
    glommio::spawn_local(async move {
        glommio::timer::sleep(again).await;
        let call = in_doubt(&state.borrow(), task, token);
        if let Some(call) = call {
            if d.calls.send(call).await.is_err() {
                tracing::warn!("the provider thread stopped");
            }
        }
    })
    .detach();
}

/// The provider took the attempt: RUNNING, then watch the job — asking the provider to stop it
/// first if the task was canceled meanwhile; the watch tells how it ended, and that end lets go
/// of the attempt's reservations.
pub(super) fn accepted(
    s: &mut ShardState,
    index: usize,
    task: TaskId,
    token: FencingToken,
    view: spindle_providers::JobView,
) -> Option<spindle_node_workers::dispatch::Call> {
    use spindle_node_workers::dispatch::Call;
    // An attempt resumed after a restart whose job the provider had accepted before it is
    // RUNNING already: found again, it is only watched.
    let was_running = s.core.task_state(task) == Some(TaskState::Running)
        && s.meta.get(&task).is_some_and(|m| m.token == Some(token));
    if !was_running {
        if let Err(e) = s.core.handle_provider_accepted(task, token) {
            // A stale token (an older attempt's answer): nothing of ours to change.
            task_event!(warn, s, task, "provider accepted {task}: {e}");
            return None;
        }
    }
    let lane = s.core.task_lane(task)?;
    let attempt = s.meta.get_mut(&task).and_then(|m| m.attempt.as_mut())?;
    attempt.job_id = Some(view.job_id.clone());
    let account = attempt.account.clone();
    let timeout = attempt.timeout(s.core.policy(), lane);
    let cancel = s.core.task_state(task) == Some(TaskState::Canceled);
    if !was_running && !cancel {
        if let Some(m) = s.meta.get(&task) {
            let waited = s.now().since(m.queued_at) / 1_000;
            s.metrics.running.record(waited, 1);
        }
        notify(s, task, TaskState::Running);
        send_reports(
            s,
            [Report::new(
                task,
                Some(token),
                ReportAction::Advance(TaskState::Running),
            )],
        );
    }
    Some(Call::Watch {
        shard: index,
        task,
        token,
        account,
        job_id: view.job_id,
        cancel,
        timeout,
    })
}

/// No definite answer: SUBMIT_UNKNOWN keeps every reservation; ask by request key.
pub(super) fn unknown(
    s: &mut ShardState,
    index: usize,
    task: TaskId,
    token: FencingToken,
) -> Option<spindle_node_workers::dispatch::Call> {
    if let Err(e) = s.core.handle_submit_unknown(task, token) {
        task_event!(warn, s, task, "submit unknown {task}: {e}");
        return None;
    }
    task_event!(
        info,
        s,
        task,
        "{task}: no answer to its submit; asking the provider by its request key"
    );
    let resolve = s
        .meta
        .get(&task)
        .and_then(|m| m.attempt.as_ref())?
        .resolve(index, task, token);
    if s.core.task_state(task) == Some(TaskState::SubmitUnknown) {
        send_reports(
            s,
            [Report::new(
                task,
                Some(token),
                ReportAction::Advance(TaskState::SubmitUnknown),
            )],
        );
    }
    Some(resolve)
}

/// Another round of queries by request key for `task`'s attempt, if it is still in doubt with
/// `token` (a cancel that won meanwhile keeps it in doubt too: the job may run there).
pub(super) fn in_doubt(
    s: &ShardState,
    task: TaskId,
    token: FencingToken,
) -> Option<spindle_node_workers::dispatch::Call> {
    let m = s.meta.get(&task).filter(|m| m.token == Some(token))?;
    let a = m.attempt.as_ref().filter(|a| a.job_id.is_none())?;
    matches!(
        s.core.task_state(task),
        Some(TaskState::SubmitUnknown | TaskState::Canceled)
    )
    .then(|| a.resolve(s.index, task, token))
}

/// A failed attempt: the core decides requeue (with backoff × jitter) or FAILED.
pub(super) fn failed(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    token: FencingToken,
    failure: spindle_core::shard::Failure,
    why: &str,
) {
    let jitter = spindle_node_base::jitter::jitter_milli(task.0 ^ now.0);
    match s
        .core
        .handle_provider_failed(now, task, token, failure, jitter)
    {
        Ok(outcome) => after_failure(s, now, task, token, outcome, why),
        Err(e) => task_event!(warn, s, task, "provider failed {task}: {e}"),
    }
}

/// Persists what the core decided after a failure.
pub(super) fn after_failure(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    token: FencingToken,
    outcome: spindle_core::shard::FailOutcome,
    why: &str,
) {
    use spindle_core::shard::FailOutcome;
    let reason = stored_reason(why);
    let report = match outcome {
        FailOutcome::Requeued { eligible_at } => {
            if let Some(m) = s.meta.get_mut(&task) {
                m.token = None;
                m.attempt = None;
                if let Some(e) = m.estimate.take() {
                    s.running.stop(m.tenant, e.fairness.milli());
                }
                m.queued_at = now;
            }
            notify(s, task, TaskState::Queued);
            ReportAction::Requeue {
                delay_ms: eligible_at.since(now) / 1_000_000,
                reason,
            }
        }
        FailOutcome::Failed => {
            remove_meta(s, &task);
            ReportAction::Finish {
                state: TaskState::Failed,
                cost_actual_milli: None,
                reason: Some(reason),
                result: None,
            }
        }
        FailOutcome::Canceled => {
            remove_meta(s, &task);
            ReportAction::Finish {
                state: TaskState::Canceled,
                cost_actual_milli: None,
                reason: None,
                result: None,
            }
        }
    };
    send_reports(s, [Report::new(task, Some(token), report)]);
}

/// The local provider: accepts at once, finishes after the modelled provider time × scale.
pub(super) async fn run_local(
    state: &SharedShard,
    task: TaskId,
    token: FencingToken,
    attempt_no: u32,
) {
    let wait = {
        let mut s = state.borrow_mut();
        if canceled_before_sent(&mut s, task, token) {
            return;
        }
        if let Some(log) = &mut s.log {
            use std::io::Write;
            // One write per line (O_APPEND): a kill -9 never leaves half a line.
            let line = format!("{} {attempt_no}\n", task.0);
            if let Err(e) = log.write_all(line.as_bytes()) {
                tracing::warn!("local provider log: {e}");
            }
        }
        if let Err(e) = s.core.handle_provider_accepted(task, token) {
            task_event!(warn, s, task, "provider accepted {task}: {e}");
            return;
        }
        notify(&mut s, task, TaskState::Running);
        send_reports(
            &mut s,
            [Report::new(
                task,
                Some(token),
                ReportAction::Advance(TaskState::Running),
            )],
        );
        let modelled_ms = s
            .meta
            .get(&task)
            .and_then(|m| m.estimate.as_deref())
            .map_or(0, |e| e.provider_ms);
        Duration::from_secs_f64(modelled_ms as f64 / 1_000.0 * s.time_scale)
    };
    // A zero wait (a time scale of 0: the node benches) registers no timer: 0.3 µs of a
    // shard's CPU per task (docs/benchmarks/journal.md, "Sixteenth round").
    if !wait.is_zero() {
        glommio::timer::sleep(wait).await;
    }
    let mut s = state.borrow_mut();
    let now = s.now();
    provider_succeeded(&mut s, now, task, token, None);
}

/// The provider finished the attempt (`actual`: what it says it cost, else the estimate);
/// the media stage follows.
pub(super) fn provider_succeeded(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    token: FencingToken,
    actual: Option<u64>,
) {
    let estimate = s
        .meta
        .get(&task)
        .and_then(|m| m.estimate.as_deref().copied());
    // The fairness debt in proportion to what it really cost.
    let units = estimate.map_or(0, |e| match actual {
        Some(a) if e.cost_milli > 0 => {
            (u128::from(e.fairness.milli()) * u128::from(a) / u128::from(e.cost_milli)) as u64
        }
        _ => e.fairness.milli(),
    });
    let current = s.meta.get(&task).is_some_and(|m| m.token == Some(token));
    if let (Some(billed), true) = (actual, current) {
        // Its quotas count what the provider billed, and keep it whatever happens next.
        s.core.settle_quota_cost(task, billed);
    }
    match s
        .core
        .handle_provider_succeeded(now, task, token, Units(units))
    {
        Ok(CompleteOutcome::AwaitingMedia) => notify(s, task, TaskState::ProviderSucceeded),
        Ok(CompleteOutcome::Canceled) => {
            // Canceled while running: its reservation is released now; persist the end.
            remove_meta(s, &task);
            send_reports(s, [finish(task, Some(token), TaskState::Canceled, None)]);
            return;
        }
        Ok(other) => {
            task_event!(
                warn,
                s,
                task,
                "{task} ended at the provider step: {other:?}"
            );
            return;
        }
        Err(e) => {
            task_event!(warn, s, task, "provider succeeded {task}: {e}");
            return;
        }
    }
    if let Some(a) = actual {
        if let Some(m) = s.meta.get_mut(&task) {
            if let Some(e) = m.estimate.as_mut() {
                e.cost_milli = a;
            }
        }
    }
    // Its media step starts now: the local provider's completion is followed by no pump.
    start_media(s, now);
}
