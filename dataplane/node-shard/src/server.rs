//! Client connections. Whichever shard's executor accepted one reads its Hello; once
//! authenticated, the connection is handed to the shard that owns its tenant (its descriptor
//! and the bytes read past the Hello), so that its frames reach the shard and its answers leave
//! without crossing threads. Frames are read, verified and validated (`spindle-wire`); every
//! command is answered when the shard answers — in any order, matched by request id. A submit
//! is admitted right in the connection's task (it runs on its tenant's shard): one that needs
//! nothing of PostgreSQL — refused, or every task rejected — is answered from there, without a
//! hop through the shard's inbox (docs/benchmarks/journal.md, "Twentieth round"); accepted tasks go
//! on to their group commit in a task of their own, which queues the answer for the socket the
//! moment it is known.
//!
//! Long file: a connection's whole life on a shard (accept and its bounds, the greeting, the
//! hand-over to its tenant's shard, serving), each step handing its state to the next.

use std::collections::HashMap;
use std::rc::Rc;

use spindle_core::TenantId;
use spindle_wire::limits::{BATCH_MAX, FRAME_BYTES_MAX};
use spindle_wire::{
    decode_request, request_id_of, Encoder, ErrorCode, FrameReader, HelloOk, Request, RequestFrame,
    Response, ResponseFrame, WireError, PROTOCOL_VERSION,
};
use tokio::sync::{mpsc, oneshot};

use crate::breaker::Verdict;
use crate::tls::{Accepted, Link, Session};
use spindle_node_base::limits::OUTBOUND_QUEUE_MAX;
pub use spindle_node_base::limits::{HANDOFF_QUEUE_MAX, REFUSING_MAX};
use spindle_node_base::messages::ShardMsg;

const READ_CHUNK: usize = 64 * 1024;
/// Encoded frames joined into one write while more are queued, up to this many bytes.
const WRITE_COALESCE_BYTES: usize = 64 * 1024;
/// The read buffer of a connection still greeting: its frames are held to
/// `HELLO_FRAME_BYTES_MAX` until its Hello is answered, so nothing bigger is read for it.
const GREETING_READ_CHUNK: usize = spindle_wire::limits::HELLO_FRAME_BYTES_MAX;

type Stream = glommio::net::TcpStream;

/// A refused plain connection is told why within this (its Hello read, the error written), then
/// closed; a client that sends nothing is closed at its end.
pub const REFUSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);
/// Refused TLS connections one shard handshakes with a second to tell them why (a second's
/// worth at once): at ~0.25 ms of CPU a handshake, at most ~1 % of the shard's core, however
/// many are refused. Past it they are closed at once.
pub const TLS_REFUSALS_PER_S: u64 = 32;

/// The node's client connections open at once, every shard's, greeting or served (counted in
/// `spindle_connections_open`); and their bound (`connections_max`).
pub struct Connections {
    metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    max: usize,
}

/// One open connection's place among the node's [`Connections`], given back when dropped: it
/// travels with the connection, handed over to its tenant's shard or not.
pub struct ConnSlot(std::sync::Arc<Connections>);

impl Connections {
    pub fn new(
        max: usize,
        metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    ) -> std::sync::Arc<Connections> {
        std::sync::Arc::new(Connections { metrics, max })
    }

