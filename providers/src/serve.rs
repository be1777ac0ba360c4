//! The accept loop the in-process HTTP servers share (the mock provider, the event receiver),
//! plain or over TLS.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// How long the loop pauses after a failed accept before the next.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// Serves HTTP/1.1 on `listener` — over TLS with `tls` — one task per connection, each request
/// answered by `handle`, until the returned task is aborted. A connection whose TLS handshake
/// fails is dropped.
pub(crate) fn serve<F, Fut>(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    handle: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: paused, not retried in a loop that holds the
                    // runtime's thread.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let handle = handle.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => connection(stream, handle).await,
                    Some(tls) => {
                        if let Ok(stream) = tls.accept(stream).await {
                            connection(stream, handle).await;
                        }
                    }
                }
            });
        }
    })
}

async fn connection<S, F, Fut>(stream: S, handle: F)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let service = service_fn(move |req| {
        let answer = handle(req);
        async move { Ok::<_, std::convert::Infallible>(answer.await) }
    });
    let _ = http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}
