//! What a starting owner (or one taking partitions over) takes back from PostgreSQL.

use spindle_control::{Db, PartitionId, Report};
use spindle_node_base::limits::RECOVER_REREADS_MAX;
pub use spindle_node_base::messages::{LiveRestore, Restore, ShardRestores, Unrestorable};

/// A stored task as its shard takes it back, queued (a live attempt and a stored cancel are the
/// caller's to add); `Err` when its stored request cannot be read.
pub fn queued(q: &spindle_control::reconcile::QueuedTask) -> anyhow::Result<Restore> {
    let (request, input, deadline_at) = restore_request(q)?;
    Ok(Restore {
        request,
        version: q.version,
        live: None,
        cancel: false,
        input,
        deadline_at,
        submitted_at: q.created_at,
    })
}

/// Which live attempts a (re)starting owner follows instead of ending them.
///
/// With an HTTP provider, those of the accounts the policy names: the provider still has their
/// jobs and can be asked by request key. In the provider stage that is every one; past it
/// (PROVIDER_SUCCEEDED, MEDIA_PROCESSING) only when the media stage is configured — the job's
/// video is found again through the provider and the media step runs again. With the local
/// provider, none: its work died with the process that ran it.
pub(super) struct Followed {
    providers: Vec<String>,
    media: bool,
}

impl Followed {
    pub fn new(
        config: &spindle_node_base::config::Config,
        policy: &spindle_core::Policy,
    ) -> Followed {
        Followed {
            providers: match config.provider {
                Some(_) => policy.providers.iter().map(|p| p.name.clone()).collect(),
                None => Vec::new(),
            },
            media: config.media.is_some(),
        }
    }

    fn follows(&self, a: &spindle_control::reconcile::LiveAttempt) -> bool {
        use spindle_core::TaskState as S;
        let past_provider = matches!(a.state, S::ProviderSucceeded | S::MediaProcessing);
        self.providers.contains(&a.provider) && (self.media || !past_provider)
    }
}

/// Resolves the previous owner's live attempts in `mine` that are not followed (see
/// [`Followed`]): in the provider stage they are requeued (a new attempt runs them); past it
/// the provider had finished, and they are completed. Followed ones are left live, for
/// [`load_restores`]. Pages through the partitions once, in task id order.
///
/// A previous owner whose lease lapsed may still be writing its attempts (its reports are
/// fenced by their tokens, not by the partition lease): an attempt it advanced or ended after
/// the page was read is not recovered as read but read again, as it is now, up to
/// [`RECOVER_REREADS_MAX`] times in a row.
pub(super) async fn recover_attempts(
    admin: &Db,
    mine: &[PartitionId],
    followed: &Followed,
) -> anyhow::Result<()> {
    let mut after = None;
    let mut rereads = 0;
    loop {
        let live = admin
            .live_attempts_in(mine, after, spindle_control::limits::SCAN_MAX)
            .await?;
        let Some(last) = live.last() else {
            return Ok(());
        };
        let changed = recover_page(admin, &live, followed).await?;
        let Some((task, seen)) = changed.first() else {
            after = Some(last.task);
            rereads = 0;
            continue;
        };
        rereads += 1;
        if rereads > RECOVER_REREADS_MAX {
            anyhow::bail!(
                "recovering live attempts: {} still changed after {RECOVER_REREADS_MAX} \
                 reads (task {task}: {seen:?})",
                changed.len()
            );
        }
        tracing::info!(
            changed = changed.len(),
            "live attempts changed while they were recovered (their previous owner is still \
             writing them); reading them again"
        );
    }
}

/// Ends the attempts of one page of [`recover_attempts`] that are not followed. Returns those
/// whose rows changed since `live` was read, with what their report found (it was not
/// applied: nothing of theirs was written).
async fn recover_page(
    admin: &Db,
    live: &[spindle_control::reconcile::LiveAttempt],
    followed: &Followed,
) -> anyhow::Result<Vec<(spindle_core::TaskId, spindle_control::ReportResult)>> {
    use spindle_control::{ReportAction as A, ReportResult};
    use spindle_core::TaskState as S;
    let reports: Vec<Report> = live
        .iter()
        .filter(|a| !followed.follows(a))
        .map(|a| {
            let succeeded = A::Finish {
                state: S::Succeeded,
                cost_actual_milli: None,
                reason: None,
                result: None,
            };
            let mut r = Report::new(a.task, Some(a.token), succeeded);
            match a.state {
                S::ProviderSucceeded => r.via = vec![S::MediaProcessing],
                S::MediaProcessing => {}
                _ => {
                    let reason = if followed.providers.is_empty() {
                        "node restarted: the local provider lost the attempt".to_string()
                    } else {
                        format!("provider {} is no longer configured", a.provider)
                    };
                    r.action = A::Requeue {
                        delay_ms: 0,
                        reason,
                    }
                }
            }
            r
        })
        .collect();
    let mut changed = Vec::new();
    for chunk in reports.chunks(spindle_control::limits::BATCH_MAX) {
        let results = admin.report_batch(chunk).await?;
        for (r, result) in chunk.iter().zip(results) {
            if !matches!(result, ReportResult::Applied { .. }) {
                changed.push((r.task, result));
            }
        }
    }
    Ok(changed)
}