    /// A place for one more connection, or `None` at the bound.
    pub fn try_open(self: &std::sync::Arc<Self>) -> Option<ConnSlot> {
        use std::sync::atomic::Ordering;
        self.metrics
            .connections_open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| ConnSlot(self.clone()))
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether no connection could be served now.
    pub fn is_full(&self) -> bool {
        self.metrics
            .connections_open
            .load(std::sync::atomic::Ordering::Acquire)
            >= self.max
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0
            .metrics
            .connections_open
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// One shard's connections still greeting (TLS handshake and Hello), held to a total and to a
/// number per source address. A new connection past either closes the oldest still greeting —
/// its own address's oldest, when that address holds its most — rather than being refused: an
/// idle or slow unauthenticated socket is the one to go, never the client that says Hello at
/// once. (Per shard: a connection greets on the shard whose executor accepted it.)
pub struct Greeting {
    max: usize,
    per_address_max: usize,
    next: u64,
    /// Oldest first: each greeting connection's id, address, and the sender whose drop tells
    /// it to close.
    live: std::collections::VecDeque<(u64, std::net::IpAddr, oneshot::Sender<()>)>,
}

impl Greeting {
    pub fn new(max: usize, per_address_max: usize) -> Greeting {
        Greeting {
            max: max.max(1),
            per_address_max: per_address_max.max(1),
            next: 0,
            live: std::collections::VecDeque::new(),
        }
    }

    /// A place for a connection from `from`: its id, the receiver that resolves if it is
    /// closed to make room for a newer one, and whether an older one was closed for it.
    pub fn admit(&mut self, from: std::net::IpAddr) -> (u64, oneshot::Receiver<()>, bool) {
        let same = self.live.iter().filter(|(_, a, _)| *a == from).count();
        let evict = if same >= self.per_address_max {
            self.live.iter().position(|(_, a, _)| *a == from)
        } else if self.live.len() >= self.max {
            Some(0)
        } else {
            None
        };
        // Dropping its sender tells that connection to close.
        let evicted = evict.and_then(|i| self.live.remove(i)).is_some();
        let (tx, rx) = oneshot::channel();
        let id = self.next;
        self.next += 1;
        self.live.push_back((id, from, tx));
        (id, rx, evicted)
    }

    /// The connection `id` is greeted (or gone).
    pub fn leave(&mut self, id: u64) {
        if let Some(i) = self.live.iter().position(|(x, _, _)| *x == id) {
            self.live.remove(i);
        }
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// A connection's place among its shard's greeting ones, given back when dropped.
struct Greets {
    ctx: Rc<ConnCtx>,
    id: u64,
}

impl Drop for Greets {
    fn drop(&mut self) {
        self.ctx.greeting.borrow_mut().leave(self.id);
        self.ctx
            .metrics
            .connections_greeting
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One shard's share of `connection_rate_max`: a token bucket of new connections (a second's
/// worth of burst), kept on the shard's thread.
pub struct AcceptPace {
    /// Connections a second; 0: no bound.
    per_s: u64,
    /// Tokens × 10⁹ (a token is gained every 10⁹ / `per_s` ns).
    level: u128,
    at: std::time::Instant,
}

const NANOS: u128 = 1_000_000_000;

impl AcceptPace {
    pub fn new(per_s: u64, now: std::time::Instant) -> AcceptPace {
        AcceptPace {
            per_s,
            level: u128::from(per_s) * NANOS,
            at: now,
        }
    }

    /// Takes a token for one connection (`None`), or says how long until there is one.
    pub fn take(&mut self, now: std::time::Instant) -> Option<std::time::Duration> {
        if self.per_s == 0 {
            return None;
        }
        let cap = u128::from(self.per_s) * NANOS;
        let gained = now.saturating_duration_since(self.at).as_nanos() * u128::from(self.per_s);
        self.level = (self.level + gained).min(cap);
        self.at = now;
        if self.level >= NANOS {
            self.level -= NANOS;
            return None;
        }
        let short = NANOS - self.level;
        let wait = short.div_ceil(u128::from(self.per_s));
        Some(std::time::Duration::from_nanos(wait as u64))
    }
}

pub use spindle_node_base::limits::ACCEPT_ERROR_PAUSE;

/// Takes this shard's new connections for ever: each one served, or refused past
/// `connections_max`, no faster than `per_s` a second (0: no bound).
///
/// The token is taken once a connection is there, not before the accept: one taken while the
/// shard waited would let a second's worth plus one through at once. Past the rate the
/// connection accepted waits its turn and the next ones wait in the kernel's backlog.
pub async fn accept(listener: glommio::net::TcpListener, ctx: Rc<ConnCtx>, per_s: u64) {
    let mut pace = AcceptPace::new(per_s, std::time::Instant::now());
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!("accept: {e}");
                glommio::timer::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        while let Some(wait) = pace.take(std::time::Instant::now()) {
            glommio::timer::sleep(wait).await;
        }
        if ctx.connections.is_full() {
            glommio::spawn_local(refuse(stream, ctx.clone())).detach();
        } else {
            glommio::spawn_local(serve(stream, ctx.clone())).detach();
        }
    }
}

/// A connection past `connections_max` is answered `Overloaded`, naming the bound, within
/// [`REFUSE_WITHIN`] (a plain one after its Hello is read, so that the answer is not lost to a
/// reset; a TLS one after its handshake), while the shard tells fewer than [`REFUSING_MAX`] at
/// once and — over TLS — while its [`TLS_REFUSALS_PER_S`] allow; past those it is closed at
/// once, without a word or a handshake.
pub async fn refuse(stream: Stream, ctx: Rc<ConnCtx>) {
    ctx.metrics
        .connections_refused
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if ctx.refusing.get() >= REFUSING_MAX {
        return;
    }
    if ctx.tls.is_some()
        && ctx
            .tls_refusals
            .borrow_mut()
            .take(std::time::Instant::now())
            .is_some()
    {
        return;
    }
    ctx.refusing.set(ctx.refusing.get() + 1);
    let mut link = Link::plain(stream);
    let _ = glommio::timer::timeout(REFUSE_WITHIN, async {
        // Its Hello is read first; a plain client on the TLS port has had its first bytes
        // read by the handshake already.
        let hello_unread = match &ctx.tls {
            None => true,
            Some(config) => match link.accept_tls(config.clone()).await {
                Ok(Accepted::Tls) => true,
                Ok(Accepted::Plain) => false,
                Err(_) => return Ok(()),
            },
        };
        if hello_unread {
            let mut first = [0u8; 1024];
            let _ = link.read(&mut first).await;
        }
        let e = WireError::new(
            ErrorCode::Overloaded,
            format!(
                "this node holds its most client connections ({}): connect to another node or \
                 later",
                ctx.connections.max()
            ),
        );
        let _ = link.write_all(&frame(0, Response::Error(e))).await;
        let _ = link.close().await;
        Ok(())
    })
    .await;
    ctx.refusing.set(ctx.refusing.get() - 1);
}

/// What every connection on this executor shares.
pub struct ConnCtx {
    pub node_id: String,
    /// The shard whose executor this is.
    pub index: usize,
    pub shards: Vec<mpsc::Sender<ShardMsg>>,
    /// Each shard's queue of connections handed over to it.
    pub handoffs: Vec<mpsc::Sender<Handoff>>,
    /// Each tenant's credential, as its digest (`spindle_node_base::credential`).
    pub credentials: HashMap<u32, spindle_node_base::credential::Credential>,
    /// Tenants other cells serve: their cell's name and address (`cells`).
    pub other_cells: std::sync::Arc<HashMap<u32, (String, String)>>,
    pub partitions: u32,
    pub inflight_max: usize,
    pub metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    pub ownership: std::sync::Arc<spindle_node_base::ownership::Ownership>,
    /// This executor's shard: a tenant's connection is served on the shard that owns it, and
    /// admits its submits there directly (`shard::decide_now`).
    pub local: crate::shard::SharedShard,
    /// Its tenants' refusals, and their suspensions (`crate::breaker`).
    pub breaker: crate::breaker::Breaker,
    /// The listener speaks TLS with this (`[tls]`); plain without.
    pub tls: Option<std::sync::Arc<crate::tls::ServerConfig>>,
    /// The node's open client connections and their bound.
    pub connections: std::sync::Arc<Connections>,
    /// Refused connections this shard is telling why ([`refuse`]).
    pub refusing: std::cell::Cell<usize>,
    /// The refused TLS connections this shard may still handshake with ([`TLS_REFUSALS_PER_S`]).
    pub tls_refusals: std::cell::RefCell<AcceptPace>,
    /// The connections greeting on this shard, and how long each may take (`hello_timeout_ms`).
    pub greeting: std::cell::RefCell<Greeting>,
    pub hello_within: std::time::Duration,
    /// Failed Hellos per address and tenant, node-wide (`spindle_node_base::auth_guard`).
    pub auth: std::sync::Arc<std::sync::Mutex<spindle_node_base::auth_guard::AuthGuard>>,
}

impl ConnCtx {
    /// Another cell's tenant is sent there (`WrongNode`, redirecting to its cell's address)
    /// before anything is checked here: that cell authenticates it. Counted as a wrong node.
    fn other_cell(&self, tenant: TenantId) -> Option<WireError> {
        let (cell, address) = self.other_cells.get(&tenant.0)?;
        self.metrics
            .wrong_node
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(
            WireError::new(
                ErrorCode::WrongNode,
                format!("tenant {tenant} is served by cell {cell} at {address}"),
            )
            .redirecting_to(address.clone()),
        )
    }

    /// The shard that owns `tenant`.
    fn owner_of(&self, tenant: TenantId) -> usize {
        spindle_node_base::config::shard_of(tenant.0, self.partitions, self.shards.len() as u32)
    }

    fn shard_of(&self, tenant: TenantId) -> &mpsc::Sender<ShardMsg> {
        &self.shards[self.owner_of(tenant)]
    }

    /// Constant-time over the presented credential's digest: the time taken says nothing
    /// about how much of it matched, nor whether the tenant is known.
    fn authenticate(&self, tenant: TenantId, presented: &str) -> bool {
        match self.credentials.get(&tenant.0) {
            Some(credential) => credential.matches(presented),
            None => spindle_node_base::credential::Credential::compare_unknown(presented),
        }
    }
}

/// What the tenant breaker counts as refused in an answer given without PostgreSQL: a
/// submit's rejected tasks, or an error. Not the tasks refused for the node's own load
/// (`REJECT_PLATFORM_OVERLOADED`): a traffic spike is many clients none of whom was told to
/// wait yet, and a tenant is not suspended for the node's state.
fn refusals_in(body: &Response) -> u64 {
    let counted = |a: &spindle_wire::Admission| {
        !a.decision.is_accepted() && a.decision != spindle_core::Decision::RejectPlatformOverloaded
    };
    match body {
        Response::Admission(a) => u64::from(counted(a)),
        Response::SubmitBatch(all) => all.iter().filter(|a| counted(a)).count() as u64,
        Response::Error(_) => 1,
        _ => 0,
    }
}

/// Counts `refused` of `tenant`'s requests with the breaker; when that suspends the tenant,
/// says so on the connection (request id 0: the connection's, after what it was answered)
/// and answers true: the connection closes.
async fn suspends(
    ctx: &ConnCtx,
    tenant: TenantId,
    refused: u64,
    now: std::time::Instant,
    out: &mpsc::Sender<Vec<u8>>,
) -> bool {
    let Verdict::Suspended(left) = ctx.breaker.refused(tenant, refused, now) else {
        return false;
    };
    let e = crate::breaker::suspended_error(tenant, left);
    let _ = out.send(frame(0, Response::Error(e))).await;
    true
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

/// What the bytes read so far hold next.
enum Next {
    /// A whole request, verified and validated.
    Request(RequestFrame),
    /// Nothing whole yet: read more.
    More,
    /// A frame that could not be decoded, and its error answer: the frame boundary is intact,
    /// so only this frame is refused and the connection goes on.
    Refused(Vec<u8>),
    /// A framing error (zero or oversized length), and its answer: the stream cannot be
    /// resynchronized, so the connection closes after it.
    Fatal(Vec<u8>),
}

fn next_request(frames: &mut FrameReader) -> Next {
    match frames.next_frame() {
        Ok(None) => Next::More,
        Err(e) => Next::Fatal(frame(0, Response::Error(e))),
        Ok(Some(payload)) => match decode_request(payload) {
            Ok(r) => Next::Request(r),
            Err(e) => Next::Refused(frame(request_id_of(payload), Response::Error(e))),
        },
    }
}

/// Serves one accepted connection: its Hello here, then everything else on the shard that owns
/// the authenticated tenant — handed over when another shard's executor accepted it, so that
/// its frames and answers never cross threads.
pub async fn serve(stream: Stream, ctx: Rc<ConnCtx>) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!("TCP_NODELAY: {e}");
    }
    let from = stream
        .peer_addr()
        .map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), |a| {
            a.ip()
        });
    let (id, evicted, evicting) = ctx.greeting.borrow_mut().admit(from);
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    ctx.metrics.connections_greeting.fetch_add(1, relaxed);
    if evicting {
        ctx.metrics.connections_evicted.fetch_add(1, relaxed);
    }
    let greets = Greets {
        ctx: ctx.clone(),
        id,
    };
    let mut link = Link::plain(stream);
    // Nothing big is buffered before the Hello: its frames are held to a few KiB.
    let mut frames = spindle_wire::greeting::reader();
    let greeted = glommio::timer::timeout(ctx.hello_within, async {
        // Closed at once when a newer connection needs its place (see `Greeting`).
        let greet = std::pin::pin!(greet(&mut link, &ctx, &mut frames, from));
        Ok(
            match futures_util::future::select(greet, std::pin::pin!(evicted)).await {
                futures_util::future::Either::Left((greeted, _)) => greeted,
                futures_util::future::Either::Right(_) => None,
            },
        )
    })
    .await;
    drop(greets);
    let Ok(Some((tenant, mut slot))) = greeted else {
        // Its end of the stream after the error answer, as a served connection's writer does.
        let _ = link.close().await;
        return;
    };
    frames.set_limit(FRAME_BYTES_MAX);
    let owner = ctx.owner_of(tenant);
    if owner != ctx.index {
        match hand_over(link, &ctx, owner, tenant, frames, slot) {
            Ok(()) => return,
            // The owner's queue of handed-over connections is full (or the descriptor could
            // not be duplicated): served here, its frames crossing to the owner as messages.
            Err((back, rest, kept)) => {
                link = back;
                frames = rest;
                slot = kept;
            }
        }
    }
    serve_tenant(link, ctx, tenant, frames, slot).await;
}

/// The TLS handshake where the listener speaks TLS, then the Hello.
async fn greet(
    link: &mut Link<Stream>,
    ctx: &ConnCtx,
    frames: &mut FrameReader,
    from: std::net::IpAddr,
) -> Option<(TenantId, ConnSlot)> {
    if let Some(config) = &ctx.tls {
        match link.accept_tls(config.clone()).await {
            Ok(Accepted::Tls) => {}
            Ok(Accepted::Plain) => {
                let e = WireError::new(
                    ErrorCode::NotAuthenticated,
                    "this node's port speaks TLS: connect with TLS",
                );
                let _ = link.write_all(&frame(0, Response::Error(e))).await;
                return None;
            }
            Err(e) => {
                tracing::debug!("a TLS handshake failed: {e}");
                return None;
            }
        }
    }
    hello(link, ctx, frames, from).await
}

/// Reads up to the Hello and answers it. `Some(tenant, its place among the served
/// connections)` once authenticated (with the frames that followed it still in `frames`);
/// `None` when the connection is to close — its error, if any, already written. Anything but
/// a Hello that decodes closes the connection.
async fn hello(
    stream: &mut Link<Stream>,
    ctx: &ConnCtx,
    frames: &mut FrameReader,
    from: std::net::IpAddr,
) -> Option<(TenantId, ConnSlot)> {
    let mut buf = vec![0u8; GREETING_READ_CHUNK];
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => n,
        };
        frames.extend(&buf[..n]);
        use spindle_wire::greeting::FirstRequest;
        let (id, h) = match spindle_wire::greeting::first_request(frames) {
            FirstRequest::More => continue,
            FirstRequest::Hello { request_id, hello } => (request_id, hello),
            FirstRequest::Refused { request_id, error } => {
                let _ = stream
                    .write_all(&frame(request_id, Response::Error(error)))
                    .await;
                return None;
            }
            FirstRequest::Fatal(error) => {
                let _ = stream.write_all(&frame(0, Response::Error(error))).await;
                return None;
            }
        };
        let refuse = |code, why: String| frame(id, Response::Error(WireError::new(code, why)));
        use spindle_node_base::auth_guard::Before;
        let arrived = std::time::Instant::now();
        let verdict = ctx
            .auth
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .before(from, h.tenant.0, arrived);
        match verdict {
            Before::Check => {}
            Before::Delay(wait) => glommio::timer::sleep(wait).await,
            Before::Refuse(left) => {
                let no = refuse(
                    ErrorCode::AuthFailed,
                    format!(
                        "too many failed Hellos from this address: refused for {} s more",
                        left.as_secs().max(1)
                    ),
                );
                let _ = stream.write_all(&no).await;
                return None;
            }
        }
        if let Some(e) = ctx.other_cell(h.tenant) {
            let _ = stream.write_all(&frame(id, Response::Error(e))).await;
            return None;
        }
        if !ctx.authenticate(h.tenant, &h.credential) {
            ctx.auth.lock().unwrap_or_else(|p| p.into_inner()).failed(
                from,
                h.tenant.0,
                std::time::Instant::now(),
            );
            let no = refuse(
                ErrorCode::AuthFailed,
                format!("tenant {} refused", h.tenant),
            );
            let _ = stream.write_all(&no).await;
            return None;
        }
        if let Some(left) = ctx
            .metrics
            .suspensions
            .left(h.tenant, std::time::Instant::now())
        {
            let e = crate::breaker::suspended_error(h.tenant, left);
            let _ = stream.write_all(&frame(id, Response::Error(e))).await;
            return None;
        }
        let partition = spindle_node_base::config::partition_of(h.tenant.0, ctx.partitions);
        if !ctx.ownership.owns(partition) {
            let e = ctx.ownership.refusal(h.tenant.0, partition);
            ctx.metrics
                .wrong_node
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = stream.write_all(&frame(id, Response::Error(e))).await;
            return None;
        }
        // A place among the served connections, taken once the client is known: one that
        // filled meanwhile is told so, as at the accept.
        let Some(slot) = ctx.connections.try_open() else {
            ctx.metrics
                .connections_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let e = WireError::new(
                ErrorCode::Overloaded,
                format!(
                    "this node holds its most client connections ({}): connect to another \
                     node or later",
                    ctx.connections.max()
                ),
            );
            let _ = stream.write_all(&frame(id, Response::Error(e))).await;
            return None;
        };
        let ok = Response::HelloOk(HelloOk {
            protocol_version: PROTOCOL_VERSION,
            node_id: ctx.node_id.clone(),
            frame_bytes_max: FRAME_BYTES_MAX as u32,
            batch_max: BATCH_MAX as u32,
        });
        return stream
            .write_all(&frame(id, ok))
            .await
            .is_ok()
            .then_some((h.tenant, slot));
    }
}

