//! Uploads to S3-compatible object storage (AWS S3, MinIO, Ceph RGW, Cloudflare R2, …): one
//! object per `PUT`, signed with AWS Signature Version 4 over the body's SHA-256, so a body
//! changed on the way is refused by the store. The signer reproduces AWS's published examples
//! (the tests below).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use bytes::Bytes;
use hmac::Mac;

use crate::signature::hex;
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};

/// Bytes of a store's error answer kept in the error (S3 answers XML naming the problem).
const ERROR_BODY_BYTES_MAX: usize = 512;

/// A bucket: its base URL — virtual-hosted (`https://BUCKET.s3.REGION.amazonaws.com`) or
/// path-style (`http://minio:9000/BUCKET`) — with its region and credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The bucket's URL, without a trailing `/`; an object's URL is this, `/`, its key.
    pub url: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// A temporary credential's token (`x-amz-security-token`), signed with the request.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket")
            .field("url", &self.url)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UploadError {
    /// The store answered with an error status (and the start of its body).
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("{url}: {reason}")]
    Failed { url: String, reason: String },
    /// More than an upload takes at once.
    #[error("{url}: {bytes} bytes, more than the {max} one upload takes")]
    TooLarge { url: String, bytes: u64, max: u64 },
}

impl UploadError {
    /// Whether trying again could help: the store's or the network's trouble, not a refusal
    /// (wrong credentials, no such bucket, a signature that does not check out).
    pub fn is_retryable(&self) -> bool {
        match self {
            UploadError::Status { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            UploadError::Failed { .. } => true,
            UploadError::TooLarge { .. } => false,
        }
    }
}

/// Hex SHA-256 of `data` (a payload's `x-amz-content-sha256`).
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    crate::signature::mac(key, data)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// `text` percent-encoded the way S3 signs a path: everything but `A-Z a-z 0-9 - _ . ~` (and
/// `/` unless `slash` is encoded too), as upper-case `%XX` of its UTF-8 bytes.
pub fn uri_encode(text: &str, slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b'/' if !slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// What one request is signed over.
pub struct Request<'a> {
    pub method: &'a str,
    /// The path as sent (already encoded: [`uri_encode`]).
    pub path: &'a str,
    /// The canonical query string (empty for none).
    pub query: &'a str,
    /// Signed headers, names in lower case; `host` among them.
    pub headers: &'a [(&'a str, &'a str)],
    /// Hex SHA-256 of the body.
    pub payload_sha256: &'a str,
}

/// The `Authorization` header of `request`, signed at `amz_date` (`YYYYMMDD'T'HHMMSS'Z'`) for
/// `service` in `region`.
pub fn authorization(
    request: &Request<'_>,
    access_key_id: &str,
    secret_access_key: &str,
    region: &str,
    service: &str,
    amz_date: &str,
) -> String {
    let mut headers: Vec<(&str, &str)> = request.headers.to_vec();
    headers.sort_unstable_by_key(|(name, _)| *name);
    let mut canonical = format!("{}\n{}\n{}\n", request.method, request.path, request.query);
    for (name, value) in &headers {
        canonical.push_str(&format!("{name}:{}\n", value.trim()));
    }
    let signed: Vec<&str> = headers.iter().map(|(name, _)| *name).collect();
    let signed = signed.join(";");
    canonical.push_str(&format!("\n{signed}\n{}", request.payload_sha256));
    let day = &amz_date[..8.min(amz_date.len())];
    let scope = format!("{day}/{region}/{service}/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        sha256_hex(canonical.as_bytes())
    );
    let key = [region, service, "aws4_request"].iter().fold(
        hmac(
            format!("AWS4{secret_access_key}").as_bytes(),
            day.as_bytes(),
        ),
        |key, part| hmac(&key, part.as_bytes()),
    );
    let signature = hex(&hmac(&key, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={access_key_id}/{scope},SignedHeaders={signed},Signature={signature}"
    )
}

/// `at` as SigV4's timestamp, `YYYYMMDD'T'HHMMSS'Z'` (UTC).
pub fn amz_date(at: SystemTime) -> String {
    let secs = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

/// Puts `body` into `bucket` under `key` (its `content_type` stored with it), within
/// `timeout`, `https://` checked against `tls`'s roots. The object's URL once the store has
/// it.
pub async fn put_object(
    bucket: &Bucket,
    key: &str,
    body: Bytes,
    content_type: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let url = format!(
        "{}/{}",
        bucket.url.trim_end_matches('/'),
        uri_encode(key, false)
    );
    let failed = |reason: String| UploadError::Failed {
        url: url.clone(),
        reason,
    };
    let uri: hyper::Uri = url.parse().map_err(|e| failed(format!("bad URL: {e}")))?;
    let host = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .ok_or_else(|| failed("no host in the URL".into()))?;
    let payload = sha256_hex(&body);
    let date = amz_date(SystemTime::now());
    let mut headers = vec![
        ("content-type", content_type),
        ("host", host.as_str()),
        ("x-amz-content-sha256", payload.as_str()),
        ("x-amz-date", date.as_str()),
    ];
    if let Some(token) = &bucket.session_token {
        headers.push(("x-amz-security-token", token.as_str()));
    }
    let auth = authorization(
        &Request {
            method: "PUT",
            path: uri.path(),
            query: "",
            headers: &headers,
            payload_sha256: &payload,
        },
        &bucket.access_key_id,
        &bucket.secret_access_key,
        &bucket.region,
        "s3",
        &date,
    );
    let mut request = hyper::Request::put(uri.clone());
    for (name, value) in &headers {
        request = request.header(*name, *value);
    }
    let request = request
        .header("authorization", auth)
        .body(Full::new(body))
        .map_err(|e| failed(e.to_string()))?;
    let put = async {
        let client = crate::tls::client(tls, timeout);
        let response = client
            .request(request)
            .await
            .map_err(|e| failed(crate::tls::describe(&e)))?;
        let status = response.status();
        let answer = response
            .into_body()
            .collect()
            .await
            .map_err(|e| failed(e.to_string()))?
            .to_bytes();
        if status.is_success() {
            return Ok(url.clone());
        }
        let text = String::from_utf8_lossy(&answer[..answer.len().min(ERROR_BODY_BYTES_MAX)]);
        Err(UploadError::Status {
            url: url.clone(),
            status: status.as_u16(),
            body: text.trim().to_string(),
        })
    };
    match tokio::time::timeout(timeout, put).await {
        Ok(r) => r,
        Err(_) => Err(failed(format!("no answer within {timeout:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACCESS: &str = "AKIAIOSFODNN7EXAMPLE";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const HOST: &str = "examplebucket.s3.amazonaws.com";
    const DATE: &str = "20130524T000000Z";

    fn signature(auth: &str) -> &str {
        auth.rsplit_once("Signature=").map_or("", |(_, s)| s)
    }

    /// AWS's "GET Object" example (sig-v4-header-based-auth): a ranged read, empty payload.
    #[test]
    fn the_get_object_example_signs_as_aws_publishes() {
        let empty = sha256_hex(b"");
        assert_eq!(
            empty,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let auth = authorization(
            &Request {
                method: "GET",
                path: "/test.txt",
                query: "",
                headers: &[
                    ("host", HOST),
                    ("range", "bytes=0-9"),
                    ("x-amz-content-sha256", &empty),
                    ("x-amz-date", DATE),
                ],
                payload_sha256: &empty,
            },
            ACCESS,
            SECRET,
            "us-east-1",
            "s3",
            DATE,
        );
        assert!(auth.starts_with(
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        ));
        assert_eq!(
            signature(&auth),
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    /// AWS's "PUT Object" example: a body, a key with `$` (signed as `%24`), headers given in
    /// any order.
    #[test]
    fn the_put_object_example_signs_as_aws_publishes() {
        let payload = sha256_hex(b"Welcome to Amazon S3.");
        assert_eq!(
            payload,
            "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
        );
        let path = format!("/{}", uri_encode("test$file.text", false));
        assert_eq!(path, "/test%24file.text");
        let auth = authorization(
            &Request {
                method: "PUT",
                path: &path,
                query: "",
                headers: &[
                    ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
                    ("date", "Fri, 24 May 2013 00:00:00 GMT"),
                    ("host", HOST),
                    ("x-amz-date", DATE),
                    ("x-amz-content-sha256", &payload),
                ],
                payload_sha256: &payload,
            },
            ACCESS,
            SECRET,
            "us-east-1",
            "s3",
            DATE,
        );
        assert_eq!(
            signature(&auth),
            "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"
        );
    }

    #[test]
    fn timestamps_are_utc_in_sigv4s_form() {
        assert_eq!(amz_date(UNIX_EPOCH), "19700101T000000Z");
        let at = |secs| UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(amz_date(at(1_369_353_600)), "20130524T000000Z");
        // A leap day, and the last second of a year.
        assert_eq!(amz_date(at(951_782_400 + 3_661)), "20000229T010101Z");
        assert_eq!(amz_date(at(1_798_761_599)), "20261231T235959Z");
    }

    #[test]
    fn keys_are_encoded_as_s3_signs_them() {
        assert_eq!(uri_encode("a b/c+d~e", false), "a%20b/c%2Bd~e");
        assert_eq!(uri_encode("a/b", true), "a%2Fb");
        assert_eq!(uri_encode("ключ", false), "%D0%BA%D0%BB%D1%8E%D1%87");
    }

    #[test]
    fn refusals_are_not_retried_and_the_stores_trouble_is() {
        let status = |status| UploadError::Status {
            url: "u".into(),
            status,
            body: String::new(),
        };
        assert!(!status(403).is_retryable());
        assert!(!status(404).is_retryable());
        assert!(status(503).is_retryable());
        assert!(status(429).is_retryable());
        assert!(UploadError::Failed {
            url: "u".into(),
            reason: "connection refused".into()
        }
        .is_retryable());
        let large = UploadError::TooLarge {
            url: "u".into(),
            bytes: 600 << 20,
            max: 512 << 20,
        };
        assert!(!large.is_retryable());
        assert_eq!(
            large.to_string(),
            "u: 629145600 bytes, more than the 536870912 one upload takes"
        );
    }
}
