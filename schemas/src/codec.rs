//! Encoding and decoding of frame payloads. Decoding checks the file identifier, runs the
//! FlatBuffers verifier with tight limits, then validates every field (required, ranges,
//! lengths) while converting to owned values. Nothing reads an unverified buffer.

use flatbuffers::{FlatBufferBuilder, VerifierOptions, WIPOffset};
use spindle_core::{Band, Decision, ModelId, TaskId, TaskSpec, TaskState, TenantId, UserId};

use crate::error::{ErrorCode, WireError};
use crate::fb;
use crate::frame::write_frame;
use crate::limits::*;
use crate::message::*;

const IDENTIFIER: &[u8; 4] = b"SPDL";

fn verifier_options() -> VerifierOptions {
    VerifierOptions {
        max_depth: VERIFY_DEPTH_MAX,
        max_tables: VERIFY_TABLES_MAX,
        max_apparent_size: FRAME_BYTES_MAX,
        ignore_missing_null_terminator: false,
    }
}

/// The identifier sits at bytes 4..8 of a FlatBuffer. Checked by hand: the library's helper
/// asserts on short input.
fn check_identifier(payload: &[u8]) -> Result<(), WireError> {
    match payload.get(4..8) {
        Some(id) if id == IDENTIFIER => Ok(()),
        Some(id) => Err(WireError::new(
            ErrorCode::BadIdentifier,
            format!(
                "file identifier is {:?}, expected \"SPDL\"",
                String::from_utf8_lossy(id)
            ),
        )),
        None => Err(WireError::new(
            ErrorCode::Malformed,
            format!("{} bytes is too short for a FlatBuffer", payload.len()),
        )),
    }
}

/// The request a refusal of `payload` answers: its frame's `request_id` when the frame itself
/// could be read (what it asks for was refused: a field out of range, an input that is not
/// JSON), so that a pipelining client matches the error to its request; 0 when it could not.
pub fn request_id_of(payload: &[u8]) -> u64 {
    if check_identifier(payload).is_err() {
        return 0;
    }
    flatbuffers::root_with_opts::<fb::RequestFrame>(&verifier_options(), payload)
        .map_or(0, |f| f.request_id())
}

/// The request a node's answer in `payload` is for, when the frame verifies — whether or not
/// its body can be read: a newer node may answer with a value this build does not know (a
/// decision, a state, an error code, a response type), and a client fails that one request
/// instead of its connection. `None` when the frame itself does not verify.
pub fn response_id_of(payload: &[u8]) -> Option<u64> {
    check_identifier(payload).ok()?;
    flatbuffers::root_with_opts::<fb::ResponseFrame>(&verifier_options(), payload)
        .ok()
        .map(|f| f.request_id())
}

/// Verifies and validates a client's frame.
pub fn decode_request(payload: &[u8]) -> Result<RequestFrame, WireError> {
    check_identifier(payload)?;
    let frame = flatbuffers::root_with_opts::<fb::RequestFrame>(&verifier_options(), payload)
        .map_err(|e| WireError::from_verifier(&e))?;
    let body = match frame.body_type() {
        fb::Request::Hello => Request::Hello(hello(frame.body_as_hello())?),
        fb::Request::SubmitTask => Request::Submit(submit(frame.body_as_submit_task(), "body")?),
        fb::Request::SubmitBatch => Request::SubmitBatch(batch(frame.body_as_submit_batch())?),
        fb::Request::CancelTask => {
            Request::Cancel(task_id(frame.body_as_cancel_task().map(|b| b.task_id()))?)
        }
        fb::Request::GetTask => {
            Request::Get(task_id(frame.body_as_get_task().map(|b| b.task_id()))?)
        }
        fb::Request::Subscribe => {
            Request::Subscribe(task_id(frame.body_as_subscribe().map(|b| b.task_id()))?)
        }
        fb::Request::Unsubscribe => {
            Request::Unsubscribe(task_id(frame.body_as_unsubscribe().map(|b| b.task_id()))?)
        }
        other => {
            return Err(WireError::new(
                ErrorCode::UnknownRequest,
                format!("request type {} is not one this node knows", other.0),
            ))
        }
    };
    Ok(RequestFrame {
        request_id: frame.request_id(),
        body,
    })
}