/// An authenticated connection on its way to the shard that owns its tenant.
pub struct Handoff {
    fd: std::os::fd::OwnedFd,
    /// Its TLS session, where the listener speaks TLS.
    tls: Option<Session>,
    tenant: TenantId,
    /// What arrived after the Hello and is not yet served.
    frames: FrameReader,
    slot: ConnSlot,
}

/// Hands `stream` to shard `owner`, or gives it back when that cannot be done now.
#[allow(clippy::result_large_err)]
fn hand_over(
    link: Link<Stream>,
    ctx: &ConnCtx,
    owner: usize,
    tenant: TenantId,
    frames: FrameReader,
    slot: ConnSlot,
) -> Result<(), (Link<Stream>, FrameReader, ConnSlot)> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    let Ok(permit) = ctx.handoffs[owner].try_reserve() else {
        return Err((link, frames, slot));
    };
    // glommio's stream gives its descriptor only as a raw one.
    #[allow(unsafe_code)]
    // SAFETY: the descriptor is the stream's, open for as long as `stream` lives, which
    // outlasts this borrow. Duplicated, the socket outlives the stream dropped below (a drop
    // closes the stream's own descriptor; it does not shut the socket down).
    let fd = unsafe { BorrowedFd::borrow_raw(link.get_ref().as_raw_fd()) }.try_clone_to_owned();
    match fd {
        Ok(fd) => {
            let (stream, tls) = link.into_parts();
            drop(stream);
            permit.send(Handoff {
                fd,
                tls,
                tenant,
                frames,
                slot,
            });
            Ok(())
        }
        Err(e) => {
            tracing::warn!("a connection could not be handed to its shard: {e}");
            Err((link, frames, slot))
        }
    }
}

