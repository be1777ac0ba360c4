//! The reconcilers a node runs over the partitions it owns — so each runs once per cluster and
//! moves with a takeover — each on its own period (jittered ±30 %) with a bound on the rows or
//! jobs one pass looks at, on one connection of their own:
//!
//! - **attempts**: live attempts whose lease lapsed (nobody renews them) or that sat in
//!   DISPATCHING or SUBMIT_UNKNOWN past `stuck_after_ms` go to their shards
//!   (`spindle_node_shard::shard::ShardState::reconcile`): one a shard holds is in hand; one nobody holds is
//!   asked about at its provider by request key and followed (a job found is watched to its
//!   end; one the provider never got runs as a new attempt — never a second submit of the
//!   same one), or, where it cannot be followed (the local provider), requeued or completed.
//!   What goes back into a queue goes through the RECOVERY lane. Writes are fenced by the
//!   attempts' tokens, like every report.
//! - **orphans**: the provider's live jobs (`GET /v1/jobs?live=true`) whose request key names
//!   an attempt that is not its task's live attempt any more — its task ended, was requeued, or
//!   is gone — are canceled at the provider (they run, and bill, for nobody).
//! - **costs**: succeeded tasks' settled cost against what the provider reports for the job
//!   now; a difference past `cost_tolerance_permille` is drift, logged and counted.
//! - **starvation**: QUEUED tasks that may start and have waited past `starved_after_ms`,
//!   logged and counted (the queues' ages are in `spindle_queued_oldest_seconds`).
//!
//! Counter drift has its own check (`crate::counter_check`). Each pass counts in
//! `spindle_reconciler_{runs,failures,findings,repairs}_total{job}` and logs what it found.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_control::{Db, DbConfig, PartitionId};
use spindle_core::TaskId;
use spindle_providers::{AsyncJobProvider, HttpProvider, Lookup};
use tokio::sync::{mpsc, oneshot};

pub use spindle_node_base::config::{Job, ReconcileConfig};

use spindle_node_base::limits::PROVIDER_REQUESTS_MAX;
use spindle_node_base::messages::ShardMsg;
use spindle_node_base::metrics::Metrics;

/// What the reconcilers work with.
pub struct Reconcilers {
    pub db_config: DbConfig,
    pub config: spindle_node_base::config::Config,
    pub metrics: Arc<Metrics>,
    pub ownership: Arc<spindle_node_base::ownership::Ownership>,
    pub live: Arc<crate::live_policy::LivePolicy>,
    pub shards: Vec<mpsc::Sender<ShardMsg>>,
    /// The provider's API (none with the local provider or a vendor's API: no orphans or costs
    /// to look at).
    pub provider: Option<HttpProvider>,
}

/// What one pass found and repaired.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Pass {
    findings: u64,
    repairs: u64,
}

/// Cursors that carry from one pass to the next.
#[derive(Default)]
struct Cursors {
    /// Per provider account: the job the orphans pass goes on after.
    orphans: std::collections::HashMap<String, String>,
    /// The task the costs pass goes on after.
    costs: Option<TaskId>,
}

impl Reconcilers {
    /// The provider client the reconcilers ask, for `config`'s provider.
    pub fn provider_client(
        config: &spindle_node_base::config::Config,
    ) -> anyhow::Result<Option<HttpProvider>> {
        // The orphans and costs passes read spindle's API (its live-jobs listing and the cost it
        // reports per job); a vendor's API has neither in that form.
        let Some(p) = config
            .provider
            .as_ref()
            .filter(|p| p.vendor == spindle_providers::Vendor::Spindle)
        else {
            return Ok(None);
        };
        Ok(Some(
            HttpProvider::new(&p.url, Duration::from_millis(p.timeout_ms))
                .with_tls(&*p.tls()?)
                .with_requests_max(PROVIDER_REQUESTS_MAX),
        ))
    }

