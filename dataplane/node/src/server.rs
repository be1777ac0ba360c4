//! Client connections: one glommio task per connection on whichever shard's executor accepted
//! it. Frames are read, verified and validated (`spindle-wire`); the first must be Hello; every
//! later command goes to the shard owning the authenticated tenant and is answered when that
//! shard answers — in any order, matched by request id.

use std::collections::HashMap;
use std::rc::Rc;

use futures_util::io::{AsyncReadExt, AsyncWriteExt};
use spindle_core::TenantId;
use spindle_wire::limits::{BATCH_MAX, FRAME_BYTES_MAX};
use spindle_wire::{
    decode_request, Encoder, ErrorCode, FrameReader, HelloOk, Request, Response, ResponseFrame,
    WireError, PROTOCOL_VERSION,
};
use tokio::sync::{mpsc, oneshot};

use crate::shard::ShardMsg;

/// Encoded frames waiting for the socket, per connection.
const OUTBOUND_QUEUE_MAX: usize = 1024;
const READ_CHUNK: usize = 64 * 1024;
/// Encoded frames joined into one write while more are queued, up to this many bytes.
const WRITE_COALESCE_BYTES: usize = 64 * 1024;

/// What every connection on this executor shares.
pub struct ConnCtx {
    pub node_id: String,
    pub shards: Vec<mpsc::Sender<ShardMsg>>,
    pub credentials: HashMap<u32, String>,
    pub partitions: u32,
    pub inflight_max: usize,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    pub ownership: std::sync::Arc<crate::ownership::Ownership>,
}

impl ConnCtx {
    fn shard_of(&self, tenant: TenantId) -> &mpsc::Sender<ShardMsg> {
        let partition = tenant.0 % self.partitions;
        &self.shards[(partition % self.shards.len() as u32) as usize]
    }

