//! spindle-mock-provider: the API of [`crate::api`] with per-account contracts it enforces and
//! *counts* — concurrency and requests-per-minute violations, repeated request keys — and fault
//! modes selectable per account. Tests, the loadgen and the demo run it; a test passes only if
//! its violation counters stay at zero.
//!
//! The contract per account: at most `concurrency` jobs queued or running, and a request rate
//! of `rpm / 60` per second with a burst of `rpm / 60` (a token bucket: what the node's own
//! limiter promises). A submit beyond either is a violation, counted and answered 429.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};

use crate::adapter::{encode, HttpProvider, QueryError, Sent};
use crate::api::{
    AccountStats, Fault, FaultBody, JobPage, JobState, JobView, Problem, ProblemKind, Stats,
    SubmitBody, BODY_BYTES_MAX, JOB_PAGE_MAX, REQUEST_KEY_BYTES_MAX,
};

/// What a job was submitted with, as the mock received it (`HttpProvider::mock_submission`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Submitted {
    pub job_id: String,
    pub model: String,
    pub input: serde_json::Value,
}

/// One account's contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountSpec {
    pub name: String,
    pub concurrency: u64,
    pub rpm: u64,
}

impl std::str::FromStr for AccountSpec {
    type Err = String;

    /// `name:concurrency:rpm` (the name may itself contain colons).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.rsplitn(3, ':');
        let (Some(r), Some(c), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("{s:?}: expected name:concurrency:rpm"));
        };
        let num = |v: &str, what: &str| {
            v.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{s:?}: {what} must be a positive integer"))
        };
        Ok(AccountSpec {
            name: name.to_string(),
            concurrency: num(c, "concurrency")?,
            rpm: num(r, "rpm")?,
        })
    }
}

#[derive(Debug, Clone)]
pub struct MockConfig {
    pub accounts: Vec<AccountSpec>,
    /// Signs callbacks.
    pub secret: String,
    /// How long a job runs.
    pub job_ms: u64,
    /// What a job costs (milli units), reported on success.
    pub cost_milli: u64,
    /// How long `timeout_after_accept` holds its answer.
    pub hang_ms: u64,
    /// The video every succeeded job returns (as a `file://` URL), if any.
    pub clip: Option<std::path::PathBuf>,
}

/// Jobs the mock keeps (oldest finished ones are forgotten beyond this).
const JOBS_MAX: usize = 1_000_000;

