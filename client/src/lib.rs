//! An async client for spindle's protocol (tokio). Requests are pipelined: any number may be in
//! flight on one connection; a reader task matches answers to requests by `request_id`, in
//! whatever order the node sends them. Events of subscriptions arrive on [`Client::next_event`].
//!
//! Requests are cancel-safe: a request is encoded whole and handed to a writer task over a
//! bounded queue, so a request future dropped at any point (a `select!`, a caller's timeout)
//! leaves either its whole frame on the connection or none of it — never half a frame that
//! would garble every frame after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use spindle_core::{TaskId, TaskState, TenantId};
use spindle_wire::limits::FRAME_BYTES_MAX;
use spindle_wire::{
    decode_response, Admission, Encoder, ErrorCode, Event, FrameReader, Hello, HelloOk, Request,
    RequestFrame, Response, SubmitTask, TaskStatus, WireError, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

mod cluster;
mod tls;

pub use cluster::{ClusterClient, CLUSTER_SUBSCRIPTIONS_MAX, FAILOVER_WITHIN, SEEDS_MAX};
pub use tls::{Tls, ROOTS_MAX};

/// How long a request waits for its answer unless the client was made with another bound
/// ([`Client::connect_within`]). Generous: a submit whose commit is in doubt on the node is
/// read back before it is answered (a few seconds at most).
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `WrongNode` redirects [`Client::connect_cluster`] follows before it gives up.
pub const REDIRECTS_MAX: usize = 4;

/// Events buffered for the application before the reader stops reading.
const EVENTS_BUFFER: usize = 4096;

/// Encoded frames waiting for the writer task; a request waits for room beyond this.
const WRITE_QUEUE_FRAMES: usize = 1024;

/// Bytes of queued frames the writer gathers into one write.
const WRITE_GATHER_BYTES: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The node answered with an error frame.
    #[error("the node refused: {0}")]
    Refused(WireError),
    /// The node sent something this client cannot read: for one request, an answer with a
    /// value this build does not know (a newer node's), which fails that request alone; a
    /// frame that does not verify ends the connection.
    #[error("undecodable frame from the node: {0}")]
    Protocol(WireError),
    #[error("the connection closed")]
    Closed,
    /// No answer within the client's request timeout. The request may still take effect on
    /// the node: a submit is safe to send again with the same idempotency key.
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("unexpected answer: {0:?}")]
    Unexpected(Box<Response>),
}

/// A request's answer: `Err` when its frame verified but its body could not be read.
type Answer = Result<Response, WireError>;

/// The requests waiting for their answers, until the connection is known to be gone.
#[derive(Default)]
struct Waiters {
    by_id: HashMap<u64, oneshot::Sender<Answer>>,
    /// The reader or the writer met the connection's end: no answer can come any more.
    closed: bool,
    /// Why the node closed the connection, when it said so (an Error under request id 0: a
    /// framing error, or the tenant suspended): every request it leaves unanswered, and every
    /// later one, fails with it.
    last_word: Option<WireError>,
}

type Pending = Arc<Mutex<Waiters>>;

pub struct Client {
    /// Encoding happens under this lock (never across an await); the frame then goes to the
    /// writer task whole.
    encoder: Mutex<Encoder>,
    frames: mpsc::Sender<Vec<u8>>,
    pending: Pending,
    next_id: AtomicU64,
    events: tokio::sync::Mutex<mpsc::Receiver<Event>>,
    hello: HelloOk,
    reader: tokio::task::JoinHandle<()>,
    request_timeout: std::time::Duration,
}

/// Takes a request's waiter out of the pending map when the request ends without its answer
/// (timed out, or its future dropped), so that the map holds only requests still waited for.
struct Waiting<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.pending
            .lock()
            .expect("pending map")
            .by_id
            .remove(&self.id);
    }
}

impl Client {
    /// Connects and authenticates as `tenant`; requests wait at most [`REQUEST_TIMEOUT`].
    pub async fn connect(
        addr: impl ToSocketAddrs,
        tenant: TenantId,
        credential: &str,
    ) -> Result<Client, ClientError> {
        Client::connect_within(addr, tenant, credential, REQUEST_TIMEOUT).await
    }

    /// [`Client::connect`] with the TCP connect and every request (the Hello too) waiting at
    /// most `timeout` for its answer.
    pub async fn connect_within(
        addr: impl ToSocketAddrs,
        tenant: TenantId,
        credential: &str,
        timeout: std::time::Duration,
    ) -> Result<Client, ClientError> {
        let stream = connect_tcp(addr, timeout).await?;
        let (read, write) = stream.into_split();
        Client::start(read, write, tenant, credential, timeout).await
    }

    /// [`Client::connect_within`] to a node whose port speaks TLS (`[tls]` in its
    /// configuration) when `tls` is given: the node's certificate must chain to `tls`'s roots
    /// and name the host of `addr` ("host:port"), or [`Tls::server_name`] where set.
    pub async fn connect_with(
        addr: &str,
        tenant: TenantId,
        credential: &str,
        timeout: std::time::Duration,
        tls: Option<&Tls>,
    ) -> Result<Client, ClientError> {
        let stream = connect_tcp(addr, timeout).await?;
        let Some(tls) = tls else {
            let (read, write) = stream.into_split();
            return Client::start(read, write, tenant, credential, timeout).await;
        };
        let stream = tokio::time::timeout(timeout, tls.connect(addr, stream))
            .await
            .map_err(|_| ClientError::Timeout(timeout))??;
        let (read, write) = tokio::io::split(stream);
        Client::start(read, write, tenant, credential, timeout).await
    }

