//! Every message survives encode → frame → decode unchanged; malformed input of every kind the
//! issue names is refused with a code and a message naming the problem, never a panic.

use proptest::prelude::*;
use spindle_core::{Band, Decision, ModelId, TaskId, TaskSpec, TaskState, TenantId, UserId};
use spindle_wire::limits::{ADDRESS_BYTES_MAX, BATCH_MAX};
use spindle_wire::testkit::hand_built;
use spindle_wire::*;

fn spec() -> TaskSpec {
    TaskSpec {
        model: ModelId(2),
        width: 1920,
        height: 1080,
        duration_ms: 8_000,
        fps: 24,
        audio: true,
        references: 2,
    }
}

fn submit(key: &str) -> SubmitTask {
    SubmitTask {
        idempotency_key: key.into(),
        user: UserId(7),
        spec: spec(),
        band_hint: Some(Band::P3),
        deadline_ms: Some(60_000),
        input: Some(r#"{"prompt":"a red kite over the sea","seed":7}"#.into()),
    }
}

/// Encodes a request and returns the payload of its one frame.
fn request_payload(frame: &RequestFrame) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().request(frame, &mut out);
    let mut r = FrameReader::new();
    r.extend(&out);
    let payload = r.next_frame().unwrap().unwrap().to_vec();
    assert_eq!(r.pending(), 0);
    payload
}

fn response_payload(frame: &ResponseFrame) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().response(frame, &mut out);
    out[4..].to_vec()
}

fn err(payload: &[u8]) -> WireError {
    decode_request(payload).expect_err("must be refused")
}

#[test]
fn every_request_round_trips() {
    let bodies = vec![
        Request::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            tenant: TenantId(42),
            credential: "s3cret".into(),
            client_name: Some("loadgen".into()),
        }),
        Request::Submit(submit("k1")),
        Request::SubmitBatch(vec![submit("a"), submit("b")]),
        Request::Cancel(TaskId(5)),
        Request::Get(TaskId(6)),
        Request::Subscribe(TaskId(7)),
        Request::Unsubscribe(TaskId(8)),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let frame = RequestFrame {
            request_id: 1_000 + i as u64,
            body,
        };
        assert_eq!(decode_request(&request_payload(&frame)).unwrap(), frame);
    }
}

