//! The node's HTTP port, on hyper: `/livez`, `/readyz`, `/metrics`, `/dashboard`, the admin API
//! (`/admin/v1/…`) and signed provider callbacks (`POST /v1/provider/callback`), plain or over
//! TLS. HTTP/1.1 with keep-alive, `HEAD`, and bodies sent whole or chunked (at most
//! `BODY_BYTES_MAX`, else `413`).
//!
//! Connections are held to `http_connections_max`. A new one past it closes the oldest
//! connection that is not in the middle of a request — idle between requests, or still sending
//! its head — so that idle or slow sockets never keep a probe, a scrape or a callback from
//! being answered; only when every connection is being answered is a new one told `503` with
//! `retry-after: 1`. A request's head must come within [`HEAD_WITHIN`]; each route has its own
//! time to answer (`Route::budget`). `/livez` is the node's liveness as a whole: every
//! shard's loop must have ticked lately ([`LIVENESS_STALE`]), not only this thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::oneshot;

use spindle_node_base::exposition::{Collect, Exposition};
use spindle_node_base::limits::HEAD_BYTES_MAX;
pub use spindle_node_base::limits::REPLAYS_MAX;
use spindle_node_base::metrics::Metrics;

/// The parts rendered on `/metrics` besides the counters, added as the wiring starts them (the
/// media workers start after the port).
pub type Collectors = Arc<Mutex<Vec<Arc<dyn Collect>>>>;

/// Where provider callbacks go, once the provider thread runs.
pub type CallbackSink = Arc<std::sync::OnceLock<Arc<spindle_node_workers::dispatch::Dispatcher>>>;

/// The operator dashboard: one static page, its script and its style, that read `/metrics`
/// (and, signed in with a viewer token, the audit log) and redraw every second. No build step,
/// no external assets, no inline code: the policy below lets the page run only its own script.
const DASHBOARD: &str = include_str!("dashboard.html");
const DASHBOARD_JS: &str = include_str!("dashboard.js");
const DASHBOARD_CSS: &str = include_str!("dashboard.css");
const DASHBOARD_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
     base-uri 'none'";
/// The cookie that keeps a signed-in dashboard's viewer token: HttpOnly (its script never sees
/// it), sent only to this node's admin API, only from its own pages, for an hour.
const SESSION_COOKIE: &str = "spindle_dashboard";
const SESSION_S: u32 = 3_600;

/// How long a request's head (its line and headers) may take to arrive.
pub const HEAD_WITHIN: Duration = Duration::from_secs(5);
/// A shard whose loop has not ticked for this long makes `/livez` fail.
pub const LIVENESS_STALE: Duration = Duration::from_secs(10);

/// What a connection past the bound, with every connection in a request, is told before it is
/// closed (written straight to a plain socket; a TLS one is closed at once).
const HTTP_BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// What the port answers with.
pub struct Port {
    pub metrics: Arc<Metrics>,
    /// The parts that write their own families for `/metrics` besides the node's counters
    /// (the live policy's lanes, the media pool): rendered after them, grouped by family.
    pub collectors: Collectors,
    pub sink: CallbackSink,
    pub admin: Option<Arc<crate::admin::Admin>>,
    /// The provider callbacks seen within their window (`Replays`).
    pub seen: Mutex<Replays>,
}

/// The signature tags of the callbacks taken within the window, oldest first: one seen again
/// is not acted on twice.
#[derive(Default)]
pub struct Replays {
    order: VecDeque<(u64, [u8; 32])>,
    tags: std::collections::HashSet<[u8; 32]>,
}

impl Replays {
    /// Whether `signed` is new (then remembered); tags older than `window_ms` before `now_ms`
    /// are forgotten first.
    pub fn first_time(
        &mut self,
        signed: spindle_providers::signature::Signed,
        now_ms: u64,
        window_ms: u64,
    ) -> bool {
        while let Some(&(at, tag)) = self.order.front() {
            if at + window_ms >= now_ms && self.order.len() < REPLAYS_MAX {
                break;
            }
            self.order.pop_front();
            self.tags.remove(&tag);
        }
        if !self.tags.insert(signed.tag) {
            return false;
        }
        // Kept in arrival order; a tag is forgotten a window after it was seen.
        self.order.push_back((now_ms, signed.tag));
        true
    }
}

/// The connections open on the port, oldest first, each with whether it is in a request and
/// the sender whose drop closes it.
struct Pool {
    max: usize,
    next: u64,
    live: VecDeque<(u64, Arc<AtomicBool>, oneshot::Sender<()>)>,
}