struct Bucket {
    tokens: f64,
    per_s: f64,
    burst: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u64) -> Bucket {
        let per_s = per_minute as f64 / 60.0;
        let burst = per_s.max(1.0);
        Bucket {
            tokens: burst,
            per_s,
            burst,
            at: Instant::now(),
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * self.per_s).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

struct Account {
    spec: AccountSpec,
    fault: Fault,
    contract: Bucket,
    /// Under `rate_limit`: the stricter limits the provider really applies.
    real: Bucket,
    stats: AccountStats,
}

struct Job {
    view: JobView,
    callback_url: Option<String>,
    /// What the caller asked for (`GET /v1/admin/submissions`).
    model: String,
    input: serde_json::Value,
}

#[derive(Default)]
struct State {
    accounts: HashMap<String, Account>,
    jobs: HashMap<String, Job>,
    by_key: HashMap<(String, String), String>,
    next_id: u64,
    /// Job requests being answered now, and the most at once.
    open_requests: u64,
    max_open_requests: u64,
}

struct Shared {
    config: MockConfig,
    /// Where this mock serves, `http://…` or `https://…` (for the output URLs it hands out).
    base: String,
    state: Mutex<State>,
    callbacks: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
}

/// A running mock provider.
pub struct MockProvider {
    pub addr: SocketAddr,
    base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MockProvider {
    /// Serves on `listener` until dropped (on the current tokio runtime).
    pub fn serve(listener: tokio::net::TcpListener, config: MockConfig) -> MockProvider {
        MockProvider::serve_on(listener, config, None)
    }

    /// Serves HTTPS on `listener` with `tls` (a certificate for `localhost`: its base URL is
    /// `https://localhost:PORT`) until dropped.
    pub fn serve_tls(
        listener: tokio::net::TcpListener,
        config: MockConfig,
        tls: Arc<rustls::ServerConfig>,
    ) -> MockProvider {
        MockProvider::serve_on(listener, config, Some(tls))
    }

    fn serve_on(
        listener: tokio::net::TcpListener,
        config: MockConfig,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> MockProvider {
        let addr = listener.local_addr().expect("a bound listener");
        let base = match tls {
            Some(_) => format!("https://localhost:{}", addr.port()),
            None => format!("http://{addr}"),
        };
        let accounts = config
            .accounts
            .iter()
            .map(|a| {
                (
                    a.name.clone(),
                    Account {
                        spec: a.clone(),
                        fault: Fault::None,
                        contract: Bucket::new(a.rpm),
                        real: Bucket::new((a.rpm / 2).max(1)),
                        stats: AccountStats::default(),
                    },
                )
            })
            .collect();
        let shared = Arc::new(Shared {
            config,
            base: base.clone(),
            state: Mutex::new(State {
                accounts,
                ..State::default()
            }),
            callbacks: hyper_util::client::legacy::Client::builder(
                hyper_util::rt::TokioExecutor::new(),
            )
            .build_http(),
        });
        let task = crate::serve::serve(listener, tls, move |req| {
            let shared = shared.clone();
            async move { route(&shared, req).await }
        });
        MockProvider { addr, base, task }
    }

    pub fn base_url(&self) -> String {
        self.base.clone()
    }

    /// An adapter pointed at this mock.
    pub fn client(&self, timeout: Duration) -> HttpProvider {
        HttpProvider::new(&self.base_url(), timeout)
    }
}

/// The mock's own endpoints, for tests and operators.
impl HttpProvider {
    /// Per-account counters (GET /v1/stats).
    pub async fn mock_stats(&self) -> Result<Stats, QueryError> {
        match self.call("GET", "/v1/stats", None).await {
            Sent::Answer(StatusCode::OK, body) => {
                serde_json::from_slice(&body).map_err(|e| QueryError(e.to_string()))
            }
            Sent::Answer(status, _) => Err(QueryError(status.to_string())),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }

    /// The model and input the job of `request_key` was submitted with (GET
    /// /v1/admin/submissions?account=A&request_key=K); `None`: no such job.
    pub async fn mock_submission(
        &self,
        account: &str,
        request_key: &str,
    ) -> Result<Option<Submitted>, QueryError> {
        let path = format!(
            "/v1/admin/submissions?account={}&request_key={}",
            encode(account),
            encode(request_key)
        );
        match self.call("GET", &path, None).await {
            Sent::Answer(StatusCode::OK, body) => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|e| QueryError(e.to_string())),
            Sent::Answer(StatusCode::NOT_FOUND, _) => Ok(None),
            Sent::Answer(status, _) => Err(QueryError(status.to_string())),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }

    /// Sets an account's fault mode (POST /v1/admin/faults).
    pub async fn set_fault(&self, account: &str, fault: Fault) -> Result<(), QueryError> {
        let body = serde_json::to_vec(&FaultBody {
            account: account.to_string(),
            fault,
        })
        .map_err(|e| QueryError(e.to_string()))?;
        match self.call("POST", "/v1/admin/faults", Some(body)).await {
            Sent::Answer(StatusCode::OK, _) => Ok(()),
            Sent::Answer(status, body) => Err(QueryError(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
            ))),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(bytes)))
        .expect("a valid response")
}

fn problem(
    kind: ProblemKind,
    message: impl Into<String>,
    retry: Option<u64>,
) -> Response<Full<Bytes>> {
    json(
        StatusCode::from_u16(kind.status()).expect("a valid status"),
        &Problem {
            error: kind,
            message: message.into(),
            retry_after_ms: retry,
        },
    )
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let body = match Limited::new(req.into_body(), BODY_BYTES_MAX)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => return problem(ProblemKind::InvalidParameters, format!("body: {e}"), None),
    };
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // The job API, counted while it answers (a video download is not a call of it).
    let job_call = segments.first() == Some(&"v1")
        && segments.get(1) == Some(&"jobs")
        && segments.get(3) != Some(&"output");
    if job_call {
        {
            let mut s = shared.lock();
            s.open_requests += 1;
            s.max_open_requests = s.max_open_requests.max(s.open_requests);
        }
        let answer = job_route(shared, &method, &segments, &query, &body).await;
        shared.lock().open_requests -= 1;
        return answer;
    }
    match (&method, segments.as_slice()) {
        (&Method::GET, ["v1", "jobs", id, "output"]) => output(shared, id).await,
        (&Method::GET, ["v1", "stats"]) => json(StatusCode::OK, &stats(shared)),
        (&Method::GET, ["v1", "admin", "submissions"]) => submission(shared, &query),
        (&Method::POST, ["v1", "admin", "faults"]) => {
            let Ok(f) = serde_json::from_slice::<FaultBody>(&body) else {
                return problem(
                    ProblemKind::InvalidParameters,
                    "expected {account, fault}",
                    None,
                );
            };
            match shared.lock().accounts.get_mut(&f.account) {
                Some(a) => {
                    a.fault = f.fault;
                    json(StatusCode::OK, &f)
                }
                None => problem(
                    ProblemKind::NotFound,
                    format!("no account {}", f.account),
                    None,
                ),
            }
        }
        _ => problem(ProblemKind::NotFound, format!("{method} {path}"), None),
    }
}

/// Submits, queries and cancels of jobs.
async fn job_route(
    shared: &Arc<Shared>,
    method: &Method,
    segments: &[&str],
    query: &str,
    body: &Bytes,
) -> Response<Full<Bytes>> {
    match (method, segments) {
        (&Method::POST, ["v1", "jobs"]) => submit(shared, body).await,
        (&Method::GET, ["v1", "jobs"]) => {
            let account = query_param(query, "account").unwrap_or_default();
            if queries_down(shared, &account) {
                return problem(ProblemKind::Unavailable, "queries are down", None);
            }
            if query_param(query, "live").as_deref() == Some("true") {
                return live_jobs(shared, &account, query);
            }
            by_key(shared, query)
        }
        (&Method::GET, ["v1", "jobs", id]) => {
            let view = shared.lock().jobs.get(*id).map(|j| j.view.clone());
            match view {
                Some(v) if queries_down(shared, &v.account) => {
                    problem(ProblemKind::Unavailable, "queries are down", None)
                }
                Some(v) => json(StatusCode::OK, &v),
                None => problem(ProblemKind::NotFound, format!("no job {id}"), None),
            }
        }
        (&Method::POST, ["v1", "jobs", id, "cancel"]) => cancel(shared, id),
        _ => problem(
            ProblemKind::NotFound,
            format!("{method} /{}", segments.join("/")),
            None,
        ),
    }
}

/// Whether `account` answers queries 503 now (fault `query-outage`).
fn queries_down(shared: &Shared, account: &str) -> bool {
    shared
        .lock()
        .accounts
        .get(account)
        .is_some_and(|a| a.fault == Fault::QueryOutage)
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn stats(shared: &Shared) -> Stats {
    let s = shared.lock();
    Stats {
        accounts: s
            .accounts
            .iter()
            .map(|(n, a)| (n.clone(), a.stats.clone()))
            .collect(),
        max_open_requests: s.max_open_requests,
    }
}

fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| decode(v))
    })
}