fn text(value: Option<&str>, field: &str, max: usize) -> Result<String, WireError> {
    let value = value.ok_or_else(|| WireError::missing(field))?;
    if value.is_empty() {
        return Err(WireError::new(
            ErrorCode::MissingField,
            format!("`{field}` is empty"),
        ));
    }
    if value.len() > max {
        return Err(WireError::too_long(field, value.len(), max));
    }
    Ok(value.to_string())
}

fn optional_text(
    value: Option<&str>,
    field: &str,
    max: usize,
) -> Result<Option<String>, WireError> {
    value.map(|v| text(Some(v), field, max)).transpose()
}

fn hello(h: Option<fb::Hello<'_>>) -> Result<Hello, WireError> {
    let h = h.ok_or_else(|| WireError::missing("body"))?;
    if h.protocol_version() != PROTOCOL_VERSION {
        return Err(WireError::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "protocol version {} is not supported; this node speaks {PROTOCOL_VERSION}",
                h.protocol_version()
            ),
        ));
    }
    if h.tenant_id() == 0 {
        return Err(WireError::range("tenant_id", 0, "1..=4294967295"));
    }
    Ok(Hello {
        protocol_version: h.protocol_version(),
        tenant: TenantId(h.tenant_id()),
        credential: text(Some(h.credential()), "credential", CREDENTIAL_BYTES_MAX)?,
        client_name: optional_text(h.client_name(), "client_name", NAME_BYTES_MAX)?,
    })
}

fn within(field: &str, value: u32, lo: u32, hi: u32) -> Result<u32, WireError> {
    if value < lo || value > hi {
        return Err(WireError::range(field, value, &format!("{lo}..={hi}")));
    }
    Ok(value)
}

fn submit(s: Option<fb::SubmitTask<'_>>, at: &str) -> Result<SubmitTask, WireError> {
    let s = s.ok_or_else(|| WireError::missing(at))?;
    let spec = s.spec();
    let spec = TaskSpec {
        model: ModelId(spec.model()),
        width: within("spec.width", u32::from(spec.width()), 1, DIMENSION_MAX)?,
        height: within("spec.height", u32::from(spec.height()), 1, DIMENSION_MAX)?,
        duration_ms: within("spec.duration_ms", spec.duration_ms(), 1, DURATION_MS_MAX)?,
        fps: within("spec.fps", u32::from(spec.fps()), 1, FPS_MAX)?,
        audio: spec.audio(),
        references: within(
            "spec.references",
            u32::from(spec.references()),
            0,
            u32::from(REFERENCES_MAX),
        )? as u8,
    };
    let band_hint = match s.band_hint() {
        0 => None,
        b @ 1..=4 => Some(Band::from_index(usize::from(b))),
        b => return Err(WireError::range("band_hint", b, "0..=4")),
    };
    let deadline_ms = match s.deadline_ms() {
        0 => None,
        d => Some(within("deadline_ms", d, 1, DEADLINE_MS_MAX)?),
    };
    Ok(SubmitTask {
        idempotency_key: text(Some(s.idempotency_key()), "idempotency_key", KEY_BYTES_MAX)?,
        user: UserId(s.user_id()),
        spec,
        band_hint,
        deadline_ms,
        input: input(s.input())?,
    })
}

