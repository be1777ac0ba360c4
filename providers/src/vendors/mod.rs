//! Adapters for AI-video vendors' own async-job APIs — Replicate's predictions
//! ([`replicate`]), fal.ai's queue ([`fal`]) and MiniMax's video generation ([`minimax`]) —
//! beside spindle's generic API ([`crate::api`], [`HttpProvider`]), one chosen per provider by
//! [`Vendor`]. Each maps its vendor's submit, status and cancel answers, rate-limit answers
//! (`Retry-After`) and error codes onto spindle's classes ([`SubmitError`], [`Lookup`]), and
//! checks its vendor's callbacks as the vendor documents them.
//!
//! Two things every vendor shares, because none of the three offers a lookup by a client's
//! key the way spindle's API does:
//!
//! - **Each attempt's callback URL names its request key**, with a token only the node can
//!   make (`spindle_key=K&spindle_token=HMAC(secret, K)`, [`callback_url`]): a callback is tied
//!   to its attempt even when the submit's answer never came back.
//! - **A callback is a reason to ask, never an outcome.** A checked callback says which job
//!   changed ([`Callback::Changed`]); the node then asks the vendor for that job. A forged or
//!   replayed body can at worst cause one query.
//!
//! A submit whose answer never came is found again by query where the vendor lists jobs in a
//! way that shows the key (Replicate: its predictions list shows each one's webhook URL), and
//! otherwise by the callback that names the key; it is never sent a second time
//! ([`Provider::finds_by_key`]). docs/providers.md has a table per vendor.

pub mod fal;
pub mod minimax;
pub mod replicate;
pub mod standin;

use std::sync::atomic::AtomicBool;

use hmac::Mac;
use serde::{Deserialize, Serialize};

use crate::adapter::{AsyncJobProvider, HttpProvider, Lookup, QueryError, SubmitError};
use crate::api::{JobView, ProblemKind};
use crate::Submission;

/// Which API a provider speaks.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Vendor {
    /// spindle's generic async-job API ([`crate::api`]; the mock provider speaks it).
    #[default]
    Spindle,
    /// Replicate's predictions API.
    Replicate,
    /// fal.ai's queue API.
    Fal,
    /// MiniMax's video generation API.
    Minimax,
}

impl Vendor {
    pub fn name(self) -> &'static str {
        match self {
            Vendor::Spindle => "spindle",
            Vendor::Replicate => "replicate",
            Vendor::Fal => "fal",
            Vendor::Minimax => "minimax",
        }
    }
}

/// The callback URL's query parameter naming the attempt's request key.
pub const KEY_PARAM: &str = "spindle_key";
/// The callback URL's query parameter holding the key's token.
pub const TOKEN_PARAM: &str = "spindle_token";

/// The token of a request key: hex HMAC-SHA256 under the provider's secret.
fn token(secret: &[u8], key: &str) -> String {
    crate::signature::hex(
        &crate::signature::mac(secret, key.as_bytes())
            .finalize()
            .into_bytes(),
    )
}

/// `base` with the attempt's key and its token appended as query parameters.
pub fn callback_url(base: &str, key: &str, secret: &[u8]) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!(
        "{base}{sep}{KEY_PARAM}={}&{TOKEN_PARAM}={}",
        crate::adapter::encode(key),
        token(secret, key)
    )
}

pub use crate::adapter::query_value;

/// The request key a callback's URL names, once its token checks out.
pub fn checked_key(query: &str, secret: &[u8]) -> Result<String, CallbackRefused> {
    let key = query_value(query, KEY_PARAM).ok_or(CallbackRefused::NoKey)?;
    let given = query_value(query, TOKEN_PARAM).ok_or(CallbackRefused::BadToken)?;
    let given = crate::signature::unhex(&given).ok_or(CallbackRefused::BadToken)?;
    crate::signature::mac(secret, key.as_bytes())
        .verify_slice(&given)
        .map_err(|_| CallbackRefused::BadToken)?;
    Ok(key)
}

/// A vendor's callback as it reached the node.
pub struct CallbackIn<'a> {
    pub headers: &'a hyper::HeaderMap,
    /// The request URL's query (after `?`).
    pub query: &'a str,
    pub body: &'a [u8],
    /// The node's clock, unix ms.
    pub now_ms: u64,
    /// How far a signed time may be from `now_ms`, either side.
    pub window_ms: u64,
}