    /// Runs every job that has a period, each when it is due, until the node stops.
    pub async fn run(self) {
        let rc = &self.config.reconcile;
        let start = Instant::now();
        let mut due: Vec<(Job, Instant)> = Job::ALL
            .iter()
            .filter_map(|&j| rc.every(j).map(|e| (j, start + jittered(e, j as u64))))
            .collect();
        if due.is_empty() {
            return;
        }
        let mut db = crate::control::reconnect(&self.db_config, &self.metrics).await;
        let mut cursors = Cursors::default();
        for round in 1u64.. {
            let (i, at) = due
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(i, &(_, at))| (i, at))
                .expect("at least one job");
            tokio::time::sleep_until(at.into()).await;
            if self.metrics.stopping() {
                return;
            }
            let job = due[i].0;
            let every = rc.every(job).expect("a scheduled job has a period");
            due[i].1 = Instant::now() + jittered(every, round);
            if db.is_closed() {
                db = crate::control::reconnect(&self.db_config, &self.metrics).await;
            }
            let mine = self.ownership.owned();
            if mine.is_empty() {
                continue;
            }
            let counts = &self.metrics.reconcilers[job as usize];
            match self.pass(job, &db, &mine, &mut cursors).await {
                Ok(p) => {
                    counts.runs.fetch_add(1, Ordering::Relaxed);
                    counts.findings.fetch_add(p.findings, Ordering::Relaxed);
                    counts.repairs.fetch_add(p.repairs, Ordering::Relaxed);
                    counts.last_findings.store(p.findings, Ordering::Relaxed);
                    if p.findings > 0 {
                        tracing::info!(
                            job = job.name(),
                            findings = p.findings,
                            repairs = p.repairs,
                            "reconciler pass"
                        );
                    }
                }
                Err(e) => {
                    counts.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("the {} reconciler failed: {e:#}", job.name());
                }
            }
        }
    }

    async fn pass(
        &self,
        job: Job,
        db: &Db,
        mine: &[PartitionId],
        cursors: &mut Cursors,
    ) -> anyhow::Result<Pass> {
        match job {
            Job::Attempts => self.attempts(db, mine).await,
            Job::Orphans => self.orphans(db, mine, &mut cursors.orphans).await,
            Job::Costs => self.costs(db, mine, &mut cursors.costs).await,
            Job::Starvation => self.starvation(db, mine).await,
        }
    }

    /// Hands the lapsed and stuck attempts to their shards; a finding is one no shard held.
    async fn attempts(&self, db: &Db, mine: &[PartitionId]) -> anyhow::Result<Pass> {
        let rc = &self.config.reconcile;
        let stuck_after = rc.stuck_after_ms.min(u64::from(u32::MAX)) as u32;
        let found = db
            .lapsed_owned(mine, stuck_after, rc.attempts_rows_max)
            .await?;
        if found.is_empty() {
            return Ok(Pass::default());
        }
        let policy = self.live.current();
        let mut per_shard = crate::control::ShardRestores::per_shard(self.config.shards);
        for o in found {
            let to = &mut per_shard[self.config.shard_of(o.task.tenant.0)];
            match crate::control::owned_restore(&policy, o) {
                Ok(r) => to.tasks.push(r),
                Err(u) => to.unrestorable.push(u),
            }
        }
        let mut pass = Pass::default();
        for (shard, found) in self.shards.iter().zip(per_shard) {
            if found.is_empty() {
                continue;
            }
            let (reply, answer) = oneshot::channel();
            shard
                .send(ShardMsg::Reconcile { found, reply })
                .await
                .map_err(|_| anyhow::anyhow!("a shard stopped"))?;
            let done = answer
                .await
                .map_err(|_| anyhow::anyhow!("a shard stopped"))?;
            pass.findings += u64::from(done.repairs());
            pass.repairs += u64::from(done.repairs());
        }
        Ok(pass)
    }

    /// Cancels the provider's live jobs that no live attempt owns. A job's task is read from
    /// its request key (`spindle-{task}-{attempt}`; another key is not this cluster's); it is
    /// this node's to judge when its task's partition is one of `mine` — or, for a task with no
    /// row any more, when `mine` holds partition 0.
    async fn orphans(
        &self,
        db: &Db,
        mine: &[PartitionId],
        after: &mut std::collections::HashMap<String, String>,
    ) -> anyhow::Result<Pass> {
        let Some(provider) = &self.provider else {
            return Ok(Pass::default());
        };
        let accounts: Vec<String> = self
            .live
            .current()
            .providers
            .iter()
            .map(|p| p.name.clone())
            .collect();
        let mut budget = self.config.reconcile.orphans_jobs_max;
        let mut pass = Pass::default();
        let row_less_is_mine = mine.contains(&PartitionId(0));
        for account in accounts {
            if budget == 0 {
                break;
            }
            let page = provider
                .live_jobs(&account, after.get(&account).map(String::as_str), budget)
                .await?;
            budget = budget.saturating_sub(page.jobs.len());
            match &page.next {
                Some(next) => after.insert(account.clone(), next.clone()),
                None => after.remove(&account),
            };
            let ours: Vec<(&spindle_providers::JobView, (TaskId, u32))> = page
                .jobs
                .iter()
                .filter_map(|j| attempt_of(&j.request_key).map(|a| (j, a)))
                .collect();
            for chunk in ours.chunks(spindle_control::limits::BATCH_MAX) {
                let asked: Vec<(TaskId, u32)> = chunk.iter().map(|&(_, a)| a).collect();
                let owners = db.attempt_owners(&asked).await?;
                for (&(job, (task, attempt)), owner) in chunk.iter().zip(owners) {
                    let orphan = match owner {
                        Some((partition, live)) => mine.contains(&partition) && !live,
                        None => row_less_is_mine,
                    };
                    if !orphan {
                        continue;
                    }
                    pass.findings += 1;
                    tracing::warn!(
                        "provider job {} ({account}) belongs to attempt {attempt} of {task}, \
                         which is not live: canceling it",
                        job.job_id
                    );
                    match provider.cancel(&account, &job.job_id).await {
                        Ok(_) => pass.repairs += 1,
                        Err(e) => tracing::warn!("canceling orphan job {}: {e}", job.job_id),
                    }
                }
            }
        }
        Ok(pass)
    }

    /// Compares succeeded tasks' settled costs with the provider's, a page per pass, going on
    /// where the last pass stopped (from the first task again after the last).
    async fn costs(
        &self,
        db: &Db,
        mine: &[PartitionId],
        after: &mut Option<TaskId>,
    ) -> anyhow::Result<Pass> {
        let Some(provider) = &self.provider else {
            return Ok(Pass::default());
        };
        let rc = &self.config.reconcile;
        let page = db.settled_costs(mine, *after, rc.costs_rows_max).await?;
        *after = match page.len() < rc.costs_rows_max {
            true => None,
            false => page.last().map(|s| s.task),
        };
        let mut pass = Pass::default();
        for s in &page {
            let found = provider.find_by_key(&s.provider, &s.request_key).await?;
            let reported = match found {
                Lookup::Found(view) => view.cost_milli,
                // Forgotten by the provider (its retention): nothing to compare with.
                Lookup::NotFound => None,
            };
            let Some(reported) = reported else {
                continue;
            };
            if cost_drifts(s.cost_milli, reported, rc.cost_tolerance_permille) {
                pass.findings += 1;
                tracing::warn!(
                    "cost drift on {}: settled {} milli-units, provider {} reports {reported}",
                    s.task,
                    s.cost_milli,
                    s.provider
                );
            }
        }
        Ok(pass)
    }

    async fn starvation(&self, db: &Db, mine: &[PartitionId]) -> anyhow::Result<Pass> {
        let rc = &self.config.reconcile;
        let after = rc.starved_after_ms.min(u64::from(u32::MAX)) as u32;
        let starved = db
            .starved_tasks(mine, after, rc.starvation_rows_max)
            .await?;
        if let Some(oldest) = starved.first() {
            tracing::warn!(
                "{} tasks have waited past {} ms; the oldest, {} of tenant {}, for {} ms",
                starved.len(),
                rc.starved_after_ms,
                oldest.task,
                oldest.tenant.0,
                oldest.waited_ms
            );
        }
        Ok(Pass {
            findings: starved.len() as u64,
            repairs: 0,
        })
    }
}