#[test]
fn every_response_round_trips() {
    let admission = Admission {
        task: TaskId(9),
        decision: Decision::RejectTenantQueueFull,
        reason: Some("tenant 4 queued tasks 100/100".into()),
        replay: false,
        queue_level: 2,
        expected_start_ms: 1_500,
        retry_after_ms: 250,
    };
    let bodies = vec![
        Response::HelloOk(HelloOk {
            protocol_version: 1,
            node_id: "node-a".into(),
            frame_bytes_max: 1 << 20,
            batch_max: 1024,
        }),
        Response::Admission(admission.clone()),
        Response::SubmitBatch(vec![
            admission.clone(),
            Admission {
                replay: true,
                reason: None,
                ..admission
            },
        ]),
        Response::Status(TaskStatus {
            task: TaskId(9),
            state: TaskState::Running,
            version: 3,
            attempt_no: 1,
            progress_pct: 30,
            cost_estimate_milli: 1_000,
            cost_actual_milli: 0,
            failure_reason: None,
            result: Some(r#"{"outputs":["/media/task-9-7-720p.mp4"]}"#.into()),
            expected_start_ms: 1_500,
        }),
        Response::Canceled {
            task: TaskId(9),
            state: TaskState::Canceled,
        },
        Response::Subscribed(TaskId(9)),
        Response::Unsubscribed(TaskId(9)),
        Response::Event(Event {
            task: TaskId(9),
            state: TaskState::Succeeded,
            progress_pct: 100,
            at_ms: 1_700_000_000_000,
            result: Some(r#"{"output_url":"http://p/v1/jobs/j/output"}"#.into()),
        }),
        Response::Error(WireError::new(ErrorCode::NotFound, "task 9 not found")),
        Response::Error(
            WireError::new(
                ErrorCode::WrongNode,
                "tenant 1 is served by node a at 10.0.0.7:7070",
            )
            .redirecting_to("10.0.0.7:7070"),
        ),
    ];
    for body in bodies {
        let frame = ResponseFrame {
            request_id: 77,
            body,
        };
        assert_eq!(decode_response(&response_payload(&frame)).unwrap(), frame);
    }
}

#[test]
fn a_redirect_past_its_bound_is_left_out_not_cut() {
    let long = "h".repeat(ADDRESS_BYTES_MAX + 1);
    let frame = ResponseFrame {
        request_id: 5,
        body: Response::Error(
            WireError::new(ErrorCode::WrongNode, "elsewhere").redirecting_to(long),
        ),
    };
    match decode_response(&response_payload(&frame)).unwrap().body {
        Response::Error(e) => assert_eq!((e.code, e.redirect), (ErrorCode::WrongNode, None)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn error_codes_match_the_schema() {
    for code in ErrorCode::ALL {
        assert_eq!(ErrorCode::from_wire(code.to_wire()), Some(code));
        assert!(
            code.to_wire().variant_name().is_some(),
            "{code:?} is in the schema"
        );
    }
    let schema_codes = fb::ErrorCode::ENUM_VALUES.len();
    assert_eq!(
        schema_codes,
        ErrorCode::ALL.len() + 1,
        "every schema code but None is mapped"
    );
}

#[test]
fn a_wrong_identifier_or_a_short_buffer_is_named() {
    let mut payload = request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Get(TaskId(1)),
    });
    payload[4..8].copy_from_slice(b"XXXX");
    let e = err(&payload);
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            ErrorCode::BadIdentifier,
            "file identifier is \"XXXX\", expected \"SPDL\""
        )
    );
    let e = err(&[1, 2, 3]);
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            ErrorCode::Malformed,
            "3 bytes is too short for a FlatBuffer"
        )
    );
}

#[test]
fn truncated_and_bad_offsets_are_refused_by_the_verifier() {
    let payload = request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Submit(submit("k")),
    });
    // (The last bytes may be alignment padding, which a buffer can lose and stay valid.)
    for cut in [8, 16, payload.len() / 2] {
        let e = err(&payload[..cut]);
        assert!(
            matches!(e.code, ErrorCode::Malformed | ErrorCode::MissingField),
            "cut {cut}: {e}"
        );
    }
    // The root offset pointing past the end.
    let mut bad = payload.clone();
    bad[0..4].copy_from_slice(&(payload.len() as u32 + 64).to_le_bytes());
    let e = err(&bad);
    assert_eq!(e.code, ErrorCode::Malformed, "{e}");
    assert!(
        e.message.contains("range") || e.message.contains("bound"),
        "{e}"
    );
}

#[test]
fn an_unknown_union_tag_is_an_unknown_request() {
    let e = err(&hand_built(99, &[]));
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            ErrorCode::UnknownRequest,
            "request type 99 is not one this node knows"
        )
    );
}

#[test]
fn a_missing_required_field_is_named() {
    // A Hello without its credential.
    let e = err(&hand_built(fb::Request::Hello.0, &[]));
    assert_eq!(e.code, ErrorCode::MissingField, "{e}");
    assert!(e.message.contains("credential"), "{e}");
}

#[test]
fn invalid_utf8_is_named() {
    // A Hello whose credential is not UTF-8.
    let e = err(&hand_built(
        fb::Request::Hello.0,
        &[(fb::Hello::VT_CREDENTIAL, &[0xff, 0xfe, b'x'])],
    ));
    assert_eq!(e.code, ErrorCode::BadUtf8, "{e}");
}

