//! Each vendor adapter against its local stand-in (`spindle_providers::vendors::standin`,
//! answering with the recorded shapes of `providers/vendor-shapes/`): accepted, refused,
//! rate-limited with the vendor's hint, a submit whose answer came too late found again without
//! a second submission (by query where the vendor has one, by the webhook naming its key where
//! it has not), and webhooks whose signature does not check out refused.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use spindle_providers::api::ProblemKind;
use spindle_providers::vendors::standin::{Standin, StandinFault};
use spindle_providers::vendors::{
    callback_url, fal::Fal, minimax::Minimax, replicate::Replicate, Callback, CallbackIn,
    CallbackRefused, Provider, Vendor,
};
use spindle_providers::{
    AsyncJobProvider, HttpProvider, JobState, Lookup, Submission, SubmitError,
};

const KEY: &str = "test-api-key";
/// The node's secret for its callback URLs' tokens (Replicate's is its signing secret).
fn secret(standin: &Standin, vendor: Vendor) -> String {
    match vendor {
        Vendor::Replicate => standin.signing_secret(),
        _ => "node-secret".to_string(),
    }
}

fn adapter(standin: &Standin, vendor: Vendor, timeout: Duration) -> Provider {
    let http = HttpProvider::new(&standin.base_url(), timeout);
    match vendor {
        Vendor::Replicate => Provider::Replicate(
            Replicate::new(http, KEY, &standin.signing_secret(), 3_600).unwrap(),
        ),
        Vendor::Fal => Provider::Fal(Fal::new(http, KEY, &standin.jwks()).unwrap()),
        Vendor::Minimax => Provider::Minimax(Minimax::new(http, KEY).unwrap()),
        Vendor::Spindle => unreachable!(),
    }
}

fn model(vendor: Vendor) -> &'static str {
    match vendor {
        Vendor::Replicate => "minimax/video-01",
        Vendor::Fal => "fal-ai/kling-video/v1/standard/text-to-video",
        _ => "MiniMax-Hailuo-02",
    }
}

/// What the test's callback endpoint (the node's part) saw: each callback's check.
type Seen = Arc<Mutex<Vec<Result<Callback, CallbackRefused>>>>;

/// Serves callbacks as the node does: checks each with the adapter, answers a challenge with
/// its echo, a good callback 200 and a bad one 401; records every check.
async fn callback_endpoint(provider: Provider, secret: String) -> (String, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/provider/callback",
        listener.local_addr().unwrap()
    );
    let seen: Seen = Arc::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (provider, secret, seen) = (provider.clone(), secret.clone(), s.clone());
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (provider, secret, seen) =
                            (provider.clone(), secret.clone(), seen.clone());
                        async move {
                            let query = req.uri().query().unwrap_or("").to_string();
                            let headers = req.headers().clone();
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let now_ms = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .unwrap()
                                .as_millis() as u64;
                            let checked = provider.callback(
                                secret.as_bytes(),
                                &CallbackIn {
                                    headers: &headers,
                                    query: &query,
                                    body: &body,
                                    now_ms,
                                    window_ms: 300_000,
                                },
                            );
                            let (status, text) = match &checked {
                                Ok(Callback::Challenge(echo)) => (StatusCode::OK, echo.clone()),
                                Ok(_) => (StatusCode::OK, "ok".into()),
                                Err(_) => (StatusCode::UNAUTHORIZED, "refused".into()),
                            };
                            seen.lock().unwrap().push(checked);
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from(text)))
                                    .unwrap(),
                            )
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, seen)
}

fn submission(vendor: Vendor, key: &str, callback: Option<String>) -> Submission {
    Submission {
        account: "acct".into(),
        request_key: key.into(),
        model: model(vendor).into(),
        input: serde_json::json!({"prompt": "a lighthouse at dusk"}),
        callback_url: callback,
    }
}

