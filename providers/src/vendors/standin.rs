//! Local stand-ins for the vendors' APIs, for tests and the demo: each serves its vendor's
//! routes as [`super::replicate`], [`super::fal`] and [`super::minimax`] describe them, with
//! every answer one of the recorded shapes of `providers/vendor-shapes/` (ids, states and URLs
//! filled in). A job is queued for the first quarter of `run_ms`, running until `run_ms`, then
//! succeeded; at its end the stand-in calls the job's webhook back, signed as its vendor signs
//! (MiniMax: after the URL's challenge was echoed). Faults make it answer as its vendor does
//! when it rate-limits, refuses, or is slow past the caller's timeout after taking the job.
//!
//! It counts what a test must see never happen: a request key submitted twice
//! ([`StandinStats::duplicate_keys`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

use super::Vendor;

/// The recorded shape `name` of `vendor` (`providers/vendor-shapes/<vendor>/<name>`).
pub fn shape(vendor: Vendor, name: &str) -> Option<String> {
    let text = match (vendor, name) {
        (Vendor::Replicate, "prediction-starting.json") => {
            include_str!("../../vendor-shapes/replicate/prediction-starting.json")
        }
        (Vendor::Replicate, "prediction-succeeded.json") => {
            include_str!("../../vendor-shapes/replicate/prediction-succeeded.json")
        }
        (Vendor::Replicate, "prediction-failed.json") => {
            include_str!("../../vendor-shapes/replicate/prediction-failed.json")
        }
        (Vendor::Replicate, "predictions-list.json") => {
            include_str!("../../vendor-shapes/replicate/predictions-list.json")
        }
        (Vendor::Replicate, "error-throttled.json") => {
            include_str!("../../vendor-shapes/replicate/error-throttled.json")
        }
        (Vendor::Replicate, "error-unauthenticated.json") => {
            include_str!("../../vendor-shapes/replicate/error-unauthenticated.json")
        }
        (Vendor::Replicate, "error-insufficient-credit.json") => {
            include_str!("../../vendor-shapes/replicate/error-insufficient-credit.json")
        }
        (Vendor::Replicate, "error-validation.json") => {
            include_str!("../../vendor-shapes/replicate/error-validation.json")
        }
        (Vendor::Replicate, "webhook-secret.json") => {
            include_str!("../../vendor-shapes/replicate/webhook-secret.json")
        }
        (Vendor::Fal, "submit-queued.json") => {
            include_str!("../../vendor-shapes/fal/submit-queued.json")
        }
        (Vendor::Fal, "status-in-queue.json") => {
            include_str!("../../vendor-shapes/fal/status-in-queue.json")
        }
        (Vendor::Fal, "status-in-progress.json") => {
            include_str!("../../vendor-shapes/fal/status-in-progress.json")
        }
        (Vendor::Fal, "status-completed.json") => {
            include_str!("../../vendor-shapes/fal/status-completed.json")
        }
        (Vendor::Fal, "result-ok.json") => include_str!("../../vendor-shapes/fal/result-ok.json"),
        (Vendor::Fal, "result-error.json") => {
            include_str!("../../vendor-shapes/fal/result-error.json")
        }
        (Vendor::Fal, "cancel-requested.json") => {
            include_str!("../../vendor-shapes/fal/cancel-requested.json")
        }
        (Vendor::Fal, "cancel-already-completed.json") => {
            include_str!("../../vendor-shapes/fal/cancel-already-completed.json")
        }
        (Vendor::Fal, "webhook-ok.json") => include_str!("../../vendor-shapes/fal/webhook-ok.json"),
        (Vendor::Fal, "error-unauthorized.json") => {
            include_str!("../../vendor-shapes/fal/error-unauthorized.json")
        }
        (Vendor::Fal, "error-balance.json") => {
            include_str!("../../vendor-shapes/fal/error-balance.json")
        }
        (Vendor::Fal, "error-validation.json") => {
            include_str!("../../vendor-shapes/fal/error-validation.json")
        }
        (Vendor::Fal, "error-rate-limited.json") => {
            include_str!("../../vendor-shapes/fal/error-rate-limited.json")
        }
        (Vendor::Fal, "jwks.json") => include_str!("../../vendor-shapes/fal/jwks.json"),
        (Vendor::Minimax, "create-ok.json") => {
            include_str!("../../vendor-shapes/minimax/create-ok.json")
        }
        (Vendor::Minimax, "error-1002.json") => {
            include_str!("../../vendor-shapes/minimax/error-1002.json")
        }
        (Vendor::Minimax, "error-1039.json") => {
            include_str!("../../vendor-shapes/minimax/error-1039.json")
        }
        (Vendor::Minimax, "error-1004.json") => {
            include_str!("../../vendor-shapes/minimax/error-1004.json")
        }
        (Vendor::Minimax, "error-1008.json") => {
            include_str!("../../vendor-shapes/minimax/error-1008.json")
        }
        (Vendor::Minimax, "error-2013.json") => {
            include_str!("../../vendor-shapes/minimax/error-2013.json")
        }
        (Vendor::Minimax, "error-1026.json") => {
            include_str!("../../vendor-shapes/minimax/error-1026.json")
        }
        (Vendor::Minimax, "error-1013.json") => {
            include_str!("../../vendor-shapes/minimax/error-1013.json")
        }
        (Vendor::Minimax, "error-1027.json") => {
            include_str!("../../vendor-shapes/minimax/error-1027.json")
        }
        (Vendor::Minimax, "query-queueing.json") => {
            include_str!("../../vendor-shapes/minimax/query-queueing.json")
        }
        (Vendor::Minimax, "query-processing.json") => {
            include_str!("../../vendor-shapes/minimax/query-processing.json")
        }
        (Vendor::Minimax, "query-success.json") => {
            include_str!("../../vendor-shapes/minimax/query-success.json")
        }
        (Vendor::Minimax, "query-fail.json") => {
            include_str!("../../vendor-shapes/minimax/query-fail.json")
        }
        (Vendor::Minimax, "file-retrieve.json") => {
            include_str!("../../vendor-shapes/minimax/file-retrieve.json")
        }
        (Vendor::Minimax, "callback-challenge.json") => {
            include_str!("../../vendor-shapes/minimax/callback-challenge.json")
        }
        (Vendor::Minimax, "callback-status.json") => {
            include_str!("../../vendor-shapes/minimax/callback-status.json")
        }
        _ => return None,
    };
    Some(text.to_string())
}