#[test]
fn semantic_checks_name_the_field() {
    let mut s = submit("k");
    s.spec.fps = 0;
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Submit(s),
    }));
    assert_eq!(
        e.to_string(),
        "OutOfRange: `spec.fps` is 0, outside 1..=120"
    );
    let s = SubmitTask {
        idempotency_key: "k".repeat(129),
        ..submit("k")
    };
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Submit(s),
    }));
    assert_eq!(
        e.to_string(),
        "TooLong: `idempotency_key` is 129 bytes, more than 128"
    );
    let with_input = |input: String| {
        let s = SubmitTask {
            input: Some(input),
            ..submit("k")
        };
        err(&request_payload(&RequestFrame {
            request_id: 1,
            body: Request::Submit(s),
        }))
        .to_string()
    };
    assert_eq!(
        with_input(r#"{"prompt": "unclosed"#.into()),
        "InvalidInput: `input` is not one JSON value: EOF while parsing a string at line 1 column 20"
    );
    assert_eq!(
        with_input(r#"{"a":1} {"b":2}"#.into()),
        "InvalidInput: `input` is not one JSON value: trailing characters at line 1 column 9"
    );
    assert_eq!(
        with_input(format!(r#""{}""#, "x".repeat(16 * 1024))),
        "TooLong: `input` is 16386 bytes, more than 16384"
    );
    // Nested past the bound (8,000 deep was accepted, and later sent to the provider as null):
    // refused with its depth, whatever the parser would make of it.
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    assert_eq!(
        with_input(deep(8_000)),
        "InvalidInput: `input` nests 8000 levels deep, more than 64"
    );
    assert_eq!(
        with_input(deep(65)),
        "InvalidInput: `input` nests 65 levels deep, more than 64"
    );
    // At the bound it is taken, and brackets inside strings are text.
    let at_bound = SubmitTask {
        input: Some(format!(r#"{{"p":"{}","a":{}}}"#, "[".repeat(500), deep(63))),
        ..submit("deep")
    };
    let frame = RequestFrame {
        request_id: 1,
        body: Request::Submit(at_bound),
    };
    assert_eq!(decode_request(&request_payload(&frame)).unwrap(), frame);
    assert_eq!(json_depth(r#"{"a":"\"]]]","b":[{}]}"#), 3);
    let mut bad = submit("x");
    bad.spec.width = 0;
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::SubmitBatch(vec![submit("a"), bad]),
    }));
    assert_eq!(
        e.to_string(),
        "OutOfRange: tasks[1]: `spec.width` is 0, outside 1..=8192"
    );
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Cancel(TaskId(0)),
    }));
    assert_eq!(e.code, ErrorCode::OutOfRange);
    let hello = Hello {
        protocol_version: 9,
        tenant: TenantId(1),
        credential: "c".into(),
        client_name: None,
    };
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::Hello(hello),
    }));
    assert_eq!(
        e.to_string(),
        "UnsupportedVersion: protocol version 9 is not supported; this node speaks 1"
    );
    let too_many: Vec<_> = (0..BATCH_MAX + 1)
        .map(|i| submit(&format!("k{i}")))
        .collect();
    let e = err(&request_payload(&RequestFrame {
        request_id: 1,
        body: Request::SubmitBatch(too_many),
    }));
    assert_eq!(
        e.to_string(),
        "BatchTooLarge: batch of 1025 tasks exceeds the maximum of 1024"
    );
}

fn arb_submit() -> impl Strategy<Value = SubmitTask> {
    (
        "[a-z0-9-]{1,128}",
        any::<u32>(),
        (
            any::<u16>(),
            1u32..=8192,
            1u32..=8192,
            1u32..=600_000,
            1u32..=120,
            any::<bool>(),
            0u8..=8,
        ),
        prop::option::of(1usize..=4),
        prop::option::of(1u32..=86_400_000),
        prop::option::of(("[ -~]{0,40}", any::<i64>()).prop_map(|(prompt, seed)| {
            serde_json::json!({ "prompt": prompt, "seed": seed }).to_string()
        })),
    )
        .prop_map(
            |(
                key,
                user,
                (model, width, height, duration_ms, fps, audio, references),
                band,
                deadline_ms,
                input,
            )| {
                SubmitTask {
                    idempotency_key: key,
                    user: UserId(user),
                    spec: TaskSpec {
                        model: ModelId(model),
                        width,
                        height,
                        duration_ms,
                        fps,
                        audio,
                        references,
                    },
                    band_hint: band.map(Band::from_index),
                    deadline_ms,
                    input,
                }
            },
        )
}