/// A task's input: absent, or one JSON value within `INPUT_BYTES_MAX` (checked for its shape
/// only: what it says is the provider's business).
fn input(value: Option<&str>) -> Result<Option<String>, WireError> {
    let Some(value) = value else {
        return Ok(None);
    };
    if value.len() > INPUT_BYTES_MAX {
        return Err(WireError::too_long("input", value.len(), INPUT_BYTES_MAX));
    }
    // Before the parse, which would otherwise walk any depth (and the node's later parse for
    // the provider would stop at serde_json's own limit).
    let depth = json_depth(value);
    if depth > INPUT_DEPTH_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidInput,
            format!("`input` nests {depth} levels deep, more than {INPUT_DEPTH_MAX}"),
        ));
    }
    serde_json::from_str::<serde::de::IgnoredAny>(value).map_err(|e| {
        WireError::new(
            ErrorCode::InvalidInput,
            format!("`input` is not one JSON value: {e}"),
        )
    })?;
    Ok(Some(value.to_string()))
}

/// The deepest nesting of arrays and objects in `json` (brackets inside strings not counted), in
/// one pass over its bytes; for well-formed JSON, its depth.
pub fn json_depth(json: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for b in json.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

fn batch(b: Option<fb::SubmitBatch<'_>>) -> Result<Vec<SubmitTask>, WireError> {
    let tasks = b.ok_or_else(|| WireError::missing("body"))?.tasks();
    if tasks.is_empty() {
        return Err(WireError::new(ErrorCode::MissingField, "`tasks` is empty"));
    }
    if tasks.len() > BATCH_MAX {
        return Err(WireError::new(
            ErrorCode::BatchTooLarge,
            format!(
                "batch of {} tasks exceeds the maximum of {BATCH_MAX}",
                tasks.len()
            ),
        ));
    }
    tasks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            submit(Some(t), "tasks")
                .map_err(|e| WireError::new(e.code, format!("tasks[{i}]: {}", e.message)))
        })
        .collect()
}

fn task_id(id: Option<u64>) -> Result<TaskId, WireError> {
    match id {
        None => Err(WireError::missing("body")),
        Some(0) => Err(WireError::range("task_id", 0, "1..")),
        Some(id) => Ok(TaskId(id)),
    }
}