/// Takes up the connections other shards hand to this one, until the node stops.
pub async fn take_handoffs(mut rx: mpsc::Receiver<Handoff>, ctx: Rc<ConnCtx>) {
    use std::os::fd::{FromRawFd, IntoRawFd};
    while let Some(h) = rx.recv().await {
        #[allow(unsafe_code)]
        // SAFETY: an open socket descriptor this task owns, given up here to the stream.
        let stream = unsafe { Stream::from_raw_fd(h.fd.into_raw_fd()) };
        let link = Link::from_parts(stream, h.tls);
        glommio::spawn_local(serve_tenant(link, ctx.clone(), h.tenant, h.frames, h.slot)).detach();
    }
}

/// What becomes of a request: a submit admitted here and answered at once, or something to
/// wait for.
enum Route {
    /// Nothing for PostgreSQL (refused, or every task rejected).
    Answered(Response),
    Wait(Pending),
}

/// A request whose answer comes later, holding one of the connection's in-flight permits.
enum Pending {
    /// For the shard's inbox, with the receiver of its answer.
    Shard(ShardMsg, oneshot::Receiver<Response>),
    /// Accepted tasks of a submit admitted here, for their group commit.
    Commit(crate::shard::Admitted),
}

/// A request for the shard's inbox; `msg` makes it around the sender of its answer.
fn to_shard(msg: impl FnOnce(oneshot::Sender<Response>) -> ShardMsg) -> Route {
    let (reply, answer) = oneshot::channel();
    Route::Wait(Pending::Shard(msg(reply), answer))
}