fn template(vendor: Vendor, name: &str) -> Value {
    serde_json::from_str(&shape(vendor, name).expect("a recorded shape")).expect("valid JSON")
}

/// How a stand-in misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandinFault {
    None,
    /// Every submit is answered as the vendor rate-limits (Replicate and fal: 429 with
    /// `Retry-After`; MiniMax: code 1002, HTTP 200).
    RateLimit {
        retry_after_s: u64,
    },
    /// Every submit is refused as invalid input (Replicate 422, fal 422, MiniMax 2013).
    Refuse,
    /// Takes the job, then answers only after this long (past the caller's timeout).
    SlowAfterAccept {
        answer_after_ms: u64,
    },
}

/// What a stand-in saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StandinStats {
    /// Submits that reached it (refused ones included).
    pub submits: u64,
    /// Jobs it took.
    pub accepted: u64,
    /// Submits naming a request key (in their webhook URL) it had taken a job for already.
    pub duplicate_keys: u64,
    /// Webhooks the node answered 2xx.
    pub callbacks_delivered: u64,
    /// MiniMax challenges the node echoed correctly.
    pub challenges_echoed: u64,
    /// Status, result and list queries.
    pub queries: u64,
    /// Submits without the API key it expects.
    pub unauthorized: u64,
}

struct Job {
    id: String,
    key: Option<String>,
    webhook: Option<String>,
    created: Instant,
    created_unix_s: u64,
    canceled: bool,
}

