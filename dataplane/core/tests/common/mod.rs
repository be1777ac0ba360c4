//! What several of the core's test files do alike.

use spindle_core::shard::SubmitRequest;
use spindle_core::{Admission, ModelId, Shard, TaskId, TaskSpec, TenantId, Time, UserId};

/// A 720p clip of model 0 submitted as `task` by `user` of `tenant` at `now`.
pub fn submit(shard: &mut Shard, now: Time, task: u64, tenant: u32, user: u32) -> Admission {
    shard
        .handle_submit(
            now,
            SubmitRequest {
                task: TaskId(task),
                tenant: TenantId(tenant),
                user: UserId(user),
                spec: TaskSpec::clip_720p(ModelId(0)),
                band_hint: None,
                deadline: None,
            },
        )
        .unwrap()
}