    /// Constant-time over the presented credential: the time taken says nothing about how
    /// much of it matched (an unknown tenant compares against an empty string).
    fn authenticate(&self, tenant: TenantId, presented: &str) -> bool {
        let expected = self.credentials.get(&tenant.0).map_or("", String::as_str);
        let known = self.credentials.contains_key(&tenant.0);
        constant_time_eq(expected.as_bytes(), presented.as_bytes()) & known
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for (i, y) in b.iter().enumerate() {
        let x = a.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

/// For a submit answer: whether anything in it was accepted (`None` for other answers).
fn submit_outcome(body: &Response) -> Option<bool> {
    match body {
        Response::Admission(a) => Some(a.decision.is_accepted()),
        Response::SubmitBatch(all) => Some(all.iter().any(|a| a.decision.is_accepted())),
        _ => None,
    }
}

pub(crate) fn frame(request_id: u64, body: Response) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().response(&ResponseFrame { request_id, body }, &mut out);
    out
}

pub async fn serve(stream: glommio::net::TcpStream, ctx: Rc<ConnCtx>) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!("TCP_NODELAY: {e}");
    }
    let (mut reader, mut writer) = stream.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(OUTBOUND_QUEUE_MAX);
    let writer_task = glommio::spawn_local(async move {
        while let Some(mut buf) = out_rx.recv().await {
            // Answers that became ready together (a submit call answers every frame it carried
            // at once) leave in one write: one system call and one segment, not one each.
            while buf.len() < WRITE_COALESCE_BYTES {
                match out_rx.try_recv() {
                    Ok(more) => buf.extend_from_slice(&more),
                    Err(_) => break,
                }
            }
            if writer.write_all(&buf).await.is_err() {
                break;
            }
        }
        let _ = writer.close().await;
    })
    .detach();
    let inflight = Rc::new(glommio::sync::Semaphore::new(ctx.inflight_max as u64));
    let mut frames = FrameReader::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut tenant: Option<TenantId> = None;
    'conn: loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        frames.extend(&buf[..n]);
        loop {
            let payload = match frames.next_frame() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => {
                    // The stream cannot be resynchronized: say why, then close.
                    let _ = out_tx.send(frame(0, Response::Error(e))).await;
                    break 'conn;
                }
            };
            let request = match decode_request(payload) {
                Ok(r) => r,
                Err(e) => {
                    // The frame boundary is intact: refuse this frame, keep the connection.
                    if out_tx.send(frame(0, Response::Error(e))).await.is_err() {
                        break 'conn;
                    }
                    continue;
                }
            };
            let id = request.request_id;
            // Frame decoded → answer encoded: what `/metrics` reports as the node's own
            // submit latency (the client adds the network and its own scheduling).
            let received = std::time::Instant::now();
            let Some(t) = tenant else {
                let Request::Hello(h) = request.body else {
                    let e = WireError::new(
                        ErrorCode::NotAuthenticated,
                        "the first request must be Hello",
                    );
                    let _ = out_tx.send(frame(id, Response::Error(e))).await;
                    break 'conn;
                };
                if !ctx.authenticate(h.tenant, &h.credential) {
                    let e = WireError::new(
                        ErrorCode::AuthFailed,
                        format!("tenant {} refused", h.tenant),
                    );
                    let _ = out_tx.send(frame(id, Response::Error(e))).await;
                    break 'conn;
                }
                let partition = h.tenant.0 % ctx.partitions;
                if !ctx.ownership.owns(partition) {
                    let why = ctx.ownership.refusal(h.tenant.0, partition);
                    let e = WireError::new(ErrorCode::WrongNode, why);
                    let _ = out_tx.send(frame(id, Response::Error(e))).await;
                    break 'conn;
                }
                tenant = Some(h.tenant);
                let ok = Response::HelloOk(HelloOk {
                    protocol_version: PROTOCOL_VERSION,
                    node_id: ctx.node_id.clone(),
                    frame_bytes_max: FRAME_BYTES_MAX as u32,
                    batch_max: BATCH_MAX as u32,
                });
                if out_tx.send(frame(id, ok)).await.is_err() {
                    break 'conn;
                }
                continue;
            };
            let (reply, answer) = oneshot::channel();
            let msg = match request.body {
                Request::Hello(_) => {
                    let e = WireError::new(
                        ErrorCode::AlreadyAuthenticated,
                        "Hello was already accepted",
                    );
                    let _ = out_tx.send(frame(id, Response::Error(e))).await;
                    continue;
                }
                Request::Submit(task) => ShardMsg::Submit {
                    tenant: t,
                    tasks: vec![task],
                    batch: false,
                    reply,
                },
                Request::SubmitBatch(tasks) => ShardMsg::Submit {
                    tenant: t,
                    tasks,
                    batch: true,
                    reply,
                },
                Request::Get(task) => ShardMsg::Get {
                    tenant: t,
                    task,
                    reply,
                },
                Request::Cancel(task) => ShardMsg::Cancel {
                    tenant: t,
                    task,
                    reply,
                },
                Request::Subscribe(task) => ShardMsg::Subscribe {
                    tenant: t,
                    task,
                    request_id: id,
                    out: out_tx.clone(),
                    reply,
                },
                Request::Unsubscribe(task) => ShardMsg::Unsubscribe {
                    task,
                    out: out_tx.clone(),
                    reply,
                },
            };
            let Ok(permit) = inflight.acquire_static_permit(1).await else {
                break 'conn;
            };
            if ctx.shard_of(t).send(msg).await.is_err() {
                let e = WireError::new(ErrorCode::Draining, "the node is stopping");
                let _ = out_tx.send(frame(id, Response::Error(e))).await;
                break 'conn;
            }
            let out = out_tx.clone();
            let metrics = ctx.metrics.clone();
            glommio::spawn_local(async move {
                let body = answer.await.unwrap_or_else(|_| {
                    Response::Error(WireError::new(
                        ErrorCode::Internal,
                        "the shard dropped the request",
                    ))
                });
                let outcome = submit_outcome(&body);
                let bytes = frame(id, body);
                if let Some(accepted) = outcome {
                    metrics.answered_submit(accepted, received.elapsed());
                }
                let _ = out.send(bytes).await;
                drop(permit);
            })
            .detach();
        }
    }
    drop(out_tx);
    let _ = writer_task.await;
}
