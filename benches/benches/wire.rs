//! The wire codec's cost per frame, as a node pays it: a request frame's payload verified
//! (tight `VerifierOptions`) and validated into owned values, and an answer encoded with its
//! length prefix — for a single submit, a batch of 64 (the bench's frame size) and one of
//! `BATCH_MAX`. Throughput is reported per task.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use spindle_core::{Decision, ModelId, TaskId, TaskSpec, UserId};
use spindle_wire::limits::BATCH_MAX;
use spindle_wire::{
    decode_request, Admission, Encoder, FrameReader, Request, RequestFrame, Response,
    ResponseFrame, SubmitTask,
};

// As spindled runs it.
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

/// A task like the loadgen's: a short clip, a key of ~30 bytes.
fn task(i: usize) -> SubmitTask {
    SubmitTask {
        idempotency_key: format!("lg-1764780000000000000-1-{i}"),
        user: UserId(1 + (i % 16) as u32),
        spec: TaskSpec::clip_720p(ModelId(2)),
        band_hint: None,
        deadline_ms: Some(60_000),
        input: None,
    }
}

fn request(n: usize) -> RequestFrame {
    let body = if n == 1 {
        Request::Submit(task(0))
    } else {
        Request::SubmitBatch((0..n).map(task).collect())
    };
    RequestFrame {
        request_id: 7,
        body,
    }
}

fn answer(n: usize) -> ResponseFrame {
    let admission = |i: usize| Admission {
        task: TaskId(1_000_000 + i as u64),
        decision: Decision::Accepted,
        reason: None,
        replay: false,
        queue_level: 1,
        expected_start_ms: 40,
        retry_after_ms: 0,
    };
    let body = if n == 1 {
        Response::Admission(admission(0))
    } else {
        Response::SubmitBatch((0..n).map(admission).collect())
    };
    ResponseFrame {
        request_id: 7,
        body,
    }
}

/// The payload of an encoded request (what the node's frame reader hands the decoder).
fn payload(frame: &RequestFrame) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().request(frame, &mut out);
    let mut reader = FrameReader::new();
    reader.extend(&out);
    let payload = reader
        .next_frame()
        .expect("a frame")
        .expect("whole")
        .to_vec();
    payload
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire");
    for n in [1, 64, BATCH_MAX] {
        group.throughput(Throughput::Elements(n as u64));
        let bytes = payload(&request(n));
        // Checked once outside the timing: the bench measures a frame that is accepted.
        assert_eq!(decode_request(&bytes).expect("valid"), request(n));
        group.bench_function(format!("decode_submit_{n}"), |b| {
            b.iter(|| decode_request(black_box(&bytes)).expect("valid"));
        });
        let frame = answer(n);
        let mut encoder = Encoder::new();
        group.bench_function(format!("encode_answer_{n}"), |b| {
            b.iter(|| {
                // A fresh buffer each time, as the node writes each answer into its own.
                let mut out = Vec::new();
                encoder.response(black_box(&frame), &mut out);
                out
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
