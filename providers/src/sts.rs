//! Temporary AWS credentials for a Kubernetes service account (EKS "IAM roles for service
//! accounts"): the pod's projected web identity token traded at STS for a role's keys
//! (`AssumeRoleWithWebIdentity`, a request STS takes unsigned: the token is the proof). The
//! keys expire (an hour by default): [`crate::temporary_keys::TemporaryKeys`] holds them and
//! trades the token again when they near it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;

use crate::object_store::{uri_encode, Credentials, UploadError};

/// The longest web identity token read (Kubernetes' are ~1 kB).
const TOKEN_BYTES_MAX: u64 = 16 << 10;
/// The longest STS answer read.
const ANSWER_BYTES_MAX: usize = 64 << 10;

/// Where and as what a web identity is traded for keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebIdentityConfig {
    /// STS's URL (`https://sts.REGION.amazonaws.com`).
    pub sts_url: String,
    /// The role to assume (`arn:aws:iam::ACCOUNT:role/NAME`).
    pub role_arn: String,
    /// The file the token is projected to (read again at every trade: Kubernetes rotates it).
    pub token_file: std::path::PathBuf,
    pub session_name: String,
}

/// Trades the token in `config.token_file` for `config.role_arn`'s keys: the keys and when
/// they expire.
pub async fn assume_role_with_web_identity(
    config: &WebIdentityConfig,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(Credentials, SystemTime), UploadError> {
    use std::io::Read;
    let fail = |what: String| UploadError::Credentials(format!("web identity: {what}"));
    let mut token = String::new();
    std::fs::File::open(&config.token_file)
        .and_then(|f| f.take(TOKEN_BYTES_MAX).read_to_string(&mut token))
        .map_err(|e| fail(format!("{}: {e}", config.token_file.display())))?;
    let form = [
        ("Action", "AssumeRoleWithWebIdentity"),
        ("Version", "2011-06-15"),
        ("RoleArn", config.role_arn.as_str()),
        ("RoleSessionName", config.session_name.as_str()),
        ("WebIdentityToken", token.trim()),
    ]
    .map(|(n, v)| format!("{n}={}", uri_encode(v, true)))
    .join("&");
    let request = hyper::Request::post(config.sts_url.as_str())
        .header("content-type", "application/x-www-form-urlencoded")
        .header("accept", "application/xml")
        .body(Full::new(Bytes::from(form)))
        .map_err(|e| fail(format!("{}: {e}", config.sts_url)))?;
    let call = async {
        let client = crate::tls::client(tls, timeout);
        let (head, body) = crate::tls::exchange(&client, request, ANSWER_BYTES_MAX)
            .await
            .map_err(|e| fail(format!("{}: {e}", config.sts_url)))?;
        Ok::<_, UploadError>((head.status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| fail(format!("{}: no answer within {timeout:?}", config.sts_url)))??;
    let text = String::from_utf8_lossy(&body);
    if !status.is_success() {
        let start = &text[..text.len().min(512)];
        return Err(fail(format!("STS answered {status}: {}", start.trim())));
    }
    let field = |name: &str| {
        crate::object_store::xml_text(&text, name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| fail(format!("no {name} in STS's answer")))
    };
    let keys = Credentials {
        access_key_id: field("AccessKeyId")?,
        secret_access_key: field("SecretAccessKey")?,
        session_token: Some(field("SessionToken")?),
    };
    let expiration = field("Expiration")?;
    let expires = parse_utc(&expiration).ok_or_else(|| {
        fail(format!(
            "an Expiration that is not a UTC time: {expiration:?}"
        ))
    })?;
    Ok((keys, expires))
}

/// `at` as `YYYY-MM-DDTHH:MM:SSZ` (UTC), as STS writes an expiration.
pub fn format_utc(at: SystemTime) -> String {
    let d = crate::object_store::amz_date(at);
    utc_of_amz_date(&d).unwrap_or(d)
}

/// SigV4's `YYYYMMDD'T'HHMMSS'Z'` written as `YYYY-MM-DDTHH:MM:SSZ`; `None` if it is not one.
pub fn utc_of_amz_date(d: &str) -> Option<String> {
    let d = d.get(..16).filter(|d| d.is_ascii() && d.ends_with('Z'))?;
    Some(format!(
        "{}-{}-{}T{}:{}:{}Z",
        &d[0..4],
        &d[4..6],
        &d[6..8],
        &d[9..11],
        &d[11..13],
        &d[13..15]
    ))
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z` as a time.
pub fn parse_utc(text: &str) -> Option<SystemTime> {
    let text = text.trim().strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let time = time.split('.').next()?;
    let mut t = time.split(':').map(|p| p.parse::<u64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days since 1970-01-01 from a civil date (H. Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days).ok()? * 86_400 + hh * 3_600 + mm * 60 + ss;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times_parse_as_they_are_written() {
        for secs in [0, 951_782_400 + 3_661, 1_369_353_600, 1_798_761_599] {
            let at = UNIX_EPOCH + Duration::from_secs(secs);
            let text = format_utc(at);
            assert_eq!(parse_utc(&text), Some(at), "{text}");
        }
        assert_eq!(format_utc(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        // AWS's example date, and a leap day.
        assert_eq!(
            parse_utc("2013-05-24T00:00:00Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_369_353_600))
        );
        assert_eq!(
            parse_utc("2000-02-29T01:01:01Z"),
            Some(UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_661))
        );
        assert_eq!(
            parse_utc("2026-12-04T18:00:00.123Z"),
            parse_utc("2026-12-04T18:00:00Z")
        );
        for bad in ["2026-12-04 18:00:00", "2026-13-01T00:00:00Z", "soon", ""] {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
    }
}