/// Verifies and validates a node's frame (the client side).
pub fn decode_response(payload: &[u8]) -> Result<ResponseFrame, WireError> {
    check_identifier(payload)?;
    let frame = flatbuffers::root_with_opts::<fb::ResponseFrame>(&verifier_options(), payload)
        .map_err(|e| WireError::from_verifier(&e))?;
    let missing = || WireError::missing("body");
    let body = match frame.body_type() {
        fb::Response::HelloOk => {
            let h = frame.body_as_hello_ok().ok_or_else(missing)?;
            Response::HelloOk(HelloOk {
                protocol_version: h.protocol_version(),
                node_id: h.node_id().unwrap_or("").to_string(),
                frame_bytes_max: h.frame_bytes_max(),
                batch_max: h.batch_max(),
            })
        }
        fb::Response::Admission => {
            Response::Admission(admission(frame.body_as_admission().ok_or_else(missing)?)?)
        }
        fb::Response::SubmitBatchResult => {
            let r = frame.body_as_submit_batch_result().ok_or_else(missing)?;
            if r.admissions().len() > BATCH_MAX {
                return Err(WireError::new(
                    ErrorCode::BatchTooLarge,
                    "more admissions than a batch holds",
                ));
            }
            Response::SubmitBatch(
                r.admissions()
                    .iter()
                    .map(admission)
                    .collect::<Result<_, _>>()?,
            )
        }
        fb::Response::TaskStatus => {
            let s = frame.body_as_task_status().ok_or_else(missing)?;
            Response::Status(TaskStatus {
                task: TaskId(s.task_id()),
                state: state(s.state())?,
                version: s.version(),
                attempt_no: s.attempt_no(),
                progress_pct: s.progress_pct(),
                cost_estimate_milli: s.cost_estimate_milli(),
                cost_actual_milli: s.cost_actual_milli(),
                failure_reason: optional_text(
                    s.failure_reason(),
                    "failure_reason",
                    MESSAGE_BYTES_MAX,
                )?,
                result: optional_text(s.result(), "result", RESULT_BYTES_MAX)?,
                expected_start_ms: s.expected_start_ms(),
            })
        }
        fb::Response::Canceled => {
            let c = frame.body_as_canceled().ok_or_else(missing)?;
            Response::Canceled {
                task: TaskId(c.task_id()),
                state: state(c.state())?,
            }
        }
        fb::Response::Unsubscribed => Response::Unsubscribed(TaskId(
            frame.body_as_unsubscribed().ok_or_else(missing)?.task_id(),
        )),
        fb::Response::Subscribed => Response::Subscribed(TaskId(
            frame.body_as_subscribed().ok_or_else(missing)?.task_id(),
        )),
        fb::Response::Event => {
            let e = frame.body_as_event().ok_or_else(missing)?;
            Response::Event(Event {
                task: TaskId(e.task_id()),
                state: state(e.state())?,
                progress_pct: e.progress_pct(),
                at_ms: e.at_ms(),
                result: optional_text(e.result(), "result", RESULT_BYTES_MAX)?,
            })
        }
        fb::Response::Error => {
            let e = frame.body_as_error().ok_or_else(missing)?;
            let code = ErrorCode::from_wire(e.code())
                .ok_or_else(|| WireError::range("code", e.code().0, "a known error code"))?;
            let mut error = WireError::new(code, e.message());
            error.redirect = optional_text(e.redirect(), "redirect", ADDRESS_BYTES_MAX)?;
            Response::Error(error)
        }
        other => {
            return Err(WireError::new(
                ErrorCode::UnknownRequest,
                format!("response type {} is not one this client knows", other.0),
            ))
        }
    };
    Ok(ResponseFrame {
        request_id: frame.request_id(),
        body,
    })
}

fn admission(a: fb::Admission<'_>) -> Result<Admission, WireError> {
    let decision = Decision::ALL
        .get(usize::from(a.decision().0))
        .copied()
        .ok_or_else(|| WireError::range("decision", a.decision().0, "a known decision"))?;
    Ok(Admission {
        task: TaskId(a.task_id()),
        decision,
        reason: optional_text(a.reason(), "reason", MESSAGE_BYTES_MAX)?,
        replay: a.replay(),
        queue_level: a.queue_level(),
        expected_start_ms: a.expected_start_ms(),
        retry_after_ms: a.retry_after_ms(),
    })
}

fn state(s: fb::TaskState) -> Result<TaskState, WireError> {
    TaskState::ALL
        .get(usize::from(s.0))
        .copied()
        .ok_or_else(|| WireError::range("state", s.0, "a known task state"))
}

/// Encodes frames, reusing one builder.
pub struct Encoder {
    fbb: FlatBufferBuilder<'static>,
}