/// A submit frame, admitted on the connection's own thread when that is its tenant's shard
/// and the shard's block of task ids covers it; otherwise through the shard's inbox.
fn submit_route(
    ctx: &ConnCtx,
    tenant: TenantId,
    tasks: Vec<spindle_wire::SubmitTask>,
    batch: bool,
) -> Route {
    let tasks = if ctx.owner_of(tenant) == ctx.index {
        match crate::shard::decide_now(&ctx.local, tenant, tasks, batch) {
            Ok(crate::shard::Decided::Answered(body)) => return Route::Answered(body),
            Ok(crate::shard::Decided::Commit(admitted)) => {
                return Route::Wait(Pending::Commit(admitted))
            }
            Err(tasks) => tasks,
        }
    } else {
        tasks
    };
    to_shard(|reply| ShardMsg::Submit {
        tenant,
        tasks,
        batch,
        reply,
    })
}

/// A request's answer on its way to the connection's writer: encoded, counted (a submit's, in
/// `/metrics`), queued. Holds the request's in-flight permit until its frame is queued.
struct Answer {
    id: u64,
    received: std::time::Instant,
    out: mpsc::Sender<Vec<u8>>,
    metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    permit: Option<glommio::sync::StaticPermit>,
}

/// A request's answer framed; a submit's counted in `/metrics` with its time since `received`.
fn encode_answer(
    metrics: &spindle_node_base::metrics::Metrics,
    id: u64,
    received: std::time::Instant,
    body: Response,
) -> Vec<u8> {
    let outcome = submit_outcome(&body);
    let bytes = frame(id, body);
    if let Some(accepted) = outcome {
        metrics.answered_submit(accepted, received.elapsed());
    }
    bytes
}

