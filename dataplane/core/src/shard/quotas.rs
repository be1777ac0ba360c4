//! Periodic quotas in the shard ([`crate::quota`]): checked and charged at admission with the
//! task's estimate, settled at what the provider billed, given back when the task ends without
//! a bill; charged again, without a check, for the tasks a restart or a takeover puts back and
//! for the ended ones PostgreSQL says were consumed in the current periods.
//!
//! A tenant without quotas costs nothing here: no counter, no write to the task's record.

use super::*;
use crate::ids::ModelId;
use crate::quota::{period_end_ms, period_index, usage_key, Exhausted, Usage, UsageKey};

/// Quota periods one shard counts at once (a counter per tenant, user or model and period).
/// Past it, a submit that would need a new counter is refused by name.
pub const QUOTA_USAGE_MAX: usize = 1 << 20;

/// What one quota of a tenant holds now ([`Shard::quota_report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaReport {
    pub quota: crate::quota::Quota,
    /// Consumed in the running period (for the user scope: the most any one user did).
    pub cost_milli: u64,
    pub tasks: u64,
    /// For the user scope: the users counted in the running period.
    pub users: u64,
    /// When the running period ends (unix ms).
    pub resets_at_ms: u64,
}

/// How one charge moves a counter.
#[derive(Clone, Copy)]
enum Move {
    /// Add cost and tasks (a new period starts the counter again; a past one is not counted).
    Add { cost_milli: u64, tasks: u64 },
    /// Take back (only within the period it was made in).
    Sub { cost_milli: u64, tasks: u64 },
    /// Settle: the cost moves by this much (only within the period).
    Adjust(i64),
}

impl Shard {
    /// The unix time (ms) of this shard's `Time::ZERO`: quotas count civil periods. The
    /// simulator leaves it at 0.
    pub fn set_wall_epoch_ms(&mut self, unix_ms: u64) {
        self.wall_epoch_ms = unix_ms;
    }

    pub(super) fn wall_ms(&self, now: Time) -> u64 {
        self.wall_epoch_ms.saturating_add(now.as_ms())
    }

    /// The distinct counters (and the period each counts now, at `at_ms`) of `tenant`'s quotas
    /// that a task of `user` and `model` counts in.
    fn quota_counters(
        &self,
        tenant: TenantId,
        user: UserId,
        model: ModelId,
        at_ms: u64,
    ) -> Vec<(UsageKey, u32)> {
        let Some(p) = self.policy.tenants.get(&tenant) else {
            return Vec::new();
        };
        // Compared in whole seconds: what a task records of its charge's time.
        if self
            .quota_floor_ms
            .get(&tenant)
            .is_some_and(|&floor| at_ms / 1_000 < floor / 1_000)
        {
            return Vec::new(); // before an operator's reset: not counted
        }
        let mut keys: Vec<(UsageKey, u32)> = Vec::new();
        for q in &p.quotas {
            let Some(key) = usage_key(tenant, q, user, model) else {
                continue;
            };
            if keys.iter().all(|(k, _)| *k != key) {
                keys.push((key, period_index(q.period, at_ms, p.utc_offset_min)));
            }
        }
        keys
    }

    /// Whether a task of `user` and `model` costing `cost_milli` fits every quota of the
    /// tenant in `slot` at `at_ms`; the first it does not, by name.
    pub(super) fn check_quotas(
        &mut self,
        slot: u32,
        user: UserId,
        model: ModelId,
        cost_milli: u64,
        at_ms: u64,
    ) -> Result<(), RejectReason> {
        let t = &self.tenants[slot as usize];
        if !t.has_quotas {
            return Ok(());
        }
        let tenant = t.id;
        let p = &self.policy.tenants[&tenant];
        let mut new_counters = 0;
        for q in &p.quotas {
            let Some(key) = usage_key(tenant, q, user, model) else {
                continue;
            };
            let index = period_index(q.period, at_ms, p.utc_offset_min);
            let used = match self.quota_usage.get(&key) {
                Some(u) => u.at(index),
                None => {
                    new_counters += 1;
                    Usage::default()
                }
            };
            let exhausted = |cost, used: u64, limit| Exhausted {
                scope: q.scope,
                period: q.period,
                cost,
                used,
                limit,
                resets_at_ms: period_end_ms(q.period, index, p.utc_offset_min),
            };
            if let Some(limit) = q.cost_milli {
                if used.cost_milli.saturating_add(cost_milli) > limit {
                    let e = exhausted(true, used.cost_milli, limit);
                    return Err(RejectReason::Quota(e));
                }
            }
            if let Some(limit) = q.tasks {
                if used.tasks + 1 > limit {
                    return Err(RejectReason::Quota(exhausted(false, used.tasks, limit)));
                }
            }
        }
        if self.quota_usage.len() + new_counters > QUOTA_USAGE_MAX {
            self.drop_past_quota_periods(at_ms);
            if self.quota_usage.len() + new_counters > QUOTA_USAGE_MAX {
                return Err(RejectReason::QuotaBooksFull(QUOTA_USAGE_MAX));
            }
        }
        Ok(())
    }

