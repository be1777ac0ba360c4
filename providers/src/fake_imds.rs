//! A stand-in for an EC2 instance's metadata service, on a real socket, for tests: IMDSv2 only
//! (a `PUT` for a session token, every `GET` refused without one), the instance's role and its
//! keys as JSON, expiring when told — counting what it handed out.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Response, StatusCode};

use crate::object_store::Credentials;

/// A running fake metadata service; it stops when dropped.
pub struct FakeImds {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    /// The instance's role, if one is attached.
    role: Option<String>,
    /// What the next reads of the role's keys give, and for how long.
    issue: Mutex<(Credentials, Duration)>,
    /// The `Code` the keys' answer carries (`Success`, or what EC2 says when the role cannot be
    /// assumed).
    code: Mutex<String>,
    /// Session tokens handed out (the n-th is `token-n`).
    tokens: AtomicU32,
    key_reads: AtomicU32,
    refused: AtomicU32,
}

impl FakeImds {
    /// An instance with `role` attached (or none), whose keys are `keys`, valid for `valid`.
    pub async fn start(
        role: Option<&str>,
        keys: Credentials,
        valid: Duration,
    ) -> std::io::Result<FakeImds> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            role: role.map(str::to_string),
            issue: Mutex::new((keys, valid)),
            code: Mutex::new("Success".into()),
            tokens: AtomicU32::new(0),
            key_reads: AtomicU32::new(0),
            refused: AtomicU32::new(0),
        });
        let shared = state.clone();
        let task = crate::serve::serve(listener, None, move |req| {
            let answer = answer(&shared, req.method(), req.uri().path(), req.headers());
            async move { answer }
        });
        Ok(FakeImds { addr, state, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on the role's keys are `keys`, valid for `valid`.
    pub fn issue(&self, keys: Credentials, valid: Duration) {
        *self.state.issue.lock().unwrap_or_else(|p| p.into_inner()) = (keys, valid);
    }

    /// From now on the keys' answer carries `code` instead of `Success`.
    pub fn answer_code(&self, code: &str) {
        *self.state.code.lock().unwrap_or_else(|p| p.into_inner()) = code.to_string();
    }

    /// Session tokens handed out, reads of the role's keys, requests refused.
    pub fn tokens(&self) -> u32 {
        self.state.tokens.load(Ordering::Relaxed)
    }

    pub fn key_reads(&self) -> u32 {
        self.state.key_reads.load(Ordering::Relaxed)
    }

    pub fn refused(&self) -> u32 {
        self.state.refused.load(Ordering::Relaxed)
    }
}

fn answer(
    state: &State,
    method: &Method,
    path: &str,
    headers: &hyper::HeaderMap,
) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut a = Response::new(Full::new(Bytes::from(body)));
        *a.status_mut() = status;
        a
    };
    let refuse = |status: StatusCode| {
        state.refused.fetch_add(1, Ordering::Relaxed);
        reply(status, String::new())
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if method == Method::PUT && path == "/latest/api/token" {
        return match header("x-aws-ec2-metadata-token-ttl-seconds")
            .and_then(|t| t.parse::<u32>().ok())
        {
            Some(1..=21_600) => {
                let n = state.tokens.fetch_add(1, Ordering::Relaxed) + 1;
                reply(StatusCode::OK, format!("token-{n}"))
            }
            _ => refuse(StatusCode::BAD_REQUEST),
        };
    }
    // IMDSv2: a GET carries a token this service handed out.
    let issued = state.tokens.load(Ordering::Relaxed);
    let valid = header("x-aws-ec2-metadata-token")
        .and_then(|t| t.strip_prefix("token-"))
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| (1..=issued).contains(&n));
    if method != Method::GET || !valid {
        return refuse(StatusCode::UNAUTHORIZED);
    }
    let Some(rest) = path.strip_prefix("/latest/meta-data/iam/security-credentials/") else {
        return reply(StatusCode::NOT_FOUND, String::new());
    };
    match (&state.role, rest) {
        (None, _) => reply(StatusCode::NOT_FOUND, String::new()),
        (Some(role), "") => reply(StatusCode::OK, role.clone()),
        (Some(role), asked) if asked == role => {
            state.key_reads.fetch_add(1, Ordering::Relaxed);
            let (keys, valid) = state
                .issue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let now = SystemTime::now();
            let body = serde_json::json!({
                "Code": state.code.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                "LastUpdated": crate::sts::format_utc(now),
                "Type": "AWS-HMAC",
                "AccessKeyId": keys.access_key_id,
                "SecretAccessKey": keys.secret_access_key,
                "Token": keys.session_token.unwrap_or_default(),
                "Expiration": crate::sts::format_utc(now + valid),
            });
            reply(StatusCode::OK, body.to_string())
        }
        _ => reply(StatusCode::NOT_FOUND, String::new()),
    }
}