impl Answer {
    fn encode(&self, body: Response) -> Vec<u8> {
        encode_answer(&self.metrics, self.id, self.received, body)
    }

    /// Queues the answer from the calling task, with no await. Only when the writer's queue
    /// is full does a task of its own wait for room, holding the permit: such waits stay
    /// bounded by the connection's in-flight limit.
    fn send_now(mut self, body: Response) {
        let bytes = self.encode(body);
        match self.out.try_send(bytes) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(bytes)) => {
                let permit = self.permit.take();
                let out = self.out.clone();
                glommio::spawn_local(async move {
                    let _ = out.send(bytes).await;
                    drop(permit);
                })
                .detach();
            }
            // The connection is gone: nobody to answer.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    async fn send(self, body: Response) {
        let bytes = self.encode(body);
        let _ = self.out.send(bytes).await;
    }
}

/// Serves an authenticated connection of `tenant` on the shard that owns it (or, when it could
/// not be handed over, wherever it is): every command is the tenant's, answered in any order.
/// Serves an authenticated connection on its tenant's shard; its `slot` is given back when it
/// ends.
async fn serve_tenant(
    link: Link<Stream>,
    ctx: Rc<ConnCtx>,
    t: TenantId,
    mut frames: FrameReader,
    slot: ConnSlot,
) {
    ctx.metrics.shards[ctx.index]
        .connections
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (mut reader, mut writer) = link.split();
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
    let mut buf = vec![0u8; READ_CHUNK];
    // The tasks this connection subscribed to, for the shard to drop when it closes (`None`:
    // more than it keeps count of — then every task's subscribers are looked at).
    let mut subscribed: Option<std::collections::HashSet<spindle_core::TaskId>> =
        Some(Default::default());
    'conn: loop {
        // Every whole frame received so far (first, those that came with the Hello), then
        // more from the socket.
        loop {
            let request = match next_request(&mut frames) {
                Next::Request(r) => r,
                Next::More => break,
                Next::Refused(answer) => {
                    if out_tx.send(answer).await.is_err()
                        || suspends(&ctx, t, 1, std::time::Instant::now(), &out_tx).await
                    {
                        break 'conn;
                    }
                    continue;
                }
                Next::Fatal(answer) => {
                    let _ = out_tx.send(answer).await;
                    break 'conn;
                }
            };
            let id = request.request_id;
            // Frame decoded → answer encoded: what `/metrics` reports as the node's own
            // submit latency (the client adds the network and its own scheduling).
            let received = std::time::Instant::now();
            if let Verdict::Suspended(left) = ctx.breaker.check(t, received) {
                let e = crate::breaker::suspended_error(t, left);
                let _ = out_tx.send(frame(id, Response::Error(e))).await;
                break 'conn;
            }
            let Some(route) = route_of(&ctx, t, id, request.body, &mut subscribed, &out_tx).await
            else {
                continue;
            };
            let pending = match route {
                Route::Answered(body) => {
                    // A rejection's whole path is this task's: no hop, no answering task.
                    let refused = refusals_in(&body);
                    let bytes = encode_answer(&ctx.metrics, id, received, body);
                    let _ = out_tx.send(bytes).await;
                    if suspends(&ctx, t, refused, received, &out_tx).await {
                        break 'conn;
                    }
                    continue;
                }
                Route::Wait(pending) => pending,
            };
            let Ok(permit) = inflight.acquire_static_permit(1).await else {
                break 'conn;
            };
            let answer = Answer {
                id,
                received,
                out: out_tx.clone(),
                metrics: ctx.metrics.clone(),
                permit: Some(permit),
            };
            if !send_pending(&ctx, t, pending, answer).await {
                break 'conn;
            }
        }
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if reader.wants_write() {
            // What rustls has to send after this read leaves with the writer's next write:
            // an empty one, now, unless the writer is busy (then its next write takes it).
            let _ = out_tx.try_send(Vec::new());
        }
        frames.extend(&buf[..n]);
    }
    // Closed: its place among the served connections is free at once, and its subscriptions
    // go, so that the writer — and the socket — end once the answers in flight are written.
    drop(slot);
    let tasks = subscribed.map(|set| set.into_iter().collect::<Vec<_>>());
    if tasks.as_ref().is_none_or(|t| !t.is_empty()) {
        let gone = ShardMsg::Disconnected {
            tasks,
            out: out_tx.clone(),
        };
        let _ = ctx.shard_of(t).send(gone).await;
    }
    drop(out_tx);
    let _ = writer_task.await;
}