fn decode(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&v[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The job of the query's `account` and `request_key`, or the answer that says why there is
/// none.
fn with_job_by_key(
    shared: &Shared,
    query: &str,
    answer: impl FnOnce(&Job) -> Response<Full<Bytes>>,
) -> Response<Full<Bytes>> {
    let (Some(account), Some(key)) = (
        query_param(query, "account"),
        query_param(query, "request_key"),
    ) else {
        return problem(
            ProblemKind::InvalidParameters,
            "account and request_key are required",
            None,
        );
    };
    let s = shared.lock();
    match s
        .by_key
        .get(&(account, key.clone()))
        .and_then(|id| s.jobs.get(id))
    {
        Some(j) => answer(j),
        None => problem(ProblemKind::NotFound, format!("no job for key {key}"), None),
    }
}

/// One page of `account`'s queued and running jobs, in job order (`job-N` by N) after the
/// query's `after`.
fn live_jobs(shared: &Shared, account: &str, query: &str) -> Response<Full<Bytes>> {
    let limit = match query_param(query, "limit").map(|l| l.parse::<usize>()) {
        None => JOB_PAGE_MAX,
        Some(Ok(n)) if (1..=JOB_PAGE_MAX).contains(&n) => n,
        Some(_) => {
            return problem(
                ProblemKind::InvalidParameters,
                format!("limit must be 1..={JOB_PAGE_MAX}"),
                None,
            )
        }
    };
    let number = |id: &str| id.strip_prefix("job-").and_then(|n| n.parse::<u64>().ok());
    let after = query_param(query, "after")
        .and_then(|a| number(&a))
        .unwrap_or(0);
    let s = shared.lock();
    let mut live: Vec<(u64, &JobView)> = s
        .jobs
        .values()
        .filter(|j| j.view.account == account && !j.view.state.is_final())
        .filter_map(|j| number(&j.view.job_id).map(|n| (n, &j.view)))
        .filter(|&(n, _)| n > after)
        .collect();
    live.sort_unstable_by_key(|&(n, _)| n);
    let more = live.len() > limit;
    live.truncate(limit);
    let page = JobPage {
        next: more
            .then(|| live.last().map(|(_, v)| v.job_id.clone()))
            .flatten(),
        jobs: live.into_iter().map(|(_, v)| v.clone()).collect(),
    };
    json(StatusCode::OK, &page)
}

fn by_key(shared: &Shared, query: &str) -> Response<Full<Bytes>> {
    with_job_by_key(shared, query, |j| json(StatusCode::OK, &j.view))
}

/// What the job of `account` and `request_key` was submitted with.
fn submission(shared: &Shared, query: &str) -> Response<Full<Bytes>> {
    with_job_by_key(shared, query, |j| {
        let submitted = Submitted {
            job_id: j.view.job_id.clone(),
            model: j.model.clone(),
            input: j.input.clone(),
        };
        json(StatusCode::OK, &submitted)
    })
}

async fn submit(shared: &Arc<Shared>, body: &[u8]) -> Response<Full<Bytes>> {
    let sub: SubmitBody = match serde_json::from_slice(body) {
        Ok(s) => s,
        Err(e) => return problem(ProblemKind::InvalidParameters, format!("body: {e}"), None),
    };
    if sub.request_key.is_empty() || sub.request_key.len() > REQUEST_KEY_BYTES_MAX {
        return problem(
            ProblemKind::InvalidParameters,
            format!("request_key must be 1..={REQUEST_KEY_BYTES_MAX} bytes"),
            None,
        );
    }
    let now = Instant::now();
    let (view, hang) = {
        let mut guard = shared.lock();
        let s = &mut *guard;
        let Some(a) = s.accounts.get_mut(&sub.account) else {
            return problem(
                ProblemKind::Auth,
                format!("no account {}", sub.account),
                None,
            );
        };
        let refuse = |kind: ProblemKind| problem(kind, format!("account fault: {kind:?}"), None);
        match a.fault {
            Fault::Auth => return refuse(ProblemKind::Auth),
            Fault::Balance => return refuse(ProblemKind::Balance),
            Fault::InvalidParameters => return refuse(ProblemKind::InvalidParameters),
            Fault::Moderation => return refuse(ProblemKind::Moderation),
            Fault::ServerError => return refuse(ProblemKind::Unavailable),
            _ => {}
        }
        let key = (sub.account.clone(), sub.request_key.clone());
        if let Some(id) = s.by_key.get(&key) {
            // The same attempt sent twice: the original job, counted.
            a.stats.duplicate_keys += 1;
            let view = s.jobs[id].view.clone();
            return json(StatusCode::OK, &view);
        }
        // The contract first: a submit beyond it is the caller's violation.
        if a.stats.in_flight >= a.spec.concurrency {
            a.stats.concurrency_violations += 1;
            return problem(
                ProblemKind::RateLimited,
                format!("concurrency {} exceeded", a.spec.concurrency),
                Some(1_000),
            );
        }
        if !a.contract.take(now) {
            a.stats.rpm_violations += 1;
            return problem(
                ProblemKind::RateLimited,
                format!("{} requests per minute exceeded", a.spec.rpm),
                Some(1_000),
            );
        }
        if a.fault == Fault::RateLimit
            && (a.stats.in_flight >= (a.spec.concurrency / 2).max(1) || !a.real.take(now))
        {
            a.stats.rate_limited += 1;
            return problem(ProblemKind::RateLimited, "slow down", Some(500));
        }
        a.stats.accepted += 1;
        a.stats.in_flight += 1;
        a.stats.max_in_flight = a.stats.max_in_flight.max(a.stats.in_flight);
        let fault = a.fault;
        s.next_id += 1;
        let id = format!("job-{}", s.next_id);
        let view = JobView {
            job_id: id.clone(),
            account: sub.account.clone(),
            request_key: sub.request_key.clone(),
            state: JobState::Running,
            progress: 10,
            cost_milli: None,
            error: None,
            retryable: false,
            output_url: None,
        };
        if s.jobs.len() >= JOBS_MAX {
            // Bounded: forget finished jobs (their keys stay answered only while kept).
            let finished: Vec<String> = s
                .jobs
                .iter()
                .filter(|(_, j)| j.view.state.is_final())
                .map(|(id, _)| id.clone())
                .take(JOBS_MAX / 10)
                .collect();
            for f in finished {
                if let Some(j) = s.jobs.remove(&f) {
                    s.by_key
                        .remove(&(j.view.account.clone(), j.view.request_key.clone()));
                }
            }
        }
        s.by_key.insert(key, id.clone());
        s.jobs.insert(
            id.clone(),
            Job {
                view: view.clone(),
                callback_url: sub.callback_url.clone(),
                model: sub.model.clone(),
                input: sub.input.clone(),
            },
        );
        let run_ms = if fault == Fault::Slow {
            shared.config.job_ms * 10
        } else {
            shared.config.job_ms
        };
        let shared2 = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(run_ms)).await;
            finish(&shared2, &id, JobState::Succeeded).await;
        });
        (view, fault == Fault::TimeoutAfterAccept)
    };
    callback(shared, &view.job_id).await;
    if hang {
        tokio::time::sleep(Duration::from_millis(shared.config.hang_ms)).await;
    }
    json(StatusCode::ACCEPTED, &view)
}