    /// Lets go of the counters of periods that have ended by `at_ms`.
    fn drop_past_quota_periods(&mut self, at_ms: u64) {
        let offsets: RunMap<TenantId, i32> = self
            .policy
            .tenants
            .iter()
            .map(|(&t, p)| (t, p.utc_offset_min))
            .collect();
        self.quota_usage.retain(|key, u| {
            let offset = offsets.get(&key.tenant).copied().unwrap_or(0);
            u.index >= period_index(key.period, at_ms, offset)
        });
    }

    fn move_quotas(&mut self, counters: &[(UsageKey, u32)], how: Move) {
        for &(key, index) in counters {
            match how {
                Move::Add { cost_milli, tasks } => {
                    let u = self.quota_usage.entry(key).or_default();
                    if index < u.index {
                        continue; // a period already over
                    }
                    *u = u.at(index);
                    u.cost_milli = u.cost_milli.saturating_add(cost_milli);
                    u.tasks = u.tasks.saturating_add(tasks);
                }
                Move::Sub { cost_milli, tasks } => {
                    if let Some(u) = self.quota_usage.get_mut(&key).filter(|u| u.index == index) {
                        u.cost_milli = u.cost_milli.saturating_sub(cost_milli);
                        u.tasks = u.tasks.saturating_sub(tasks);
                    }
                }
                Move::Adjust(delta) => {
                    if let Some(u) = self.quota_usage.get_mut(&key).filter(|u| u.index == index) {
                        u.cost_milli = u.cost_milli.saturating_add_signed(delta);
                    }
                }
            }
        }
    }

    /// The counters the task in `slot` counts in as of `at_ms`, and its estimated cost.
    fn task_counters(&self, slot: u32, at_ms: u64) -> (Vec<(UsageKey, u32)>, u64) {
        let e = self.tasks.at(slot);
        let tenant = self.tenants[e.tenant_slot as usize].id;
        let user = self.users[e.user_slot as usize].id;
        let model = self.estimates.model(e.estimate);
        let counters = self.quota_counters(tenant, user, model, at_ms);
        (counters, self.estimates.get(e.estimate).cost_milli)
    }

    /// When the task in `slot` was charged (unix ms), unless it was not or is settled.
    fn unsettled_charge_ms(&self, slot: u32) -> Option<u64> {
        let cold = self.tasks.cold(slot);
        (cold.quota_at_s != 0 && !cold.quota_settled).then(|| u64::from(cold.quota_at_s) * 1_000)
    }

    /// Charges the task in `entry` (just admitted or put back, submitted at `at_ms`) to its
    /// tenant's quotas, and notes on it when, for its settlement or refund.
    /// Whether it counts in any.
    pub(super) fn charge_task_quotas(&mut self, entry: u32, at_ms: u64) -> bool {
        if !self.tenants[self.tasks.at(entry).tenant_slot as usize].has_quotas {
            return false;
        }
        let (counters, cost_milli) = self.task_counters(entry, at_ms);
        if counters.is_empty() {
            return false;
        }
        self.move_quotas(
            &counters,
            Move::Add {
                cost_milli,
                tasks: 1,
            },
        );
        let cold = self.tasks.cold_mut(entry);
        cold.quota_at_s = (at_ms / 1_000).clamp(1, u64::from(u32::MAX)) as u32;
        cold.quota_settled = false;
        true
    }

    /// Counts `cost_milli` (and `tasks`) moved into tenants' quotas (`charged`) or out of them.
    pub(super) fn count_quota_move(&mut self, charged: bool, tasks: u64, cost_milli: u64) {
        let moves = if charged {
            &mut self.stats.quota_charged
        } else {
            &mut self.stats.quota_returned
        };
        moves.tasks += tasks;
        moves.cost_milli = moves.cost_milli.saturating_add(cost_milli);
    }

    /// Counts a task put back by a restart or a takeover (`handle_restore`,
    /// `handle_resume`) in its tenant's quotas as of its submission (`submitted_unix_ms`),
    /// without a check: it was admitted then. Nothing for a task this shard does not hold.
    pub fn charge_restored_quotas(&mut self, task: TaskId, submitted_unix_ms: u64) {
        if let Some(slot) = self.tasks.slot(task) {
            self.charge_task_quotas(slot, submitted_unix_ms);
        }
    }

    /// Counts what ended tasks consumed (read back from PostgreSQL at a start or takeover):
    /// `tasks` of `user` and `model` of `tenant`, submitted at `at_unix_ms`, that cost
    /// `cost_milli` together. Counted only in the periods still running.
    pub fn charge_ended_quotas(
        &mut self,
        tenant: TenantId,
        user: UserId,
        model: ModelId,
        at_unix_ms: u64,
        cost_milli: u64,
        tasks: u64,
    ) {
        let counters = self.quota_counters(tenant, user, model, at_unix_ms);
        self.move_quotas(&counters, Move::Add { cost_milli, tasks });
    }

