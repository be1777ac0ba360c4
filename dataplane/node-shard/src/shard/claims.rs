//! Claims: the pump that drains the core's dispatches into claim messages, and their answers
//! (granted, refused, in doubt).

use super::*;
use spindle_node_base::limits::IN_DOUBT_PAUSE_MAX;

/// Drains the core's dispatches into one claim message and handles the answers.
pub(super) async fn pump(state: &SharedShard) {
    let (claims, reports) = {
        let mut guard = state.borrow_mut();
        // Through a plain reference, so that fields borrow apart (the live tasks and their count).
        let s = &mut *guard;
        // Media jobs waiting for a worker that came free (a job ended, a split moved one
        // here) start first: their reports go out with this pump's.
        let now = s.now();
        crate::shard::media::start_media(s, now);
        let reports = take_reports(s);
        publish_gauges(s);
        if s.metrics.stopping() {
            // Draining: what is queued stays QUEUED in PostgreSQL for the next owner; reports
            // still go out.
            (Vec::new(), reports)
        } else {
            let ready = s.ready_claims.len().min(CLAIMS_PER_PUMP_MAX);
            let mut claims: Vec<ClaimRequest> = s.ready_claims.drain(..ready).collect();
            while claims.len() < CLAIMS_PER_PUMP_MAX {
                match s.core.poll_dispatch(now) {
                    Poll::Dispatch(d) => {
                        let (version, committed, queued_at) = match s.meta.get_mut(&d.task) {
                            Some(m) => {
                                // A task dispatched again holds the new attempt's units.
                                if let Some(old) = m.estimate.replace(Box::new(d.estimate)) {
                                    s.running.stop(m.tenant, old.fairness.milli());
                                }
                                s.running.start(m.tenant, d.estimate.fairness.milli());
                                (
                                    m.db_version,
                                    m.committed && m.pending_reports == 0,
                                    m.queued_at,
                                )
                            }
                            None => (0, true, now),
                        };
                        s.metrics
                            .waited(d.lane, d.band, now.since(queued_at) / 1_000);
                        let account = &s.core.policy().providers[d.provider.0 as usize];
                        let provider = account.name.clone();
                        let pool_shard = preferred_pool_shard(
                            &s.node,
                            s.index,
                            s.shard_count,
                            s.pipes
                                .submit_calls
                                .load(std::sync::atomic::Ordering::Relaxed),
                            provider_pool_shards(account.concurrency),
                        );
                        let claim = ClaimRequest {
                            task: d.task,
                            expected_version: version,
                            provider: provider.clone(),
                            demands: vec![Demand {
                                shard: PoolShard::new(provider_pool(&provider), pool_shard),
                                amount: 1,
                            }],
                        };
                        if committed {
                            claims.push(claim);
                        } else {
                            s.held_claims.insert(d.task, claim);
                        }
                    }
                    Poll::Expired(task) => {
                        let committed = remove_meta(s, &task).is_some_and(|m| m.committed);
                        // Its subscribers hear the end once it is stored.
                        if committed {
                            send_reports(s, [expired(task)]);
                        } else {
                            // Its submit is still on the way (on another connection): the end is
                            // reported once it committed.
                            s.expired_uncommitted.insert(task);
                        }
                    }
                    Poll::Yield => continue,
                    Poll::Idle => break,
                }
            }
            // Again after dispatching: a drain must count what was just picked.
            publish_gauges(s);
            (claims, reports)
        }
    };
    // Spawned only now that the borrow is gone: glommio may run a new task at once.
    if let Some(reports) = reports {
        glommio::spawn_local(send_reports_now(state.clone(), reports)).detach();
    }
    if claims.is_empty() {
        return;
    }
    let state = state.clone();
    glommio::spawn_local(async move { claim(&state, claims).await }).detach();
}