/// Moves a live job to `state` (once) and calls back.
async fn finish(shared: &Arc<Shared>, id: &str, state: JobState) -> Option<JobView> {
    let view = {
        let mut guard = shared.lock();
        let s = &mut *guard;
        let job = s.jobs.get_mut(id)?;
        if job.view.state.is_final() {
            return Some(job.view.clone());
        }
        job.view.state = state;
        job.view.progress = 100;
        if state == JobState::Succeeded {
            job.view.cost_milli = Some(shared.config.cost_milli);
            job.view.output_url = shared
                .config
                .clip
                .as_ref()
                .map(|_| format!("{}/v1/jobs/{id}/output", shared.base));
        }
        let view = job.view.clone();
        if let Some(a) = s.accounts.get_mut(&view.account) {
            a.stats.in_flight = a.stats.in_flight.saturating_sub(1);
            match state {
                JobState::Succeeded => a.stats.completed += 1,
                JobState::Failed => a.stats.failed += 1,
                JobState::Canceled => a.stats.canceled += 1,
                _ => {}
            }
        }
        view
    };
    callback(shared, id).await;
    Some(view)
}

/// A succeeded job's video (the configured clip).
async fn output(shared: &Arc<Shared>, id: &str) -> Response<Full<Bytes>> {
    let done = shared
        .lock()
        .jobs
        .get(id)
        .is_some_and(|j| j.view.state == JobState::Succeeded);
    let Some(clip) = shared.config.clip.as_ref().filter(|_| done) else {
        return problem(
            ProblemKind::NotFound,
            format!("no output for job {id}"),
            None,
        );
    };
    match tokio::fs::read(clip).await {
        Ok(bytes) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "video/mp4")
            .body(Full::new(Bytes::from(bytes)))
            .expect("a valid response"),
        Err(e) => problem(
            ProblemKind::Unavailable,
            format!("reading the clip: {e}"),
            None,
        ),
    }
}