    /// The provider billed `actual_cost_milli` for `task`: its charge moves from the estimate
    /// to that (within the period it was made in), and it is no longer given back when the
    /// task ends. Nothing for a task not charged, or settled already.
    pub fn settle_quota_cost(&mut self, task: TaskId, actual_cost_milli: u64) {
        let Some(slot) = self.tasks.slot(task) else {
            return;
        };
        let Some(at_ms) = self.unsettled_charge_ms(slot) else {
            return;
        };
        let (counters, estimate) = self.task_counters(slot, at_ms);
        let delta = actual_cost_milli as i64 - estimate as i64;
        self.move_quotas(&counters, Move::Adjust(delta));
        self.count_quota_move(delta > 0, 0, delta.unsigned_abs());
        self.tasks.cold_mut(slot).quota_settled = true;
    }

    /// The media stage found `task`'s video worth `extra_milli` more than it was charged (it is
    /// priced as probed): its quotas count that too, within the period the charge was made in,
    /// whether or not the provider billed it. Nothing for a task not charged.
    pub fn charge_quota_extra(&mut self, task: TaskId, extra_milli: u64) {
        let Some(slot) = self.tasks.slot(task) else {
            return;
        };
        let at_s = self.tasks.cold(slot).quota_at_s;
        if at_s == 0 || extra_milli == 0 {
            return;
        }
        let (counters, _) = self.task_counters(slot, u64::from(at_s) * 1_000);
        let extra = i64::try_from(extra_milli).unwrap_or(i64::MAX);
        self.move_quotas(&counters, Move::Adjust(extra));
        self.count_quota_move(true, 0, extra_milli);
    }

    /// A task in `slot` leaves the shard: one that did not succeed and was never billed gives
    /// its charge back.
    pub(super) fn refund_quotas(&mut self, slot: u32) {
        let e = self.tasks.at(slot);
        if !self.tenants[e.tenant_slot as usize].has_quotas || e.state.state == TaskState::Succeeded
        {
            return;
        }
        let Some(at_ms) = self.unsettled_charge_ms(slot) else {
            return;
        };
        let (counters, cost_milli) = self.task_counters(slot, at_ms);
        self.move_quotas(
            &counters,
            Move::Sub {
                cost_milli,
                tasks: 1,
            },
        );
        self.count_quota_move(false, 1, cost_milli);
    }

    /// What `tenant` consumed of each of its quotas in the period running at `now`, in the
    /// quotas' order. For the user scope, the most any one user consumed, and how many users
    /// are counted.
    pub fn quota_report(&self, tenant: TenantId, now: Time) -> Vec<QuotaReport> {
        use crate::quota::{QuotaScope, UsageOf};
        let Some(p) = self.policy.tenants.get(&tenant) else {
            return Vec::new();
        };
        let at_ms = self.wall_ms(now);
        p.quotas
            .iter()
            .map(|q| {
                let index = period_index(q.period, at_ms, p.utc_offset_min);
                let mut r = QuotaReport {
                    quota: *q,
                    cost_milli: 0,
                    tasks: 0,
                    users: 0,
                    resets_at_ms: period_end_ms(q.period, index, p.utc_offset_min),
                };
                let current = |key: &UsageKey| {
                    self.quota_usage
                        .get(key)
                        .copied()
                        .unwrap_or_default()
                        .at(index)
                };
                match q.scope {
                    QuotaScope::Tenant | QuotaScope::Model { .. } => {
                        let of = match q.scope {
                            QuotaScope::Model { model } => UsageOf::Model(model),
                            _ => UsageOf::Tenant,
                        };
                        let u = current(&UsageKey {
                            tenant,
                            of,
                            period: q.period,
                        });
                        (r.cost_milli, r.tasks) = (u.cost_milli, u.tasks);
                    }
                    QuotaScope::User => {
                        for (key, u) in self.quota_usage.iter() {
                            let mine = key.tenant == tenant
                                && key.period == q.period
                                && matches!(key.of, UsageOf::User(_));
                            if mine && u.index == index {
                                r.users += 1;
                                r.cost_milli = r.cost_milli.max(u.cost_milli);
                                r.tasks = r.tasks.max(u.tasks);
                            }
                        }
                    }
                }
                r
            })
            .collect()
    }

    /// An operator reset `tenant`'s quota counts as of `floor_unix_ms`: they start again from
    /// zero, and nothing submitted before it counts (set again from the stored floor when its
    /// partition comes back to a node).
    pub fn set_quota_floor(&mut self, tenant: TenantId, floor_unix_ms: u64) {
        self.clear_quota_usage(tenant);
        self.quota_floor_ms.insert(tenant, floor_unix_ms);
    }

    /// Forgets `tenant`'s quota counts (its partition comes back to this node: they are
    /// counted again from what PostgreSQL holds).
    pub fn clear_quota_usage(&mut self, tenant: TenantId) {
        self.quota_usage.retain(|key, _| key.tenant != tenant);
    }

    /// The wall clock as the quotas read it at `now` (unix ms).
    pub fn quota_clock_ms(&self, now: Time) -> u64 {
        self.wall_ms(now)
    }
}