/// A claim committed with `token`: true when the attempt starts now (false: the task was
/// canceled meanwhile, and the attempt ends at once).
fn granted(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    token: FencingToken,
    attempt_no: u32,
) -> bool {
    s.metrics
        .claims_granted
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let queued_at = s.meta.get_mut(&task).map(|m| {
        m.token = Some(token);
        m.db_version += 1;
        m.queued_at
    });
    match s.core.handle_claim_granted(task, token) {
        Ok(ClaimOutcome::Submit) => {
            if let (1, Some(at)) = (attempt_no, queued_at) {
                s.metrics.dispatch.record(now.since(at) / 1_000, 1);
            }
            true
        }
        Ok(ClaimOutcome::Canceled) => {
            remove_meta(s, &task);
            let end = finish(task, Some(token), TaskState::Canceled, None);
            send_reports(s, [end]);
            false
        }
        Err(e) => {
            task_event!(warn, s, task, "claim granted for {task}: {e}");
            false
        }
    }
}

/// A claim PostgreSQL refused.
fn refused(s: &mut ShardState, now: Time, task: TaskId, why: ClaimRefusal) {
    s.metrics
        .claims_refused
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let ClaimRefusal::VersionMoved {
        state: TaskState::Queued,
        version,
    } = why
    {
        // Still queued in this node's partition, at a version this shard did not see: its own
        // report moved it, unheard (a requeue whose answer was lost, its retry refused as
        // done). The task is claimed again at the version PostgreSQL has.
        if let Some(m) = s.meta.get_mut(&task) {
            m.db_version = version;
        }
        if let Err(e) = s.core.handle_claim_refused(now, task) {
            task_event!(warn, s, task, "claim refused for {task}: {e}");
        }
        return;
    }
    if let ClaimRefusal::PartitionNotOwned(partition) = why {
        if s.ownership.owns(partition.0) {
            // Not taken by another node as far as this one knows: its own lease lapsed (it
            // could not renew it, PostgreSQL out of reach past `lease_ms`), and its next
            // renewal decides. Renewed, the claim goes again; lost, the lease loop marks the
            // partition and the next refusal lets the task go. Dropped now, it would be
            // nobody's: no other node took the partition over, so none loads its queue.
            let wait_ms = u64::from(s.lease_ms / LEASE_RECHECKS_PER_LEASE).max(1);
            let at = now.plus_ns(wait_ms * 1_000_000);
            if let Err(e) = s.core.handle_claim_refused_until(task, at) {
                task_event!(warn, s, task, "claim refused for {task}: {e}");
            }
            return;
        }
    }
    if matches!(
        why,
        ClaimRefusal::TaskGone
            | ClaimRefusal::VersionMoved { .. }
            | ClaimRefusal::PartitionNotOwned(_)
    ) {
        // Its submit never committed (a replay, a conflict), another writer moved it, or its
        // partition went to another node: it is not ours to run, nor its end ours to tell.
        let _ = s.core.handle_cancel(task);
        remove_meta(s, &task);
        drop_subscribers(s, task);
    }
    if let Err(e) = s.core.handle_claim_refused(now, task) {
        task_event!(warn, s, task, "claim refused for {task}: {e}");
    }
}

/// How often, per lease, a claim refused for a partition this node still believes it holds is
/// tried again (twice per renewal interval, which is a third of a lease).
const LEASE_RECHECKS_PER_LEASE: u32 = 6;

/// How many times a shard asks for the rows of calls in doubt before it leaves them to a
/// restart or a takeover (with pauses doubling up to `IN_DOUBT_PAUSE_MAX`: ~30 minutes).
pub(super) const IN_DOUBT_LOOKUPS_MAX: u32 = 1_000;

/// The rows of `tasks` as they are now, read down `cp` (it reconnects as it needs) in at most
/// `tries`; `None` when PostgreSQL did not answer in them, or the pipeline stopped.
pub(super) async fn look_up(
    cp: &mpsc::Sender<CpMsg>,
    tasks: Vec<TaskId>,
    tries: u32,
) -> Option<Vec<Option<TaskHead>>> {
    let mut pause = Duration::from_millis(50);
    for _ in 0..tries {
        let asked = tasks.clone();
        match ask(cp, |reply| CpMsg::Lookup {
            tasks: asked,
            reply,
        })
        .await
        {
            Ok(heads) => return Some(heads),
            Err(e) if cp.is_closed() => {
                tracing::warn!("reading rows in doubt: {e}");
                return None;
            }
            Err(e) => tracing::debug!("reading rows in doubt: {e}"),
        }
        glommio::timer::sleep(pause).await;
        pause = (pause * 2).min(IN_DOUBT_PAUSE_MAX);
    }
    None
}