struct Shared {
    vendor: Vendor,
    api_key: String,
    signing_key: Vec<u8>,
    fal_key: Option<ring::signature::Ed25519KeyPair>,
    run: Duration,
    state: Mutex<State>,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
}

#[derive(Default)]
struct State {
    fault: Option<StandinFault>,
    jobs: HashMap<String, Job>,
    next: u64,
    stats: StandinStats,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct Standin {
    base: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Standin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The fal stand-in's signing seed (a test key, never a real one).
const FAL_SEED: [u8; 32] = [7; 32];

impl Standin {
    /// Serves `vendor`'s API on 127.0.0.1 (a free port), taking `api_key`; jobs run `run`.
    /// Replicate's webhooks are signed with the secret of `webhook-secret.json`
    /// ([`Standin::signing_secret`]), fal's with a fixed test key ([`Standin::jwks`]).
    pub async fn start(vendor: Vendor, api_key: &str, run: Duration) -> std::io::Result<Standin> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let signing_key = super::replicate::signing_key(&Self::secret_of(vendor))
            .expect("the recorded secret reads");
        let fal_key = (vendor == Vendor::Fal).then(|| {
            ring::signature::Ed25519KeyPair::from_seed_unchecked(&FAL_SEED).expect("a seed")
        });
        let shared = Arc::new(Shared {
            vendor,
            api_key: api_key.to_string(),
            signing_key,
            fal_key,
            run,
            state: Mutex::new(State::default()),
            client: hyper_util::client::legacy::Client::builder(
                hyper_util::rt::TokioExecutor::new(),
            )
            .build_http(),
        });
        let s = shared.clone();
        let task = crate::serve::serve(listener, None, move |req| {
            let s = s.clone();
            async move { route(&s, req).await }
        });
        Ok(Standin { base, shared, task })
    }

    fn secret_of(_vendor: Vendor) -> String {
        let v = template(Vendor::Replicate, "webhook-secret.json");
        v["key"].as_str().expect("a key").to_string()
    }

    pub fn base_url(&self) -> String {
        self.base.clone()
    }

    /// Replicate's webhook signing secret (`whsec_…`) this stand-in signs with.
    pub fn signing_secret(&self) -> String {
        Self::secret_of(self.shared.vendor)
    }

    /// The JWKS holding the key this fal stand-in signs webhooks with.
    pub fn jwks(&self) -> Vec<u8> {
        use ring::signature::KeyPair;
        let key = ring::signature::Ed25519KeyPair::from_seed_unchecked(&FAL_SEED).expect("a seed");
        let x = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.public_key().as_ref());
        json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "standin", "alg": "EdDSA"}]})
            .to_string()
            .into_bytes()
    }

    pub fn set_fault(&self, fault: StandinFault) {
        self.shared.lock().fault = Some(fault);
    }

    pub fn stats(&self) -> StandinStats {
        self.shared.lock().stats
    }
}

/// An HTTP answer the stand-in sends.
type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode, body: &Value) -> Answer {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a valid response")
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn route(s: &Arc<Shared>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let auth = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match Limited::new(req.into_body(), crate::api::BODY_BYTES_MAX)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return answer(
                StatusCode::PAYLOAD_TOO_LARGE,
                &json!({"detail": "too large"}),
            )
        }
    };
    let expected = match s.vendor {
        Vendor::Fal => format!("Key {}", s.api_key),
        _ => format!("Bearer {}", s.api_key),
    };
    if auth != expected {
        s.lock().stats.unauthorized += 1;
        return match s.vendor {
            Vendor::Replicate => answer(
                StatusCode::UNAUTHORIZED,
                &template(Vendor::Replicate, "error-unauthenticated.json"),
            ),
            Vendor::Fal => answer(
                StatusCode::UNAUTHORIZED,
                &template(Vendor::Fal, "error-unauthorized.json"),
            ),
            _ => answer(
                StatusCode::OK,
                &template(Vendor::Minimax, "error-1004.json"),
            ),
        };
    }
    match s.vendor {
        Vendor::Replicate => replicate(s, &method, &path, &query, &body).await,
        Vendor::Fal => fal(s, &method, &path, &query, &body).await,
        Vendor::Minimax => minimax(s, &method, &path, &query, &body).await,
        Vendor::Spindle => answer(StatusCode::NOT_FOUND, &json!({"detail": "not a vendor"})),
    }
}

