//! MiniMax's video generation API (`https://api.minimax.io`, `Authorization: Bearer <key>`).
//!
//! ```text
//! submit   POST /v1/video_generation {model, prompt, …, callback_url}
//!          → 200 {task_id, base_resp: {status_code, status_msg}}
//! status   GET  /v1/query/video_generation?task_id=T
//!          → 200 {task_id, status: Preparing | Queueing | Processing | Success | Fail,
//!                 file_id, base_resp}
//! file     GET  /v1/files/retrieve?file_id=F → 200 {file: {download_url}, base_resp}
//! cancel   none: a job runs to its end
//! by key   none: a submit in doubt is found by the callback that names its key
//! callback POST callback_url: first {"challenge": C}, answered {"challenge": C} within 3 s;
//!          then {task_id, status, file_id, base_resp}. Unsigned: the node checks the token
//!          in the URL it gave, and only asks MiniMax about the task named.
//! ```
//!
//! MiniMax answers HTTP 200 with its own codes in `base_resp.status_code`; they map as
//! [`code_class`] says (0 is success).

use std::sync::atomic::AtomicBool;

use hyper::StatusCode;
use serde::Deserialize;

use super::{excerpt, status_class, Callback, CallbackIn, CallbackRefused};
use crate::adapter::{encode, HttpProvider, Lookup, QueryError, Sent, SubmitError};
use crate::api::{JobState, JobView, ProblemKind};
use crate::Submission;

#[derive(Debug, Clone, Default, Deserialize)]
pub struct BaseResp {
    #[serde(default)]
    pub status_code: i64,
    #[serde(default)]
    pub status_msg: String,
}

#[derive(Clone)]
pub struct Minimax {
    http: HttpProvider,
}

/// What a MiniMax code means for a submit (`None`: success).
pub fn code_class(code: i64, message: &str) -> Option<SubmitError> {
    let refused = |kind| {
        Some(SubmitError::Refused {
            kind,
            message: format!("MiniMax {code}: {message}"),
        })
    };
    match code {
        0 => None,
        // Requests per minute, and tokens per minute, over the account's limit.
        1002 | 1039 => Some(SubmitError::RateLimited {
            retry_after_ms: None,
        }),
        1004 => refused(ProblemKind::Auth),
        1008 => refused(ProblemKind::Balance),
        1026 | 1027 => refused(ProblemKind::Moderation),
        2013 => refused(ProblemKind::InvalidParameters),
        // 1000 unknown, 1001 timeout, 1013 internal, and anything new: it may have been taken.
        _ => Some(SubmitError::Unknown(format!("MiniMax {code}: {message}"))),
    }
}

impl Minimax {
    pub fn new(http: HttpProvider, key: &str) -> Result<Minimax, String> {
        Ok(Minimax {
            http: http.with_authorization(&format!("Bearer {key}"))?,
        })
    }

    pub(crate) async fn submit_unless(
        &self,
        s: &Submission,
        withdrawn: &AtomicBool,
    ) -> Result<JobView, SubmitError> {
        let mut body = match &s.input {
            serde_json::Value::Object(o) => o.clone(),
            serde_json::Value::Null => serde_json::Map::new(),
            _ => {
                return Err(SubmitError::Refused {
                    kind: ProblemKind::InvalidParameters,
                    message: "a MiniMax input is a JSON object (prompt, duration, …)".into(),
                })
            }
        };
        body.entry("model")
            .or_insert_with(|| s.model.clone().into());
        if let Some(url) = &s.callback_url {
            body.insert("callback_url".into(), url.clone().into());
        }
        let body = serde_json::to_vec(&body).map_err(|e| SubmitError::NotSent(e.to_string()))?;
        let (sent, hint) = self
            .http
            .send_unless("/v1/video_generation", body, withdrawn)
            .await?;
        submit_answer(sent, hint, s)
    }

    pub(crate) async fn job(&self, account: &str, task_id: &str) -> Result<Lookup, QueryError> {
        #[derive(Deserialize)]
        struct Query {
            #[serde(default)]
            status: String,
            #[serde(default)]
            file_id: Option<serde_json::Value>,
            #[serde(default)]
            base_resp: BaseResp,
        }
        let path = format!("/v1/query/video_generation?task_id={}", encode(task_id));
        let q: Query = read(self.http.call("GET", &path, None).await)?;
        if q.base_resp.status_code != 0 {
            return Err(QueryError(format!(
                "MiniMax {}: {}",
                q.base_resp.status_code, q.base_resp.status_msg
            )));
        }
        let mut view = JobView::queued(task_id, account, "");
        match q.status.as_str() {
            "Preparing" | "Queueing" => {}
            "Processing" => {
                view.state = JobState::Running;
                view.progress = 50;
            }
            "Success" => {
                view.state = JobState::Succeeded;
                view.progress = 100;
                let file = match q.file_id {
                    Some(serde_json::Value::String(s)) => s,
                    Some(serde_json::Value::Number(n)) => n.to_string(),
                    _ => return Err(QueryError("a finished task without a file_id".into())),
                };
                view.output_url = Some(self.download_url(&file).await?);
            }
            "Fail" => {
                view.state = JobState::Failed;
                view.progress = 100;
                view.error = Some(if q.base_resp.status_msg.is_empty() {
                    "failed".into()
                } else {
                    q.base_resp.status_msg
                });
            }
            other => return Err(QueryError(format!("unknown task status {other:?}"))),
        }
        Ok(Lookup::Found(view))
    }

