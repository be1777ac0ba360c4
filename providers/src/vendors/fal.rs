//! fal.ai's queue API (`https://queue.fal.run`, `Authorization: Key <key>`).
//!
//! ```text
//! submit   POST /{model}?fal_webhook=URL, body the model's input
//!          → 200 {request_id, status_url, response_url, cancel_url}
//!          429 (+ Retry-After), 401/403 bad key, 402/403 no balance, 422 invalid input
//! status   GET  /{app}/requests/{id}/status → {status: IN_QUEUE | IN_PROGRESS | COMPLETED}
//!          | 404 (app: the model's first two path segments)
//! result   GET  /{app}/requests/{id}        → 200 the output | 4xx/5xx {detail} the failure
//! cancel   PUT  /{app}/requests/{id}/cancel → 202 CANCELLATION_REQUESTED | 400 ALREADY_COMPLETED
//! by key   none: a submit in doubt is found by the webhook that names its key
//! webhook  POST fal_webhook, body {request_id, status: OK | ERROR, payload, error};
//!          headers x-fal-webhook-request-id, -user-id, -timestamp (unix s), -signature
//!          (hex Ed25519 over "{request_id}\n{user_id}\n{timestamp}\n{hex sha256(body)}"),
//!          checked against the keys of fal's JWKS
//! ```
//!
//! spindle's job id for a fal request is `{app}|{request_id}`: the status and result routes
//! need the app, and a job id is all the node keeps.

use std::sync::atomic::AtomicBool;

use base64::Engine;
use hyper::StatusCode;
use serde::Deserialize;
use sha2::Digest;

use super::{excerpt, first_url, status_class, Callback, CallbackIn, CallbackRefused};
use crate::adapter::{encode, HttpProvider, Lookup, QueryError, Sent, SubmitError};
use crate::api::{JobState, JobView, ProblemKind};
use crate::Submission;

/// The callback URL's parameter naming the request's app (its status route needs it).
pub const APP_PARAM: &str = "spindle_app";
/// Keys a JWKS may hold.
pub const JWKS_KEYS_MAX: usize = 32;

#[derive(Clone)]
pub struct Fal {
    http: HttpProvider,
    /// Ed25519 public keys webhooks may be signed with.
    keys: Vec<[u8; 32]>,
}

impl Fal {
    /// `http` reaches the queue API; `jwks` is fal's JSON Web Key Set for webhooks.
    pub fn new(http: HttpProvider, key: &str, jwks: &[u8]) -> Result<Fal, String> {
        Ok(Fal {
            http: http.with_authorization(&format!("Key {key}"))?,
            keys: jwks_keys(jwks)?,
        })
    }

    pub(crate) async fn submit_unless(
        &self,
        s: &Submission,
        withdrawn: &AtomicBool,
    ) -> Result<JobView, SubmitError> {
        let app = app_of(&s.model).map_err(|message| SubmitError::Refused {
            kind: ProblemKind::InvalidParameters,
            message,
        })?;
        let mut path = format!("/{}", s.model);
        if let Some(url) = &s.callback_url {
            let url = format!("{url}&{APP_PARAM}={}", encode(&app));
            path.push_str(&format!("?fal_webhook={}", encode(&url)));
        }
        let body = serde_json::to_vec(&s.input).map_err(|e| SubmitError::NotSent(e.to_string()))?;
        let (sent, hint) = self.http.send_unless(&path, body, withdrawn).await?;
        match sent {
            Sent::Answer(status, body) if status.is_success() => {
                #[derive(Deserialize)]
                struct Queued {
                    request_id: String,
                }
                let q: Queued = serde_json::from_slice(&body)
                    .map_err(|e| SubmitError::Unknown(format!("unreadable acceptance: {e}")))?;
                Ok(JobView::queued(
                    format!("{app}|{}", q.request_id),
                    &s.account,
                    &s.request_key,
                ))
            }
            Sent::Answer(status, body) => {
                let message = detail(&body);
                let balance = message.to_ascii_lowercase().contains("balance");
                Err(match status_class(status.as_u16(), message, hint) {
                    SubmitError::Refused { message, .. } if balance => SubmitError::Refused {
                        kind: ProblemKind::Balance,
                        message,
                    },
                    other => other,
                })
            }
            Sent::Unsent(e) => Err(SubmitError::NotSent(e)),
            Sent::NoAnswer(e) => Err(SubmitError::Unknown(e)),
        }
    }

