//! A shard's subscriptions: who is sent each live task's events, bounded per task, per tenant
//! and in all, and dropped when their connection closes (a closed connection's subscriptions
//! would otherwise hold its frame queue — and with it its writer and its socket — until each
//! task changed state).

use std::collections::HashMap;

use spindle_core::hash::RunMap;
use spindle_core::{TaskId, TenantId};
pub use spindle_node_base::limits::{
    SUBSCRIPTIONS_MAX, SUBSCRIPTIONS_PER_TASK_MAX, SUBSCRIPTIONS_PER_TENANT_MAX,
};
use tokio::sync::mpsc;

pub(super) struct Subscriber {
    pub request_id: u64,
    pub out: mpsc::Sender<Vec<u8>>,
    pub tenant: TenantId,
}

#[derive(Default)]
pub(super) struct Subscriptions {
    by_task: RunMap<TaskId, Vec<Subscriber>>,
    total: usize,
    per_tenant: HashMap<TenantId, usize>,
}

impl Subscriptions {
    /// Adds `sub` to `task`'s subscribers, or says which bound it would pass.
    pub fn add(&mut self, task: TaskId, sub: Subscriber) -> Result<(), String> {
        let per_task = self.by_task.get(&task).map_or(0, Vec::len);
        let per_tenant = self.per_tenant.get(&sub.tenant).copied().unwrap_or(0);
        if self.total >= SUBSCRIPTIONS_MAX
            || per_task >= SUBSCRIPTIONS_PER_TASK_MAX
            || per_tenant >= SUBSCRIPTIONS_PER_TENANT_MAX
        {
            return Err(format!(
                "at most {SUBSCRIPTIONS_PER_TASK_MAX} per task, {SUBSCRIPTIONS_PER_TENANT_MAX} per \
                 tenant and {SUBSCRIPTIONS_MAX} per shard"
            ));
        }
        *self.per_tenant.entry(sub.tenant).or_default() += 1;
        self.total += 1;
        self.by_task.entry(task).or_default().push(sub);
        Ok(())
    }

    pub fn has(&self, task: TaskId) -> bool {
        self.by_task.contains_key(&task)
    }

    /// Keeps `task`'s subscribers that `keep` keeps (it may send to them); all of them go
    /// when `end` (the task ended). How many went.
    pub fn retain(
        &mut self,
        task: TaskId,
        end: bool,
        mut keep: impl FnMut(&Subscriber) -> bool,
    ) -> usize {
        let Some(subs) = self.by_task.get_mut(&task) else {
            return 0;
        };
        let mut gone: Vec<TenantId> = Vec::new();
        subs.retain(|sub| {
            let kept = keep(sub) && !end;
            if !kept {
                gone.push(sub.tenant);
            }
            kept
        });
        if subs.is_empty() {
            self.by_task.remove(&task);
        }
        for tenant in &gone {
            self.forget_one(*tenant);
        }
        gone.len()
    }

    /// Drops the subscriptions of the connection whose frame queue is `out`: of `tasks`, or —
    /// `None`, the connection having subscribed to more than it kept count of — of every task.
    pub fn drop_connection(&mut self, tasks: Option<&[TaskId]>, out: &mpsc::Sender<Vec<u8>>) {
        let all: Vec<TaskId>;
        let tasks = match tasks {
            Some(t) => t,
            None => {
                all = self.by_task.keys().copied().collect();
                &all
            }
        };
        for &task in tasks {
            self.retain(task, false, |sub| !sub.out.same_channel(out));
        }
    }

    fn forget_one(&mut self, tenant: TenantId) {
        self.total -= 1;
        if let Some(n) = self.per_tenant.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
    }

    /// Subscriptions held now, in all and of `tenant`.
    pub fn total(&self) -> usize {
        self.total
    }

    #[cfg(test)]
    pub fn of(&self, tenant: TenantId) -> usize {
        self.per_tenant.get(&tenant).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(tenant: u32, out: &mpsc::Sender<Vec<u8>>) -> Subscriber {
        Subscriber {
            request_id: 1,
            out: out.clone(),
            tenant: TenantId(tenant),
        }
    }

    #[test]
    fn a_closed_connections_subscriptions_go_and_the_counts_follow() {
        let mut s = Subscriptions::default();
        let (a, _ra) = mpsc::channel(1);
        let (b, _rb) = mpsc::channel(1);
        for t in 1..=3 {
            s.add(TaskId(t), sub(1, &a)).unwrap();
            s.add(TaskId(t), sub(1, &b)).unwrap();
        }
        assert_eq!((s.total(), s.of(TenantId(1))), (6, 6));
        s.drop_connection(Some(&[TaskId(1), TaskId(2)]), &a);
        assert_eq!(s.total(), 4);
        s.drop_connection(None, &a);
        assert_eq!(s.total(), 3);
        assert!(s.has(TaskId(3)));
        // A task's end takes all of its subscribers.
        assert_eq!(s.retain(TaskId(3), true, |_| true), 1);
        assert!(!s.has(TaskId(3)));
        assert_eq!((s.total(), s.of(TenantId(1))), (2, 2));
    }

    #[test]
    fn a_tenant_and_a_task_hold_a_bounded_number() {
        let mut s = Subscriptions::default();
        let (a, _ra) = mpsc::channel(1);
        for i in 0..SUBSCRIPTIONS_PER_TASK_MAX {
            s.add(TaskId(1), sub(i as u32 % 2, &a)).unwrap();
        }
        assert!(s.add(TaskId(1), sub(3, &a)).is_err());
        for t in 0..SUBSCRIPTIONS_PER_TENANT_MAX as u64 {
            s.add(TaskId(100 + t), sub(7, &a)).unwrap();
        }
        let e = s.add(TaskId(99), sub(7, &a)).unwrap_err();
        assert!(e.contains("per tenant"), "{e}");
        // Another tenant is not held by this one's bound.
        s.add(TaskId(99), sub(8, &a)).unwrap();
    }
}