    async fn download_url(&self, file_id: &str) -> Result<String, QueryError> {
        #[derive(Deserialize)]
        struct File {
            download_url: String,
        }
        #[derive(Deserialize)]
        struct Retrieved {
            file: File,
        }
        let path = format!("/v1/files/retrieve?file_id={}", encode(file_id));
        let r: Retrieved = read(self.http.call("GET", &path, None).await)?;
        Ok(r.file.download_url)
    }

    /// MiniMax has no cancel: the task's state, which runs to its end.
    pub(crate) async fn cancel(&self, account: &str, task_id: &str) -> Result<Lookup, QueryError> {
        self.job(account, task_id).await
    }
}

fn read<T: serde::de::DeserializeOwned>(sent: Sent) -> Result<T, QueryError> {
    match sent {
        Sent::Answer(StatusCode::OK, body) => {
            serde_json::from_slice(&body).map_err(|e| QueryError(format!("unreadable: {e}")))
        }
        Sent::Answer(status, body) => Err(QueryError(format!("{status}: {}", excerpt(&body)))),
        Sent::Unsent(e) | Sent::NoAnswer(e) => Err(QueryError(e)),
    }
}

fn submit_answer(sent: Sent, hint: Option<u64>, s: &Submission) -> Result<JobView, SubmitError> {
    #[derive(Deserialize)]
    struct Created {
        #[serde(default)]
        task_id: Option<String>,
        #[serde(default)]
        base_resp: BaseResp,
    }
    match sent {
        Sent::Answer(StatusCode::OK, body) => {
            let c: Created = serde_json::from_slice(&body)
                .map_err(|e| SubmitError::Unknown(format!("unreadable answer: {e}")))?;
            if let Some(e) = code_class(c.base_resp.status_code, &c.base_resp.status_msg) {
                return Err(match e {
                    SubmitError::RateLimited { .. } => SubmitError::RateLimited {
                        retry_after_ms: hint,
                    },
                    e => e,
                });
            }
            match c.task_id {
                Some(task_id) if !task_id.is_empty() => {
                    Ok(JobView::queued(task_id, &s.account, &s.request_key))
                }
                _ => Err(SubmitError::Unknown(
                    "success without a task_id: unreadable acceptance".into(),
                )),
            }
        }
        Sent::Answer(status, body) => Err(status_class(status.as_u16(), excerpt(&body), hint)),
        Sent::Unsent(e) => Err(SubmitError::NotSent(e)),
        Sent::NoAnswer(e) => Err(SubmitError::Unknown(e)),
    }
}

/// A MiniMax callback: the URL check's challenge, echoed; or a task's change, named.
pub(crate) fn callback(secret: &[u8], c: &CallbackIn) -> Result<Callback, CallbackRefused> {
    let request_key = super::checked_key(c.query, secret)?;
    let v: serde_json::Value =
        serde_json::from_slice(c.body).map_err(|e| CallbackRefused::Unreadable(e.to_string()))?;
    if let Some(challenge) = v.get("challenge") {
        return Ok(Callback::Challenge(
            serde_json::json!({ "challenge": challenge }).to_string(),
        ));
    }
    let job_id = match v.get("task_id") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => return Err(CallbackRefused::Unreadable("no task_id".into())),
    };
    Ok(Callback::Changed {
        job_id,
        request_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(name: &str) -> bytes::Bytes {
        super::super::standin::shape(super::super::Vendor::Minimax, name)
            .unwrap()
            .into()
    }

    #[test]
    fn the_seeds_error_codes_map_onto_classes() {
        let s = Submission {
            account: "a".into(),
            request_key: "k".into(),
            model: "MiniMax-Hailuo-02".into(),
            input: serde_json::json!({"prompt": "x"}),
            callback_url: None,
        };
        let answer =
            |name: &str| submit_answer(Sent::Answer(StatusCode::OK, shape(name)), None, &s);
        assert_eq!(answer("create-ok.json").unwrap().job_id, "106916112212032");
        for (name, class) in [
            ("error-1002.json", "rate"),
            ("error-1039.json", "rate"),
            ("error-1004.json", "auth"),
            ("error-1008.json", "balance"),
            ("error-2013.json", "invalid"),
            ("error-1026.json", "moderation"),
            ("error-1013.json", "unknown"),
        ] {
            let got = answer(name).unwrap_err();
            let ok = match class {
                "rate" => matches!(got, SubmitError::RateLimited { .. }),
                "auth" => matches!(
                    got,
                    SubmitError::Refused {
                        kind: ProblemKind::Auth,
                        ..
                    }
                ),
                "balance" => {
                    matches!(
                        got,
                        SubmitError::Refused {
                            kind: ProblemKind::Balance,
                            ..
                        }
                    )
                }
                "invalid" => matches!(
                    got,
                    SubmitError::Refused {
                        kind: ProblemKind::InvalidParameters,
                        ..
                    }
                ),
                "moderation" => {
                    matches!(
                        got,
                        SubmitError::Refused {
                            kind: ProblemKind::Moderation,
                            ..
                        }
                    )
                }
                _ => matches!(got, SubmitError::Unknown(_)),
            };
            assert!(ok, "{name}: {got:?}");
        }
    }
}
