//! Writes the seed corpus of the `frame_decoder` fuzz target: one valid stream per request and
//! response type, and the malformed cases the protocol must refuse.
//!
//!   cargo run -p spindle-wire --example write_corpus -- schemas/fuzz/corpus/frame_decoder

use spindle_core::{Band, Decision, ModelId, TaskId, TaskSpec, TaskState, TenantId, UserId};
use spindle_wire::*;

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).expect("usage: write_corpus DIR");
    std::fs::create_dir_all(&dir)?;
    let submit = SubmitTask {
        idempotency_key: "order-17".into(),
        user: UserId(3),
        spec: TaskSpec::clip_720p(ModelId(1)),
        band_hint: Some(Band::P3),
        deadline_ms: None,
        input: None,
    };
    let requests = [
        (
            "hello",
            Request::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                tenant: TenantId(1),
                credential: "secret".into(),
                client_name: Some("fuzz".into()),
            }),
        ),
        ("submit", Request::Submit(submit.clone())),
        (
            "batch",
            Request::SubmitBatch(vec![
                submit.clone(),
                SubmitTask {
                    idempotency_key: "order-18".into(),
                    input: Some(
                        r#"{"prompt":"a kite","refs":["https://x/1.png"],"seed":7}"#.into(),
                    ),
                    ..submit
                },
            ]),
        ),
        ("cancel", Request::Cancel(TaskId(9))),
        ("get", Request::Get(TaskId(9))),
        ("subscribe", Request::Subscribe(TaskId(9))),
    ];
    let mut enc = Encoder::new();
    let mut pipelined = Vec::new();
    for (i, (name, body)) in requests.into_iter().enumerate() {
        let mut out = Vec::new();
        enc.request(
            &RequestFrame {
                request_id: i as u64 + 1,
                body,
            },
            &mut out,
        );
        pipelined.extend_from_slice(&out);
        std::fs::write(format!("{dir}/request-{name}"), &out)?;
    }
    std::fs::write(format!("{dir}/requests-pipelined"), &pipelined)?;
    let responses = [
        (
            "admission",
            Response::Admission(Admission {
                task: TaskId(9),
                decision: Decision::Accepted,
                reason: None,
                replay: false,
                queue_level: 0,
                expected_start_ms: 10,
                retry_after_ms: 0,
            }),
        ),
        (
            "status",
            Response::Status(TaskStatus {
                task: TaskId(9),
                state: TaskState::Running,
                version: 2,
                attempt_no: 1,
                progress_pct: 30,
                cost_estimate_milli: 1_000,
                cost_actual_milli: 0,
                failure_reason: None,
                result: Some(r#"{"outputs":["/media/task-9-7-720p.mp4"]}"#.into()),
                expected_start_ms: 0,
            }),
        ),
        (
            "error",
            Response::Error(WireError::new(ErrorCode::NotFound, "task 9 not found")),
        ),
    ];
    for (name, body) in responses {
        let mut out = Vec::new();
        enc.response(
            &ResponseFrame {
                request_id: 1,
                body,
            },
            &mut out,
        );
        std::fs::write(format!("{dir}/response-{name}"), &out)?;
    }
    std::fs::write(format!("{dir}/zero-length"), 0u32.to_le_bytes())?;
    std::fs::write(format!("{dir}/oversized-length"), u32::MAX.to_le_bytes())?;
    let mut truncated = Vec::new();
    enc.request(
        &RequestFrame {
            request_id: 1,
            body: Request::Get(TaskId(1)),
        },
        &mut truncated,
    );
    truncated.truncate(truncated.len() - 6);
    std::fs::write(format!("{dir}/truncated"), &truncated)?;
    Ok(())
}
