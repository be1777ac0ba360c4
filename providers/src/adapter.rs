//! The trait spindle dispatches through, and the generic HTTP adapter for the API of
//! [`crate::api`].
//!
//! The one distinction that matters for money is between a definite "not accepted" (a 429, a
//! refusal, a connection that never reached the provider) and "no answer" (a timeout, a reset
//! after the request was sent, a 5xx): after the latter the provider may be running — and
//! billing — the job, so the caller keeps the reservation and asks by request key before it
//! sends anything again.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::StatusCode;
use hyper_util::client::legacy::Client;

use crate::api::{JobView, Problem, ProblemKind, SubmitBody, BODY_BYTES_MAX};

/// What an attempt asks of a provider.
pub type Submission = SubmitBody;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Provably not accepted: slow down and try later.
    #[error("rate limited (retry after {retry_after_ms:?} ms)")]
    RateLimited { retry_after_ms: Option<u64> },
    /// Provably not accepted and never will be (auth, balance, invalid parameters, moderation).
    #[error("refused ({kind:?}): {message}")]
    Refused { kind: ProblemKind, message: String },
    /// The request never reached the provider (connection refused): not accepted, retryable.
    #[error("not sent: {0}")]
    NotSent(String),
    /// No definite answer: it may have been accepted.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// The caller withdrew it while it waited for its turn ([`HttpProvider::submit_unless`]):
    /// nothing was sent, and nothing about the provider's health follows from it.
    #[error("withdrawn before it was sent")]
    Withdrawn,
}

/// A lookup's answer: the job, or a definite "no such job".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Found(JobView),
    NotFound,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("provider query failed: {0}")]
pub struct QueryError(pub String);

/// An async-job provider: submit with a request key, then learn the outcome by callback or by
/// asking.
pub trait AsyncJobProvider: Send + Sync + 'static {
    fn submit(&self, s: &Submission) -> impl Future<Output = Result<JobView, SubmitError>> + Send;
    fn job(
        &self,
        account: &str,
        job_id: &str,
    ) -> impl Future<Output = Result<Lookup, QueryError>> + Send;
    /// The job a request key created, or a definite NotFound: the only answer after which a
    /// request whose outcome was unknown may be sent again.
    fn find_by_key(
        &self,
        account: &str,
        request_key: &str,
    ) -> impl Future<Output = Result<Lookup, QueryError>> + Send;
    fn cancel(
        &self,
        account: &str,
        job_id: &str,
    ) -> impl Future<Output = Result<Lookup, QueryError>> + Send;
}

/// The generic HTTP adapter.
#[derive(Clone)]
pub struct HttpProvider {
    base: String,
    client: Client<crate::tls::Connector, Full<Bytes>>,
    timeout: Duration,
    /// One permit per call open at once, when bounded ([`HttpProvider::with_requests_max`]).
    open: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    /// The `authorization` header every call carries (a vendor's API key), if any.
    authorization: Option<hyper::header::HeaderValue>,
}

pub(crate) enum Sent {
    Answer(StatusCode, Bytes),
    /// Connecting failed: nothing reached the provider.
    Unsent(String),
    /// Sent (or maybe sent) without an answer.
    NoAnswer(String),
}

impl HttpProvider {
    /// `base` like `http://127.0.0.1:7480` or `https://api.example.com` (its certificate
    /// checked against the public web's roots); every call gives up after `timeout`.
    pub fn new(base: &str, timeout: Duration) -> HttpProvider {
        HttpProvider {
            base: base.trim_end_matches('/').to_string(),
            client: crate::tls::client(&crate::tls::public_roots(), timeout),
            timeout,
            open: None,
            authorization: None,
        }
    }

    /// Sends `value` as the `authorization` header of every call (`Bearer …`, `Key …`); a
    /// value no header may hold (a line break in a key file, say) is refused here, by name.
    pub fn with_authorization(mut self, value: &str) -> Result<HttpProvider, String> {
        let mut v = hyper::header::HeaderValue::from_str(value)
            .map_err(|_| "the API key holds characters no HTTP header may carry".to_string())?;
        v.set_sensitive(true);
        self.authorization = Some(v);
        Ok(self)
    }