/// Where a job is now: queued for the first quarter of the run, then running, then done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Running,
    Done,
    Canceled,
}

fn phase(s: &Shared, job: &Job) -> Phase {
    let age = job.created.elapsed();
    if job.canceled {
        Phase::Canceled
    } else if age >= s.run {
        Phase::Done
    } else if age >= s.run / 4 {
        Phase::Running
    } else {
        Phase::Queued
    }
}

/// The key a webhook URL names.
fn key_of(webhook: Option<&str>) -> Option<String> {
    let (_, q) = webhook?.split_once('?')?;
    super::query_value(q, super::KEY_PARAM)
}

/// Takes a job (or refuses, per the fault). `Err` is the answer to send instead.
fn take(
    s: &Arc<Shared>,
    webhook: Option<String>,
    refusal: impl Fn(StandinFault) -> Option<Response<Full<Bytes>>>,
) -> Result<(String, Option<StandinFault>), Box<Answer>> {
    let mut st = s.lock();
    st.stats.submits += 1;
    let fault = st.fault;
    if let Some(r) = fault.and_then(&refusal) {
        return Err(Box::new(r));
    }
    let key = key_of(webhook.as_deref());
    if key.is_some() && st.jobs.values().any(|j| j.key == key) {
        st.stats.duplicate_keys += 1;
    }
    st.next += 1;
    let id = match s.vendor {
        Vendor::Replicate => format!("standin{:018}", st.next),
        Vendor::Fal => format!("00000000-0000-4000-8000-{:012}", st.next),
        _ => format!("{}", 106_916_112_212_000 + st.next),
    };
    st.jobs.insert(
        id.clone(),
        Job {
            id: id.clone(),
            key,
            webhook,
            created: Instant::now(),
            created_unix_s: unix_s(),
            canceled: false,
        },
    );
    st.stats.accepted += 1;
    Ok((id, fault))
}

/// Waits out a slow-after-accept fault, then schedules the job's webhook.
async fn after_take(s: &Arc<Shared>, id: &str, fault: Option<StandinFault>) {
    let s2 = s.clone();
    let id2 = id.to_string();
    tokio::spawn(async move {
        tokio::time::sleep(s2.run).await;
        deliver(&s2, &id2).await;
    });
    if let Some(StandinFault::SlowAfterAccept { answer_after_ms }) = fault {
        tokio::time::sleep(Duration::from_millis(answer_after_ms)).await;
    }
}

fn rate_limited(vendor: Vendor, retry_after_s: u64) -> Response<Full<Bytes>> {
    let (status, body) = match vendor {
        Vendor::Replicate => (
            StatusCode::TOO_MANY_REQUESTS,
            template(Vendor::Replicate, "error-throttled.json"),
        ),
        Vendor::Fal => (
            StatusCode::TOO_MANY_REQUESTS,
            template(Vendor::Fal, "error-rate-limited.json"),
        ),
        _ => (StatusCode::OK, template(Vendor::Minimax, "error-1002.json")),
    };
    let mut r = answer(status, &body);
    if vendor != Vendor::Minimax {
        r.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from(retry_after_s),
        );
    }
    r
}

fn prediction(s: &Shared, job: &Job) -> Value {
    let (name, status) = match phase(s, job) {
        Phase::Queued => ("prediction-starting.json", "starting"),
        Phase::Running => ("prediction-starting.json", "processing"),
        Phase::Done => ("prediction-succeeded.json", "succeeded"),
        Phase::Canceled => ("prediction-starting.json", "canceled"),
    };
    let mut p = template(Vendor::Replicate, name);
    p["id"] = job.id.clone().into();
    p["status"] = status.into();
    p["webhook"] = job.webhook.clone().map_or(Value::Null, Value::String);
    p["created_at"] = super::replicate::rfc3339(job.created_unix_s).into();
    p["urls"]["get"] = format!("https://api.replicate.com/v1/predictions/{}", job.id).into();
    p
}

