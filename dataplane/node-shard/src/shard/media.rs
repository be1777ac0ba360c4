//! The media stage of a shard's tasks: started when the core gives a media slot, run on the
//! media workers, settled when they answer; the declared spec checked against the video.

use super::*;

/// Starts every media step the core lets run now: on the media workers when the stage is
/// configured and the provider gave a video, else (the local provider, no media stage) at once.
pub(super) fn start_media(s: &mut ShardState, now: Time) {
    while let Some(m) = s.core.poll_media(now) {
        let media_task = m.task;
        let Some(meta) = s.meta.get(&media_task) else {
            continue;
        };
        let Some(t) = meta.token else { continue };
        let input = meta.attempt.as_ref().and_then(|a| a.output_url.clone());
        let declared = meta.spec;
        // The steps its row has not recorded yet, in order.
        let unrecorded: &[TaskState] = match meta.stored_stage {
            Some(TaskState::MediaProcessing) => &[],
            Some(_) => &[TaskState::MediaProcessing],
            None => &[TaskState::ProviderSucceeded, TaskState::MediaProcessing],
        };
        let steps = unrecorded
            .iter()
            .map(|&to| Report::new(media_task, Some(t), ReportAction::Advance(to)));
        send_reports(s, steps);
        let Some((pool, input_url)) = s.media.clone().zip(input.clone()) else {
            // No media stage: the provider's video, if it gave one, is the result.
            let result = input.map(|url| stored_result(serde_json::json!({ "output_url": url })));
            media_finished(s, media_task, t, Ok(result));
            continue;
        };
        let job = spindle_node_workers::media::MediaJob {
            shard: s.index,
            task: media_task,
            token: t,
            attempt_no: s.core.task_attempt_no(media_task).unwrap_or(0),
            input_url,
            reject_beyond: match pool.declaration {
                spindle_node_workers::media::DeclarationPolicy::Reject => declared,
                spindle_node_workers::media::DeclarationPolicy::Correct => None,
            },
        };
        match pool.submit(job) {
            Ok(()) => notify(s, media_task, TaskState::MediaProcessing),
            // Bounded: a full media queue fails the step, with the reason.
            Err(_) => {
                media_finished(s, media_task, t, Err("the media queue is full".into()));
            }
        }
    }
}

const _: () =
    assert!(spindle_control::limits::RESULT_BYTES_MAX <= spindle_wire::limits::RESULT_BYTES_MAX);

/// A task's result as stored: `result` as JSON, or — when that is longer than a result may be
/// (a provider's URL can be) — a note saying so, so that the finish is never refused for it.
fn stored_result(result: serde_json::Value) -> String {
    let text = result.to_string();
    let max = spindle_control::limits::RESULT_BYTES_MAX;
    if text.len() <= max {
        return text;
    }
    serde_json::json!({ "omitted": format!("a result of {} bytes (at most {max} are kept)", text.len()) })
        .to_string()
}

/// A media step ended — `Ok` with what the task produced, if anything, or `Err` with why it
/// failed: the core settles the task; the end (and the result, for a success) is reported.
/// The end reported, if any (none when the step's attempt is no longer the task's).
pub(super) fn media_finished(
    s: &mut ShardState,
    task: TaskId,
    token: FencingToken,
    result: Result<Option<String>, String>,
) -> Option<TaskState> {
    let outcome = match s.core.handle_media_done(task, token, result.is_ok()) {
        Ok(o) => o,
        Err(e) => {
            task_event!(warn, s, task, "media done {task}: {e}");
            return None;
        }
    };
    let meta = remove_meta(s, &task)?;
    let (state, cost, reason, produced) = match (outcome, result) {
        (CompleteOutcome::Succeeded, result) => {
            s.metrics
                .completed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let cost = meta.estimate.map(|e| e.cost_milli);
            (TaskState::Succeeded, cost, None, result.ok().flatten())
        }
        (CompleteOutcome::Canceled, _) => (TaskState::Canceled, None, None, None),
        (_, result) => (TaskState::Failed, None, result.err(), None),
    };
    // Its subscribers hear the end once it is stored (`reports::ended_durably`).
    let action = ReportAction::Finish {
        state,
        cost_actual_milli: cost,
        reason: reason.map(|r| format!("media: {r}")),
        result: produced,
    };
    send_reports(s, [Report::new(task, Some(token), action)]);
    Some(state)
}