/// Where request `id`'s `body` goes: answered here, or to the tenant's shard (`None`: answered
/// already, nothing else to do). Keeps the connection's `subscribed` tasks.
async fn route_of(
    ctx: &Rc<ConnCtx>,
    t: TenantId,
    id: u64,
    body: Request,
    subscribed: &mut Option<std::collections::HashSet<spindle_core::TaskId>>,
    out_tx: &mpsc::Sender<Vec<u8>>,
) -> Option<Route> {
    Some(match body {
        Request::Hello(_) => {
            let e = WireError::new(
                ErrorCode::AlreadyAuthenticated,
                "Hello was already accepted",
            );
            let _ = out_tx.send(frame(id, Response::Error(e))).await;
            return None;
        }
        Request::Submit(task) => submit_route(ctx, t, vec![task], false),
        Request::SubmitBatch(tasks) => submit_route(ctx, t, tasks, true),
        Request::Get(task) => to_shard(|reply| ShardMsg::Get {
            tenant: t,
            task,
            reply,
        }),
        Request::Cancel(task) => to_shard(|reply| ShardMsg::Cancel {
            tenant: t,
            task,
            reply,
        }),
        Request::Subscribe(task) => {
            if let Some(set) = subscribed {
                set.insert(task);
                if set.len() > 2 * crate::shard::SUBSCRIPTIONS_PER_TENANT_MAX {
                    *subscribed = None;
                }
            }
            to_shard(|reply| ShardMsg::Subscribe {
                tenant: t,
                task,
                request_id: id,
                out: out_tx.clone(),
                reply,
            })
        }
        Request::Unsubscribe(task) => {
            if let Some(set) = subscribed {
                set.remove(&task);
            }
            to_shard(|reply| ShardMsg::Unsubscribe {
                task,
                out: out_tx.clone(),
                reply,
            })
        }
    })
}