fn arb_request() -> impl Strategy<Value = RequestFrame> {
    let body = prop_oneof![
        arb_submit().prop_map(Request::Submit),
        prop::collection::vec(arb_submit(), 1..20).prop_map(Request::SubmitBatch),
        (1u64..).prop_map(|t| Request::Cancel(TaskId(t))),
        (1u64..).prop_map(|t| Request::Get(TaskId(t))),
        (1u32.., "[ -~]{1,256}").prop_map(|(tenant, credential)| Request::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            tenant: TenantId(tenant),
            credential,
            client_name: None,
        })),
    ];
    (any::<u64>(), body).prop_map(|(request_id, body)| RequestFrame { request_id, body })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn valid_requests_round_trip(frame in arb_request()) {
        prop_assert_eq!(decode_request(&request_payload(&frame)).unwrap(), frame);
    }

    /// Flipped bytes, truncation and garbage never panic: the decoder either refuses with a
    /// code or yields a value that survives its own round trip.
    #[test]
    fn mutated_frames_never_panic(
        frame in arb_request(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut payload = request_payload(&frame);
        for (at, byte) in flips {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        let payload = &payload[..cut.index(payload.len() + 1)];
        if let Ok(decoded) = decode_request(payload) {
            prop_assert_eq!(decode_request(&request_payload(&decoded)).unwrap(), decoded);
        }
        let _ = decode_response(payload);
    }
}

#[test]
fn every_malformed_case_gets_its_code() {
    for m in spindle_wire::testkit::malformed() {
        let mut r = FrameReader::new();
        r.extend(&m.frame);
        let got = match r.next_frame() {
            Err(e) => e,
            Ok(Some(payload)) => decode_request(payload).expect_err(m.name),
            Ok(None) => panic!("{}: not a whole frame", m.name),
        };
        assert_eq!(got.code, m.code, "{}: {got}", m.name);
        assert_eq!(got.code.closes_connection(), m.closes, "{}", m.name);
    }
}

/// A frame refused whole (the node's overload gate) answers every task with the same reason:
/// it is written once and shared, so the answer stays small, and reads back the same, with
/// each admission's retry hint.
#[test]
fn a_reason_shared_by_a_batchs_admissions_is_written_once() {
    let reason = "the node is overloaded: a submit would wait 60 ms for its commit, past the \
                  50 ms budget";
    let refused = |task: u64| Admission {
        task: TaskId(task),
        decision: Decision::RejectPlatformOverloaded,
        reason: Some(reason.into()),
        replay: false,
        queue_level: 0,
        expected_start_ms: 0,
        retry_after_ms: 10,
    };
    let frame = ResponseFrame {
        request_id: 7,
        body: Response::SubmitBatch((0..BATCH_MAX as u64).map(|_| refused(0)).collect()),
    };
    let payload = response_payload(&frame);
    // Each admission's own fields and offsets, and the reason once (written 1,024 times it
    // would take over 90 kB).
    assert!(
        payload.len() < 40 * BATCH_MAX + 2 * reason.len(),
        "{}",
        payload.len()
    );
    assert_eq!(decode_response(&payload).unwrap(), frame);
    let Response::SubmitBatch(back) = decode_response(&payload).unwrap().body else {
        unreachable!()
    };
    assert!(back
        .iter()
        .all(|a| a.retry_after().is_some_and(|d| d.as_millis() == 10)));
}