/// A media worker's answer. The probed video is checked against what the task declared: a
/// longer or larger video than declared is charged as what it is (`correct`) or fails the task
/// (`reject`), so a client cannot pay for less than it gets.
pub(super) fn media_event(s: &mut ShardState, event: spindle_node_workers::media::MediaEvent) {
    use spindle_node_workers::media::{DeclarationPolicy, MediaOutcome};
    let result = match &event.outcome {
        MediaOutcome::Done { probed, .. } => check_declaration(s, event.task, probed),
        MediaOutcome::Failed { reason, .. } => Err(reason.clone()),
    };
    // What the task produced: its renditions.
    let produced = match &event.outcome {
        MediaOutcome::Done {
            outputs, uploaded, ..
        } => {
            let paths: Vec<String> = outputs.iter().map(|o| o.display().to_string()).collect();
            let mut result = serde_json::json!({ "outputs": paths });
            if let Some(uploaded) = uploaded {
                let urls: Vec<&str> = uploaded.iter().map(|u| u.url.as_str()).collect();
                // In the bucket (and, with `keep_local`, still in `output_dir` too).
                result["urls"] = urls.clone().into();
                if outputs.is_empty() {
                    result = serde_json::json!({ "urls": urls });
                }
            } else if let Some(base) = s.media.as_ref().and_then(|m| m.output_url.as_deref()) {
                // Outputs are files directly in `output_dir`, named by the node (ASCII).
                let urls: Vec<String> = outputs
                    .iter()
                    .filter_map(|o| o.file_name())
                    .map(|name| format!("{base}/{}", name.to_string_lossy()))
                    .collect();
                result["urls"] = urls.into();
            }
            Some(stored_result(result))
        }
        MediaOutcome::Failed { .. } => None,
    };
    let result = match (result, s.media.as_ref().map(|m| m.declaration)) {
        (Err(why), _) => Err(why),
        (Ok(None), _) => Ok(produced),
        (Ok(Some((why, _))), Some(DeclarationPolicy::Reject)) => Err(why),
        (Ok(Some((why, corrected))), _) => {
            task_event!(
                info,
                s,
                event.task,
                "{}: {why}; charged as probed",
                event.task
            );
            if let Some(e) = s
                .meta
                .get_mut(&event.task)
                .and_then(|m| m.estimate.as_mut())
            {
                let extra = corrected.saturating_sub(e.cost_milli);
                e.cost_milli += extra;
                // Its quotas count what it is charged, as its bill does.
                s.core.charge_quota_extra(event.task, extra);
            }
            Ok(produced)
        }
    };
    let failed = result.is_err();
    let ended = media_finished(s, event.task, event.token, result);
    if let MediaOutcome::Done {
        outputs, uploaded, ..
    } = event.outcome
    {
        if failed || ended != Some(TaskState::Succeeded) {
            // What a rejected, canceled or stale attempt made is nobody's: its files go, and
            // so do its objects in the bucket.
            for o in &outputs {
                let _ = std::fs::remove_file(o);
            }
            let keys: Vec<String> = uploaded.into_iter().flatten().map(|u| u.key).collect();
            if let (false, Some(pool)) = (keys.is_empty(), &s.media) {
                pool.discard(event.task, keys);
            }
        }
    }
}

/// `Some((why, corrected cost))` when the video is longer (by more than a tenth) or has more
/// pixels than the task declared ([`spindle_node_workers::media::over_declared`]).
pub(super) fn check_declaration(
    s: &ShardState,
    task: TaskId,
    probed: &spindle_transcode::MediaInfo,
) -> Result<Option<(String, u64)>, String> {
    let Some(declared) = s.meta.get(&task).and_then(|m| m.spec) else {
        return Ok(None);
    };
    let Some(why) = spindle_node_workers::media::over_declared(&declared, probed) else {
        return Ok(None);
    };
    let truth = spindle_core::TaskSpec {
        width: probed.width,
        height: probed.height,
        duration_ms: u32::try_from(probed.duration_ms).unwrap_or(u32::MAX),
        ..declared
    };
    // As a new task of the model is priced now (its calibration included).
    let corrected = s
        .core
        .price(&truth)
        .map_err(|e| format!("the probed video cannot be priced: {e}"))?;
    Ok(Some((why, corrected.cost_milli)))
}