/// A connection's place in the pool.
struct Place {
    id: u64,
    busy: Arc<AtomicBool>,
    closed: oneshot::Receiver<()>,
}

impl Pool {
    /// A place for a new connection: at the bound, the oldest connection not in a request is
    /// closed for it (`Some(.., true)`); `None` when every one is in a request.
    fn admit(&mut self) -> Option<(Place, bool)> {
        let mut evicted = false;
        if self.live.len() >= self.max {
            let i = self
                .live
                .iter()
                .position(|(_, busy, _)| !busy.load(Ordering::Acquire))?;
            // Dropping its sender closes it.
            self.live.remove(i);
            evicted = true;
        }
        let (tx, rx) = oneshot::channel();
        let busy = Arc::new(AtomicBool::new(false));
        let id = self.next;
        self.next += 1;
        self.live.push_back((id, busy.clone(), tx));
        Some((
            Place {
                id,
                busy,
                closed: rx,
            },
            evicted,
        ))
    }

    fn leave(&mut self, id: u64) {
        if let Some(i) = self.live.iter().position(|(x, _, _)| *x == id) {
            self.live.remove(i);
        }
    }
}

/// Serves the port until the runtime stops.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    connections_max: usize,
    port: Arc<Port>,
) {
    let pool = Arc::new(Mutex::new(Pool {
        max: connections_max.max(1),
        next: 0,
        live: VecDeque::new(),
    }));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: this runtime is the control plane's, so the loop
                // pauses rather than taking its thread from the pipelines.
                tracing::warn!("http accept: {e}");
                tokio::time::sleep(spindle_node_base::limits::ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let admitted = pool.lock().unwrap_or_else(|p| p.into_inner()).admit();
        let Some((place, evicted)) = admitted else {
            port.metrics.http_refused.fetch_add(1, Ordering::Relaxed);
            if tls.is_none() {
                // Written straight to the socket (a fresh one's buffer takes it whole), not
                // through the reactor, which may not have seen it writable yet; never waited
                // for.
                if let Ok(mut socket) = stream.into_std() {
                    use std::io::Write;
                    let _ = socket.write(HTTP_BUSY);
                }
            }
            continue;
        };
        if evicted {
            port.metrics.http_evicted.fetch_add(1, Ordering::Relaxed);
        }
        let _ = stream.set_nodelay(true);
        let (port, tls, pool) = (port.clone(), tls.clone(), pool.clone());
        tokio::spawn(async move {
            let id = place.id;
            let closed = place.closed;
            let served = async {
                match tls {
                    None => connection(stream, &port, place.busy).await,
                    Some(tls) => {
                        match tokio::time::timeout(HEAD_WITHIN, tls.accept(stream)).await {
                            Ok(Ok(stream)) => connection(stream, &port, place.busy).await,
                            Ok(Err(e)) => {
                                tracing::debug!("a TLS handshake on the HTTP port failed: {e}")
                            }
                            Err(_) => tracing::debug!("a TLS handshake on the HTTP port timed out"),
                        }
                    }
                }
            };
            // Served to its end, or closed for a newer connection.
            tokio::select! {
                () = served => {}
                _ = closed => {}
            }
            pool.lock().unwrap_or_else(|p| p.into_inner()).leave(id);
        });
    }
}

/// Serves one connection's requests (keep-alive) until it closes.
async fn connection<S>(stream: S, port: &Arc<Port>, busy: Arc<AtomicBool>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let port = port.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (port, busy) = (port.clone(), busy.clone());
        async move {
            busy.store(true, Ordering::Release);
            let answer = handle(&port, req).await;
            busy.store(false, Ordering::Release);
            Ok::<_, std::convert::Infallible>(answer)
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_WITHIN)
        .max_buf_size(HEAD_BYTES_MAX.max(8192))
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// What a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Live,
    Ready,
    Metrics,
    Dashboard,
    DashboardJs,
    DashboardCss,
    SignIn,
    SignOut,
    Admin,
    Callback,
    NotFound,
}

impl Route {
    fn of(method: &Method, path: &str) -> Route {
        let read = method == Method::GET || method == Method::HEAD;
        match path {
            "/livez" => Route::Live,
            "/readyz" => Route::Ready,
            "/metrics" if read => Route::Metrics,
            "/dashboard" if read => Route::Dashboard,
            "/dashboard.js" if read => Route::DashboardJs,
            "/dashboard.css" if read => Route::DashboardCss,
            "/dashboard/login" if method == Method::POST => Route::SignIn,
            "/dashboard/logout" if method == Method::POST => Route::SignOut,
            "/v1/provider/callback" if method == Method::POST => Route::Callback,
            p if p.starts_with("/admin/") => Route::Admin,
            _ => Route::NotFound,
        }
    }