async fn replicate(
    s: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        (&Method::POST, ["v1", "predictions"])
        | (&Method::POST, ["v1", "models", _, _, "predictions"]) => {
            let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            if !v["input"].is_object() {
                return answer(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &template(Vendor::Replicate, "error-validation.json"),
                );
            }
            let webhook = v["webhook"].as_str().map(str::to_string);
            let taken = take(s, webhook, |f| match f {
                StandinFault::RateLimit { retry_after_s } => {
                    Some(rate_limited(Vendor::Replicate, retry_after_s))
                }
                StandinFault::Refuse => Some(answer(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &template(Vendor::Replicate, "error-validation.json"),
                )),
                _ => None,
            });
            let (id, fault) = match taken {
                Ok(t) => t,
                Err(r) => return *r,
            };
            after_take(s, &id, fault).await;
            let st = s.lock();
            answer(StatusCode::CREATED, &prediction(s, &st.jobs[&id]))
        }
        (&Method::GET, ["v1", "predictions"]) => {
            let mut st = s.lock();
            st.stats.queries += 1;
            let after = super::query_value(query, "created_after").unwrap_or_default();
            let mut jobs: Vec<&Job> = st
                .jobs
                .values()
                .filter(|j| super::replicate::rfc3339(j.created_unix_s) >= after)
                .collect();
            jobs.sort_by_key(|j| std::cmp::Reverse(j.created));
            let mut page = template(Vendor::Replicate, "predictions-list.json");
            page["results"] = jobs.iter().map(|j| prediction(s, j)).collect();
            answer(StatusCode::OK, &page)
        }
        (&Method::GET, ["v1", "predictions", id]) => {
            let mut st = s.lock();
            st.stats.queries += 1;
            match st.jobs.get(*id) {
                Some(job) => answer(StatusCode::OK, &prediction(s, job)),
                None => answer(
                    StatusCode::NOT_FOUND,
                    &json!({"detail": "Not found.", "status": 404}),
                ),
            }
        }
        (&Method::POST, ["v1", "predictions", id, "cancel"]) => {
            let mut st = s.lock();
            let done = st.jobs.get(*id).map(|j| phase(s, j) == Phase::Done);
            match (done, st.jobs.get_mut(*id)) {
                (Some(done), Some(job)) => {
                    job.canceled |= !done;
                    let p = prediction(s, job);
                    answer(StatusCode::OK, &p)
                }
                _ => answer(
                    StatusCode::NOT_FOUND,
                    &json!({"detail": "Not found.", "status": 404}),
                ),
            }
        }
        _ => answer(
            StatusCode::NOT_FOUND,
            &json!({"detail": "Not found.", "status": 404}),
        ),
    }
}