async fn claim(state: &SharedShard, claims: Vec<ClaimRequest>) {
    let (cp, gauge) = {
        let s = state.borrow();
        (s.pipes.work.clone(), s.pipes.work_gauge.clone())
    };
    let asked: Vec<(TaskId, u32)> = claims
        .iter()
        .map(|c| (c.task, c.expected_version))
        .collect();
    let queued = gauge.enqueue(claims.len());
    let result = ask(&cp, |reply| CpMsg::Claim {
        claims,
        reply,
        queued,
    })
    .await;
    // One answer per claim; `None`: not taken, the task goes back to its queue.
    let results: Vec<Option<ClaimResult>> = match result {
        Ok(results) => results.into_iter().map(Some).collect(),
        Err(e) if e.is_in_doubt() => {
            // Taken or not, only the rows can tell: until they do, the tasks stay dispatched
            // with their claims outstanding (nothing else starts them, nothing releases them).
            tracing::warn!("{} claims in doubt ({e}); reading their rows", asked.len());
            count_in_doubt(state);
            let tasks = asked.iter().map(|&(t, _)| t).collect();
            let Some(heads) = look_up(&cp, tasks, IN_DOUBT_LOOKUPS_MAX).await else {
                tracing::error!(
                    "claims of {} tasks stay in doubt: PostgreSQL did not answer; a restart \
                     or a takeover resolves them",
                    asked.len()
                );
                return;
            };
            let node = state.borrow().node.clone();
            asked
                .iter()
                .zip(&heads)
                .map(|(&(task, expected), head)| lost_claim(task, head.as_ref(), &node, expected))
                .collect()
        }
        Err(e) => {
            tracing::warn!("claims failed ({e}); tasks go back to their queues");
            vec![None; asked.len()]
        }
    };
    let mut started = Vec::new();
    {
        let mut s = state.borrow_mut();
        let now = s.now();
        for (&(task, _), r) in asked.iter().zip(results) {
            match r {
                Some(r @ ClaimResult::Granted { .. }) => {
                    started.extend(grant(&mut s, now, task, r))
                }
                Some(ClaimResult::Refused(why)) => refused(&mut s, now, task, why),
                None => {
                    if let Err(e) = s.core.handle_claim_refused(now, task) {
                        task_event!(warn, s, task, "requeue of {task}: {e}");
                    }
                }
            }
        }
    }
    start_attempts(state, started).await;
}

/// An attempt whose claim committed, to start: (task, token, attempt_no, request key).
pub(super) type Started = (TaskId, FencingToken, u32, String);

/// Starts attempts whose claims committed: at their provider, or on the local one.
pub(super) async fn start_attempts(state: &SharedShard, started: Vec<Started>) {
    let dispatch = state.borrow().dispatch.clone();
    let Some(d) = dispatch else {
        for (task, token, attempt_no, _) in started {
            let state = state.clone();
            glommio::spawn_local(async move { run_local(&state, task, token, attempt_no).await })
                .detach();
        }
        return;
    };
    let mut stored = stored_inputs(state, &started).await;
    for (task, token, _, request_key) in started {
        let stored = stored.remove(&task);
        submit_to_provider(state, &d, task, token, request_key, stored).await;
    }
}

/// The start of an attempt whose claim `result` came back granted and goes ahead (not canceled
/// meanwhile: then its end is reported instead, by [`granted`]).
pub(super) fn grant(
    s: &mut ShardState,
    now: Time,
    task: TaskId,
    result: ClaimResult,
) -> Option<Started> {
    let ClaimResult::Granted {
        token,
        attempt_no,
        request_key,
        ..
    } = result
    else {
        return None;
    };
    granted(s, now, task, token, attempt_no).then_some((task, token, attempt_no, request_key))
}
