//! Live attempts the attempts reconciler found lapsed or stuck in PostgreSQL
//! ([`spindle_node_control::reconciler`]), as this shard takes them: one it holds is in hand (it renews its
//! lease and follows it already); one nobody holds is followed from here — asked about at the
//! provider by request key, never submitted again — or, where its work cannot be followed
//! (the local provider's died with the process that ran it), ended or put back in its queue.
//! What comes back into a queue comes back in the RECOVERY lane: small, but never blocked by
//! the tenants' own lanes.

use super::*;
use spindle_node_base::messages::Reconciled;
use spindle_node_control::control::Unrestorable;

impl ShardState {
    /// Takes the attempts of `found` that nobody holds (see the module's comment).
    pub fn reconcile(&mut self, found: spindle_node_control::control::ShardRestores) -> Reconciled {
        let mut done = Reconciled::default();
        // Tasks this shard still has reports of: ended here, their end not yet stored.
        let reporting: RunSet<TaskId> = self
            .outbox
            .iter()
            .map(|r| r.task)
            .chain(self.reporting.iter().copied())
            .collect();
        let now = self.now();
        let mut calls = Vec::new();
        let mut unrestorable = found.unrestorable;
        for mut r in found.tasks {
            let task = r.request.submit.task;
            let held = self.meta.contains_key(&task)
                || self.core.task_state(task).is_some()
                || reporting.contains(&task);
            let Some((token, stored, provider)) =
                r.live.as_ref().map(|l| (l.token, l.stored, l.provider))
            else {
                continue;
            };
            if held {
                done.in_hand += 1;
                continue;
            }
            let past_provider = matches!(
                stored,
                TaskState::ProviderSucceeded | TaskState::MediaProcessing
            );
            let followed = self.dispatch.is_some() && (self.media.is_some() || !past_provider);
            r.request.lane = spindle_core::Lane::Recovery;
            if followed {
                task_event!(
                    info,
                    self,
                    task,
                    "{task}: its attempt had nobody following it; asking its provider"
                );
                let cancel = r.cancel;
                match self.restore_one(now, r) {
                    Ok(call) => {
                        calls.extend(call);
                        done.resumed += 1;
                        if cancel {
                            self.cancel_put_back(task);
                        }
                    }
                    Err(e) => unrestorable.push(Unrestorable::refused(task, Some(token), e)),
                }
                continue;
            }
            if past_provider {
                // Its provider finished; the step after it died with the process that ran it.
                let mut end = finish(task, Some(token), TaskState::Succeeded, None);
                if stored == TaskState::ProviderSucceeded {
                    end.via = vec![TaskState::MediaProcessing];
                }
                task_event!(
                    info,
                    self,
                    task,
                    "{task}: its attempt had nobody following it; completing it"
                );
                send_reports(self, [end]);
                done.completed += 1;
                continue;
            }
            let reason = match self.dispatch {
                None => "reconciler: the local provider lost the attempt".to_string(),
                Some(_) => format!(
                    "reconciler: provider {} is no longer configured",
                    self.core.policy().providers[provider.0 as usize].name
                ),
            };
            let cancel = r.cancel;
            r.live = None;
            match self.restore_one(now, r) {
                Ok(_) => {
                    task_event!(
                        info,
                        self,
                        task,
                        "{task}: its attempt had nobody following it; requeued"
                    );
                    // Its claim waits for this report (it counts in the task's pending ones).
                    let requeue = ReportAction::Requeue {
                        delay_ms: 0,
                        reason: stored_reason(&reason),
                    };
                    send_reports(self, [Report::new(task, Some(token), requeue)]);
                    done.requeued += 1;
                    if cancel {
                        self.cancel_put_back(task);
                    }
                }
                Err(e) => unrestorable.push(Unrestorable::refused(task, Some(token), e)),
            }
        }
        done.failed = unrestorable.len() as u32;
        self.fail_unrestorable(unrestorable);
        self.send_calls(calls);
        done
    }
}
