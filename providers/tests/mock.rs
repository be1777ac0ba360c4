//! The HTTP adapter against the mock provider (in-process, real sockets): every answer class the
//! adapter distinguishes, every fault mode, the counters, signed callbacks, and HTTPS.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use spindle_providers::api::{Fault, JobState, JobView, ProblemKind};
use spindle_providers::{
    AccountSpec, AsyncJobProvider, HttpProvider, Lookup, MockConfig, MockProvider, Submission,
    SubmitError,
};

const SECRET: &str = "s3cret";

async fn mock(job_ms: u64) -> MockProvider {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    MockProvider::serve(
        listener,
        MockConfig {
            accounts: vec![
                "acme:2:6000".parse::<AccountSpec>().unwrap(),
                "slowpoke:4:120".parse().unwrap(),
            ],
            secret: SECRET.into(),
            job_ms,
            cost_milli: 1_500,
            hang_ms: 1_000,
            clip: None,
        },
    )
}

fn job(account: &str, key: &str, callback: Option<String>) -> Submission {
    Submission {
        account: account.into(),
        request_key: key.into(),
        model: "video-1".into(),
        input: serde_json::json!({"prompt": "a cat"}),
        callback_url: callback,
    }
}

async fn until_final(p: &HttpProvider, account: &str, key: &str) -> JobView {
    for _ in 0..500 {
        if let Lookup::Found(v) = p.find_by_key(account, key).await.unwrap() {
            if v.state.is_final() {
                return v;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("job {key} never finished");
}

#[tokio::test]
async fn a_job_runs_to_success_and_a_repeated_key_is_the_same_job() {
    let m = mock(20).await;
    let p = m.client(Duration::from_secs(2));
    let a = p.submit(&job("acme", "k1", None)).await.unwrap();
    assert_eq!(a.state, JobState::Running);
    let again = p.submit(&job("acme", "k1", None)).await.unwrap();
    assert_eq!(again.job_id, a.job_id, "a repeated key is the original job");
    let done = until_final(&p, "acme", "k1").await;
    assert_eq!(
        (done.state, done.cost_milli),
        (JobState::Succeeded, Some(1_500))
    );
    assert_eq!(p.job("acme", &a.job_id).await.unwrap(), Lookup::Found(done));
    assert_eq!(
        p.find_by_key("acme", "nope").await.unwrap(),
        Lookup::NotFound
    );
    let s = p.mock_stats().await.unwrap().accounts["acme"].clone();
    assert_eq!((s.accepted, s.completed, s.duplicate_keys), (1, 1, 1));
    assert_eq!((s.concurrency_violations, s.rpm_violations), (0, 0));
}

/// A submit withdrawn before its turn is not sent: the provider never sees it, and its key is
/// free for a later submit. One not withdrawn goes out as usual.
#[tokio::test]
async fn a_withdrawn_submit_is_never_sent() {
    use std::sync::atomic::AtomicBool;
    let m = mock(20).await;
    let p = m.client(Duration::from_secs(2)).with_requests_max(1);
    let e = p
        .submit_unless(&job("acme", "w", None), &AtomicBool::new(true))
        .await
        .unwrap_err();
    assert_eq!(e, SubmitError::Withdrawn);
    assert_eq!(p.find_by_key("acme", "w").await.unwrap(), Lookup::NotFound);
    let a = p
        .submit_unless(&job("acme", "w", None), &AtomicBool::new(false))
        .await
        .unwrap();
    assert_eq!(a.state, JobState::Running);
    let s = p.mock_stats().await.unwrap().accounts["acme"].clone();
    assert_eq!((s.accepted, s.duplicate_keys), (1, 0));
}

#[tokio::test]
async fn submits_beyond_the_contract_are_refused_and_counted() {
    let m = mock(10_000).await;
    let p = m.client(Duration::from_secs(2));
    p.submit(&job("acme", "a", None)).await.unwrap();
    p.submit(&job("acme", "b", None)).await.unwrap();
    let over = p.submit(&job("acme", "c", None)).await.unwrap_err();
    assert!(matches!(over, SubmitError::RateLimited { .. }), "{over:?}");
    // 120 a minute: a burst of 2, then nothing for half a second.
    p.submit(&job("slowpoke", "x", None)).await.unwrap();
    p.submit(&job("slowpoke", "y", None)).await.unwrap();
    let fast = p.submit(&job("slowpoke", "z", None)).await.unwrap_err();
    assert!(matches!(fast, SubmitError::RateLimited { .. }), "{fast:?}");
    let stats = p.mock_stats().await.unwrap();
    assert_eq!(stats.accounts["acme"].concurrency_violations, 1);
    assert_eq!(stats.accounts["slowpoke"].rpm_violations, 1);
}

#[tokio::test]
async fn each_refusal_class_is_told_apart() {
    let m = mock(20).await;
    let p = m.client(Duration::from_millis(300));
    for (fault, kind) in [
        (Fault::Auth, ProblemKind::Auth),
        (Fault::Balance, ProblemKind::Balance),
        (Fault::InvalidParameters, ProblemKind::InvalidParameters),
        (Fault::Moderation, ProblemKind::Moderation),
    ] {
        p.set_fault("acme", fault).await.unwrap();
        match p.submit(&job("acme", "r", None)).await {
            Err(SubmitError::Refused { kind: k, .. }) => assert_eq!(k, kind, "{fault:?}"),
            other => panic!("{fault:?}: {other:?}"),
        }
    }
    // A 5xx says nothing about acceptance.
    p.set_fault("acme", Fault::ServerError).await.unwrap();
    let e = p.submit(&job("acme", "r", None)).await.unwrap_err();
    assert!(matches!(e, SubmitError::Unknown(_)), "{e:?}");
    assert_eq!(p.find_by_key("acme", "r").await.unwrap(), Lookup::NotFound);

    // Accepted, but the answer comes after our timeout: unknown, and the key finds the job.
    p.set_fault("acme", Fault::TimeoutAfterAccept)
        .await
        .unwrap();
    let e = p.submit(&job("acme", "t", None)).await.unwrap_err();
    assert!(matches!(e, SubmitError::Unknown(_)), "{e:?}");
    assert!(matches!(
        p.find_by_key("acme", "t").await.unwrap(),
        Lookup::Found(_)
    ));

    // Nothing listening: not sent at all.
    let gone = HttpProvider::new("http://127.0.0.1:9", Duration::from_millis(300));
    let e = gone.submit(&job("acme", "n", None)).await.unwrap_err();
    assert!(matches!(e, SubmitError::NotSent(_)), "{e:?}");
}

#[tokio::test]
async fn a_rate_limit_storm_answers_429_at_half_the_contract_without_violations() {
    let m = mock(10_000).await;
    let p = m.client(Duration::from_secs(2));
    p.set_fault("acme", Fault::RateLimit).await.unwrap();
    // Concurrency 2 by contract, 1 for real: the second is refused with a hint.
    p.submit(&job("acme", "s1", None)).await.unwrap();
    match p.submit(&job("acme", "s2", None)).await {
        Err(SubmitError::RateLimited { retry_after_ms }) => assert_eq!(retry_after_ms, Some(500)),
        other => panic!("{other:?}"),
    }
    let s = p.mock_stats().await.unwrap().accounts["acme"].clone();
    assert_eq!(
        (s.accepted, s.rate_limited, s.concurrency_violations),
        (1, 1, 0)
    );
}

/// A callback receiver: counts signed callbacks per job, refuses bad signatures.
async fn receiver() -> (String, Arc<Mutex<Vec<JobView>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/callback", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let sig = req
                            .headers()
                            .get("x-signature")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_string();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap()
                            .as_millis() as u64;
                        let ok = spindle_providers::signature::verify_at(
                            SECRET.as_bytes(),
                            &body,
                            &sig,
                            now,
                            60_000,
                        );
                        assert!(ok.is_ok(), "a callback with a bad signature: {ok:?}");
                        seen.lock()
                            .unwrap()
                            .push(serde_json::from_slice::<JobView>(&body).unwrap());
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            Bytes::new(),
                        )))
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, got)
}