async fn fal(
    s: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || {
        answer(
            StatusCode::NOT_FOUND,
            &json!({"detail": "Request not found"}),
        )
    };
    match (method, segments.as_slice()) {
        (&Method::GET, [_, _, "requests", id, "status"]) => {
            let mut st = s.lock();
            st.stats.queries += 1;
            let Some(job) = st.jobs.get(*id) else {
                return not_found();
            };
            let name = match phase(s, job) {
                Phase::Queued => "status-in-queue.json",
                Phase::Running => "status-in-progress.json",
                Phase::Done | Phase::Canceled => "status-completed.json",
            };
            answer(StatusCode::OK, &template(Vendor::Fal, name))
        }
        (&Method::GET, [_, _, "requests", id]) => {
            let mut st = s.lock();
            st.stats.queries += 1;
            match st.jobs.get(*id).map(|j| phase(s, j)) {
                Some(Phase::Done) => {
                    answer(StatusCode::OK, &template(Vendor::Fal, "result-ok.json"))
                }
                Some(Phase::Canceled) => answer(
                    StatusCode::BAD_REQUEST,
                    &json!({"detail": "Request was cancelled"}),
                ),
                Some(_) => answer(
                    StatusCode::BAD_REQUEST,
                    &json!({"detail": "Request is still in progress"}),
                ),
                None => not_found(),
            }
        }
        (&Method::PUT, [_, _, "requests", id, "cancel"]) => {
            let mut st = s.lock();
            let done = st.jobs.get(*id).map(|j| phase(s, j) == Phase::Done);
            match (done, st.jobs.get_mut(*id)) {
                (Some(true), _) => answer(
                    StatusCode::BAD_REQUEST,
                    &template(Vendor::Fal, "cancel-already-completed.json"),
                ),
                (Some(false), Some(job)) => {
                    job.canceled = true;
                    answer(
                        StatusCode::ACCEPTED,
                        &template(Vendor::Fal, "cancel-requested.json"),
                    )
                }
                _ => not_found(),
            }
        }
        (&Method::POST, [_, _, ..]) => {
            if serde_json::from_slice::<Value>(body).map_or(true, |v| !v.is_object()) {
                return answer(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &template(Vendor::Fal, "error-validation.json"),
                );
            }
            let webhook = super::query_value(query, "fal_webhook");
            let taken = take(s, webhook, |f| match f {
                StandinFault::RateLimit { retry_after_s } => {
                    Some(rate_limited(Vendor::Fal, retry_after_s))
                }
                StandinFault::Refuse => Some(answer(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &template(Vendor::Fal, "error-validation.json"),
                )),
                _ => None,
            });
            let (id, fault) = match taken {
                Ok(t) => t,
                Err(r) => return *r,
            };
            after_take(s, &id, fault).await;
            let app = format!("{}/{}", segments[0], segments[1]);
            let mut q = template(Vendor::Fal, "submit-queued.json");
            let base = format!("https://queue.fal.run/{app}/requests/{id}");
            q["request_id"] = id.into();
            q["response_url"] = base.clone().into();
            q["status_url"] = format!("{base}/status").into();
            q["cancel_url"] = format!("{base}/cancel").into();
            answer(StatusCode::OK, &q)
        }
        _ => not_found(),
    }
}

async fn minimax(
    s: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    match (method, path) {
        (&Method::POST, "/v1/video_generation") => {
            let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            if v["prompt"].as_str().is_none_or(str::is_empty) || v["model"].as_str().is_none() {
                return answer(
                    StatusCode::OK,
                    &template(Vendor::Minimax, "error-2013.json"),
                );
            }
            let webhook = v["callback_url"].as_str().map(str::to_string);
            // MiniMax checks a callback URL before it takes the job: the URL must echo the
            // challenge.
            if let Some(url) = &webhook {
                if !challenge(s, url).await {
                    return answer(
                        StatusCode::OK,
                        &template(Vendor::Minimax, "error-2013.json"),
                    );
                }
            }
            let taken = take(s, webhook, |f| match f {
                StandinFault::RateLimit { retry_after_s } => {
                    Some(rate_limited(Vendor::Minimax, retry_after_s))
                }
                StandinFault::Refuse => Some(answer(
                    StatusCode::OK,
                    &template(Vendor::Minimax, "error-2013.json"),
                )),
                _ => None,
            });
            let (id, fault) = match taken {
                Ok(t) => t,
                Err(r) => return *r,
            };
            after_take(s, &id, fault).await;
            let mut c = template(Vendor::Minimax, "create-ok.json");
            c["task_id"] = id.into();
            answer(StatusCode::OK, &c)
        }
        (&Method::GET, "/v1/query/video_generation") => {
            let mut st = s.lock();
            st.stats.queries += 1;
            let id = super::query_value(query, "task_id").unwrap_or_default();
            let Some(job) = st.jobs.get(&id) else {
                return answer(
                    StatusCode::OK,
                    &template(Vendor::Minimax, "error-2013.json"),
                );
            };
            let name = match phase(s, job) {
                Phase::Queued => "query-queueing.json",
                Phase::Running => "query-processing.json",
                Phase::Done => "query-success.json",
                Phase::Canceled => "query-fail.json",
            };
            let mut q = template(Vendor::Minimax, name);
            q["task_id"] = id.into();
            answer(StatusCode::OK, &q)
        }
        (&Method::GET, "/v1/files/retrieve") => {
            s.lock().stats.queries += 1;
            answer(
                StatusCode::OK,
                &template(Vendor::Minimax, "file-retrieve.json"),
            )
        }
        _ => answer(
            StatusCode::NOT_FOUND,
            &json!({"base_resp": {"status_code": 404}}),
        ),
    }
}

