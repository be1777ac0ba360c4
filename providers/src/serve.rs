//! The accept loop the in-process HTTP servers share (the mock provider, the event receiver).

use std::future::Future;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// Serves HTTP/1.1 on `listener`, one task per connection, each request answered by `handle`,
/// until the returned task is aborted.
pub(crate) fn serve<F, Fut>(
    listener: tokio::net::TcpListener,
    handle: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let handle = handle.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let answer = handle(req);
                    async move { Ok::<_, std::convert::Infallible>(answer.await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}
