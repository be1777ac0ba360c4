//! Replicate's predictions API (`https://api.replicate.com`, `Authorization: Bearer <token>`).
//!
//! ```text
//! submit   POST /v1/models/{owner}/{name}/predictions   (model "owner/name")
//!          POST /v1/predictions {"version": …}          (model "owner/name:version")
//!          body {input, webhook, webhook_events_filter} → 201 prediction
//!          429 {"detail": "… Expected available in N seconds."} (+ Retry-After)
//!          401 unauthenticated, 402 insufficient credit, 404 no such model, 422 invalid input
//! status   GET  /v1/predictions/{id}                    → prediction | 404
//! cancel   POST /v1/predictions/{id}/cancel             → prediction
//! by key   GET  /v1/predictions?created_after=T         → {next, results: [prediction]},
//!          newest first; ours is the one whose `webhook` names the key
//! webhook  POST callback, body a prediction; headers webhook-id, webhook-timestamp (unix s),
//!          webhook-signature "v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")> …",
//!          key the base64 after `whsec_` of the account's signing secret
//! ```
//!
//! Prediction states: `starting` (queued), `processing` (running), `succeeded`, `failed`,
//! `canceled` (and `aborted`, canceled before it started).

use std::sync::atomic::AtomicBool;

use base64::Engine;
use hmac::Mac;
use hyper::StatusCode;
use serde::Deserialize;

use super::{excerpt, first_url, query_value, status_class, Callback, CallbackIn, CallbackRefused};
use crate::adapter::{encode, HttpProvider, Lookup, QueryError, Sent, SubmitError};
use crate::api::{JobState, JobView, ProblemKind};
use crate::Submission;

/// Pages of the predictions list one lookup by key reads at most (100 predictions a page):
/// past them the answer is "cannot tell", never "not found".
pub const LIST_PAGES_MAX: usize = 20;

/// A Replicate prediction, as its API and its webhooks show it.
#[derive(Debug, Clone, Deserialize)]
pub struct Prediction {
    pub id: String,
    pub status: String,
    #[serde(default)]
    pub output: serde_json::Value,
    #[serde(default)]
    pub error: serde_json::Value,
    #[serde(default)]
    pub webhook: Option<String>,
}

/// An error answer (RFC 7807 problem details).
#[derive(Debug, Default, Deserialize)]
struct Problem {
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    detail: Option<String>,
}

#[derive(Clone)]
pub struct Replicate {
    http: HttpProvider,
    /// The webhook signing key (the base64 after `whsec_`, decoded).
    signing_key: Vec<u8>,
    /// How far back a lookup by key lists predictions.
    lookup_window_s: u64,
}

impl Replicate {
    /// `http` reaches the API (its base `https://api.replicate.com`) and carries the token;
    /// `signing_secret` is the account's `whsec_…` webhook secret.
    pub fn new(
        http: HttpProvider,
        token: &str,
        signing_secret: &str,
        lookup_window_s: u64,
    ) -> Result<Replicate, String> {
        Ok(Replicate {
            http: http.with_authorization(&format!("Bearer {token}"))?,
            signing_key: signing_key(signing_secret)?,
            lookup_window_s,
        })
    }

    pub(crate) async fn submit_unless(
        &self,
        s: &Submission,
        withdrawn: &AtomicBool,
    ) -> Result<JobView, SubmitError> {
        let (path, version) = route(&s.model).map_err(|message| SubmitError::Refused {
            kind: ProblemKind::InvalidParameters,
            message,
        })?;
        let mut body = serde_json::json!({
            "input": s.input,
            "webhook_events_filter": ["start", "completed"],
        });
        if let Some(v) = version {
            body["version"] = v.into();
        }
        if let Some(url) = &s.callback_url {
            body["webhook"] = url.clone().into();
        }
        let body = serde_json::to_vec(&body).map_err(|e| SubmitError::NotSent(e.to_string()))?;
        let (sent, hint) = self.http.send_unless(&path, body, withdrawn).await?;
        submit_answer(sent, hint, s)
    }

    pub(crate) async fn job(&self, account: &str, id: &str) -> Result<Lookup, QueryError> {
        let path = format!("/v1/predictions/{}", encode(id));
        prediction_lookup(self.http.call("GET", &path, None).await, account)
    }