#[tokio::test]
async fn callbacks_are_signed_and_follow_the_fault_mode() {
    let m = mock(10).await;
    let p = m.client(Duration::from_secs(2));
    let (url, got) = receiver().await;
    let count = |key: &str| {
        got.lock()
            .unwrap()
            .iter()
            .filter(|v| v.request_key == key && v.state == JobState::Succeeded)
            .count()
    };
    p.submit(&job("acme", "once", Some(url.clone())))
        .await
        .unwrap();
    until_final(&p, "acme", "once").await;
    p.set_fault("acme", Fault::DuplicateCallback).await.unwrap();
    p.submit(&job("acme", "twice", Some(url.clone())))
        .await
        .unwrap();
    until_final(&p, "acme", "twice").await;
    p.set_fault("acme", Fault::LostCallback).await.unwrap();
    p.submit(&job("acme", "never", Some(url.clone())))
        .await
        .unwrap();
    until_final(&p, "acme", "never").await;
    // The final callback is sent before the state can be read as final; give the receiver
    // its bounded moment to record the last one.
    for _ in 0..200 {
        if count("once") == 1 && count("twice") == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!((count("once"), count("twice"), count("never")), (1, 2, 0));
}

/// One account, `acme`, whose quick jobs return `clip`.
fn returning(clip: std::path::PathBuf) -> MockConfig {
    MockConfig {
        accounts: vec!["acme:2:6000".parse::<AccountSpec>().unwrap()],
        secret: SECRET.into(),
        job_ms: 10,
        cost_milli: 1,
        hang_ms: 1_000,
        clip: Some(clip),
    }
}

#[tokio::test]
async fn a_succeeded_job_serves_its_video_and_downloads_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.bin");
    std::fs::write(&clip, vec![7u8; 10_000]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve(listener, returning(clip.clone()));
    let p = m.client(Duration::from_secs(2));
    p.submit(&job("acme", "v", None)).await.unwrap();
    let done = until_final(&p, "acme", "v").await;
    let url = done.output_url.expect("a succeeded job names its video");
    let public = spindle_providers::tls::public_roots();
    let dest = dir.path().join("got.bin");
    let n = spindle_providers::download(&url, &dest, 1 << 20, Duration::from_secs(5), &public)
        .await
        .unwrap();
    assert_eq!(n, 10_000);
    assert_eq!(std::fs::read(&dest).unwrap(), vec![7u8; 10_000]);
    let small = dir.path().join("small.bin");
    let e = spindle_providers::download(&url, &small, 1_000, Duration::from_secs(5), &public)
        .await
        .unwrap_err();
    assert!(
        matches!(e, spindle_providers::FetchError::TooLarge { .. }),
        "{e}"
    );
    assert!(!e.is_retryable());
    assert!(!small.exists(), "a partial download is removed");
    let missing = url.replace(&done.job_id, "job-999");
    let e = spindle_providers::download(&missing, &small, 1 << 20, Duration::from_secs(5), &public)
        .await
        .unwrap_err();
    assert!(
        matches!(e, spindle_providers::FetchError::Status { status: 404, .. }),
        "{e}"
    );
}

/// A certificate for `localhost`, self-signed, and its key (PEM): the test's own CA.
fn localhost_certificate() -> (String, String) {
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    (cert.pem(), key_pair.serialize_pem())
}

#[tokio::test]
async fn over_https_the_adapter_trusts_the_roots_it_is_given_and_no_others() {
    use spindle_providers::tls;
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.bin");
    std::fs::write(&clip, vec![9u8; 4_000]).unwrap();
    let (cert, key) = localhost_certificate();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve_tls(
        listener,
        returning(clip),
        tls::server_config(cert.as_bytes(), key.as_bytes()).unwrap(),
    );
    assert!(
        m.base_url().starts_with("https://localhost:"),
        "{}",
        m.base_url()
    );

    // Trusting the test's CA: the whole API, and the video it names, over TLS.
    let roots = tls::with_extra_roots(cert.as_bytes(), "the test's CA").unwrap();
    let p = HttpProvider::new(&m.base_url(), Duration::from_secs(2)).with_tls(&roots);
    p.submit(&job("acme", "tls", None)).await.unwrap();
    let done = until_final(&p, "acme", "tls").await;
    assert_eq!(done.state, JobState::Succeeded);
    let url = done.output_url.expect("a succeeded job names its video");
    assert!(url.starts_with("https://localhost:"), "{url}");
    let dest = dir.path().join("got.bin");
    let n = spindle_providers::download(&url, &dest, 1 << 20, Duration::from_secs(5), &roots)
        .await
        .unwrap();
    assert_eq!(n, 4_000);
    assert_eq!(p.mock_stats().await.unwrap().accounts["acme"].accepted, 1);

    // The public web's roots alone do not vouch for it: nothing is sent.
    let public = HttpProvider::new(&m.base_url(), Duration::from_secs(2));
    let e = public.mock_stats().await.unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
    match public.submit(&job("acme", "untrusted", None)).await {
        Err(SubmitError::NotSent(why)) => {
            assert!(
                why.contains("invalid peer certificate: UnknownIssuer"),
                "{why}"
            )
        }
        other => panic!("a submit to an untrusted server: {other:?}"),
    }
    let e = spindle_providers::download(
        &url,
        &dir.path().join("no.bin"),
        1 << 20,
        Duration::from_secs(5),
        &tls::public_roots(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
    assert_eq!(p.mock_stats().await.unwrap().accounts["acme"].accepted, 1);

    // More certificates than a private CA needs are refused, naming the bound.
    let many = cert.repeat(tls::EXTRA_ROOTS_MAX + 1);
    let e = tls::with_extra_roots(many.as_bytes(), "many.pem").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("many.pem: more than {} certificates", tls::EXTRA_ROOTS_MAX)
    );
    assert!(tls::with_extra_roots(cert.repeat(tls::EXTRA_ROOTS_MAX).as_bytes(), "ok").is_ok());
    // Roots that are not PEM certificates are refused, naming where they came from.
    let e = tls::with_extra_roots(b"not a certificate", "ca.pem").unwrap_err();
    assert!(
        e.to_string().starts_with("ca.pem: no PEM certificate"),
        "{e}"
    );
    let e = tls::with_roots_file(&dir.path().join("missing.pem")).unwrap_err();
    assert!(e.to_string().contains("missing.pem"), "{e}");
}

/// The listing pages an account's live jobs in job order, leaves out ended ones and other
/// accounts', and a cancel of a live job is counted (once: a second cancel of it changes
/// nothing).
#[tokio::test]
async fn live_jobs_are_listed_in_pages_and_cancels_counted() {
    let m = mock(60_000).await;
    let p = m.client(Duration::from_secs(2));
    let mut ids = Vec::new();
    for k in ["k1", "k2"] {
        ids.push(p.submit(&job("acme", k, None)).await.unwrap().job_id);
    }
    p.submit(&job("slowpoke", "k9", None)).await.unwrap();
    let first = p.live_jobs("acme", None, 1).await.unwrap();
    assert_eq!(
        first.jobs.iter().map(|j| &j.job_id).collect::<Vec<_>>(),
        [&ids[0]]
    );
    let second = p.live_jobs("acme", first.next.as_deref(), 1).await.unwrap();
    assert_eq!(
        second.jobs.iter().map(|j| &j.job_id).collect::<Vec<_>>(),
        [&ids[1]]
    );
    assert_eq!(second.next, None, "the last page says so");

    p.cancel("acme", &ids[0]).await.unwrap();
    p.cancel("acme", &ids[0]).await.unwrap();
    until_final(&p, "acme", "k1").await;
    let left = p.live_jobs("acme", None, 10).await.unwrap();
    assert_eq!(
        left.jobs.iter().map(|j| &j.job_id).collect::<Vec<_>>(),
        [&ids[1]],
        "a canceled job is no longer live"
    );
    assert_eq!(p.mock_stats().await.unwrap().accounts["acme"].canceled, 1);
    assert!(p.live_jobs("acme", None, 0).await.is_ok(), "clamped to 1");
}
