//! What running work reports back, fenced by the attempt's token: claims granted or refused,
//! the provider's answers, retries, the media stage, cancels and finishes.

use super::*;

impl Shard {
    /// The slot of `task` if `token` is its current fencing token.
    fn fenced(&self, task: TaskId, token: FencingToken) -> Result<u32, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let current = self.tasks.cold(slot).fencing;
        if current != Some(token) {
            return Err(ShardError::StaleFencing {
                task,
                presented: token,
                current,
            });
        }
        Ok(slot)
    }

    fn transition(&mut self, task: TaskId, to: TaskState) -> Result<(), ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        self.tasks
            .at_mut(slot)
            .state
            .transition(to, Actor::System)
            .map(|_| ())
            .map_err(|error| ShardError::Transition { task, error })
    }

    /// Like `fenced`, and the task must be in its provider stage (a report about an attempt
    /// that has already moved on is refused, whatever its token). Returns its state.
    fn fenced_provider(
        &self,
        task: TaskId,
        token: FencingToken,
        to: TaskState,
    ) -> Result<TaskState, ShardError> {
        let e = self.tasks.at(self.fenced(task, token)?);
        if e.place != Place::Provider {
            let from = e.state.state;
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal { from, to },
            });
        }
        Ok(e.state.state)
    }

    /// The slot of a task whose claim is outstanding (dispatched, no token yet), refusing
    /// anything else as an illegal move to `to`.
    fn claim_pending(&self, task: TaskId, to: TaskState) -> Result<u32, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let e = self.tasks.at(slot);
        if e.place != Place::Provider || self.tasks.cold(slot).fencing.is_some() {
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: e.state.state,
                    to,
                },
            });
        }
        Ok(slot)
    }

    /// The control plane committed the claim and issued `token` for this attempt. Returns
    /// `Canceled` when a cancel won the race: the shell must then not submit anything.
    pub fn handle_claim_granted(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<ClaimOutcome, ShardError> {
        let slot = self.claim_pending(task, TaskState::Dispatching)?;
        self.tasks.cold_mut(slot).fencing = Some(token);
        if self.tasks.at(slot).state.state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(ClaimOutcome::Canceled);
        }
        Ok(ClaimOutcome::Submit)
    }

    /// The control plane refused the claim (the task moved, or a global pool key was full): undo
    /// the local reservation and put the task back at the front of its band.
    pub fn handle_claim_refused(&mut self, now: Time, task: TaskId) -> Result<(), ShardError> {
        self.handle_claim_refused_until(task, now)
    }

    /// [`Shard::handle_claim_refused`], the task eligible again only from `eligible_at` (a
    /// refusal that a later moment may lift, such as a lease about to be renewed).
    pub fn handle_claim_refused_until(
        &mut self,
        task: TaskId,
        eligible_at: Time,
    ) -> Result<(), ShardError> {
        let slot = self.claim_pending(task, TaskState::Queued)?;
        if self.tasks.at(slot).state.state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(());
        }
        self.release_provider_hold(task);
        self.transition(task, TaskState::Queued)?;
        self.tasks.at_mut(slot).attempt_no -= 1;
        self.requeue_at(task, eligible_at);
        Ok(())
    }

    /// The provider accepted the request (or a query found it after SUBMIT_UNKNOWN).
    pub fn handle_provider_accepted(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<(), ShardError> {
        if self.fenced_provider(task, token, TaskState::Running)? == TaskState::Canceled {
            return Ok(());
        }
        self.transition(task, TaskState::Running)
    }

    /// The submit timed out: the provider may have accepted. Keep every reservation.
    pub fn handle_submit_unknown(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<(), ShardError> {
        let state = self.fenced_provider(task, token, TaskState::SubmitUnknown)?;
        if state == TaskState::Canceled {
            return Ok(());
        }
        self.transition(task, TaskState::SubmitUnknown)
    }

    /// A query by request key says the provider never saw the attempt: release and requeue at
    /// once (no penalty, it was our loss).
    pub fn handle_provider_not_found(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
    ) -> Result<FailOutcome, ShardError> {
        if self.fenced_provider(task, token, TaskState::Queued)? == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(FailOutcome::Canceled);
        }
        self.transition(task, TaskState::Queued)?;
        self.release_provider_hold(task);
        self.give_back_drr_charge(task);
        self.requeue_at(task, now);
        Ok(FailOutcome::Requeued { eligible_at: now })
    }

    /// An attempt of `task` the provider never accepted (a rate limit, or a submit it never
    /// received) used nothing: what DRR charged its tenant for it comes back as fairness debt
    /// the tenant is owed (paid out of its next quanta, within the per-task cap like any
    /// correction), so a tenant whose attempts are refused is not charged twice for its tasks.
    fn give_back_drr_charge(&mut self, task: TaskId) {
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot);
        let (tenant_slot, lane) = (e.tenant_slot, e.lane);
        let charged = self.estimates.get(e.estimate).fairness.milli() as i64;
        let cap = self.policy.drr.debt_cap_per_task.milli() as i64;
        self.tenants[tenant_slot as usize].queue_mut(lane).debt -= charged.min(cap);
    }

    /// A provider attempt failed. `jitter_milli` (700..=1300) comes from the shell's RNG so the
    /// core stays deterministic.
    pub fn handle_provider_failed(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        failure: Failure,
        jitter_milli: u64,
    ) -> Result<FailOutcome, ShardError> {
        assert!((700..=1300).contains(&jitter_milli), "jitter is 0.7–1.3");
        let state = self.fenced_provider(task, token, TaskState::Queued)?;
        if state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(FailOutcome::Canceled);
        }
        if failure == Failure::RateLimited && state != TaskState::Dispatching {
            // Only an answer to our submit proves the request was not accepted.
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: state,
                    to: TaskState::Queued,
                },
            });
        }
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot).clone();
        let lane = self.policy.lane(e.lane);
        let (retries_max, rate_limit_retries_max) = (lane.retries_max, lane.rate_limit_retries_max);
        let cold = self.tasks.cold_mut(slot);
        let (retry_no, limit) = match failure {
            Failure::RateLimited => {
                cold.rate_limit_retries += 1;
                (cold.rate_limit_retries, rate_limit_retries_max)
            }
            Failure::Retryable => {
                cold.retries += 1;
                (cold.retries, retries_max)
            }
            Failure::NonRetryable => (u32::MAX, 0),
        };
        let provider = e.provider.expect("a failed attempt had a provider");
        if failure == Failure::RateLimited {
            self.give_back_drr_charge(task);
            // Not accepted, so not billed: refund cost tokens; slow the provider's bucket down.
            let cost = self.estimates.get(e.estimate).cost_milli;
            let rpm = self.node.provider_rpm[provider.0 as usize];
            self.ledger.penalize(rpm, now);
            self.tenants[e.tenant_slot as usize]
                .cost_per_minute
                .refund(cost);
            self.ledger
                .refund(self.node.cost_bucket[e.lane.index()], cost);
        }
        let exhausted = retry_no > limit || e.attempt_no >= ATTEMPTS_MAX;
        if exhausted {
            self.transition(task, TaskState::Failed)?;
            self.release_provider_hold(task);
            self.stats.failed += 1;
            self.finish(task);
            return Ok(FailOutcome::Failed);
        }
        self.transition(task, TaskState::Queued)?;
        self.release_provider_hold(task);
        let eligible_at = now.plus_ns(self.policy.retry.backoff_ns(retry_no, jitter_milli));
        self.requeue_at(task, eligible_at);
        self.stats.requeued += 1;
        Ok(FailOutcome::Requeued { eligible_at })
    }

    fn requeue_at(&mut self, task: TaskId, eligible_at: Time) {
        let slot = self.tasks.slot(task).expect("entry");
        self.tasks.cold_mut(slot).fencing = None;
        let e = self.tasks.at_mut(slot);
        e.provider = None;
        e.place = Place::Delayed;
        assert!(
            self.delayed.len() < DELAYED_MAX,
            "delay heap bounded by TASKS_MAX"
        );
        self.delayed.push(Reverse((eligible_at, task)));
    }

    /// The provider finished the work. `actual` is the measured fairness cost; the difference to
    /// the estimate becomes fairness debt (capped per task). The task waits for a media slot.
    pub fn handle_provider_succeeded(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        actual: Units,
    ) -> Result<CompleteOutcome, ShardError> {
        let state = self.fenced_provider(task, token, TaskState::ProviderSucceeded)?;
        if state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(CompleteOutcome::Canceled);
        }
        self.transition(task, TaskState::ProviderSucceeded)?;
        let slot = self.tasks.slot(task).expect("entry");
        let started = self.tasks.cold(slot).mark;
        if started > 0 {
            let lane = self.tasks.at(slot).lane;
            self.lanes[lane.index()]
                .service
                .record(now.since(Time(started)));
        }
        self.release_provider_hold(task);
        let e = self.tasks.at(slot);
        let (tenant_slot, lane) = (e.tenant_slot, e.lane);
        let est = *self.estimates.get(e.estimate);
        let spec = self.estimates.spec(e.estimate);
        self.calibrate(&spec, &est, actual);
        let estimated = est.fairness.milli() as i64;
        let cap = self.policy.drr.debt_cap_per_task.milli() as i64;
        let delta = (actual.milli() as i64 - estimated).clamp(-cap, cap);
        self.tenants[tenant_slot as usize].queue_mut(lane).debt += delta;
        self.tasks.at_mut(slot).place = Place::MediaQueue;
        self.media.push(lane, task);
        Ok(CompleteOutcome::AwaitingMedia)
    }

    /// Starts the next media job whose slots fit: the lanes in turn, each FIFO with a bounded
    /// fit-scan.
    pub fn poll_media(&mut self, now: Time) -> Option<MediaStart> {
        if self.media.len() == 0 {
            return None;
        }
        for lane in self.media.turns() {
            if let Some(task) = self.take_fitting_media(lane, now) {
                self.media.turn_after(lane);
                self.transition(task, TaskState::MediaProcessing)
                    .expect("PROVIDER_SUCCEEDED → MEDIA_PROCESSING");
                let slot = self.tasks.slot(task).expect("entry");
                let e = self.tasks.at_mut(slot);
                e.place = Place::Media;
                let (tenant_slot, estimate) = (e.tenant_slot, e.estimate);
                return Some(MediaStart {
                    task,
                    tenant: self.tenants[tenant_slot as usize].id,
                    estimate: *self.estimates.get(estimate),
                });
            }
        }
        None
    }

    /// The media stage ended: release its slots; the task is SUCCEEDED or FAILED.
    pub fn handle_media_done(
        &mut self,
        task: TaskId,
        token: FencingToken,
        ok: bool,
    ) -> Result<CompleteOutcome, ShardError> {
        let e = self.tasks.at(self.fenced(task, token)?);
        if e.place != Place::Media {
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: e.state.state,
                    to: TaskState::Succeeded,
                },
            });
        }
        let canceled = e.state.state == TaskState::Canceled;
        let demand = self.media_demand(e);
        if !canceled {
            let to = if ok {
                TaskState::Succeeded
            } else {
                TaskState::Failed
            };
            self.transition(task, to)?;
        }
        self.ledger.release(&demand);
        self.unstall_all();
        self.finish(task);
        Ok(match (canceled, ok) {
            (true, _) => CompleteOutcome::Canceled,
            (false, true) => {
                self.stats.succeeded += 1;
                CompleteOutcome::Succeeded
            }
            (false, false) => {
                self.stats.failed += 1;
                CompleteOutcome::Failed
            }
        })
    }

    /// Cancels a task: at once if it waits; otherwise it becomes CANCELED and keeps its
    /// reservations until its running step reports (a canceled task is never submitted again).
    pub fn handle_cancel(&mut self, task: TaskId) -> Result<CancelOutcome, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let e = self.tasks.at(slot).clone();
        self.transition(task, TaskState::Canceled)?;
        self.stats.canceled += 1;
        match e.place {
            Place::Band => {
                self.take_out_of_band(slot, &e);
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::Delayed => {
                // Its heap entry is skipped when it comes due.
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::MediaQueue => {
                assert!(self.media.remove(e.lane, task), "in the media queue");
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::Provider | Place::Media => Ok(CancelOutcome::CanceledPendingRelease),
        }
    }

    /// Drops a task that left the shard for good, settling its cost reservation.
    pub(super) fn finish(&mut self, task: TaskId) {
        if let Some(slot) = self.tasks.slot(task) {
            self.refund_quotas(slot);
        }
        let e = self.tasks.remove(&task).expect("entry");
        assert!(
            e.state.state.is_terminal(),
            "finishing a task in {}",
            e.state.state
        );
        let cost = self.estimates.get(e.estimate).cost_milli;
        self.tenants[e.tenant_slot as usize].release_cost(cost);
        self.estimates.release(e.estimate);
        self.users[e.user_slot as usize].tasks -= 1;
    }
}