/// The (task, attempt) a request key of this cluster names (`spindle-{task}-{attempt}`).
fn attempt_of(request_key: &str) -> Option<(TaskId, u32)> {
    let rest = request_key.strip_prefix("spindle-")?;
    let (task, attempt) = rest.split_once('-')?;
    Some((TaskId(task.parse().ok()?), attempt.parse().ok()?))
}

/// Whether `reported` is further than `permille` ‰ of it from `settled`.
fn cost_drifts(settled: u64, reported: u64, permille: u64) -> bool {
    let diff = settled.abs_diff(reported);
    u128::from(diff) * 1_000 > u128::from(reported) * u128::from(permille)
}

/// `every` × a jitter of 0.7–1.3.
fn jittered(every: Duration, seed: u64) -> Duration {
    every * spindle_node_base::jitter::jitter_milli(seed) as u32 / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_keys_name_their_attempt_or_are_not_ours() {
        assert_eq!(attempt_of("spindle-42-3"), Some((TaskId(42), 3)));
        assert_eq!(attempt_of("spindle-42"), None);
        assert_eq!(attempt_of("other-42-3"), None);
        assert_eq!(attempt_of("spindle-x-3"), None);
    }

    #[test]
    fn drift_is_past_the_tolerance_only() {
        assert!(!cost_drifts(1_000, 1_000, 0));
        assert!(!cost_drifts(1_010, 1_000, 10));
        assert!(cost_drifts(1_011, 1_000, 10));
        assert!(cost_drifts(0, 1_000, 10));
    }

    #[test]
    fn a_bad_period_or_bound_is_named() {
        let mut c = ReconcileConfig::default();
        c.check().unwrap();
        c.orphans_every_ms = 50;
        let e = c.check().unwrap_err().to_string();
        assert_eq!(
            e,
            "reconcile.orphans_every_ms must be 0 (off) or 100..=86400000"
        );
        c.orphans_every_ms = 0;
        c.costs_rows_max = 0;
        assert!(c.check().unwrap_err().to_string().contains("costs"));
    }
}