/// A stored task as its shard's core takes it back, its input, and when its deadline passes.
fn restore_request(
    q: &spindle_control::reconcile::QueuedTask,
) -> anyhow::Result<(
    spindle_core::RestoreRequest,
    Option<Box<str>>,
    Option<std::time::SystemTime>,
)> {
    let stored: spindle_node_base::messages::StoredRequest = serde_json::from_slice(&q.payload)
        .map_err(|e| anyhow::anyhow!("task {}: unreadable payload: {e}", q.task))?;
    let lane = *spindle_core::Lane::ALL
        .get(q.lane as usize)
        .ok_or_else(|| anyhow::anyhow!("task {}: lane {}", q.task, q.lane))?;
    let band = *spindle_core::Band::ALL
        .get(q.band as usize)
        .ok_or_else(|| anyhow::anyhow!("task {}: band {}", q.task, q.band))?;
    let request = spindle_core::RestoreRequest {
        submit: spindle_core::SubmitRequest {
            task: q.task,
            tenant: q.tenant,
            user: spindle_core::UserId(q.user),
            spec: stored.spec,
            band_hint: stored.band_hint,
            // Set by the shard, on its clock, from `Restore::deadline_at`.
            deadline: None,
        },
        lane,
        band,
        attempts_before: q.attempt_no,
    };
    let deadline_at = stored
        .deadline_ms
        .map(|ms| q.created_at + std::time::Duration::from_millis(u64::from(ms)));
    Ok((request, stored.input.map(|i| i.get().into()), deadline_at))
}

/// Every task of `mine` to put back, as restores per shard: the QUEUED ones, and the live
/// attempts [`recover_attempts`] left live (the followed ones), in one walk. One that cannot
/// be read back goes to its shard as [`Unrestorable`].
pub(super) async fn load_restores(
    admin: &Db,
    config: &spindle_node_base::config::Config,
    policy: &spindle_core::Policy,
    mine: &[PartitionId],
) -> anyhow::Result<Vec<ShardRestores>> {
    let mut per_shard = ShardRestores::per_shard(config.shards);
    load_quota_consumption(admin, config, policy, mine, &mut per_shard).await?;
    let mut after = None;
    loop {
        let page = admin
            .load_owned(mine, after, spindle_control::limits::SCAN_MAX)
            .await?;
        let Some(last) = page.last() else {
            return Ok(per_shard);
        };
        after = Some(last.task.task);
        for o in page {
            let to = &mut per_shard[config.shard_of(o.task.tenant.0)];
            match owned_restore(policy, o) {
                Ok(r) => to.tasks.push(r),
                Err(u) => to.unrestorable.push(u),
            }
        }
    }
}

/// The tenants of `mine` with periodic quotas, and what their ended tasks consumed in the
/// periods still running, for their shards.
async fn load_quota_consumption(
    admin: &Db,
    config: &spindle_node_base::config::Config,
    policy: &spindle_core::Policy,
    mine: &[PartitionId],
    per_shard: &mut [ShardRestores],
) -> anyhow::Result<()> {
    let tenants: Vec<(spindle_core::TenantId, u64)> = policy
        .tenants
        .iter()
        .filter(|(t, p)| {
            !p.quotas.is_empty()
                && mine.contains(&PartitionId(spindle_node_base::config::partition_of(
                    t.0,
                    config.partitions,
                )))
        })
        .map(|(&t, p)| {
            let longest = p.quotas.iter().map(|q| q.period.longest_ms()).max();
            (t, longest.unwrap_or(0))
        })
        .collect();
    let Some(longest) = tenants.iter().map(|&(_, ms)| ms).max() else {
        return Ok(());
    };
    for &(t, _) in &tenants {
        per_shard[config.shard_of(t.0)].quota_tenants.push(t);
    }
    // A period's start is at most its longest length (plus a time zone's offset) ago.
    let since =
        std::time::SystemTime::now() - std::time::Duration::from_millis(longest + 86_400_000);
    let ids: Vec<spindle_core::TenantId> = tenants.iter().map(|&(t, _)| t).collect();
    for chunk in ids.chunks(spindle_control::limits::BATCH_MAX) {
        for (t, at) in admin.quota_resets(chunk).await? {
            let ms = at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            per_shard[config.shard_of(t.0)].quota_floors.push((t, ms));
        }
        for c in admin.quota_consumed(mine, chunk, since).await? {
            per_shard[config.shard_of(c.tenant.0)].consumed.push(c);
        }
    }
    Ok(())
}

