//! Temporary AWS credentials of an EC2 instance's role (its instance profile), read from the
//! instance metadata service the way IMDSv2 requires: a session token first (`PUT`), then the
//! role's name and its keys (`GET`, each with the token). The keys expire (AWS hands out keys
//! good for hours and rotates them well before): [`crate::temporary_keys::TemporaryKeys`]
//! holds them and reads again when they near expiry.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::Full;

use crate::object_store::{uri_encode, Credentials, UploadError};

/// Where the metadata service answers on every EC2 instance.
pub const IMDS_URL: &str = "http://169.254.169.254";
/// How long a session token is asked to last (IMDSv2's most: six hours).
const TOKEN_TTL_S: u32 = 21_600;
/// The longest answer read from the metadata service.
const ANSWER_BYTES_MAX: usize = 16 << 10;
/// The metadata service's header names.
const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";
const CREDENTIALS_PATH: &str = "/latest/meta-data/iam/security-credentials/";

/// The instance role's keys from the metadata service at `url`, and when they expire.
pub async fn instance_credentials(
    url: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(Credentials, SystemTime), UploadError> {
    let fail = |what: String| UploadError::Credentials(format!("instance profile: {what}"));
    let base = url.trim_end_matches('/');
    let client = crate::tls::client(tls, timeout);
    let call = |method: hyper::Method, path: String, header: (&'static str, String)| {
        let client = client.clone();
        async move {
            let target = format!("{base}{path}");
            let request = hyper::Request::builder()
                .method(method)
                .uri(target.as_str())
                .header(header.0, header.1)
                .body(Full::new(Bytes::new()))
                .map_err(|e| fail(format!("{target}: {e}")))?;
            let (head, body) = crate::tls::exchange(&client, request, ANSWER_BYTES_MAX)
                .await
                .map_err(|e| fail(format!("{target}: {e}")))?;
            Ok::<_, UploadError>((head.status, String::from_utf8_lossy(&body).into_owned()))
        }
    };
    let read = async {
        let (status, token) = call(
            hyper::Method::PUT,
            "/latest/api/token".into(),
            (TTL_HEADER, TOKEN_TTL_S.to_string()),
        )
        .await?;
        if !status.is_success() || token.trim().is_empty() {
            return Err(fail(format!(
                "the metadata service gave no session token ({status})"
            )));
        }
        let token = token.trim().to_string();
        let (status, roles) = call(
            hyper::Method::GET,
            CREDENTIALS_PATH.into(),
            (TOKEN_HEADER, token.clone()),
        )
        .await?;
        let role = roles.lines().next().unwrap_or("").trim().to_string();
        if status == hyper::StatusCode::NOT_FOUND || (status.is_success() && role.is_empty()) {
            return Err(fail("no IAM role is attached to this instance".into()));
        }
        if !status.is_success() {
            return Err(fail(format!("the metadata service answered {status}")));
        }
        let (status, body) = call(
            hyper::Method::GET,
            format!("{CREDENTIALS_PATH}{}", uri_encode(&role, true)),
            (TOKEN_HEADER, token),
        )
        .await?;
        if !status.is_success() {
            return Err(fail(format!(
                "the metadata service answered {status} for role {role}"
            )));
        }
        parse(&body).map_err(|why| fail(format!("role {role}: {why}")))
    };
    tokio::time::timeout(timeout, read).await.map_err(|_| {
        fail(format!(
            "no answer from {base} within {timeout:?} (not on EC2? in a container, the \
             instance's metadata hop limit must be 2 or more)"
        ))
    })?
}

/// The keys in the metadata service's answer, and when they expire.
fn parse(body: &str) -> Result<(Credentials, SystemTime), String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Answer {
        code: String,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        token: Option<String>,
        expiration: Option<String>,
    }
    let a: Answer =
        serde_json::from_str(body).map_err(|e| format!("an answer that is not theirs: {e}"))?;
    if a.code != "Success" {
        return Err(format!("the metadata service says {:?}", a.code));
    }
    let field = |v: Option<String>, name: &str| {
        v.filter(|v| !v.is_empty())
            .ok_or_else(|| format!("no {name} in the answer"))
    };
    let expiration = field(a.expiration, "Expiration")?;
    let expires = crate::sts::parse_utc(&expiration)
        .ok_or_else(|| format!("an Expiration that is not a UTC time: {expiration:?}"))?;
    Ok((
        Credentials {
            access_key_id: field(a.access_key_id, "AccessKeyId")?,
            secret_access_key: field(a.secret_access_key, "SecretAccessKey")?,
            session_token: Some(field(a.token, "Token")?),
        },
        expires,
    ))
}
