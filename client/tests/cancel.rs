//! Requests dropped before their answer — here while the node has stopped reading, so the
//! connection's buffers are full — must leave the byte stream whole: every frame the node reads
//! afterwards decodes, and the next request is answered.

use std::time::Duration;

use spindle_client::{Client, ClientError};
use spindle_core::{Band, ModelId, TaskId, TaskSpec, TenantId, UserId};
use spindle_wire::{
    decode_request, Encoder, ErrorCode, FrameReader, HelloOk, Request, Response, ResponseFrame,
    SubmitTask, WireError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;

/// Batches sent while the node does not read: far more bytes than loopback buffers hold.
const ROUNDS: usize = 64;

fn task(i: usize) -> SubmitTask {
    SubmitTask {
        idempotency_key: format!("{i:0>120}"),
        user: UserId(1),
        spec: TaskSpec::clip_720p(ModelId(0)),
        band_hint: Some(Band::P3),
        deadline_ms: None,
        input: None,
    }
}

fn hello_ok() -> Response {
    Response::HelloOk(HelloOk {
        protocol_version: spindle_wire::PROTOCOL_VERSION,
        node_id: "test-node".into(),
        frame_bytes_max: spindle_wire::limits::FRAME_BYTES_MAX as u32,
        batch_max: spindle_wire::limits::BATCH_MAX as u32,
    })
}

async fn answer(socket: &mut TcpStream, request_id: u64, body: Response) {
    let mut out = Vec::new();
    Encoder::new().response(&ResponseFrame { request_id, body }, &mut out);
    socket.write_all(&out).await.unwrap();
}

/// A node that answers the Hello, stops reading until `resume`, then reads every frame: it
/// counts the submit batches and answers the first Get with NotFound. Any frame that does not
/// decode ends it with that error.
async fn stalling_node(
    socket: &mut TcpStream,
    resume: oneshot::Receiver<()>,
) -> Result<usize, String> {
    let mut frames = FrameReader::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut resume = Some(resume);
    let mut batches = 0;
    loop {
        let n = socket.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("closed after {batches} batches"));
        }
        frames.extend(&buf[..n]);
        let mut answers = Vec::new();
        while let Some(payload) = frames.next_frame().map_err(|e| e.to_string())? {
            let frame = decode_request(payload).map_err(|e| format!("after {batches}: {e}"))?;
            match frame.body {
                Request::Hello(_) => answers.push((frame.request_id, hello_ok())),
                Request::SubmitBatch(_) => batches += 1,
                Request::Get(task) => {
                    let e = WireError::new(ErrorCode::NotFound, format!("task {}", task.0));
                    answer(socket, frame.request_id, Response::Error(e)).await;
                    return Ok(batches);
                }
                other => return Err(format!("unexpected {other:?}")),
            }
        }
        for (id, body) in answers {
            answer(socket, id, body).await;
            if let Some(resume) = resume.take() {
                resume.await.map_err(|e| e.to_string())?;
            }
        }
    }
}

#[tokio::test]
async fn requests_dropped_while_the_connection_is_full_leave_the_stream_whole() {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let listener = socket.listen(4).unwrap();
    let (resume_tx, resume_rx) = oneshot::channel();
    let node = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        stalling_node(&mut socket, resume_rx).await
    });

    let client = Client::connect_within(addr, TenantId(1), "one", Duration::from_secs(10))
        .await
        .unwrap();
    let batch: Vec<SubmitTask> = (0..spindle_wire::limits::BATCH_MAX).map(task).collect();
    for round in 0..ROUNDS {
        // Each request is dropped unanswered: the node reads nothing now.
        let sent = tokio::time::timeout(
            Duration::from_millis(20),
            client.submit_batch(batch.clone()),
        )
        .await;
        assert!(sent.is_err(), "round {round}: answered {sent:?}");
    }
    resume_tx.send(()).unwrap();

    let got = client.get(TaskId(7)).await;
    assert!(
        matches!(&got, Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound
            && e.message == "task 7"),
        "{got:?}"
    );
    // Every dropped request had been queued whole, so each went out whole.
    assert_eq!(node.await.unwrap(), Ok(ROUNDS));
}

#[tokio::test]
async fn requests_after_the_node_stopped_sending_fail_at_once_as_closed() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let node = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        // Answers the Hello, then stops sending (its side of the stream ends) but goes on
        // reading: every write of the client still succeeds, no answer can come.
        let mut frames = FrameReader::new();
        let mut buf = vec![0u8; 64 * 1024];
        let hello = loop {
            let n = socket.read(&mut buf).await.unwrap();
            frames.extend(&buf[..n]);
            if let Some(payload) = frames.next_frame().unwrap() {
                break decode_request(payload).unwrap();
            }
        };
        assert!(matches!(hello.body, Request::Hello(_)), "{hello:?}");
        answer(&mut socket, hello.request_id, hello_ok()).await;
        socket.shutdown().await.unwrap();
        while socket.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    let bound = Duration::from_secs(2);
    let client = Client::connect_within(addr, TenantId(1), "one", bound)
        .await
        .unwrap();
    for i in 0..3 {
        // The first ends when the reader meets the end of the stream; the later ones at once,
        // not at the timeout.
        let got = client.get(TaskId(i)).await;
        assert!(
            matches!(got, Err(ClientError::Closed)),
            "request {i}: {got:?}"
        );
    }
    drop(client);
    node.abort();
}