    /// How long the route may take to answer: the admin API's calls go to PostgreSQL (a
    /// counter rebuild takes a while); the rest is the node's memory.
    fn budget(self) -> Duration {
        match self {
            Route::Admin => Duration::from_secs(60),
            Route::Callback => Duration::from_secs(10),
            _ => Duration::from_secs(5),
        }
    }
}

async fn handle(port: &Port, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let route = Route::of(req.method(), req.uri().path());
    match tokio::time::timeout(route.budget(), answer(port, route, req)).await {
        Ok(response) => response,
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no answer within {:?}\n", route.budget()),
        ),
    }
}

async fn answer(port: &Port, route: Route, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let metrics = &port.metrics;
    match route {
        Route::Live => match metrics.stale_shard(LIVENESS_STALE) {
            None => text(StatusCode::OK, "ok\n".into()),
            Some((shard, since)) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "shard {shard} has not ticked for {} ms\n",
                    since.as_millis()
                ),
            ),
        },
        Route::Ready if metrics.ready() => text(StatusCode::OK, "ready\n".into()),
        Route::Ready => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", metrics.not_ready_why()),
        ),
        Route::Metrics => {
            let collectors = port
                .collectors
                .lock()
                .map(|c| c.clone())
                .unwrap_or_default();
            let mut parts: Vec<&dyn Collect> = vec![&**metrics];
            parts.extend(collectors.iter().map(|c| &**c));
            let mut r = text(StatusCode::OK, Exposition::collect(&parts).text);
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        }
        Route::Dashboard => page(DASHBOARD, "text/html; charset=utf-8"),
        Route::DashboardJs => page(DASHBOARD_JS, "text/javascript; charset=utf-8"),
        Route::DashboardCss => page(DASHBOARD_CSS, "text/css; charset=utf-8"),
        Route::SignOut => signed_in(None),
        Route::NotFound => text(StatusCode::NOT_FOUND, "not found\n".into()),
        Route::Admin | Route::Callback | Route::SignIn => {
            let (parts, body) = req.into_parts();
            let body = match Limited::new(body, spindle_providers::api::BODY_BYTES_MAX)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                    return text(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!(
                            "a body of at most {} bytes\n",
                            spindle_providers::api::BODY_BYTES_MAX
                        ),
                    )
                }
                Err(e) => return text(StatusCode::BAD_REQUEST, format!("reading the body: {e}\n")),
            };
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            if route == Route::Callback {
                return callback_route(port, &parts, &body).await;
            }
            let Some(admin) = &port.admin else {
                return text(StatusCode::NOT_FOUND, "no admin tokens configured\n".into());
            };
            if route == Route::SignIn {
                return match form_value(&body, "token") {
                    Some(token) if admin.knows(&token) => signed_in(Some(&token)),
                    _ => {
                        let mut r = text(
                            StatusCode::UNAUTHORIZED,
                            "not a token of this node\n".into(),
                        );
                        r.headers_mut().insert(
                            "content-security-policy",
                            HeaderValue::from_static(DASHBOARD_POLICY),
                        );
                        r
                    }
                };
            }
            // A signed-in dashboard reads with its cookie: for reads only (a page elsewhere
            // cannot send it, and nothing it allows changes anything).
            let authorization = header("authorization").or_else(|| {
                (parts.method == Method::GET)
                    .then(|| session_token(&parts.headers))
                    .flatten()
                    .map(|t| format!("Bearer {t}"))
            });
            let path = parts
                .uri
                .path_and_query()
                .map_or(parts.uri.path(), |p| p.as_str());
            let (status, body) = admin
                .handle(parts.method.as_str(), path, authorization.as_deref(), &body)
                .await;
            let mut r = text(status_of(status), body);
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            r
        }
    }
}

/// One of the dashboard's files, with the headers that keep it from being framed, its content
/// sniffed or cached, and a policy that lets it run only its own script and read only this
/// node.
fn page(body: &'static str, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(DASHBOARD_POLICY),
    );
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    r
}