/// Posts MiniMax's challenge to `url`; whether it came back echoed within 3 s.
async fn challenge(s: &Arc<Shared>, url: &str) -> bool {
    let body = template(Vendor::Minimax, "callback-challenge.json");
    let echoed = post(s, url, body.to_string().into_bytes(), Vec::new()).await;
    let ok = echoed
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .is_some_and(|v| v["challenge"] == body["challenge"]);
    if ok {
        s.lock().stats.challenges_echoed += 1;
    }
    ok
}

/// POSTs `body` with `headers` to `url` (at most 3 s); the answer's body if it was 2xx.
async fn post(
    s: &Shared,
    url: &str,
    body: Vec<u8>,
    headers: Vec<(&'static str, String)>,
) -> Option<Bytes> {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        request = request.header(k, v);
    }
    let request = request.body(Full::new(Bytes::from(body))).ok()?;
    let response = tokio::time::timeout(Duration::from_secs(3), s.client.request(request))
        .await
        .ok()?
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    Limited::new(response.into_body(), 64 * 1024)
        .collect()
        .await
        .ok()
        .map(|b| b.to_bytes())
}

/// Calls the job's webhook back, signed as its vendor signs.
async fn deliver(s: &Arc<Shared>, id: &str) {
    let (url, body) = {
        let st = s.lock();
        let Some(job) = st.jobs.get(id) else { return };
        let Some(url) = job.webhook.clone() else {
            return;
        };
        let body = match s.vendor {
            Vendor::Replicate => prediction(s, job),
            Vendor::Fal => {
                let mut w = template(Vendor::Fal, "webhook-ok.json");
                w["request_id"] = id.into();
                w["gateway_request_id"] = id.into();
                w
            }
            _ => {
                let mut c = template(Vendor::Minimax, "callback-status.json");
                c["task_id"] = id.into();
                c
            }
        };
        (url, body.to_string().into_bytes())
    };
    let headers = sign(s, id, &body);
    if post(s, &url, body, headers).await.is_some() {
        s.lock().stats.callbacks_delivered += 1;
    }
}

/// A webhook's signature headers, as the vendor sends them.
fn sign(s: &Shared, id: &str, body: &[u8]) -> Vec<(&'static str, String)> {
    let at = unix_s().to_string();
    match s.vendor {
        Vendor::Replicate => {
            use hmac::Mac;
            let msg_id = format!("msg_{id}");
            let mut m = crate::signature::mac(&s.signing_key, format!("{msg_id}.{at}.").as_bytes());
            m.update(body);
            let sig = base64::engine::general_purpose::STANDARD.encode(m.finalize().into_bytes());
            vec![
                ("webhook-id", msg_id),
                ("webhook-timestamp", at),
                ("webhook-signature", format!("v1,{sig}")),
            ]
        }
        Vendor::Fal => {
            let Some(key) = &s.fal_key else {
                return Vec::new();
            };
            let user = "standin-user".to_string();
            let message = super::fal::signed_message(id, &user, &at, body);
            let sig = crate::signature::hex(key.sign(message.as_bytes()).as_ref());
            vec![
                ("x-fal-webhook-request-id", id.to_string()),
                ("x-fal-webhook-user-id", user),
                ("x-fal-webhook-timestamp", at),
                ("x-fal-webhook-signature", sig),
            ]
        }
        _ => Vec::new(),
    }
}
