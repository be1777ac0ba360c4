//! The `spindle-mock-provider` binary serving HTTPS: started with a certificate and key made by
//! the test (and a fault it sets on itself at start, over TLS), it answers a client that trusts
//! that certificate, and only such a client.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use spindle_providers::{tls, AsyncJobProvider, HttpProvider, Submission, SubmitError};

/// Kills the mock when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_mock_binary_serves_https_with_the_certificate_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key_pair.serialize_pem()).unwrap();
    let ready = dir.path().join("ready");
    let mut child = Command::new(env!("CARGO_BIN_EXE_spindle-mock-provider"))
        .args(["--listen", "127.0.0.1:0", "--account", "acme:2:6000"])
        .args(["--account", "refusing:2:6000", "--fault", "refusing:auth"])
        .arg("--tls-cert")
        .arg(&cert_file)
        .arg("--tls-key")
        .arg(&key_file)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let base = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text.trim().to_string();
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the mock exited before serving: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the mock was not serving within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _running = Running(child);
    assert!(base.starts_with("https://localhost:"), "{base}");

    let roots = tls::with_roots_file(&cert_file).unwrap();
    let p = HttpProvider::new(&base, Duration::from_secs(5)).with_tls(&roots);
    let job = |account: &str| Submission {
        account: account.into(),
        request_key: "k-1".into(),
        model: "video-1".into(),
        input: serde_json::json!({"prompt": "a cat"}),
        callback_url: None,
    };
    p.submit(&job("acme")).await.unwrap();
    // The fault it set on itself at start went over HTTPS too.
    match p.submit(&job("refusing")).await {
        Err(SubmitError::Refused { .. }) => {}
        other => panic!("the auth fault was not set: {other:?}"),
    }
    assert_eq!(p.mock_stats().await.unwrap().accounts["acme"].accepted, 1);
    // A client that does not trust the certificate sends nothing.
    let untrusting = HttpProvider::new(&base, Duration::from_secs(5));
    assert!(untrusting.mock_stats().await.is_err());
}