/// One stored task as its shard takes it back, or why it cannot be.
pub(crate) fn owned_restore(
    policy: &spindle_core::Policy,
    o: spindle_control::reconcile::OwnedTask,
) -> Result<Restore, Unrestorable> {
    let token = o.live.as_ref().map(|l| l.token);
    let unrestorable = |reason: String| Unrestorable {
        task: o.task.task,
        token,
        reason,
    };
    let mut restore = queued(&o.task).map_err(|e| unrestorable(format!("{e:#}")))?;
    let live = match o.live {
        None => None,
        Some(l) => {
            let Some(i) = policy.providers.iter().position(|p| p.name == l.provider) else {
                return Err(unrestorable(format!(
                    "task {}: its live attempt's provider {} left the policy",
                    o.task.task, l.provider
                )));
            };
            Some(LiveRestore {
                provider: spindle_core::ProviderId(i as u16),
                token: l.token,
                stored: l.state,
                request_key: l.request_key,
                running_ms: l.running_ms,
            })
        }
    };
    restore.live = live;
    restore.cancel = o.cancel_requested;
    Ok(restore)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spindle_control::testing::TestDb;
    use spindle_control::{ClaimRequest, ClaimResult, Demand, NewTask, PoolShard, ReportAction};
    use spindle_core::{Band, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

    const OLD: &str = "node-old";

    /// A previous owner that outlived its lease moves two of its attempts on between the new
    /// owner's read and its reports (one past the provider, which a requeue may not undo; one
    /// to its end): recovery reads them again and ends them as they are now (before, the
    /// start or takeover stopped on the first report not applied).
    #[tokio::test]
    async fn recovery_reads_again_the_attempts_their_previous_owner_changed_meanwhile() {
        let test = TestDb::new().await;
        let db = test.open().await;
        db.register_node(OLD, "127.0.0.1:0").await.unwrap();
        db.ensure_partitions(1).await.unwrap();
        let mine = [PartitionId(0)];
        db.acquire_partitions(OLD, &mine, 30_000).await.unwrap();
        let pool = crate::control::provider_pool("local");
        db.set_pool(&pool, 8, 1).await.unwrap();
        let tasks: Vec<NewTask> = (1..=3)
            .map(|i| NewTask {
                task: TaskId(i),
                tenant: TenantId(1),
                user: UserId(1),
                idempotency_key: format!("k{i}"),
                payload: b"{}".to_vec(),
                partition: PartitionId(0),
                lane: Lane::Standard,
                band: Band::P2,
                cost_estimate_milli: 1_000,
                fairness_milli: 500,
            })
            .collect();
        db.submit_batch(&tasks, PolicyVersion(1)).await.unwrap();
        let claims: Vec<ClaimRequest> = (1..=3)
            .map(|i| ClaimRequest {
                task: TaskId(i),
                expected_version: 0,
                provider: "local".into(),
                demands: vec![Demand {
                    shard: PoolShard::new(pool.as_str(), 0),
                    amount: 1,
                }],
            })
            .collect();
        let tokens: Vec<_> = db
            .claim_batch(OLD, 30_000, &claims)
            .await
            .unwrap()
            .into_iter()
            .map(|g| match g {
                ClaimResult::Granted { token, .. } => token,
                refused => panic!("claim refused: {refused:?}"),
            })
            .collect();

        let read = db.live_attempts_in(&mine, None, 100).await.unwrap();
        assert_eq!(read.len(), 3);
        let mut provider_done = Report::new(
            TaskId(1),
            Some(tokens[0]),
            ReportAction::Advance(TaskState::ProviderSucceeded),
        );
        provider_done.via = vec![TaskState::Running];
        let mut finished = Report::new(
            TaskId(2),
            Some(tokens[1]),
            ReportAction::Finish {
                state: TaskState::Succeeded,
                cost_actual_milli: None,
                reason: None,
                result: None,
            },
        );
        finished.via = vec![
            TaskState::Running,
            TaskState::ProviderSucceeded,
            TaskState::MediaProcessing,
        ];
        let moved = db.report_batch(&[provider_done, finished]).await.unwrap();
        assert!(
            moved
                .iter()
                .all(|r| matches!(r, spindle_control::ReportResult::Applied { .. })),
            "{moved:?}"
        );

        let local = Followed {
            providers: Vec::new(),
            media: false,
        };
        let changed = recover_page(&db, &read, &local).await.unwrap();
        let changed: Vec<u64> = changed.iter().map(|(t, _)| t.0).collect();
        assert_eq!(changed, [1, 2], "the two rows changed after the read");

        recover_attempts(&db, &mine, &local).await.unwrap();
        assert!(db
            .live_attempts_in(&mine, None, 100)
            .await
            .unwrap()
            .is_empty());
        let states: Vec<TaskState> = db
            .task_heads(&[TaskId(1), TaskId(2), TaskId(3)])
            .await
            .unwrap()
            .into_iter()
            .map(|h| h.expect("task row").state)
            .collect();
        assert_eq!(
            states,
            [
                TaskState::Succeeded,
                TaskState::Succeeded,
                TaskState::Queued
            ]
        );
        assert_eq!(db.pool_usage(&pool).await.unwrap()[0].used, 0);
    }
}