/// Back to the dashboard, signed in with `token` (kept in the session cookie) or — `None` —
/// signed out (the cookie cleared).
fn signed_in(token: Option<&str>) -> Response<Full<Bytes>> {
    let cookie = match token {
        // Hex: a token may hold what a cookie may not.
        Some(t) => format!(
            "{SESSION_COOKIE}={}; Path=/admin/; Max-Age={SESSION_S}; HttpOnly; SameSite=Strict",
            t.bytes().map(|b| format!("{b:02x}")).collect::<String>()
        ),
        None => format!("{SESSION_COOKIE}=; Path=/admin/; Max-Age=0; HttpOnly; SameSite=Strict"),
    };
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::SEE_OTHER;
    let h = r.headers_mut();
    h.insert(
        hyper::header::LOCATION,
        HeaderValue::from_static("/dashboard"),
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        h.insert(hyper::header::SET_COOKIE, v);
    }
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    r
}

/// The dashboard's session token from a request's cookies.
fn session_token(headers: &hyper::HeaderMap) -> Option<String> {
    headers
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            let (k, v) = c.trim().split_once('=')?;
            if k != SESSION_COOKIE || v.is_empty() || v.len() % 2 != 0 {
                return None;
            }
            let bytes: Option<Vec<u8>> = (0..v.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(v.get(i..i + 2)?, 16).ok())
                .collect();
            String::from_utf8(bytes?).ok()
        })
}

/// A field of an `application/x-www-form-urlencoded` body, decoded (`+` a space, `%XX` a
/// byte); `None` when absent or not UTF-8.
fn form_value(body: &[u8], name: &str) -> Option<String> {
    let body = std::str::from_utf8(body).ok()?;
    body.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        if k != name {
            return None;
        }
        let mut out = Vec::with_capacity(v.len());
        let mut bytes = v.bytes();
        while let Some(b) = bytes.next() {
            match b {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = [bytes.next()?, bytes.next()?];
                    out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
                }
                b => out.push(b),
            }
        }
        String::from_utf8(out).ok()
    })
}