    pub(crate) async fn cancel(&self, account: &str, id: &str) -> Result<Lookup, QueryError> {
        let path = format!("/v1/predictions/{}/cancel", encode(id));
        prediction_lookup(self.http.call("POST", &path, None).await, account)
    }

    /// The prediction whose webhook URL names `key`, among those created within the lookup
    /// window; NotFound only once every page of the window was read and each shows its
    /// webhook.
    pub(crate) async fn find_by_key(&self, account: &str, key: &str) -> Result<Lookup, QueryError> {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_sub(self.lookup_window_s);
        let mut path = format!("/v1/predictions?created_after={}", encode(&rfc3339(since)));
        for _ in 0..LIST_PAGES_MAX {
            let body = match self.http.call("GET", &path, None).await {
                Sent::Answer(StatusCode::OK, body) => body,
                Sent::Answer(status, body) => {
                    return Err(QueryError(format!("{status}: {}", excerpt(&body))))
                }
                Sent::Unsent(e) | Sent::NoAnswer(e) => return Err(QueryError(e)),
            };
            match page_match(&body, key)? {
                PageMatch::Found(p) => return view(p, account, None).map(Lookup::Found),
                PageMatch::Next(next) => path = next,
                PageMatch::Last => return Ok(Lookup::NotFound),
            }
        }
        Err(QueryError(format!(
            "more than {LIST_PAGES_MAX} pages of predictions in the lookup window: cannot tell"
        )))
    }

    /// Checks a webhook's signature and time, and names the prediction it is about.
    pub(crate) fn callback(
        &self,
        secret: &[u8],
        c: &CallbackIn,
    ) -> Result<Callback, CallbackRefused> {
        let request_key = super::checked_key(c.query, secret)?;
        let id = c.signed_header("webhook-id")?;
        let at = c.signed_header("webhook-timestamp")?;
        let signatures = c.signed_header("webhook-signature")?;
        let good = signatures.split(' ').any(|entry| {
            let Some(sig) = entry.strip_prefix("v1,") else {
                return false;
            };
            let Ok(sig) = base64::engine::general_purpose::STANDARD.decode(sig) else {
                return false;
            };
            let mut m = crate::signature::mac(&self.signing_key, format!("{id}.{at}.").as_bytes());
            m.update(c.body);
            m.verify_slice(&sig).is_ok()
        });
        if !good {
            return Err(CallbackRefused::BadSignature);
        }
        c.within_window(at.parse().map_err(|_| CallbackRefused::BadSignature)?)?;
        let p: Prediction = serde_json::from_slice(c.body)
            .map_err(|e| CallbackRefused::Unreadable(e.to_string()))?;
        Ok(Callback::Changed {
            job_id: p.id,
            request_key,
        })
    }
}

/// The decoded key of a `whsec_<base64>` signing secret.
pub fn signing_key(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret
        .strip_prefix("whsec_")
        .ok_or("a Replicate signing secret starts with whsec_")?;
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("a Replicate signing secret is base64 after whsec_: {e}"))
}

/// Where a model's predictions are created: `owner/name` on the model's own route,
/// `owner/name:version` (or a bare 64-hex version) with the version in the body.
pub fn route(model: &str) -> Result<(String, Option<String>), String> {
    if let Some((_, version)) = model.split_once(':') {
        return Ok(("/v1/predictions".into(), Some(version.to_string())));
    }
    if model.len() == 64 && model.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(("/v1/predictions".into(), Some(model.to_string())));
    }
    match model.split_once('/') {
        Some((owner, name)) if !owner.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((
                format!("/v1/models/{}/{}/predictions", encode(owner), encode(name)),
                None,
            ))
        }
        _ => Err(format!(
            "{model:?} is no Replicate model (owner/name or owner/name:version)"
        )),
    }
}