fn cancel(shared: &Arc<Shared>, id: &str) -> Response<Full<Bytes>> {
    let exists = shared.lock().jobs.contains_key(id);
    if !exists {
        return problem(ProblemKind::NotFound, format!("no job {id}"), None);
    }
    let shared2 = shared.clone();
    let id2 = id.to_string();
    tokio::spawn(async move { finish(&shared2, &id2, JobState::Canceled).await });
    let view = shared.lock().jobs[id].view.clone();
    json(StatusCode::OK, &view)
}

/// Posts the job's current view to its callback URL, signed (per the account's fault mode: not
/// at all, once, or twice). Best effort: a lost callback is what polling is for.
async fn callback(shared: &Arc<Shared>, id: &str) {
    let (view, url, fault) = {
        let s = shared.lock();
        let Some(job) = s.jobs.get(id) else { return };
        let Some(url) = job.callback_url.clone() else {
            return;
        };
        let fault = s
            .accounts
            .get(&job.view.account)
            .map_or(Fault::None, |a| a.fault);
        (job.view.clone(), url, fault)
    };
    let times = match fault {
        Fault::LostCallback => 0,
        Fault::DuplicateCallback => 2,
        _ => 1,
    };
    let body = serde_json::to_vec(&view).unwrap_or_default();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let signature = crate::signature::sign_at(shared.config.secret.as_bytes(), now_ms, &body);
    for _ in 0..times {
        let Ok(request) = Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header("content-type", "application/json")
            .header(crate::signature::HEADER, &signature)
            .body(Full::new(Bytes::from(body.clone())))
        else {
            return;
        };
        let sent =
            tokio::time::timeout(Duration::from_secs(2), shared.callbacks.request(request)).await;
        if matches!(sent, Ok(Ok(_))) {
            if let Some(a) = shared.lock().accounts.get_mut(&view.account) {
                a.stats.callbacks_sent += 1;
            }
        }
    }
}