impl CallbackIn<'_> {
    /// A header the signature check needs: missing or unreadable, the signature is bad.
    pub(crate) fn signed_header(&self, name: &str) -> Result<&str, CallbackRefused> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .ok_or(CallbackRefused::BadSignature)
    }

    /// Refuses a signed time (unix seconds) outside the window.
    pub(crate) fn within_window(&self, at_s: u64) -> Result<(), CallbackRefused> {
        let off = self.now_ms.abs_diff(at_s.saturating_mul(1_000));
        if off > self.window_ms {
            return Err(CallbackRefused::OutsideWindow(off));
        }
        Ok(())
    }
}

/// What a checked callback asks of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Callback {
    /// MiniMax's check of a new callback URL: answer 200 with this body.
    Challenge(String),
    /// The job changed: ask the vendor for it.
    Changed { job_id: String, request_key: String },
}

/// Why a callback was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallbackRefused {
    #[error("the callback URL names no request key")]
    NoKey,
    #[error("the callback URL's token does not match its key")]
    BadToken,
    #[error("bad signature")]
    BadSignature,
    #[error("signed {0} ms from now, outside the window")]
    OutsideWindow(u64),
    #[error("unreadable callback: {0}")]
    Unreadable(String),
}

impl CallbackRefused {
    /// The metric kind and HTTP status it is answered with.
    pub fn kind(&self) -> (&'static str, u16) {
        match self {
            CallbackRefused::NoKey | CallbackRefused::Unreadable(_) => ("unreadable", 400),
            CallbackRefused::BadToken | CallbackRefused::BadSignature => ("bad_signature", 401),
            CallbackRefused::OutsideWindow(_) => ("outside_window", 401),
        }
    }
}

/// A provider as the node dispatches to it: spindle's API or one vendor's.
#[derive(Clone)]
pub enum Provider {
    Spindle(HttpProvider),
    Replicate(replicate::Replicate),
    Fal(fal::Fal),
    Minimax(minimax::Minimax),
}

impl Provider {
    pub fn vendor(&self) -> Vendor {
        match self {
            Provider::Spindle(_) => Vendor::Spindle,
            Provider::Replicate(_) => Vendor::Replicate,
            Provider::Fal(_) => Vendor::Fal,
            Provider::Minimax(_) => Vendor::Minimax,
        }
    }

    /// Whether [`AsyncJobProvider::find_by_key`] can answer: where it cannot, an attempt in
    /// doubt is found by the callback that names its key.
    pub fn finds_by_key(&self) -> bool {
        matches!(self, Provider::Spindle(_) | Provider::Replicate(_))
    }

    /// `submit`, unless `withdrawn` is set by the time the call's turn comes (see
    /// [`HttpProvider::submit_unless`]).
    pub async fn submit_unless(
        &self,
        s: &Submission,
        withdrawn: &AtomicBool,
    ) -> Result<JobView, SubmitError> {
        match self {
            Provider::Spindle(p) => p.submit_unless(s, withdrawn).await,
            Provider::Replicate(p) => p.submit_unless(s, withdrawn).await,
            Provider::Fal(p) => p.submit_unless(s, withdrawn).await,
            Provider::Minimax(p) => p.submit_unless(s, withdrawn).await,
        }
    }

    /// Checks a vendor's callback (spindle's API signs its own way: `crate::signature`).
    pub fn callback(&self, secret: &[u8], c: &CallbackIn) -> Result<Callback, CallbackRefused> {
        match self {
            Provider::Spindle(_) => Err(CallbackRefused::Unreadable(
                "spindle's API posts job views, signed with x-signature".into(),
            )),
            Provider::Replicate(p) => p.callback(secret, c),
            Provider::Fal(p) => p.callback(secret, c),
            Provider::Minimax(_) => minimax::callback(secret, c),
        }
    }
}

impl AsyncJobProvider for Provider {
    async fn submit(&self, s: &Submission) -> Result<JobView, SubmitError> {
        self.submit_unless(s, &AtomicBool::new(false)).await
    }