/// What a create's answer says.
fn submit_answer(sent: Sent, hint: Option<u64>, s: &Submission) -> Result<JobView, SubmitError> {
    match sent {
        Sent::Answer(status, body) if status.is_success() => {
            serde_json::from_slice::<Prediction>(&body)
                .map_err(|e| e.to_string())
                .and_then(|p| view(p, &s.account, Some(&s.request_key)).map_err(|e| e.0))
                // Accepted, but we cannot read what: ask by key.
                .map_err(|e| SubmitError::Unknown(format!("unreadable acceptance: {e}")))
        }
        Sent::Answer(status, body) => {
            let p: Problem = serde_json::from_slice(&body).unwrap_or_default();
            let message = p.detail.or(p.title).unwrap_or_else(|| excerpt(&body));
            let hint = hint.or_else(|| throttle_hint(&message));
            Err(status_class(status.as_u16(), message, hint))
        }
        Sent::Unsent(e) => Err(SubmitError::NotSent(e)),
        Sent::NoAnswer(e) => Err(SubmitError::Unknown(e)),
    }
}

/// "Request was throttled. Expected available in 7 seconds." → 7,000 ms.
fn throttle_hint(detail: &str) -> Option<u64> {
    let rest = detail.split("available in ").nth(1)?;
    let n: u64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(n.saturating_mul(1_000))
}

fn prediction_lookup(sent: Sent, account: &str) -> Result<Lookup, QueryError> {
    match sent {
        Sent::Answer(StatusCode::OK, body) => serde_json::from_slice::<Prediction>(&body)
            .map_err(|e| QueryError(format!("unreadable prediction: {e}")))
            .and_then(|p| view(p, account, None))
            .map(Lookup::Found),
        Sent::Answer(StatusCode::NOT_FOUND, _) => Ok(Lookup::NotFound),
        Sent::Answer(status, body) => Err(QueryError(format!("{status}: {}", excerpt(&body)))),
        Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
    }
}

/// A prediction as spindle's job view; the request key `key`, or else the one its webhook URL
/// names.
pub fn view(p: Prediction, account: &str, key: Option<&str>) -> Result<JobView, QueryError> {
    let state = match p.status.as_str() {
        "starting" => JobState::Queued,
        "processing" => JobState::Running,
        "succeeded" => JobState::Succeeded,
        "failed" => JobState::Failed,
        "canceled" | "aborted" => JobState::Canceled,
        other => return Err(QueryError(format!("unknown prediction status {other:?}"))),
    };
    let request_key = key
        .map(str::to_string)
        .or_else(|| {
            p.webhook
                .as_deref()
                .and_then(|w| w.split_once('?'))
                .and_then(|(_, q)| query_value(q, super::KEY_PARAM))
        })
        .unwrap_or_default();
    let error = match &p.error {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    };
    Ok(JobView {
        job_id: p.id,
        account: account.to_string(),
        request_key,
        state,
        progress: match state {
            JobState::Queued => 0,
            JobState::Running => 50,
            _ => 100,
        },
        cost_milli: None,
        error: error.or_else(|| (state == JobState::Failed).then(|| "failed".to_string())),
        retryable: false,
        output_url: (state == JobState::Succeeded)
            .then(|| first_url(&p.output))
            .flatten(),
    })
}

enum PageMatch {
    Found(Prediction),
    Next(String),
    Last,
}

/// Looks for the prediction whose webhook names `key` on one page of the list. A listed
/// prediction that does not show its webhook at all makes the page unreadable for this
/// purpose: "not found" must never rest on a field that was not there.
fn page_match(body: &[u8], key: &str) -> Result<PageMatch, QueryError> {
    #[derive(Deserialize)]
    struct Page {
        #[serde(default)]
        next: Option<String>,
        results: Vec<serde_json::Map<String, serde_json::Value>>,
    }
    let page: Page = serde_json::from_slice(body)
        .map_err(|e| QueryError(format!("unreadable predictions page: {e}")))?;
    for p in page.results {
        let webhook = match p.get("webhook") {
            None => {
                return Err(QueryError(
                    "the predictions list does not show webhooks: cannot tell".into(),
                ))
            }
            Some(w) => w.as_str().map(str::to_string),
        };
        let named = webhook
            .as_deref()
            .and_then(|w| w.split_once('?'))
            .and_then(|(_, q)| query_value(q, super::KEY_PARAM));
        if named.as_deref() == Some(key) {
            let p: Prediction = serde_json::from_value(serde_json::Value::Object(p))
                .map_err(|e| QueryError(format!("unreadable prediction: {e}")))?;
            return Ok(PageMatch::Found(p));
        }
    }
    match page.next {
        None => Ok(PageMatch::Last),
        Some(next) => {
            let at = next
                .find("/v1/predictions")
                .ok_or_else(|| QueryError(format!("unreadable next page {next:?}")))?;
            Ok(PageMatch::Next(next[at..].to_string()))
        }
    }
}