impl Default for Encoder {
    fn default() -> Self {
        Encoder {
            fbb: FlatBufferBuilder::with_capacity(1024),
        }
    }
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder::default()
    }

    /// Appends `frame` to `out` as one length-prefixed frame.
    pub fn request(&mut self, frame: &RequestFrame, out: &mut Vec<u8>) {
        self.fbb.reset();
        let fbb = &mut self.fbb;
        let (body_type, body) = match &frame.body {
            Request::Hello(h) => {
                let credential = fbb.create_string(&h.credential);
                let client_name = h.client_name.as_deref().map(|n| fbb.create_string(n));
                let args = fb::HelloArgs {
                    protocol_version: h.protocol_version,
                    tenant_id: h.tenant.0,
                    credential: Some(credential),
                    client_name,
                };
                (
                    fb::Request::Hello,
                    fb::Hello::create(fbb, &args).as_union_value(),
                )
            }
            Request::Submit(s) => (
                fb::Request::SubmitTask,
                encode_submit(fbb, s).as_union_value(),
            ),
            Request::SubmitBatch(tasks) => {
                let offsets: Vec<_> = tasks.iter().map(|t| encode_submit(fbb, t)).collect();
                let tasks = fbb.create_vector(&offsets);
                let args = fb::SubmitBatchArgs { tasks: Some(tasks) };
                (
                    fb::Request::SubmitBatch,
                    fb::SubmitBatch::create(fbb, &args).as_union_value(),
                )
            }
            Request::Cancel(t) => (
                fb::Request::CancelTask,
                fb::CancelTask::create(fbb, &fb::CancelTaskArgs { task_id: t.0 }).as_union_value(),
            ),
            Request::Get(t) => (
                fb::Request::GetTask,
                fb::GetTask::create(fbb, &fb::GetTaskArgs { task_id: t.0 }).as_union_value(),
            ),
            Request::Subscribe(t) => (
                fb::Request::Subscribe,
                fb::Subscribe::create(fbb, &fb::SubscribeArgs { task_id: t.0 }).as_union_value(),
            ),
            Request::Unsubscribe(t) => (
                fb::Request::Unsubscribe,
                fb::Unsubscribe::create(fbb, &fb::UnsubscribeArgs { task_id: t.0 })
                    .as_union_value(),
            ),
        };
        let root = fb::RequestFrame::create(
            fbb,
            &fb::RequestFrameArgs {
                request_id: frame.request_id,
                body_type,
                body: Some(body),
            },
        );
        fb::finish_request_frame_buffer(fbb, root);
        write_frame(out, fbb.finished_data());
    }

    /// Appends `frame` to `out` as one length-prefixed frame.
    pub fn response(&mut self, frame: &ResponseFrame, out: &mut Vec<u8>) {
        self.fbb.reset();
        let fbb = &mut self.fbb;
        let (body_type, body) = match &frame.body {
            Response::HelloOk(h) => {
                let node_id = fbb.create_string(&h.node_id);
                let args = fb::HelloOkArgs {
                    protocol_version: h.protocol_version,
                    node_id: Some(node_id),
                    frame_bytes_max: h.frame_bytes_max,
                    batch_max: h.batch_max,
                };
                (
                    fb::Response::HelloOk,
                    fb::HelloOk::create(fbb, &args).as_union_value(),
                )
            }
            Response::Admission(a) => (
                fb::Response::Admission,
                encode_admission(fbb, a).as_union_value(),
            ),
            Response::SubmitBatch(all) => {
                let offsets: Vec<_> = all.iter().map(|a| encode_admission(fbb, a)).collect();
                let admissions = fbb.create_vector(&offsets);
                let args = fb::SubmitBatchResultArgs {
                    admissions: Some(admissions),
                };
                (
                    fb::Response::SubmitBatchResult,
                    fb::SubmitBatchResult::create(fbb, &args).as_union_value(),
                )
            }
            Response::Status(s) => {
                let failure_reason = s.failure_reason.as_deref().map(|r| fbb.create_string(r));
                let result = s.result.as_deref().map(|r| fbb.create_string(r));
                let args = fb::TaskStatusArgs {
                    task_id: s.task.0,
                    state: fb::TaskState(s.state as u8),
                    version: s.version,
                    attempt_no: s.attempt_no,
                    progress_pct: s.progress_pct,
                    cost_estimate_milli: s.cost_estimate_milli,
                    cost_actual_milli: s.cost_actual_milli,
                    failure_reason,
                    result,
                    expected_start_ms: s.expected_start_ms,
                };
                (
                    fb::Response::TaskStatus,
                    fb::TaskStatus::create(fbb, &args).as_union_value(),
                )
            }
            Response::Canceled { task, state } => {
                let args = fb::CanceledArgs {
                    task_id: task.0,
                    state: fb::TaskState(*state as u8),
                };
                (
                    fb::Response::Canceled,
                    fb::Canceled::create(fbb, &args).as_union_value(),
                )
            }
            Response::Subscribed(t) => (
                fb::Response::Subscribed,
                fb::Subscribed::create(fbb, &fb::SubscribedArgs { task_id: t.0 }).as_union_value(),
            ),
            Response::Unsubscribed(t) => (
                fb::Response::Unsubscribed,
                fb::Unsubscribed::create(fbb, &fb::UnsubscribedArgs { task_id: t.0 })
                    .as_union_value(),
            ),
            Response::Event(e) => {
                let result = e.result.as_deref().map(|r| fbb.create_string(r));
                let args = fb::EventArgs {
                    task_id: e.task.0,
                    state: fb::TaskState(e.state as u8),
                    progress_pct: e.progress_pct,
                    at_ms: e.at_ms,
                    result,
                };
                (
                    fb::Response::Event,
                    fb::Event::create(fbb, &args).as_union_value(),
                )
            }
            Response::Error(e) => {
                let message = fbb.create_string(truncate(&e.message, MESSAGE_BYTES_MAX));
                // An address past its bound is left out rather than cut (a cut one misleads).
                let redirect = e
                    .redirect
                    .as_deref()
                    .filter(|r| r.len() <= ADDRESS_BYTES_MAX)
                    .map(|r| fbb.create_string(r));
                let args = fb::ErrorArgs {
                    code: e.code.to_wire(),
                    message: Some(message),
                    redirect,
                };
                (
                    fb::Response::Error,
                    fb::Error::create(fbb, &args).as_union_value(),
                )
            }
        };
        let root = fb::ResponseFrame::create(
            fbb,
            &fb::ResponseFrameArgs {
                request_id: frame.request_id,
                body_type,
                body: Some(body),
            },
        );
        fbb.finish(root, Some(fb::REQUEST_FRAME_IDENTIFIER));
        write_frame(out, fbb.finished_data());
    }
}

