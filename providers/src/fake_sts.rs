//! A stand-in for AWS STS's `AssumeRoleWithWebIdentity`, on a real socket, for tests: it takes
//! the form STS takes, refuses a wrong role or token with STS's error, and answers with the
//! keys it was told to issue, expiring when told — counting the trades.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};

use crate::object_store::Credentials;

/// A running fake STS; it stops when dropped.
pub struct FakeSts {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeSts {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    role_arn: String,
    token: String,
    /// What the next trades issue, and for how long.
    issue: Mutex<(Credentials, Duration)>,
    trades: AtomicU32,
    refused: AtomicU32,
}

impl FakeSts {
    /// Trades `token` (and only it) for `role_arn`'s keys: `keys`, valid for `valid`.
    pub async fn start(
        role_arn: &str,
        token: &str,
        keys: Credentials,
        valid: Duration,
    ) -> std::io::Result<FakeSts> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            role_arn: role_arn.to_string(),
            token: token.to_string(),
            issue: Mutex::new((keys, valid)),
            trades: AtomicU32::new(0),
            refused: AtomicU32::new(0),
        });
        let shared = state.clone();
        let task = crate::serve::serve(listener, None, move |req| {
            let state = shared.clone();
            async move {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                answer(&state, &body)
            }
        });
        Ok(FakeSts { addr, state, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// From now on trades issue `keys`, valid for `valid`.
    pub fn issue(&self, keys: Credentials, valid: Duration) {
        *self.state.issue.lock().unwrap_or_else(|p| p.into_inner()) = (keys, valid);
    }

    /// Tokens traded for keys, and trades refused.
    pub fn trades(&self) -> u32 {
        self.state.trades.load(Ordering::Relaxed)
    }

    pub fn refused(&self) -> u32 {
        self.state.refused.load(Ordering::Relaxed)
    }
}

fn answer(state: &State, body: &[u8]) -> Response<Full<Bytes>> {
    let form = String::from_utf8_lossy(body);
    let field = |name: &str| crate::adapter::query_value(&form, name);
    let refuse = |status: StatusCode, code: &str| {
        state.refused.fetch_add(1, Ordering::Relaxed);
        let mut a = Response::new(Full::new(Bytes::from(format!(
            "<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code></Error></ErrorResponse>"
        ))));
        *a.status_mut() = status;
        a
    };
    if field("Action").as_deref() != Some("AssumeRoleWithWebIdentity")
        || field("Version").as_deref() != Some("2011-06-15")
        || field("RoleSessionName").is_none_or(|n| n.is_empty())
    {
        return refuse(StatusCode::BAD_REQUEST, "InvalidAction");
    }
    if field("RoleArn").as_deref() != Some(state.role_arn.as_str()) {
        return refuse(StatusCode::FORBIDDEN, "AccessDenied");
    }
    if field("WebIdentityToken").as_deref() != Some(state.token.as_str()) {
        return refuse(StatusCode::BAD_REQUEST, "InvalidIdentityToken");
    }
    state.trades.fetch_add(1, Ordering::Relaxed);
    let (keys, valid) = state
        .issue
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let expiration = crate::sts::format_utc(SystemTime::now() + valid);
    Response::new(Full::new(Bytes::from(format!(
        "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials>\
         <AccessKeyId>{}</AccessKeyId><SecretAccessKey>{}</SecretAccessKey>\
         <SessionToken>{}</SessionToken><Expiration>{expiration}</Expiration></Credentials>\
         </AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>",
        keys.access_key_id,
        keys.secret_access_key,
        keys.session_token.unwrap_or_default()
    ))))
}
