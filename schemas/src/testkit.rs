//! Malformed frames of every kind the protocol must refuse, shared by the codec tests, the
//! daemon's tests and the fuzz corpus. Each is a whole frame (length prefix included) with the
//! error code a node must answer.

use flatbuffers::FlatBufferBuilder;
use spindle_core::TaskId;

use crate::error::ErrorCode;
use crate::frame::write_frame;
use crate::{fb, Encoder, Request, RequestFrame};

pub struct Malformed {
    pub name: &'static str,
    pub frame: Vec<u8>,
    pub code: ErrorCode,
    /// A framing error: the node answers, then closes the connection.
    pub closes: bool,
}

/// A RequestFrame built by hand: `body_type` and a body table with the given string slots.
pub fn hand_built(body_type: u8, strings: &[(u16, &[u8])]) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let offsets: Vec<_> = strings
        .iter()
        .map(|(slot, bytes)| (*slot, fbb.create_byte_string(bytes)))
        .collect();
    let start = fbb.start_table();
    for (slot, off) in offsets {
        fbb.push_slot_always(slot, off);
    }
    let body = fbb.end_table(start);
    let start = fbb.start_table();
    fbb.push_slot::<u64>(fb::RequestFrame::VT_REQUEST_ID, 3, 0);
    fbb.push_slot_always(fb::RequestFrame::VT_BODY, body);
    fbb.push_slot::<u8>(fb::RequestFrame::VT_BODY_TYPE, body_type, 0);
    let root = fbb.end_table(start);
    fbb.finish(root, Some("SPDL"));
    fbb.finished_data().to_vec()
}

/// A node's answer to request `request_id` as a newer node might send it: an admission with
/// decision `decision` (this build knows 0..=8), or, with `body_type` other than
/// `Admission`'s, a response type this build does not know. Length prefix included.
pub fn newer_answer(request_id: u64, body_type: u8, decision: u8) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let body = fb::Admission::create(
        &mut fbb,
        &fb::AdmissionArgs {
            task_id: 7,
            decision: fb::Decision(decision),
            ..Default::default()
        },
    );
    let root = fb::ResponseFrame::create(
        &mut fbb,
        &fb::ResponseFrameArgs {
            request_id,
            body_type: fb::Response(body_type),
            body: Some(body.as_union_value()),
        },
    );
    fbb.finish(root, Some(fb::REQUEST_FRAME_IDENTIFIER));
    framed(fbb.finished_data())
}

fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, payload);
    out
}

/// A valid Get request's payload.
pub fn get_payload(task: u64) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().request(
        &RequestFrame {
            request_id: 9,
            body: Request::Get(TaskId(task)),
        },
        &mut out,
    );
    out[4..].to_vec()
}

/// Every malformed case, recoverable ones first and the two framing errors last.
pub fn malformed() -> Vec<Malformed> {
    let valid = get_payload(1);
    let mut wrong_id = valid.clone();
    wrong_id[4..8].copy_from_slice(b"XXXX");
    let mut bad_offset = valid.clone();
    bad_offset[0..4].copy_from_slice(&(valid.len() as u32 + 64).to_le_bytes());
    let case = |name, payload: Vec<u8>, code| Malformed {
        name,
        frame: framed(&payload),
        code,
        closes: false,
    };
    vec![
        case(
            "truncated",
            valid[..valid.len() / 2].to_vec(),
            ErrorCode::Malformed,
        ),
        case("wrong identifier", wrong_id, ErrorCode::BadIdentifier),
        case("bad offset", bad_offset, ErrorCode::Malformed),
        case(
            "unknown union tag",
            hand_built(99, &[]),
            ErrorCode::UnknownRequest,
        ),
        case(
            "missing required field",
            hand_built(fb::Request::Hello.0, &[]),
            ErrorCode::MissingField,
        ),
        case(
            "invalid UTF-8",
            hand_built(
                fb::Request::Hello.0,
                &[(fb::Hello::VT_CREDENTIAL, &[0xff, 0xfe, b'x'])],
            ),
            ErrorCode::BadUtf8,
        ),
        Malformed {
            name: "zero length",
            frame: 0u32.to_le_bytes().to_vec(),
            code: ErrorCode::FrameEmpty,
            closes: true,
        },
        Malformed {
            name: "oversized length",
            frame: u32::MAX.to_le_bytes().to_vec(),
            code: ErrorCode::FrameTooLarge,
            closes: true,
        },
    ]
}