fn encode_submit<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    s: &SubmitTask,
) -> WIPOffset<fb::SubmitTask<'a>> {
    let key = fbb.create_string(&s.idempotency_key);
    let input = s.input.as_deref().map(|i| fbb.create_string(i));
    let spec = fb::TaskSpec::create(
        fbb,
        &fb::TaskSpecArgs {
            model: s.spec.model.0,
            width: u16::try_from(s.spec.width).unwrap_or(u16::MAX),
            height: u16::try_from(s.spec.height).unwrap_or(u16::MAX),
            duration_ms: s.spec.duration_ms,
            fps: u8::try_from(s.spec.fps).unwrap_or(u8::MAX),
            audio: s.spec.audio,
            references: s.spec.references,
        },
    );
    fb::SubmitTask::create(
        fbb,
        &fb::SubmitTaskArgs {
            idempotency_key: Some(key),
            user_id: s.user.0,
            spec: Some(spec),
            band_hint: s.band_hint.map_or(0, |b| b.index() as u8),
            deadline_ms: s.deadline_ms.unwrap_or(0),
            input,
        },
    )
}

fn encode_admission<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    a: &Admission,
) -> WIPOffset<fb::Admission<'a>> {
    // Shared: a frame refused whole (the node's overload gate) gives every task the same
    // reason, written once and pointed to by each admission.
    let reason = a
        .reason
        .as_deref()
        .map(|r| fbb.create_shared_string(truncate(r, MESSAGE_BYTES_MAX)));
    fb::Admission::create(
        fbb,
        &fb::AdmissionArgs {
            task_id: a.task.0,
            decision: fb::Decision(a.decision as u8),
            reason,
            replay: a.replay,
            queue_level: a.queue_level,
            expected_start_ms: a.expected_start_ms,
            retry_after_ms: a.retry_after_ms,
        },
    )
}

/// The longest prefix of `s` within `max` bytes that ends on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
