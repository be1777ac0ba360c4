//! A node newer than this client may answer with values the client does not know — a decision,
//! a response type. The request so answered fails with `Protocol`, naming the value; the
//! connection and the other requests on it go on.

use spindle_client::{Client, ClientError};
use spindle_core::{Decision, ModelId, TaskId, TaskSpec, TenantId, UserId};
use spindle_wire::{
    decode_request, fb, testkit, Admission, Encoder, FrameReader, HelloOk, Request, Response,
    ResponseFrame, SubmitTask, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers the Hello, then the first request with decision 99, the second with response type
/// 250, and every later one as this build would.
async fn newer_node(listener: tokio::net::TcpListener) {
    let (mut socket, _) = listener.accept().await.unwrap();
    let mut frames = FrameReader::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut encoder = Encoder::new();
    let mut seen = 0;
    loop {
        let n = socket.read(&mut buf).await.unwrap();
        if n == 0 {
            return;
        }
        frames.extend(&buf[..n]);
        while let Some(f) = frames.next_frame().unwrap() {
            let frame = decode_request(f).unwrap();
            let id = frame.request_id;
            let out = match frame.body {
                Request::Hello(_) => answer(&mut encoder, id, hello()),
                _ => {
                    seen += 1;
                    match seen {
                        1 => testkit::newer_answer(id, fb::Response::Admission.0, 99),
                        2 => testkit::newer_answer(id, 250, 0),
                        _ => answer(&mut encoder, id, accepted()),
                    }
                }
            };
            socket.write_all(&out).await.unwrap();
        }
    }
}

fn hello() -> Response {
    Response::HelloOk(HelloOk {
        protocol_version: PROTOCOL_VERSION,
        node_id: "newer".into(),
        frame_bytes_max: 1 << 20,
        batch_max: 1024,
    })
}

fn accepted() -> Response {
    Response::Admission(Admission {
        task: TaskId(7),
        decision: Decision::Accepted,
        reason: None,
        replay: false,
        queue_level: 0,
        expected_start_ms: 0,
        retry_after_ms: 0,
    })
}

fn answer(encoder: &mut Encoder, request_id: u64, body: Response) -> Vec<u8> {
    let mut out = Vec::new();
    encoder.response(&ResponseFrame { request_id, body }, &mut out);
    out
}

#[tokio::test]
async fn an_answer_this_client_cannot_read_fails_its_request_alone() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let node = tokio::spawn(newer_node(listener));
    let client = Client::connect(addr, TenantId(1), "one").await.unwrap();
    let task = || SubmitTask {
        idempotency_key: "k".into(),
        user: UserId(1),
        spec: TaskSpec::clip_720p(ModelId(0)),
        band_hint: None,
        deadline_ms: None,
        input: None,
    };

    let unknown_decision = client.submit(task()).await.unwrap_err();
    assert!(
        matches!(&unknown_decision, ClientError::Protocol(e) if e.message.contains("decision")),
        "{unknown_decision}"
    );
    let unknown_type = client.submit(task()).await.unwrap_err();
    assert!(
        matches!(&unknown_type, ClientError::Protocol(e) if e.message.contains("250")),
        "{unknown_type}"
    );
    // The same connection still serves.
    let a = client.submit(task()).await.unwrap();
    assert_eq!((a.task, a.decision), (TaskId(7), Decision::Accepted));
    node.abort();
}