    /// Checks `https://` peers against `tls`'s roots instead (a private CA's among them:
    /// [`crate::tls::with_roots_file`]).
    pub fn with_tls(mut self, tls: &rustls::ClientConfig) -> HttpProvider {
        self.client = crate::tls::client(tls, self.timeout);
        self
    }

    /// At most `n` calls open at once (each clone shares the bound); more wait their turn, and
    /// the wait does not count against a call's timeout.
    pub fn with_requests_max(mut self, n: usize) -> HttpProvider {
        self.open = Some(std::sync::Arc::new(tokio::sync::Semaphore::new(n)));
        self
    }

    pub(crate) async fn call(&self, method: &str, path: &str, body: Option<Vec<u8>>) -> Sent {
        let _open = self.turn().await;
        self.exchange(method, path, body).await
    }

    /// Waits for a call's turn when calls are bounded; the permit is held for the call.
    async fn turn(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // Never closed: a permit always comes.
        match &self.open {
            Some(open) => open.acquire().await.ok(),
            None => None,
        }
    }

    /// One request and its answer, bounded by the timeout.
    async fn exchange(&self, method: &str, path: &str, body: Option<Vec<u8>>) -> Sent {
        self.exchange_hinted(method, path, body).await.0
    }

    /// A call in its turn, with the answer's `Retry-After` ([`Self::exchange_hinted`]).
    pub(crate) async fn call_hinted(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> (Sent, Option<u64>) {
        let _open = self.turn().await;
        self.exchange_hinted(method, path, body).await
    }

    /// One request and its answer, bounded by the timeout; with the answer's `Retry-After`
    /// in ms (seconds or an HTTP date), when it has one.
    async fn exchange_hinted(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> (Sent, Option<u64>) {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        if let Some(auth) = &self.authorization {
            request = request.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        let request = match request.body(Full::new(Bytes::from(body.unwrap_or_default()))) {
            Ok(r) => r,
            Err(e) => return (Sent::Unsent(format!("bad request: {e}")), None),
        };
        let exchange = async {
            let response = match self.client.request(request).await {
                Ok(r) => r,
                Err(e) if e.is_connect() => return (Sent::Unsent(crate::tls::describe(&e)), None),
                Err(e) => return (Sent::NoAnswer(crate::tls::describe(&e)), None),
            };
            let status = response.status();
            let hint = response
                .headers()
                .get(hyper::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(retry_after_ms);
            match Limited::new(response.into_body(), BODY_BYTES_MAX)
                .collect()
                .await
            {
                Ok(b) => (Sent::Answer(status, b.to_bytes()), hint),
                Err(e) => (Sent::NoAnswer(format!("reading the answer: {e}")), None),
            }
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(sent) => sent,
            Err(_) => (
                Sent::NoAnswer(format!("no answer within {:?}", self.timeout)),
                None,
            ),
        }
    }

    /// `submit`, unless `withdrawn` is set by the time the call's turn comes (with
    /// `with_requests_max`, a call may wait for one): then nothing is sent and the answer is
    /// [`SubmitError::Withdrawn`]. A submit already on its way is not called back.
    pub async fn submit_unless(
        &self,
        s: &Submission,
        withdrawn: &std::sync::atomic::AtomicBool,
    ) -> Result<JobView, SubmitError> {
        let body = serde_json::to_vec(s).map_err(|e| SubmitError::NotSent(e.to_string()))?;
        let (sent, hint) = self.send_unless("/v1/jobs", body, withdrawn).await?;
        submit_answer(sent, hint)
    }

    /// POSTs `body` to `path` in its turn — unless `withdrawn` is set by then: nothing is
    /// sent and the answer is [`SubmitError::Withdrawn`]. With the answer's `Retry-After`.
    pub(crate) async fn send_unless(
        &self,
        path: &str,
        body: Vec<u8>,
        withdrawn: &std::sync::atomic::AtomicBool,
    ) -> Result<(Sent, Option<u64>), SubmitError> {
        let _open = self.turn().await;
        if withdrawn.load(std::sync::atomic::Ordering::Acquire) {
            return Err(SubmitError::Withdrawn);
        }
        Ok(self.exchange_hinted("POST", path, Some(body)).await)
    }

    async fn lookup(&self, method: &str, path: &str) -> Result<Lookup, QueryError> {
        match self.call(method, path, None).await {
            Sent::Answer(StatusCode::OK, body) => serde_json::from_slice(&body)
                .map(Lookup::Found)
                .map_err(|e| QueryError(format!("unreadable job: {e}"))),
            Sent::Answer(StatusCode::NOT_FOUND, _) => Ok(Lookup::NotFound),
            Sent::Answer(status, body) => Err(QueryError(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
            ))),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }
}

impl HttpProvider {
    /// One page of `account`'s queued and running jobs after job `after` (`None`: from the
    /// first), at most `limit` (1..=[`crate::api::JOB_PAGE_MAX`]): what the orphan reconciler
    /// walks to find jobs no live attempt owns.
    pub async fn live_jobs(
        &self,
        account: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<crate::api::JobPage, QueryError> {
        let mut path = format!(
            "/v1/jobs?account={}&live=true&limit={}",
            encode(account),
            limit.clamp(1, crate::api::JOB_PAGE_MAX)
        );
        if let Some(after) = after {
            path.push_str(&format!("&after={}", encode(after)));
        }
        match self.call("GET", &path, None).await {
            Sent::Answer(StatusCode::OK, body) => serde_json::from_slice(&body)
                .map_err(|e| QueryError(format!("unreadable job page: {e}"))),
            Sent::Answer(status, body) => Err(QueryError(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
            ))),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }
}

/// A `Retry-After` value in ms: delay-seconds, or an HTTP date (0 when it has passed).
pub(crate) fn retry_after_ms(value: &str) -> Option<u64> {
    let value = value.trim();
    if let Ok(s) = value.parse::<u64>() {
        return Some(s.saturating_mul(1_000));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .map_or(0, |d| d.as_millis() as u64),
    )
}

/// What a submit's exchange says about the job; `hint` is the answer's `Retry-After`, which
/// a 429 without a hint in its body goes by.
fn submit_answer(sent: Sent, hint: Option<u64>) -> Result<JobView, SubmitError> {
    match sent {
        Sent::Answer(status, body) if status.is_success() => serde_json::from_slice(&body)
            // It answered success: accepted, but we cannot read what. Ask by key.
            .map_err(|e| SubmitError::Unknown(format!("unreadable acceptance: {e}"))),
        Sent::Answer(status, body) => {
            let problem: Option<Problem> = serde_json::from_slice(&body).ok();
            let message = problem.as_ref().map_or_else(
                || String::from_utf8_lossy(&body).into_owned(),
                |p| p.message.clone(),
            );
            match status.as_u16() {
                429 => Err(SubmitError::RateLimited {
                    retry_after_ms: problem.and_then(|p| p.retry_after_ms).or(hint),
                }),
                400..=499 => Err(SubmitError::Refused {
                    kind: problem.map_or(
                        match status.as_u16() {
                            401 | 403 => ProblemKind::Auth,
                            402 => ProblemKind::Balance,
                            422 => ProblemKind::Moderation,
                            _ => ProblemKind::InvalidParameters,
                        },
                        |p| p.error,
                    ),
                    message,
                }),
                // A 5xx says nothing about whether the job was taken.
                _ => Err(SubmitError::Unknown(format!("{status}: {message}"))),
            }
        }
        Sent::Unsent(e) => Err(SubmitError::NotSent(e)),
        Sent::NoAnswer(e) => Err(SubmitError::Unknown(e)),
    }
}

/// `%XX`-decoded `text`; `None` where it is not valid encoding of UTF-8.
pub(crate) fn decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The value of `name` in a URL query or a form (`a=1&b=2`; `+` is a space, `%2B` a plus);
/// `None` when absent or not UTF-8 once decoded.
pub fn query_value(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| decode(&v.replace('+', " "))).flatten()
    })
}

/// Percent-encodes a query value (request keys and accounts are short ASCII in practice).
pub(crate) fn encode(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl AsyncJobProvider for HttpProvider {
    async fn submit(&self, s: &Submission) -> Result<JobView, SubmitError> {
        let body = serde_json::to_vec(s).map_err(|e| SubmitError::NotSent(e.to_string()))?;
        let (sent, hint) = self.call_hinted("POST", "/v1/jobs", Some(body)).await;
        submit_answer(sent, hint)
    }

    async fn job(&self, _account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        self.lookup("GET", &format!("/v1/jobs/{}", encode(job_id)))
            .await
    }

    async fn find_by_key(&self, account: &str, request_key: &str) -> Result<Lookup, QueryError> {
        let path = format!(
            "/v1/jobs?account={}&request_key={}",
            encode(account),
            encode(request_key)
        );
        self.lookup("GET", &path).await
    }

    async fn cancel(&self, _account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        self.lookup("POST", &format!("/v1/jobs/{}/cancel", encode(job_id)))
            .await
    }
}

/// Why a download failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: larger than {max_bytes} bytes")]
    TooLarge { url: String, max_bytes: u64 },
    #[error("{url}: {reason}")]
    Failed { url: String, reason: String },
    /// Not a source media may be fetched from (`crate::sources`).
    #[error("{url}: refused: {reason}")]
    Refused { url: String, reason: String },
}

impl FetchError {
    /// Whether trying again could help (a refused or oversized file will not change).
    pub fn is_retryable(&self) -> bool {
        match self {
            FetchError::Status { status, .. } => *status >= 500,
            FetchError::TooLarge { .. } | FetchError::Refused { .. } => false,
            FetchError::Failed { .. } => true,
        }
    }
}

/// Downloads `url` (http:// or https://, checked against `tls`'s roots) into `dest`, at most
/// `max_bytes`, within `timeout`, from any host but the addresses no video is served from
/// (`crate::sources`). A partial file is removed.
pub async fn download(
    url: &str,
    dest: &std::path::Path,
    max_bytes: u64,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<u64, FetchError> {
    download_from(
        url,
        dest,
        max_bytes,
        timeout,
        tls,
        &crate::sources::Sources::any(),
    )
    .await
}

/// [`download`] from the hosts `sources` allows only.
pub async fn download_from(
    url: &str,
    dest: &std::path::Path,
    max_bytes: u64,
    timeout: Duration,
    tls: &rustls::ClientConfig,
    sources: &crate::sources::Sources,
) -> Result<u64, FetchError> {
    use tokio::io::AsyncWriteExt;
    let failed = |reason: String| FetchError::Failed {
        url: url.to_string(),
        reason,
    };
    let fetch = async {
        let client = crate::tls::guarded_client(tls, timeout);
        let uri: hyper::Uri = url.parse().map_err(|e| failed(format!("bad URL: {e}")))?;
        if let Some(why) = sources.refusal(&uri) {
            return Err(FetchError::Refused {
                url: url.to_string(),
                reason: why,
            });
        }
        let response = client
            .get(uri)
            .await
            .map_err(|e| failed(crate::tls::describe(&e)))?;
        if !response.status().is_success() {
            return Err(FetchError::Status {
                url: url.to_string(),
                status: response.status().as_u16(),
            });
        }
        let mut body = response.into_body();
        let mut file = tokio::fs::File::create(dest)
            .await
            .map_err(|e| failed(format!("creating {}: {e}", dest.display())))?;
        let mut written = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| failed(e.to_string()))?;
            if let Ok(chunk) = frame.into_data() {
                written += chunk.len() as u64;
                if written > max_bytes {
                    return Err(FetchError::TooLarge {
                        url: url.to_string(),
                        max_bytes,
                    });
                }
                file.write_all(&chunk)
                    .await
                    .map_err(|e| failed(format!("writing {}: {e}", dest.display())))?;
            }
        }
        file.flush().await.map_err(|e| failed(e.to_string()))?;
        Ok(written)
    };
    let result = match tokio::time::timeout(timeout, fetch).await {
        Ok(r) => r,
        Err(_) => Err(failed(format!("no complete answer within {timeout:?}"))),
    };
    if result.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    result
}
