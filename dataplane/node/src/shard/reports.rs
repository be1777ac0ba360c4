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

/// A failure's reason as a report carries it: at most `REASON_BYTES_MAX` bytes whatever the
/// characters (four bytes each at most).
pub(super) fn stored_reason(why: &str) -> String {
    why.chars()
        .take(spindle_control::limits::REASON_BYTES_MAX / 4)
        .collect()
}

/// Queues `reports` for the next flush, in order.
pub(super) fn send_reports(s: &mut ShardState, reports: impl IntoIterator<Item = Report>) {
    let before = s.outbox.len();
    s.outbox.extend(reports);
    s.metrics.reports_pending.fetch_add(
        (s.outbox.len() - before) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// Rows of one report message (the control plane's batch limit is higher).
pub(super) const REPORTS_PER_MESSAGE_MAX: usize = 1024;

/// Sends every queued report as few messages and rows as possible. A task's consecutive steps
/// of one attempt fold into one multi-step report (RUNNING → … → SUCCEEDED in one row); what
/// does not fold goes in rounds: round k holds each task's k-th report, so a batch never names
/// a task twice and each task's reports stay in order (the pipeline executes messages in the
/// order they were sent). Answers matter only when they fail (logged; the reconciler repairs
/// what a lost report leaves behind).
///
/// Takes the outbox under the caller's borrow; `send_rounds` must be spawned only after that
/// borrow ends (glommio may run a spawned task at once, and it borrows the shard).
pub(super) fn take_reports(s: &mut ShardState) -> Option<Vec<Vec<Report>>> {
    if s.outbox.is_empty() {
        return None;
    }
    let queued = s.outbox.len();
    let rounds = fold_reports(s.outbox.drain(..));
    let folded = queued - rounds.iter().map(Vec::len).sum::<usize>();
    for r in rounds.iter().flatten() {
        if let Some(m) = s.meta.get_mut(&r.task) {
            m.pending_reports += 1;
        }
    }
    s.metrics
        .reports_pending
        .fetch_sub(folded as u64, std::sync::atomic::Ordering::Relaxed);
    Some(rounds)
}

/// Sends report rounds down the work pipeline and handles the answers.
pub(super) async fn send_rounds(shared: SharedShard, rounds: Vec<Vec<Report>>) {
    let (cp, gauge, metrics) = {
        let s = shared.borrow();
        (
            s.pipes.work.clone(),
            s.pipes.work_gauge.clone(),
            s.metrics.clone(),
        )
    };
    {
        let pending = |n: usize| {
            metrics
                .reports_pending
                .fetch_sub(n as u64, std::sync::atomic::Ordering::Relaxed)
        };
        let mut answers = Vec::new();
        let mut unsent: usize = rounds.iter().map(Vec::len).sum();
        for round in rounds {
            let mut round = round.into_iter().peekable();
            while round.peek().is_some() {
                let reports: Vec<Report> = round.by_ref().take(REPORTS_PER_MESSAGE_MAX).collect();
                let n = reports.len();
                let (tx, rx) = oneshot::channel();
                if cp
                    .send(CpMsg::Report {
                        reports: reports.clone(),
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
                answers.push((reports, rx));
            }
        }
        // Batches PostgreSQL did not take (it was unreachable) go back to the front of the
        // outbox, in order, and are sent again with the next flush after it returns.
        let mut retry: Vec<Report> = Vec::new();
        for (reports, rx) in answers {
            let n = reports.len();
            let answer = rx.await;
            pending(n);
            answered(
                &shared,
                &reports,
                answer.as_ref().ok().and_then(|a| a.as_ref().ok()),
            );
            match answer {
                Ok(Ok(results)) => {
                    for r in results {
                        if !matches!(r, ReportResult::Applied { .. }) {
                            tracing::warn!("report not applied: {r:?}");
                        }
                    }
                }
                Ok(Err(e)) if e.is_retryable() => {
                    tracing::warn!("reports failed, kept for a retry: {e}");
                    retry.extend(reports);
                }
                Ok(Err(e)) => tracing::warn!("reports refused: {e}"),
                Err(_) => tracing::warn!("control plane dropped a report batch"),
            }
        }
        if !retry.is_empty() {
            let mut s = shared.borrow_mut();
            s.metrics
                .reports_pending
                .fetch_add(retry.len() as u64, std::sync::atomic::Ordering::Relaxed);
            retry.append(&mut s.outbox);
            s.outbox = retry;
        }
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

/// Folds each task's consecutive reports where they fold (`Report::then`) and puts the rest in
/// rounds: round k holds each task's k-th remaining report.
pub(super) fn fold_reports(reports: impl Iterator<Item = Report>) -> Vec<Vec<Report>> {
    let mut rounds: Vec<Vec<Report>> = Vec::new();
    // Per task: (its last round, the index of its report there).
    let mut last: RunMap<TaskId, (usize, usize)> = RunMap::default();
    for r in reports {
        let r = match last.get(&r.task) {
            Some(&(k, i)) => match rounds[k][i].then(r) {
                Ok(()) => continue,
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
