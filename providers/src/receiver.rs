//! An in-process receiver of the node's event batches (the platform's side of
//! [`crate::webhook`]), for tests and demos: it checks each post's signature, records every
//! event it takes, and can be told to refuse posts (503) to show that the relay tries again.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// Bytes of one post the receiver reads at most.
pub const POST_BYTES_MAX: usize = 16 * 1024 * 1024;

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
    events: Mutex<Vec<Received>>,
    refusing: AtomicBool,
    refused: AtomicU64,
    bad_signatures: AtomicU64,
    posts: AtomicU64,
}

/// The receiver; it stops serving when dropped.
pub struct EventReceiver {
    addr: SocketAddr,
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
        let addr = listener.local_addr().expect("a bound listener");
        let shared = Arc::new(Shared {
            secret: secret.to_vec(),
            ..Shared::default()
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = s.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, std::convert::Infallible>(take(&shared, req).await) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        EventReceiver { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }

    /// Every event taken, in the order they came (a repeat is recorded again).
    pub fn events(&self) -> Vec<Received> {
        self.shared
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Answers every post 503 (taking nothing) while `on`.
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::Relaxed);
    }

    /// Posts refused (while refusing), posts with a bad signature, and posts taken.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.shared.refused.load(Ordering::Relaxed),
            self.shared.bad_signatures.load(Ordering::Relaxed),
            self.shared.posts.load(Ordering::Relaxed),
        )
    }
}

async fn take(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let answer = |status: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = status;
        r
    };
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
    shared
        .events
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(batch.events);
    answer(StatusCode::OK)
}