    pub(crate) async fn job(&self, account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        let (app, id) = split(job_id)?;
        let path = format!("/{app}/requests/{}/status", encode(id));
        let status = match self.http.call("GET", &path, None).await {
            Sent::Answer(StatusCode::OK | StatusCode::ACCEPTED, body) => {
                #[derive(Deserialize)]
                struct Status {
                    status: String,
                }
                serde_json::from_slice::<Status>(&body)
                    .map_err(|e| QueryError(format!("unreadable status: {e}")))?
                    .status
            }
            Sent::Answer(StatusCode::NOT_FOUND, _) => return Ok(Lookup::NotFound),
            Sent::Answer(status, body) => {
                return Err(QueryError(format!("{status}: {}", excerpt(&body))))
            }
            Sent::Unsent(e) | Sent::NoAnswer(e) => return Err(QueryError(e)),
        };
        let mut view = JobView::queued(job_id, account, "");
        match status.as_str() {
            "IN_QUEUE" => {}
            "IN_PROGRESS" => {
                view.state = JobState::Running;
                view.progress = 50;
            }
            "COMPLETED" => {
                view.progress = 100;
                let path = format!("/{app}/requests/{}", encode(id));
                match self.http.call("GET", &path, None).await {
                    Sent::Answer(status, body) if status.is_success() => {
                        let output: serde_json::Value = serde_json::from_slice(&body)
                            .map_err(|e| QueryError(format!("unreadable result: {e}")))?;
                        view.state = JobState::Succeeded;
                        view.output_url = first_url(&output);
                    }
                    Sent::Answer(status, body) => {
                        view.state = JobState::Failed;
                        view.error = Some(format!("{status}: {}", detail(&body)));
                        // fal bills no server error; a runner's failure may pass.
                        view.retryable = status.is_server_error();
                    }
                    Sent::Unsent(e) | Sent::NoAnswer(e) => return Err(QueryError(e)),
                }
            }
            other => return Err(QueryError(format!("unknown request status {other:?}"))),
        }
        Ok(Lookup::Found(view))
    }

    pub(crate) async fn cancel(&self, account: &str, job_id: &str) -> Result<Lookup, QueryError> {
        let (app, id) = split(job_id)?;
        let path = format!("/{app}/requests/{}/cancel", encode(id));
        match self.http.call("PUT", &path, None).await {
            // Asked to stop, or ended already: either way its state is what follows.
            Sent::Answer(s, _) if s.is_success() || s == StatusCode::BAD_REQUEST => {
                self.job(account, job_id).await
            }
            Sent::Answer(StatusCode::NOT_FOUND, _) => Ok(Lookup::NotFound),
            Sent::Answer(status, body) => Err(QueryError(format!("{status}: {}", excerpt(&body)))),
            Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
        }
    }

    /// Checks a webhook's Ed25519 signature and time, and names the request it is about.
    pub(crate) fn callback(
        &self,
        secret: &[u8],
        c: &CallbackIn,
    ) -> Result<Callback, CallbackRefused> {
        let request_key = super::checked_key(c.query, secret)?;
        let app = super::query_value(c.query, APP_PARAM)
            .ok_or_else(|| CallbackRefused::Unreadable("the callback URL names no app".into()))?;
        let request_id = c.signed_header("x-fal-webhook-request-id")?;
        let user_id = c.signed_header("x-fal-webhook-user-id")?;
        let at = c.signed_header("x-fal-webhook-timestamp")?;
        let signature = crate::signature::unhex(c.signed_header("x-fal-webhook-signature")?)
            .ok_or(CallbackRefused::BadSignature)?;
        let message = signed_message(request_id, user_id, at, c.body);
        let good = self.keys.iter().any(|k| {
            ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, k)
                .verify(message.as_bytes(), &signature)
                .is_ok()
        });
        if !good {
            return Err(CallbackRefused::BadSignature);
        }
        c.within_window(at.parse().map_err(|_| CallbackRefused::BadSignature)?)?;
        #[derive(Deserialize)]
        struct Hook {
            request_id: String,
        }
        let hook: Hook = serde_json::from_slice(c.body)
            .map_err(|e| CallbackRefused::Unreadable(e.to_string()))?;
        if hook.request_id != request_id {
            return Err(CallbackRefused::Unreadable(
                "the body names another request than the signed header".into(),
            ));
        }
        Ok(Callback::Changed {
            job_id: format!("{app}|{request_id}"),
            request_key,
        })
    }
}

