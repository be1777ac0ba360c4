//! Reports to the control plane: queued per task, folded where one attempt's steps follow each
//! other, sent in rounds down the work pipeline, and their answers applied.

use super::*;

pub(super) fn finish(
    task: TaskId,
    token: Option<FencingToken>,
    state: TaskState,
    cost: Option<u64>,
) -> Report {
    let action = ReportAction::Finish {
        state,
        cost_actual_milli: cost,
        reason: None,
        result: None,
    };
    Report::new(task, token, action)
}

/// The end of a task whose deadline passed while it waited to start, with the reason.
pub(super) fn expired(task: TaskId) -> Report {
    let action = ReportAction::Finish {
        state: TaskState::Expired,
        cost_actual_milli: None,
        reason: Some("its deadline passed before it started".into()),
        result: None,
    };
    Report::new(task, None, action)
}

/// A failure's reason as a report carries it: at most `REASON_BYTES_MAX` bytes whatever the
/// characters (four bytes each at most).
pub(super) fn stored_reason(why: &str) -> String {
    why.chars()
        .take(spindle_control::limits::REASON_BYTES_MAX / 4)
        .collect()
}

/// Queues `reports` for the next flush, in order. Each counts in its task's
/// `pending_reports` from now until it is answered (a claim of the task waits for them all).
pub(super) fn send_reports(s: &mut ShardState, reports: impl IntoIterator<Item = Report>) {
    let before = s.outbox.len();
    for r in reports {
        if let Some(m) = s.meta.get_mut(&r.task) {
            m.pending_reports += 1;
        }
        s.outbox.push(r);
    }
    s.metrics.reports_pending.fetch_add(
        (s.outbox.len() - before) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// Takes what may be sent of the outbox: each task's reports folded where one attempt's steps
/// follow each other (RUNNING → … → SUCCEEDED in one row), and of those each task's first —
/// unless a report of that task is still unanswered. A task's later reports wait in the
/// outbox, in order, for the answer to the one before: a batch that fails while PostgreSQL is
/// away goes back to the front of the outbox, and a finish sent meanwhile would otherwise be
/// refused as an illegal step (it would overtake the RUNNING it follows) and the task left
/// RUNNING with its slot held after its job ended.
///
/// Takes the outbox under the caller's borrow; `send_reports_now` must be spawned only after
/// that borrow ends (glommio may run a spawned task at once, and it borrows the shard).
pub(super) fn take_reports(s: &mut ShardState) -> Option<Vec<Report>> {
    if s.outbox.is_empty() {
        return None;
    }
    let queued = s.outbox.len();
    let mut folded_into = Vec::new();
    let rounds = fold_reports_noting(s.outbox.drain(..), |task| folded_into.push(task));
    s.metrics.reports_pending.fetch_sub(
        folded_into.len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    debug_assert_eq!(
        queued - folded_into.len(),
        rounds.iter().map(Vec::len).sum::<usize>()
    );
    // A report folded into the one before is answered with it.
    for task in folded_into {
        if let Some(m) = s.meta.get_mut(&task) {
            m.pending_reports = m.pending_reports.saturating_sub(1);
        }
    }
    let (send, wait) = next_in_order(rounds, &s.reporting);
    s.outbox = wait;
    for r in &send {
        s.reporting.insert(r.task);
    }
    (!send.is_empty()).then_some(send)
}

/// Of `rounds` (`fold_reports`), the reports that may go now — each task's first, where none
/// of its reports is `in_flight` — and those that wait, each task's in their order.
fn next_in_order(
    rounds: Vec<Vec<Report>>,
    in_flight: &RunSet<TaskId>,
) -> (Vec<Report>, Vec<Report>) {
    let mut rounds = rounds.into_iter();
    let (send, mut wait): (Vec<Report>, Vec<Report>) = rounds
        .next()
        .unwrap_or_default()
        .into_iter()
        .partition(|r| !in_flight.contains(&r.task));
    wait.extend(rounds.flatten());
    (send, wait)
}

/// Rows of one report message (the control plane's batch limit is higher).
pub(super) const REPORTS_PER_MESSAGE_MAX: usize = 1024;

/// Sends reports down the work pipeline and handles the answers. Answers matter only when
/// they fail: a batch PostgreSQL did not take goes back to the front of the outbox; a report
/// refused is logged and counted (`spindle_reports_refused_total`).
pub(super) async fn send_reports_now(shared: SharedShard, reports: Vec<Report>) {
    let (cp, gauge, metrics) = {
        let s = shared.borrow();
        (
            s.pipes.work.clone(),
            s.pipes.work_gauge.clone(),
            s.metrics.clone(),
        )
    };
    let pending = |n: usize| {
        metrics
            .reports_pending
            .fetch_sub(n as u64, std::sync::atomic::Ordering::Relaxed)
    };
    let mut answers = Vec::new();
    let mut unsent = reports.len();
    let mut reports = reports.into_iter().peekable();
    while reports.peek().is_some() {
        let batch: Vec<Report> = reports.by_ref().take(REPORTS_PER_MESSAGE_MAX).collect();
        let n = batch.len();
        let (tx, rx) = oneshot::channel();
        if cp
            .send(CpMsg::Report {
                reports: batch.clone(),
                reply: tx,
                queued: gauge.enqueue(n),
            })
            .await
            .is_err()
        {
            tracing::warn!("control plane stopped; reports wait for the reconciler");
            pending(unsent);
            return;
        }
        unsent -= n;
        answers.push((batch, rx));
    }
    // Batches PostgreSQL did not take (it was unreachable) go back to the front of the
    // outbox, in order, and are sent again with the next flush after it returns; their tasks'
    // later reports wait behind them.
    let mut retry: Vec<Report> = Vec::new();
    for (batch, rx) in answers {
        let n = batch.len();
        let answer = rx.await;
        pending(n);
        answered(
            &shared,
            &batch,
            answer.as_ref().ok().and_then(|a| a.as_ref().ok()),
        );
        let answer_lost = !matches!(answer, Ok(Ok(_)));
        let settled = match answer {
            Ok(Ok(results)) => {
                let refused = results
                    .iter()
                    .filter(|r| !matches!(r, ReportResult::Applied { .. }))
                    .count();
                if refused > 0 {
                    metrics
                        .reports_refused
                        .fetch_add(refused as u64, std::sync::atomic::Ordering::Relaxed);
                    for (r, result) in batch.iter().zip(&results) {
                        if !matches!(result, ReportResult::Applied { .. }) {
                            tracing::warn!(task = %r.task, "report for task {} not applied: {result:?}", r.task);
                        }
                    }
                }
                true
            }
            Ok(Err(e)) if e.is_retryable() => {
                tracing::warn!("reports failed, kept for a retry: {e}");
                false
            }
            Ok(Err(e)) => {
                tracing::warn!("reports refused: {e}");
                true
            }
            Err(_) => {
                tracing::warn!("control plane dropped a report batch");
                true
            }
        };
        if settled {
            let mut s = shared.borrow_mut();
            for r in &batch {
                s.reporting.remove(&r.task);
                // A batch refused whole, or lost: no end of it is stored to tell.
                if answer_lost && matches!(r.action, ReportAction::Finish { .. }) {
                    drop_subscribers(&mut s, r.task);
                }
            }
        } else {
            retry.extend(batch);
        }
    }
    if !retry.is_empty() {
        let mut s = shared.borrow_mut();
        s.metrics
            .reports_pending
            .fetch_add(retry.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for r in &retry {
            s.reporting.remove(&r.task);
            // Pending again until it is answered (`answered` counted this answer).
            if let Some(m) = s.meta.get_mut(&r.task) {
                m.pending_reports += 1;
            }
        }
        retry.append(&mut s.outbox);
        s.outbox = retry;
    }
}

/// Report rows came back (or failed as a batch): each task learns its stored version, and a
/// claim held for its answers goes out with that version.
pub(super) fn answered(
    shared: &SharedShard,
    reports: &[Report],
    results: Option<&Vec<ReportResult>>,
) {
    let mut s = shared.borrow_mut();
    let s = &mut *s;
    let committed_successes = reports
        .iter()
        .zip(results.into_iter().flatten())
        .filter(|(r, result)| {
            // A finish sent again after its answer was lost (in doubt) is refused as stale
            // once the first one committed: the task is SUCCEEDED all the same.
            matches!(
                (&r.action, result),
                (
                    ReportAction::Finish {
                        state: TaskState::Succeeded,
                        ..
                    },
                    ReportResult::Applied { .. }
                        | ReportResult::StaleToken {
                            current: None,
                            state: TaskState::Succeeded,
                        }
                )
            )
        })
        .count();
    s.metrics.succeeded_durable.fetch_add(
        committed_successes as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    // A finish with a result refused because a newer attempt holds the task (this one was
    // superseded while it ran — its partition moved): what it put into the bucket is nobody's.
    if let Some(pool) = &s.media {
        for (r, result) in reports.iter().zip(results.into_iter().flatten()) {
            if let (
                ReportAction::Finish {
                    result: Some(_), ..
                },
                ReportResult::StaleToken {
                    current: Some(current),
                    ..
                },
                Some(token),
            ) = (&r.action, result, r.token)
            {
                if *current != token {
                    pool.discard_attempt(r.task, token);
                }
            }
        }
    }
    if let Some(results) = results {
        for (r, result) in reports.iter().zip(results) {
            ended_durably(s, r, result);
        }
    }
    for (i, r) in reports.iter().enumerate() {
        let Some(m) = s.meta.get_mut(&r.task) else {
            continue;
        };
        m.pending_reports = m.pending_reports.saturating_sub(1);
        if let Some(ReportResult::Applied { version, .. }) = results.and_then(|rs| rs.get(i)) {
            m.db_version = *version;
        }
        if m.pending_reports == 0 && m.committed {
            let version = m.db_version;
            if let Some(mut claim) = s.held_claims.remove(&r.task) {
                claim.expected_version = version;
                s.ready_claims.push(claim);
            }
        }
    }
}

/// A task's end reaches its subscribers once PostgreSQL holds it: a client that reads the task
/// after the event finds the end there, result included (the shard forgets an ended task when
/// it sends the report, and a read of a task it does not hold goes to PostgreSQL). The end
/// told is the stored one: this report's, or — a finish applied before, unheard — the state
/// it found. A finish PostgreSQL refused (another attempt holds the task) ends nothing here:
/// the subscriptions are dropped, and the node holding the task tells its own.
fn ended_durably(s: &mut ShardState, r: &Report, result: &ReportResult) {
    let ReportAction::Finish {
        state,
        result: produced,
        ..
    } = &r.action
    else {
        return;
    };
    s.ending.remove(&r.task);
    match result {
        ReportResult::Applied { .. } => {
            notify_at(s, r.task, *state, progress_of(*state), produced.as_deref())
        }
        ReportResult::StaleToken {
            current: None,
            state: stored,
        } if stored.is_terminal() => notify_at(
            s,
            r.task,
            *stored,
            progress_of(*stored),
            (stored == state).then_some(produced.as_deref()).flatten(),
        ),
        _ => drop_subscribers(s, r.task),
    }
}

/// Drops `task`'s subscriptions without an event (its end is not this node's to tell).
pub(super) fn drop_subscribers(s: &mut ShardState, task: TaskId) {
    s.ending.remove(&task);
    s.subs.retain(task, true, |_| true);
}

/// Folds each task's consecutive reports where they fold (`Report::then`) and puts the rest in
/// rounds: round k holds each task's k-th remaining report.
#[cfg(test)]
pub(super) fn fold_reports(reports: impl Iterator<Item = Report>) -> Vec<Vec<Report>> {
    fold_reports_noting(reports, |_| {})
}

/// [`fold_reports`], telling `folded` the task of each report folded into the one before.
fn fold_reports_noting(
    reports: impl Iterator<Item = Report>,
    mut folded: impl FnMut(TaskId),
) -> Vec<Vec<Report>> {
    let mut rounds: Vec<Vec<Report>> = Vec::new();
    // Per task: (its last round, the index of its report there).
    let mut last: RunMap<TaskId, (usize, usize)> = RunMap::default();
    for r in reports {
        let r = match last.get(&r.task) {
            Some(&(k, i)) => match rounds[k][i].then(r) {
                Ok(()) => {
                    folded(rounds[k][i].task);
                    continue;
                }
                Err(r) => r,
            },
            None => r,
        };
        let k = last.get(&r.task).map_or(0, |&(k, _)| k + 1);
        if rounds.len() <= k {
            rounds.push(Vec::new());
        }
        last.insert(r.task, (k, rounds[k].len()));
        rounds[k].push(r);
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tasks_next_report_waits_for_the_answer_to_the_one_before() {
        use TaskState as S;
        // Task 1's RUNNING went out in a batch that failed; its finish was made meanwhile.
        let mut in_flight = RunSet::default();
        in_flight.insert(TaskId(1));
        let rounds = fold_reports(
            vec![
                finish(TaskId(1), Some(FencingToken(7)), S::Succeeded, None),
                advance(2, 8, S::Running),
                Report::new(TaskId(2), Some(FencingToken(9)), ReportAction::Release),
                advance(3, 4, S::Running),
            ]
            .into_iter(),
        );
        let (send, wait) = next_in_order(rounds, &in_flight);
        assert_eq!(
            send,
            vec![advance(2, 8, S::Running), advance(3, 4, S::Running)],
            "one report a task, none for a task whose report is unanswered"
        );
        assert_eq!(
            wait,
            vec![
                finish(TaskId(1), Some(FencingToken(7)), S::Succeeded, None),
                Report::new(TaskId(2), Some(FencingToken(9)), ReportAction::Release),
            ]
        );
        // The failed batch back at the front: RUNNING, then the finish, folded into one.
        let mut outbox = vec![advance(1, 7, S::Running)];
        outbox.extend(wait);
        let (send, wait) = next_in_order(fold_reports(outbox.into_iter()), &RunSet::default());
        let mut whole = finish(TaskId(1), Some(FencingToken(7)), S::Succeeded, None);
        whole.via = vec![S::Running];
        assert_eq!(
            send,
            vec![
                whole,
                Report::new(TaskId(2), Some(FencingToken(9)), ReportAction::Release)
            ]
        );
        assert!(wait.is_empty());
    }

    fn advance(task: u64, token: u64, to: TaskState) -> Report {
        Report::new(
            TaskId(task),
            Some(FencingToken(token)),
            ReportAction::Advance(to),
        )
    }

    #[test]
    fn consecutive_steps_of_one_attempt_fold_into_one_report() {
        use TaskState as S;
        let reports = vec![
            advance(1, 7, S::Running),
            advance(2, 8, S::Running),
            advance(1, 7, S::ProviderSucceeded),
            advance(1, 7, S::MediaProcessing),
            finish(TaskId(1), Some(FencingToken(7)), S::Succeeded, Some(5)),
            // Another attempt's report does not fold into the previous one.
            finish(TaskId(2), Some(FencingToken(9)), S::Failed, None),
            // Nothing folds into a release, and a release folds into nothing.
            Report::new(TaskId(3), Some(FencingToken(4)), ReportAction::Release),
            finish(TaskId(3), Some(FencingToken(4)), S::Succeeded, None),
            advance(4, 2, S::Running),
            Report::new(TaskId(4), Some(FencingToken(2)), ReportAction::Release),
        ];
        let rounds = fold_reports(reports.into_iter());
        assert_eq!(rounds.len(), 2, "{rounds:?}");
        let mut whole = finish(TaskId(1), Some(FencingToken(7)), S::Succeeded, Some(5));
        whole.via = vec![S::Running, S::ProviderSucceeded, S::MediaProcessing];
        assert_eq!(
            rounds[0],
            vec![
                whole,
                advance(2, 8, S::Running),
                Report::new(TaskId(3), Some(FencingToken(4)), ReportAction::Release),
                advance(4, 2, S::Running),
            ]
        );
        assert_eq!(
            rounds[1],
            vec![
                finish(TaskId(2), Some(FencingToken(9)), S::Failed, None),
                finish(TaskId(3), Some(FencingToken(4)), S::Succeeded, None),
                Report::new(TaskId(4), Some(FencingToken(2)), ReportAction::Release),
            ]
        );
    }
}
