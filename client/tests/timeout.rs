//! A node that never answers: every request ends at the client's timeout with `Timeout`,
//! instead of waiting forever.

use std::time::{Duration, Instant};

use spindle_client::{Client, ClientError};
use spindle_core::TenantId;
use tokio::io::AsyncReadExt;

#[tokio::test]
async fn a_request_without_an_answer_ends_at_the_timeout() {
    // Accepts and reads everything, answers nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        while socket.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    let bound = Duration::from_millis(200);
    let started = Instant::now();
    let err = Client::connect_within(addr, TenantId(1), "one", bound)
        .await
        .err()
        .expect("no Hello answer, no client");
    assert!(
        matches!(err, ClientError::Timeout(d) if d == bound),
        "{err}"
    );
    assert!(started.elapsed() >= bound);
    assert!(err.to_string().contains("no answer within"), "{err}");
    silent.abort();
}