/// What a fal webhook's signature covers.
pub fn signed_message(request_id: &str, user_id: &str, at: &str, body: &[u8]) -> String {
    let digest = sha2::Sha256::digest(body);
    format!(
        "{request_id}\n{user_id}\n{at}\n{}",
        crate::signature::hex(&digest)
    )
}

/// The Ed25519 keys of a JWKS document (`{"keys": [{"kty": "OKP", "crv": "Ed25519", "x": …}]}`).
pub fn jwks_keys(jwks: &[u8]) -> Result<Vec<[u8; 32]>, String> {
    #[derive(Deserialize)]
    struct Jwks {
        keys: Vec<Jwk>,
    }
    #[derive(Deserialize)]
    struct Jwk {
        #[serde(default)]
        kty: String,
        #[serde(default)]
        crv: String,
        #[serde(default)]
        x: String,
    }
    let set: Jwks = serde_json::from_slice(jwks).map_err(|e| format!("unreadable JWKS: {e}"))?;
    if set.keys.len() > JWKS_KEYS_MAX {
        return Err(format!("a JWKS of more than {JWKS_KEYS_MAX} keys"));
    }
    let keys: Vec<[u8; 32]> = set
        .keys
        .iter()
        .filter(|k| k.kty == "OKP" && k.crv == "Ed25519")
        .map(|k| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(k.x.trim_end_matches('='))
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| format!("JWKS key {:?} is no Ed25519 public key", k.x))
        })
        .collect::<Result<_, _>>()?;
    if keys.is_empty() {
        return Err("the JWKS holds no Ed25519 key".into());
    }
    Ok(keys)
}

/// A model's app: its first two path segments (`fal-ai/kling-video/v1/…` → `fal-ai/kling-video`).
pub fn app_of(model: &str) -> Result<String, String> {
    let mut parts = model.split('/');
    match (parts.next(), parts.next()) {
        (Some(owner), Some(app)) if !owner.is_empty() && !app.is_empty() => {
            if model
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
            {
                Ok(format!("{owner}/{app}"))
            } else {
                Err(format!("{model:?} holds characters no fal model id has"))
            }
        }
        _ => Err(format!("{model:?} is no fal model id (owner/app[/path])")),
    }
}

fn split(job_id: &str) -> Result<(&str, &str), QueryError> {
    job_id
        .split_once('|')
        .ok_or_else(|| QueryError(format!("{job_id:?} is no fal job id (app|request_id)")))
}

fn detail(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Detail {
        detail: serde_json::Value,
    }
    match serde_json::from_slice::<Detail>(body) {
        Ok(Detail {
            detail: serde_json::Value::String(s),
        }) => s,
        Ok(Detail { detail }) => detail.to_string(),
        Err(_) => excerpt(body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apps_are_the_first_two_segments_of_a_model() {
        assert_eq!(
            app_of("fal-ai/kling-video/v1/standard/text-to-video").unwrap(),
            "fal-ai/kling-video"
        );
        assert!(app_of("fal-ai").is_err());
        assert!(app_of("fal-ai/x?y=1").is_err());
    }

    #[test]
    fn a_recorded_jwks_gives_its_keys_and_a_bad_one_is_refused_by_name() {
        let jwks = super::super::standin::shape(super::super::Vendor::Fal, "jwks.json").unwrap();
        assert_eq!(jwks_keys(jwks.as_bytes()).unwrap().len(), 1);
        assert!(jwks_keys(br#"{"keys": []}"#)
            .unwrap_err()
            .contains("no Ed25519"));
        assert!(
            jwks_keys(br#"{"keys": [{"kty": "OKP", "crv": "Ed25519", "x": "AA"}]}"#)
                .unwrap_err()
                .contains("no Ed25519 public key")
        );
    }
}