/// Waits (bounded) for a callback check that names `key`.
async fn changed(seen: &Seen, key: &str) -> String {
    for _ in 0..200 {
        let found = seen.lock().unwrap().iter().find_map(|c| match c {
            Ok(Callback::Changed {
                job_id,
                request_key,
            }) if request_key == key => Some(job_id.clone()),
            _ => None,
        });
        if let Some(job) = found {
            return job;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "no checked callback named {key}: {:?}",
        seen.lock().unwrap()
    );
}

async fn each_vendor_keeps_its_contract(vendor: Vendor) {
    let standin = Standin::start(vendor, KEY, Duration::from_millis(400))
        .await
        .unwrap();
    let provider = adapter(&standin, vendor, Duration::from_secs(2));
    let secret = secret(&standin, vendor);
    let (base, seen) = callback_endpoint(provider.clone(), secret.clone()).await;
    let url = |key: &str| Some(callback_url(&base, key, secret.as_bytes()));

    // Accepted; its webhook arrives signed and checks out; the job is asked for and succeeded.
    let view = provider
        .submit(&submission(vendor, "k-accepted", url("k-accepted")))
        .await
        .unwrap();
    assert_eq!(view.state, JobState::Queued, "{vendor:?}");
    assert_eq!(view.request_key, "k-accepted");
    let job = changed(&seen, "k-accepted").await;
    assert_eq!(job, view.job_id, "{vendor:?}");
    let Lookup::Found(done) = provider.job("acct", &job).await.unwrap() else {
        panic!("{vendor:?}: the job is not found");
    };
    assert_eq!(done.state, JobState::Succeeded, "{vendor:?}: {done:?}");
    assert!(done.output_url.is_some(), "{vendor:?}: {done:?}");
    if vendor == Vendor::Minimax {
        assert!(
            standin.stats().challenges_echoed >= 1,
            "the callback URL was checked"
        );
    }

    // Refused: invalid input, never retried.
    standin.set_fault(StandinFault::Refuse);
    let refused = provider
        .submit(&submission(vendor, "k-refused", url("k-refused")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            SubmitError::Refused {
                kind: ProblemKind::InvalidParameters,
                ..
            }
        ),
        "{vendor:?}: {refused:?}"
    );

    // Rate limited, with the vendor's hint where it gives one (MiniMax's 1002 carries none).
    standin.set_fault(StandinFault::RateLimit { retry_after_s: 7 });
    let limited = provider
        .submit(&submission(vendor, "k-limited", url("k-limited")))
        .await
        .unwrap_err();
    let hint = (vendor != Vendor::Minimax).then_some(7_000);
    assert_eq!(
        limited,
        SubmitError::RateLimited {
            retry_after_ms: hint
        },
        "{vendor:?}"
    );

    // Taken, but answered after the caller gave up: unknown — then found again by key, or by
    // the webhook that names the key, and never submitted twice.
    standin.set_fault(StandinFault::SlowAfterAccept {
        answer_after_ms: 1_500,
    });
    let impatient = adapter(&standin, vendor, Duration::from_millis(300));
    let submits = standin.stats().submits;
    let unknown = impatient
        .submit(&submission(vendor, "k-doubt", url("k-doubt")))
        .await
        .unwrap_err();
    assert!(
        matches!(unknown, SubmitError::Unknown(_)),
        "{vendor:?}: {unknown:?}"
    );
    standin.set_fault(StandinFault::None);
    let found = if provider.finds_by_key() {
        match provider.find_by_key("acct", "k-doubt").await.unwrap() {
            Lookup::Found(v) => v.job_id,
            Lookup::NotFound => panic!("{vendor:?}: the job it took is not found by key"),
        }
    } else {
        let e = provider.find_by_key("acct", "k-doubt").await.unwrap_err();
        assert!(e.0.contains("no lookup by request key"), "{e}");
        changed(&seen, "k-doubt").await
    };
    let Lookup::Found(v) = provider.job("acct", &found).await.unwrap() else {
        panic!("{vendor:?}: found, then not found");
    };
    assert_eq!(v.job_id, found);
    let stats = standin.stats();
    assert_eq!(
        stats.submits,
        submits + 1,
        "{vendor:?}: sent once: {stats:?}"
    );
    assert_eq!(stats.duplicate_keys, 0, "{vendor:?}: {stats:?}");

    // A key that was never sent is not found (where the vendor can be asked).
    if provider.finds_by_key() {
        assert_eq!(
            provider.find_by_key("acct", "k-never").await.unwrap(),
            Lookup::NotFound
        );
    }
    // Canceling a running job stops it (MiniMax has no cancel: it runs to its end).
    let view = provider
        .submit(&submission(vendor, "k-cancel", url("k-cancel")))
        .await
        .unwrap();
    let after = provider.cancel("acct", &view.job_id).await.unwrap();
    let Lookup::Found(after) = after else {
        panic!("{vendor:?}: canceled job not found")
    };
    match vendor {
        Vendor::Minimax => assert!(!after.state.is_final(), "{after:?}"),
        _ => assert!(
            matches!(after.state, JobState::Canceled | JobState::Failed),
            "{vendor:?}: {after:?}"
        ),
    }
}

#[tokio::test]
async fn replicate_keeps_its_contract() {
    each_vendor_keeps_its_contract(Vendor::Replicate).await;
}

#[tokio::test]
async fn fal_keeps_its_contract() {
    each_vendor_keeps_its_contract(Vendor::Fal).await;
}

#[tokio::test]
async fn minimax_keeps_its_contract() {
    each_vendor_keeps_its_contract(Vendor::Minimax).await;
}

/// A callback as the stand-in would sign it, then altered: each alteration is refused.
#[tokio::test]
async fn webhooks_whose_signature_does_not_check_out_are_refused() {
    for vendor in [Vendor::Replicate, Vendor::Fal, Vendor::Minimax] {
        let standin = Standin::start(vendor, KEY, Duration::from_millis(50))
            .await
            .unwrap();
        let provider = adapter(&standin, vendor, Duration::from_secs(2));
        let secret = secret(&standin, vendor);
        let (base, seen) = callback_endpoint(provider.clone(), secret.clone()).await;
        let good = callback_url(&base, "k-signed", secret.as_bytes());
        provider
            .submit(&submission(vendor, "k-signed", Some(good.clone())))
            .await
            .unwrap();
        changed(&seen, "k-signed").await;

        // The same URL with another key (a token made for one key names no other).
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>();
        // fal's URL also names the request's app (the adapter adds it to what it sends).
        let good = match vendor {
            Vendor::Fal => format!("{good}&spindle_app=fal-ai%2Fkling-video"),
            _ => good,
        };
        let forged_key = good.replace("k-signed", "k-forged");
        let body = br#"{"id": "x", "status": "succeeded", "request_id": "x", "task_id": "x"}"#;
        let headers = vec![
            ("webhook-id", "msg_x".to_string()),
            ("webhook-timestamp", "1".to_string()),
            ("webhook-signature", "v1,AAAA".to_string()),
            ("x-fal-webhook-request-id", "x".to_string()),
            ("x-fal-webhook-user-id", "u".to_string()),
            ("x-fal-webhook-timestamp", "1".to_string()),
            ("x-fal-webhook-signature", "00".repeat(64)),
        ];
        for (url, expect) in [
            (forged_key.clone(), CallbackRefused::BadToken),
            (good.clone(), CallbackRefused::BadSignature),
        ] {
            if vendor == Vendor::Minimax && expect == CallbackRefused::BadSignature {
                // MiniMax signs nothing: only the URL's token guards it.
                continue;
            }
            let mut req = Request::post(&url);
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            let answer = client
                .request(req.body(Full::new(Bytes::from_static(body))).unwrap())
                .await
                .unwrap();
            assert_eq!(
                answer.status(),
                StatusCode::UNAUTHORIZED,
                "{vendor:?} {url}"
            );
            let last = seen.lock().unwrap().last().cloned().unwrap();
            assert_eq!(last, Err(expect.clone()), "{vendor:?}");
        }
    }
}