/// A plain-text answer.
fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// `"404 Not Found"` → 404 (the admin API's answers name their status so).
fn status_of(line: &str) -> StatusCode {
    line.split_whitespace()
        .next()
        .and_then(|c| c.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// `POST /v1/provider/callback`: spindle's API's signed job views, or a vendor's callback.
async fn callback_route(
    port: &Port,
    parts: &hyper::http::request::Parts,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let (status, answer) = match port.sink.get() {
        Some(d) if d.vendor() != spindle_providers::Vendor::Spindle => {
            let (status, answer) = vendor_callback(d, parts, body).await;
            if answer.starts_with('{') {
                // MiniMax's challenge, echoed as the JSON it came as.
                let mut r = text(status, answer);
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                return r;
            }
            (status, answer)
        }
        _ => {
            let signature = parts
                .headers
                .get(spindle_providers::signature::HEADER)
                .and_then(|v| v.to_str().ok());
            callback(port, body, signature).await
        }
    };
    text(status, answer)
}

/// A vendor's callback, checked and acted on by the dispatcher (`Dispatcher::on_vendor_callback`).
async fn vendor_callback(
    dispatcher: &spindle_node_workers::dispatch::Dispatcher,
    parts: &hyper::http::request::Parts,
    body: &[u8],
) -> (StatusCode, String) {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (status, answer) = dispatcher
        .on_vendor_callback(&spindle_providers::vendors::CallbackIn {
            headers: &parts.headers,
            query: parts.uri.query().unwrap_or(""),
            body,
            now_ms,
            window_ms: dispatcher.callback_window_ms(),
        })
        .await;
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        answer,
    )
}

/// A provider callback: its signature and the time it was signed first — outside the window,
/// or seen already within it, it changes nothing — then the body.
async fn callback(port: &Port, body: &[u8], signature: Option<&str>) -> (StatusCode, String) {
    use spindle_providers::signature::{verify_at, Refused};
    let metrics = &port.metrics;
    let Some(dispatcher) = port.sink.get() else {
        return (
            StatusCode::NOT_FOUND,
            "no provider configured\n".to_string(),
        );
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let window_ms = dispatcher.callback_window_ms();
    let signed = signature
        .ok_or(Refused::Bad)
        .and_then(|s| verify_at(dispatcher.secret(), body, s, now_ms, window_ms));
    let signed = match signed {
        Ok(s) => s,
        Err(Refused::Bad) => {
            metrics.callback("bad_signature");
            return (StatusCode::UNAUTHORIZED, "bad signature\n".to_string());
        }
        Err(Refused::OutsideWindow(off)) => {
            metrics.callback("outside_window");
            return (
                StatusCode::UNAUTHORIZED,
                format!("signed {off} ms from now, outside the {window_ms} ms window\n"),
            );
        }
    };
    let first = port
        .seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .first_time(signed, now_ms, window_ms);
    if !first {
        // Taken already: a provider sending it again after a lost answer is told so.
        metrics.callback("replayed");
        return (StatusCode::OK, "seen already\n".to_string());
    }
    match serde_json::from_slice::<spindle_providers::JobView>(body) {
        Ok(view) => {
            dispatcher.on_callback(view).await;
            (StatusCode::OK, "ok\n".to_string())
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("unreadable job: {e}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sign_in_form_and_its_cookie_are_read_back() {
        assert_eq!(
            form_value(b"a=1&token=ab%2Fc+d", "token"),
            Some("ab/c d".into())
        );
        assert_eq!(form_value(b"token=%zz", "token"), None);
        assert_eq!(form_value(b"other=1", "token"), None);
        let mut h = hyper::HeaderMap::new();
        h.insert(
            hyper::header::COOKIE,
            HeaderValue::from_static("x=1; spindle_dashboard=74303b6b; y=2"),
        );
        assert_eq!(session_token(&h), Some("t0;k".into()));
        let set = signed_in(Some("t0;k"));
        let cookie = set.headers()[hyper::header::SET_COOKIE].to_str().unwrap();
        assert!(
            cookie.starts_with("spindle_dashboard=74303b6b;"),
            "{cookie}"
        );
        let cleared = signed_in(None);
        let cookie = cleared.headers()[hyper::header::SET_COOKIE]
            .to_str()
            .unwrap();
        assert!(
            cookie.contains("Max-Age=0") && cookie.contains("HttpOnly"),
            "{cookie}"
        );
    }

    #[test]
    fn a_callback_is_taken_once_within_its_window() {
        use spindle_providers::signature::Signed;
        let mut r = Replays::default();
        let s = |tag: u8, at_ms| Signed {
            at_ms,
            tag: [tag; 32],
        };
        assert!(r.first_time(s(1, 1_000), 1_000, 300_000));
        assert!(!r.first_time(s(1, 1_000), 2_000, 300_000));
        assert!(r.first_time(s(2, 2_000), 2_000, 300_000));
        // A window on, the first is forgotten (its signed time is then outside the window
        // anyway); the second is still remembered.
        assert!(r.first_time(s(1, 1_000), 301_500, 300_000));
        assert!(!r.first_time(s(2, 2_000), 301_500, 300_000));
        assert!(r.order.len() <= REPLAYS_MAX);
    }

    /// At the bound a new connection closes the oldest one not in a request; with every one in
    /// a request it is refused.
    #[test]
    fn the_pool_closes_the_oldest_idle_connection_for_a_new_one() {
        let mut pool = Pool {
            max: 3,
            next: 0,
            live: VecDeque::new(),
        };
        let mut places: Vec<Place> = (0..3).map(|_| pool.admit().unwrap().0).collect();
        places[0].busy.store(true, Ordering::Release);
        let (fourth, evicted) = pool.admit().unwrap();
        assert!(evicted);
        // The second (the oldest idle one) was told to close; the first (busy) was not.
        assert_eq!(
            places[0].closed.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        );
        assert_eq!(
            places[1].closed.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        );
        for p in [&places[2], &fourth] {
            p.busy.store(true, Ordering::Release);
        }
        assert!(pool.admit().is_none(), "every connection is in a request");
        pool.leave(fourth.id);
        assert!(pool.admit().is_some());
    }

    #[test]
    fn routes_and_their_statuses() {
        assert_eq!(Route::of(&Method::HEAD, "/metrics"), Route::Metrics);
        assert_eq!(Route::of(&Method::POST, "/metrics"), Route::NotFound);
        assert_eq!(Route::of(&Method::GET, "/admin/v1/audit"), Route::Admin);
        assert_eq!(
            Route::of(&Method::GET, "/v1/provider/callback"),
            Route::NotFound
        );
        assert_eq!(status_of("404 Not Found"), StatusCode::NOT_FOUND);
        assert_eq!(Route::of(&Method::POST, "/dashboard/login"), Route::SignIn);
        assert_eq!(Route::of(&Method::GET, "/dashboard/login"), Route::NotFound);
        assert_eq!(status_of("nonsense"), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