    /// The reader and writer tasks over a connected stream's halves, then the Hello.
    async fn start(
        read: impl AsyncRead + Unpin + Send + 'static,
        write: impl AsyncWrite + Unpin + Send + 'static,
        tenant: TenantId,
        credential: &str,
        timeout: std::time::Duration,
    ) -> Result<Client, ClientError> {
        let pending: Pending = Arc::default();
        let (events_tx, events_rx) = mpsc::channel(EVENTS_BUFFER);
        let reader = tokio::spawn(read_loop(read, pending.clone(), events_tx));
        let (frames, queued) = mpsc::channel(WRITE_QUEUE_FRAMES);
        tokio::spawn(write_loop(write, queued, pending.clone()));
        let mut client = Client {
            encoder: Mutex::new(Encoder::new()),
            frames,
            pending,
            next_id: AtomicU64::new(1),
            events: tokio::sync::Mutex::new(events_rx),
            hello: HelloOk {
                protocol_version: 0,
                node_id: String::new(),
                frame_bytes_max: 0,
                batch_max: 0,
            },
            reader,
            request_timeout: timeout,
        };
        let hello = Request::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            tenant,
            credential: credential.to_string(),
            client_name: Some("spindle-client".into()),
        });
        match client.request(hello).await? {
            Response::HelloOk(ok) => client.hello = ok,
            other => return Err(ClientError::Unexpected(Box::new(other))),
        }
        Ok(client)
    }

    /// [`Client::connect`] through any node of a cluster: a node that does not serve `tenant`
    /// answers the Hello with `WrongNode` and the address of the node that does, and the client
    /// reconnects there — at most [`REDIRECTS_MAX`] times, never twice to one address. A
    /// `WrongNode` without an address (the partition has no live owner for the moment, during
    /// a takeover) is returned as it is: try again shortly.
    pub async fn connect_cluster(
        addr: &str,
        tenant: TenantId,
        credential: &str,
    ) -> Result<Client, ClientError> {
        Client::connect_cluster_with(addr, tenant, credential, None).await
    }

    /// [`Client::connect_cluster`] over TLS when `tls` is given ([`Client::connect_with`]):
    /// each node's certificate must name the address it is reached at (a redirect's
    /// included), unless [`Tls::server_name`] names one name for all of them.
    pub async fn connect_cluster_with(
        addr: &str,
        tenant: TenantId,
        credential: &str,
        tls: Option<&Tls>,
    ) -> Result<Client, ClientError> {
        let mut at = addr.to_string();
        let mut visited = Vec::new();
        loop {
            let connected = Client::connect_with(&at, tenant, credential, REQUEST_TIMEOUT, tls);
            let refusal = match connected.await {
                Err(ClientError::Refused(e)) if e.code == ErrorCode::WrongNode => e,
                done => return done,
            };
            visited.push(at);
            match &refusal.redirect {
                Some(next) if visited.len() <= REDIRECTS_MAX && !visited.contains(next) => {
                    at = next.clone();
                }
                Some(_) => {
                    let why = format!(
                        "{} (the nodes sent the client on from {} without reaching one that \
                         serves tenant {tenant})",
                        refusal.message,
                        visited.join(" to ")
                    );
                    return Err(ClientError::Refused(WireError::new(
                        ErrorCode::WrongNode,
                        why,
                    )));
                }
                None => return Err(ClientError::Refused(refusal)),
            }
        }
    }

    /// What the node announced: its id and its frame and batch maxima.
    pub fn hello(&self) -> &HelloOk {
        &self.hello
    }

    /// Whether the connection is known to be gone (its reader or writer met its end): every
    /// request on it fails.
    pub fn is_closed(&self) -> bool {
        self.pending.lock().expect("pending map").closed
    }

    /// Sends one request and waits for its answer; an Error answer is `Refused`.
    pub async fn request(&self, body: Request) -> Result<Response, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut waiters = self.pending.lock().expect("pending map");
            if waiters.closed {
                return Err(waiters
                    .last_word
                    .clone()
                    .map_or(ClientError::Closed, ClientError::Refused));
            }
            waiters.by_id.insert(id, tx);
        }
        let _waiting = Waiting {
            pending: &self.pending,
            id,
        };
        let mut frame = Vec::new();
        self.encoder.lock().expect("encoder").request(
            &RequestFrame {
                request_id: id,
                body,
            },
            &mut frame,
        );
        // Cancel-safe: dropped while waiting for room, the frame is not sent at all; once
        // queued, it is written whole. A closed queue means the writer met an error.
        self.frames
            .send(frame)
            .await
            .map_err(|_| ClientError::Closed)?;
        // Only the answer is timed: a queued frame is sent whatever happens to this request.
        let answer = tokio::time::timeout(self.request_timeout, rx)
            .await
            .map_err(|_| ClientError::Timeout(self.request_timeout))?;
        match answer.map_err(|_| ClientError::Closed)? {
            Err(e) => Err(ClientError::Protocol(e)),
            Ok(Response::Error(e)) => Err(ClientError::Refused(e)),
            Ok(other) => Ok(other),
        }
    }

    pub async fn submit(&self, task: SubmitTask) -> Result<Admission, ClientError> {
        match self.request(Request::Submit(task)).await? {
            Response::Admission(a) => Ok(a),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// One frame, one group commit on the node; admissions in the order of `tasks`.
    pub async fn submit_batch(
        &self,
        tasks: Vec<SubmitTask>,
    ) -> Result<Vec<Admission>, ClientError> {
        match self.request(Request::SubmitBatch(tasks)).await? {
            Response::SubmitBatch(all) => Ok(all),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    pub async fn get(&self, task: TaskId) -> Result<TaskStatus, ClientError> {
        match self.request(Request::Get(task)).await? {
            Response::Status(s) => Ok(s),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    pub async fn cancel(&self, task: TaskId) -> Result<TaskState, ClientError> {
        match self.request(Request::Cancel(task)).await? {
            Response::Canceled { state, .. } => Ok(state),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Asks for `task`'s events; they arrive through [`Client::next_event`].
    pub async fn subscribe(&self, task: TaskId) -> Result<(), ClientError> {
        match self.request(Request::Subscribe(task)).await? {
            Response::Subscribed(_) => Ok(()),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// The next event of any subscription; `None` once the connection is gone.
    pub async fn next_event(&self) -> Option<Event> {
        self.events.lock().await.recv().await
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A TCP connection to `addr`, bounded by `timeout`: an address that drops the SYNs would
/// take the OS's own timeout (minutes).
async fn connect_tcp(
    addr: impl ToSocketAddrs,
    timeout: std::time::Duration,
) -> Result<TcpStream, ClientError> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| ClientError::Timeout(timeout))??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

async fn read_loop(
    mut read: impl AsyncRead + Unpin,
    pending: Pending,
    events: mpsc::Sender<Event>,
) {
    let mut frames = FrameReader::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        frames.extend(&buf[..n]);
        loop {
            let (request_id, answer) = match frames.next_frame() {
                Ok(Some(f)) => match decode_response(f) {
                    Ok(frame) => (frame.request_id, Ok(frame.body)),
                    // Verified, but with a value this build does not know: that request fails
                    // (an event of a kind it does not know is passed over).
                    Err(e) => match spindle_wire::response_id_of(f) {
                        Some(id) => (id, Err(e)),
                        None => return close(&pending),
                    },
                },
                Ok(None) => break,
                Err(_) => return close(&pending),
            };
            if let Ok(Response::Event(e)) = answer {
                if events.send(e).await.is_err() {
                    // Nobody listens for events any more; answers still flow.
                }
                continue;
            }
            if let (0, Ok(Response::Error(e))) = (request_id, &answer) {
                pending.lock().expect("pending map").last_word = Some(e.clone());
                continue;
            }
            let waiter = pending
                .lock()
                .expect("pending map")
                .by_id
                .remove(&request_id);
            if let Some(w) = waiter {
                let _ = w.send(answer);
            }
        }
        if frames.pending() > FRAME_BYTES_MAX + 4 {
            break;
        }
    }
    close(&pending);
}

/// Writes queued frames in order, gathering what is queued into one write. On a write error
/// the connection is done: every waiting request fails and later ones find the queue closed.
/// Ends when the client is dropped (the queue's sender with it), after writing what was queued.
async fn write_loop(
    mut write: impl AsyncWrite + Unpin,
    mut queued: mpsc::Receiver<Vec<u8>>,
    pending: Pending,
) {
    let mut out = Vec::new();
    while let Some(first) = queued.recv().await {
        let written = match queued.try_recv() {
            // One frame alone is written as it is.
            Err(_) => write.write_all(&first).await,
            Ok(second) => {
                out.clear();
                out.extend_from_slice(&first);
                out.extend_from_slice(&second);
                while out.len() < WRITE_GATHER_BYTES {
                    match queued.try_recv() {
                        Ok(frame) => out.extend_from_slice(&frame),
                        Err(_) => break,
                    }
                }
                write.write_all(&out).await
            }
        };
        // Over TLS what was written may wait in the session until flushed.
        let written = match written {
            Ok(()) => write.flush().await,
            e => e,
        };
        if written.is_err() {
            queued.close();
            return close(&pending);
        }
    }
}

/// Fails every request still waiting, and every later one at once: their answers will never
/// come.
fn close(pending: &Pending) {
    let mut waiters = pending.lock().expect("pending map");
    waiters.closed = true;
    let last_word = waiters.last_word.clone();
    for (_, waiter) in waiters.by_id.drain() {
        // Without the node's last word, a dropped waiter is `Closed`.
        if let Some(e) = &last_word {
            let _ = waiter.send(Ok(Response::Error(e.clone())));
        }
    }
}