/// `unix_s` as an RFC 3339 UTC time (`2026-12-07T23:40:00Z`).
pub fn rfc3339(unix_s: u64) -> String {
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(name: &str) -> Vec<u8> {
        super::super::standin::shape(super::super::Vendor::Replicate, name)
            .unwrap()
            .into_bytes()
    }

    #[test]
    fn models_are_routed_by_name_or_version() {
        assert_eq!(
            route("minimax/video-01").unwrap(),
            ("/v1/models/minimax/video-01/predictions".into(), None)
        );
        assert_eq!(
            route("a/b:5c7d").unwrap(),
            ("/v1/predictions".into(), Some("5c7d".into()))
        );
        assert!(route("no-owner").is_err());
        assert!(route("a/b/c").is_err());
    }

    #[test]
    fn recorded_predictions_map_onto_job_views() {
        let p: Prediction = serde_json::from_slice(&shape("prediction-starting.json")).unwrap();
        let v = view(p, "acct", Some("k-1")).unwrap();
        assert_eq!((v.state, v.request_key.as_str()), (JobState::Queued, "k-1"));
        let p: Prediction = serde_json::from_slice(&shape("prediction-succeeded.json")).unwrap();
        let v = view(p, "acct", None).unwrap();
        assert_eq!(v.state, JobState::Succeeded);
        assert!(v
            .output_url
            .unwrap()
            .starts_with("https://replicate.delivery/"));
        let p: Prediction = serde_json::from_slice(&shape("prediction-failed.json")).unwrap();
        let v = view(p, "acct", None).unwrap();
        assert_eq!(v.state, JobState::Failed);
        assert!(!v.retryable);
        assert!(v.error.is_some());
    }

    #[test]
    fn recorded_errors_map_onto_classes() {
        let s = Submission {
            account: "a".into(),
            request_key: "k".into(),
            model: "o/m".into(),
            input: serde_json::json!({}),
            callback_url: None,
        };
        let answer = |status: u16, name: &str, hint| {
            submit_answer(
                Sent::Answer(StatusCode::from_u16(status).unwrap(), shape(name).into()),
                hint,
                &s,
            )
            .unwrap_err()
        };
        assert_eq!(
            answer(429, "error-throttled.json", None),
            SubmitError::RateLimited {
                retry_after_ms: Some(1_000)
            }
        );
        // The header wins over the text.
        assert_eq!(
            answer(429, "error-throttled.json", Some(7_000)),
            SubmitError::RateLimited {
                retry_after_ms: Some(7_000)
            }
        );
        assert!(matches!(
            answer(401, "error-unauthenticated.json", None),
            SubmitError::Refused {
                kind: ProblemKind::Auth,
                ..
            }
        ));
        assert!(matches!(
            answer(402, "error-insufficient-credit.json", None),
            SubmitError::Refused {
                kind: ProblemKind::Balance,
                ..
            }
        ));
        assert!(matches!(
            answer(422, "error-validation.json", None),
            SubmitError::Refused {
                kind: ProblemKind::InvalidParameters,
                ..
            }
        ));
        assert!(matches!(
            answer(503, "error-throttled.json", None),
            SubmitError::Unknown(_)
        ));
    }

    #[test]
    fn a_list_without_webhooks_never_says_not_found() {
        let page = br#"{"next": null, "results": [{"id": "x", "status": "succeeded"}]}"#;
        assert!(page_match(page, "k").is_err());
        let page =
            br#"{"next": null, "results": [{"id": "x", "status": "succeeded", "webhook": null}]}"#;
        assert!(matches!(page_match(page, "k"), Ok(PageMatch::Last)));
        let list = shape("predictions-list.json");
        assert!(matches!(
            page_match(&list, "spindle-42-1"),
            Ok(PageMatch::Found(p)) if p.id == "gm3qorzdhgbfurvjtvhg6dckhu"
        ));
    }

    #[test]
    fn times_are_written_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_687_999), "2026-12-07T23:59:59Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