    async fn job(&self, account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        match self {
            Provider::Spindle(p) => p.job(account, job_id).await,
            Provider::Replicate(p) => p.job(account, job_id).await,
            Provider::Fal(p) => p.job(account, job_id).await,
            Provider::Minimax(p) => p.job(account, job_id).await,
        }
    }

    async fn find_by_key(&self, account: &str, request_key: &str) -> Result<Lookup, QueryError> {
        match self {
            Provider::Spindle(p) => p.find_by_key(account, request_key).await,
            Provider::Replicate(p) => p.find_by_key(account, request_key).await,
            Provider::Fal(_) | Provider::Minimax(_) => Err(QueryError(format!(
                "{} has no lookup by request key: the attempt is found by the callback \
                 that names its key",
                self.vendor().name()
            ))),
        }
    }

    async fn cancel(&self, account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        match self {
            Provider::Spindle(p) => p.cancel(account, job_id).await,
            Provider::Replicate(p) => p.cancel(account, job_id).await,
            Provider::Fal(p) => p.cancel(account, job_id).await,
            Provider::Minimax(p) => p.cancel(account, job_id).await,
        }
    }
}

/// An HTTP error status a vendor refused a submit with, as spindle's class: 429 rate limited
/// (with the hint), other 4xx refusals by kind, 5xx unknown (it may have been taken).
pub(crate) fn status_class(status: u16, message: String, hint: Option<u64>) -> SubmitError {
    match status {
        429 => SubmitError::RateLimited {
            retry_after_ms: hint,
        },
        401 | 403 => SubmitError::Refused {
            kind: ProblemKind::Auth,
            message,
        },
        402 => SubmitError::Refused {
            kind: ProblemKind::Balance,
            message,
        },
        400..=499 => SubmitError::Refused {
            kind: ProblemKind::InvalidParameters,
            message,
        },
        _ => SubmitError::Unknown(format!("{status}: {message}")),
    }
}

/// The first `http(s)://` URL in a vendor's output (a string, a list, or an object with a
/// `url` somewhere: `{"video": {"url": …}}`), depth-first, at most a few levels down.
pub(crate) fn first_url(v: &serde_json::Value) -> Option<String> {
    fn walk(v: &serde_json::Value, depth: u8) -> Option<String> {
        if depth > 4 {
            return None;
        }
        match v {
            serde_json::Value::String(s)
                if s.starts_with("https://") || s.starts_with("http://") =>
            {
                Some(s.clone())
            }
            serde_json::Value::Array(a) => a.iter().find_map(|x| walk(x, depth + 1)),
            serde_json::Value::Object(o) => o
                .get("url")
                .and_then(|u| walk(u, depth + 1))
                .or_else(|| o.values().find_map(|x| walk(x, depth + 1))),
            _ => None,
        }
    }
    walk(v, 0)
}

/// A short text of an answer's body for an error message (at most 300 characters).
pub(crate) fn excerpt(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callback_url_carries_its_key_and_a_token_only_the_secret_makes() {
        let url = callback_url("http://n:7072/v1/provider/callback", "spindle-7-1", b"s3");
        let query = url.split_once('?').unwrap().1;
        assert_eq!(checked_key(query, b"s3"), Ok("spindle-7-1".to_string()));
        assert_eq!(checked_key(query, b"other"), Err(CallbackRefused::BadToken));
        let forged = query.replace("spindle-7-1", "spindle-8-1");
        assert_eq!(checked_key(&forged, b"s3"), Err(CallbackRefused::BadToken));
        assert_eq!(checked_key("a=1", b"s3"), Err(CallbackRefused::NoKey));
        assert_eq!(query_value("a=x%2Fy+z&b", "a"), Some("x/y z".into()));
        assert_eq!(query_value("a=%2", "a"), None);
    }

    #[test]
    fn the_first_url_of_an_output_is_found_in_strings_lists_and_objects() {
        let v = serde_json::json!({"video": {"url": "https://cdn/v.mp4", "size": 3}});
        assert_eq!(first_url(&v).as_deref(), Some("https://cdn/v.mp4"));
        let v = serde_json::json!(["not a url", "https://cdn/a.mp4"]);
        assert_eq!(first_url(&v).as_deref(), Some("https://cdn/a.mp4"));
        assert_eq!(first_url(&serde_json::json!({"n": 1})), None);
    }
}
