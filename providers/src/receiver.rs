//! An in-process receiver of the node's event batches (the platform's side of
//! [`crate::webhook`]), for tests and demos: it checks each post's signature, records every
//! event it takes, and can be told to refuse posts (503) to show that the relay tries again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

/// Bytes of one post the receiver reads at most.
pub const POST_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Events it keeps to hand back ([`EventReceiver::events`]); past them it only counts.
pub const KEPT_MAX: usize = 1_000_000;

/// One event as the receiver took it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Received {
    pub id: u64,
    pub kind: String,
    pub task: Option<u64>,
    pub tenant: Option<u32>,
    pub body: serde_json::Value,
}

#[derive(serde::Deserialize)]
struct Batch {
    events: Vec<Received>,
}

#[derive(Default)]
struct Shared {
    secret: Vec<u8>,
    events: Mutex<Taken>,
    refusing: AtomicBool,
    refused: AtomicU64,
    bad_signatures: AtomicU64,
    posts: AtomicU64,
}

#[derive(Default)]
struct Taken {
    kept: Vec<Received>,
    total: u64,
    last_id: Option<u64>,
    /// Events whose id was not above the one before (a repeat, or out of order).
    not_after: u64,
}

/// What the receiver took, as `GET /stats` answers it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReceiverStats {
    pub events: u64,
    pub posts: u64,
    pub refused: u64,
    pub bad_signatures: u64,
    /// Events whose id was not above the one before.
    pub not_after: u64,
}

/// The receiver; it stops serving when dropped.
pub struct EventReceiver {
    /// `http://ADDR` or `https://localhost:PORT`.
    base: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EventReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EventReceiver {
    pub fn serve(listener: tokio::net::TcpListener, secret: &[u8]) -> EventReceiver {
        EventReceiver::serve_on(listener, secret, None)
    }

    /// [`EventReceiver::serve`] over HTTPS with `tls` (a certificate for `localhost`: its URL
    /// is `https://localhost:PORT/events`).
    pub fn serve_tls(
        listener: tokio::net::TcpListener,
        secret: &[u8],
        tls: Arc<rustls::ServerConfig>,
    ) -> EventReceiver {
        EventReceiver::serve_on(listener, secret, Some(tls))
    }

    fn serve_on(
        listener: tokio::net::TcpListener,
        secret: &[u8],
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> EventReceiver {
        let addr = listener.local_addr().expect("a bound listener");
        let base = match tls {
            Some(_) => format!("https://localhost:{}", addr.port()),
            None => format!("http://{addr}"),
        };
        let shared = Arc::new(Shared {
            secret: secret.to_vec(),
            ..Shared::default()
        });
        let s = shared.clone();
        let task = crate::serve::serve(listener, tls, move |req| {
            let shared = s.clone();
            async move { take(&shared, req).await }
        });
        EventReceiver { base, shared, task }
    }

    pub fn url(&self) -> String {
        format!("{}/events", self.base)
    }

    /// The events taken, in the order they came (a repeat is recorded again), up to
    /// [`KEPT_MAX`].
    pub fn events(&self) -> Vec<Received> {
        self.shared
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .kept
            .clone()
    }

    pub fn stats(&self) -> ReceiverStats {
        stats(&self.shared)
    }

    /// Answers every post 503 (taking nothing) while `on`.
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::Relaxed);
    }
}

fn stats(shared: &Shared) -> ReceiverStats {
    let taken = shared.events.lock().unwrap_or_else(|p| p.into_inner());
    ReceiverStats {
        events: taken.total,
        posts: shared.posts.load(Ordering::Relaxed),
        refused: shared.refused.load(Ordering::Relaxed),
        bad_signatures: shared.bad_signatures.load(Ordering::Relaxed),
        not_after: taken.not_after,
    }
}

async fn take(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let answer = |status: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = status;
        r
    };
    if req.method() == hyper::Method::GET && req.uri().path() == "/stats" {
        let body = serde_json::to_vec(&stats(shared)).unwrap_or_default();
        return Response::new(Full::new(Bytes::from(body)));
    }
    let signature = req
        .headers()
        .get(crate::signature::HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let Ok(body) = Limited::new(req.into_body(), POST_BYTES_MAX)
        .collect()
        .await
    else {
        return answer(StatusCode::PAYLOAD_TOO_LARGE);
    };
    let body = body.to_bytes();
    if !crate::signature::verify(&shared.secret, &body, &signature) {
        shared.bad_signatures.fetch_add(1, Ordering::Relaxed);
        return answer(StatusCode::UNAUTHORIZED);
    }
    if shared.refusing.load(Ordering::Relaxed) {
        shared.refused.fetch_add(1, Ordering::Relaxed);
        return answer(StatusCode::SERVICE_UNAVAILABLE);
    }
    let Ok(batch) = serde_json::from_slice::<Batch>(&body) else {
        return answer(StatusCode::BAD_REQUEST);
    };
    shared.posts.fetch_add(1, Ordering::Relaxed);
    let mut taken = shared.events.lock().unwrap_or_else(|p| p.into_inner());
    for e in batch.events {
        if taken.last_id.is_some_and(|last| e.id <= last) {
            taken.not_after += 1;
        }
        taken.last_id = Some(e.id);
        taken.total += 1;
        if taken.kept.len() < KEPT_MAX {
            taken.kept.push(e);
        }
    }
    answer(StatusCode::OK)
}