/// Sends a request that waits to its shard, or to its group commit: `false` when the shard is
/// gone (the node is stopping) and the connection ends.
async fn send_pending(ctx: &Rc<ConnCtx>, t: TenantId, pending: Pending, answer: Answer) -> bool {
    match pending {
        Pending::Shard(msg, reply) => {
            if ctx.shard_of(t).send(msg).await.is_err() {
                let e = WireError::new(ErrorCode::Draining, "the node is stopping");
                let _ = answer.out.send(frame(answer.id, Response::Error(e))).await;
                return false;
            }
            let ctx = ctx.clone();
            glommio::spawn_local(async move {
                let body = reply.await.unwrap_or_else(|_| {
                    Response::Error(WireError::new(
                        ErrorCode::Internal,
                        "the shard dropped the request",
                    ))
                });
                // Past its rate: a refusal (the connection's next request sees a
                // suspension it trips).
                if matches!(&body, Response::Error(e) if e.code == ErrorCode::RateLimited) {
                    ctx.breaker.refused(t, 1, std::time::Instant::now());
                }
                answer.send(body).await;
            })
            .detach();
        }
        Pending::Commit(admitted) => {
            // The commit answers the moment its outcome is known, from its own task.
            let local = ctx.local.clone();
            glommio::spawn_local(async move {
                crate::shard::commit(&local, admitted, |body| answer.send_now(body)).await;
            })
            .detach();
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second's worth of connections at once, then one every 1/rate; no bound at 0.
    #[test]
    fn the_accept_pace_gives_a_seconds_worth_then_the_rate() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let mut pace = AcceptPace::new(4, t0);
        for _ in 0..4 {
            assert_eq!(pace.take(t0), None);
        }
        assert_eq!(pace.take(t0), Some(Duration::from_millis(250)));
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(pace.take(t1), Some(Duration::from_millis(150)));
        let t2 = t0 + Duration::from_millis(250);
        assert_eq!(pace.take(t2), None);
        assert_eq!(pace.take(t2), Some(Duration::from_millis(250)));
        // Idle for long: no more than a second's worth is saved up.
        let t3 = t2 + Duration::from_secs(60);
        for _ in 0..4 {
            assert_eq!(pace.take(t3), None);
        }
        assert!(pace.take(t3).is_some());
        let mut free = AcceptPace::new(0, t0);
        assert!((0..10_000).all(|_| free.take(t0).is_none()));
    }

    fn admission(task: u64) -> Response {
        Response::Admission(spindle_wire::Admission {
            task: spindle_core::TaskId(task),
            decision: spindle_core::Decision::Accepted,
            reason: None,
            replay: false,
            queue_level: 0,
            expected_start_ms: 0,
            retry_after_ms: 0,
        })
    }

    /// A commit's answer that finds the writer's queue full is neither dropped nor awaited by
    /// the commit: a task of its own queues it once there is room, and only then gives the
    /// request's in-flight permit back. With room, it is queued at once.
    #[test]
    fn an_answer_meeting_a_full_writer_queue_waits_for_room_with_its_permit() {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(|| async move {
                let metrics = spindle_node_base::metrics::Metrics::new(1);
                let inflight = Rc::new(glommio::sync::Semaphore::new(2));
                let (out, mut writer) = mpsc::channel::<Vec<u8>>(1);
                let answer = |id: u64| Answer {
                    id,
                    received: std::time::Instant::now(),
                    out: out.clone(),
                    metrics: metrics.clone(),
                    permit: Some(inflight.clone().try_acquire_static_permit(1).expect("room")),
                };
                let (first, second) = (answer(7), answer(8));
                assert_eq!(inflight.available(), 0);
                first.send_now(admission(70));
                // Queued at once: its permit is back.
                assert_eq!(inflight.available(), 1);
                second.send_now(admission(80));
                // The queue was full: the answer waits, holding its permit.
                assert_eq!(inflight.available(), 1);
                // The writer drains its queue; each turn gives the waiting task its chance.
                let mut ids = Vec::new();
                for _ in 0..64 {
                    while let Ok(bytes) = writer.try_recv() {
                        let mut frames = FrameReader::new();
                        frames.extend(&bytes);
                        let payload = frames.next_frame().expect("framed").expect("whole");
                        let frame = spindle_wire::decode_response(payload).expect("decodes");
                        ids.push(frame.request_id);
                    }
                    if ids.len() == 2 && inflight.available() == 2 {
                        break;
                    }
                    glommio::executor().yield_now().await;
                }
                assert_eq!(ids, [7, 8], "both answers reach the writer, in order here");
                // Once queued, the waiting answer's permit is back too.
                assert_eq!(inflight.available(), 2);
                let text = spindle_node_base::exposition::Exposition::collect(&[&*metrics]).text;
                assert!(
                    text.contains("spindle_submit_answer_seconds_count{outcome=\"accepted\"} 2"),
                    "both counted as accepted answers"
                );
            })
            .expect("executor")
            .join()
            .expect("test body");
    }
}
