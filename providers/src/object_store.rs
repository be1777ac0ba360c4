//! Uploads to S3-compatible object storage (AWS S3, MinIO, Ceph RGW, Cloudflare R2, …), every
//! request signed with AWS Signature Version 4 over its body's SHA-256, so a body changed on
//! the way is refused by the store. A file up to one part's size goes in one `PUT`; a larger one
//! as a multipart upload, a few parts read and sent at once, so memory stays at those parts
//! whatever the file's size ([`upload_file`]). The signer reproduces AWS's published examples (the tests
//! below); [`crate::fake_s3`] is a bucket that checks it the way S3 does.
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use bytes::Bytes;
use hmac::Mac;

use crate::signature::hex;
use http_body_util::Full;
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
    /// Headers every new object is created with, signed with its request — a storage class
    /// (`x-amz-storage-class`), server-side encryption (`x-amz-server-side-encryption`, and
    /// `x-amz-server-side-encryption-aws-kms-key-id`): names in lower case.
    pub object_headers: Vec<(String, String)>,
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
    /// More than one upload takes: [`PARTS_MAX`] parts of the configured size.
    #[error("{url}: {bytes} bytes, more than the {max} one upload takes")]
    TooLarge { url: String, bytes: u64, max: u64 },
    /// A multipart upload the store took and then failed: S3 answers `CompleteMultipartUpload`
    /// with `200 OK` before it has put the parts together, and an error in the body if that
    /// fails.
    #[error("{url}: the store failed the upload after accepting it: {body}")]
    FailedAfterOk { url: String, body: String },
    /// An answer that is not S3's (no upload id, no part ETag): not a store this speaks to.
    #[error("{url}: not an S3 answer: {reason}")]
    Unexpected { url: String, reason: String },
    /// The credentials could not be read (a credentials file missing, unreadable or without
    /// the profile's keys).
    #[error("credentials: {0}")]
    Credentials(String),
    /// Told to stop ([`upload_file_until`]) before every part was sent; the upload aborted.
    #[error("{url}: stopped before its last part")]
    Stopped { url: String },
}

impl UploadError {
    /// Whether trying again could help: the store's or the network's trouble, not a refusal
    /// (wrong credentials, no such bucket, a signature that does not check out).
    pub fn is_retryable(&self) -> bool {
        match self {
            UploadError::Status { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            UploadError::Failed { .. } | UploadError::FailedAfterOk { .. } => true,
            UploadError::TooLarge { .. }
            | UploadError::Unexpected { .. }
            | UploadError::Credentials(_)
            | UploadError::Stopped { .. } => false,
        }
    }
}

/// The longest credentials file read.
pub const CREDENTIALS_FILE_BYTES_MAX: u64 = 64 << 10;

/// An access key, as a credentials file holds it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// `profile`'s keys in an AWS shared credentials file (INI: `[profile]` sections of
/// `aws_access_key_id`, `aws_secret_access_key` and, for temporary credentials,
/// `aws_session_token`; `#` and `;` comments). An error names the file and what is wrong.
pub fn credentials_from_file(
    path: &std::path::Path,
    profile: &str,
) -> Result<Credentials, UploadError> {
    use std::io::Read;
    let fail = |what: String| UploadError::Credentials(format!("{}: {what}", path.display()));
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| {
            f.take(CREDENTIALS_FILE_BYTES_MAX + 1)
                .read_to_string(&mut text)
        })
        .map_err(|e| fail(e.to_string()))?;
    if text.len() as u64 > CREDENTIALS_FILE_BYTES_MAX {
        return Err(fail(format!(
            "larger than {CREDENTIALS_FILE_BYTES_MAX} bytes"
        )));
    }
    let (mut section, mut found) = (None::<String>, false);
    let (mut id, mut secret, mut token) = (None, None, None);
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            found |= section.as_deref() == Some(profile);
            continue;
        }
        if section.as_deref() != Some(profile) {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let value = Some(value.trim().to_string()).filter(|v| !v.is_empty());
        match key.trim() {
            "aws_access_key_id" => id = value,
            "aws_secret_access_key" => secret = value,
            "aws_session_token" => token = value,
            _ => {}
        }
    }
    if !found {
        return Err(fail(format!("no [{profile}] profile")));
    }
    match (id, secret) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token: token,
        }),
        _ => Err(fail(format!(
            "[{profile}] lacks aws_access_key_id or aws_secret_access_key"
        ))),
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
    let (scope, signed, signature) = sign(request, secret_access_key, region, service, amz_date);
    format!(
        "AWS4-HMAC-SHA256 Credential={access_key_id}/{scope},SignedHeaders={signed},Signature={signature}"
    )
}

/// SigV4 over `request`: its scope, its signed header names and its signature.
fn sign(
    request: &Request<'_>,
    secret_access_key: &str,
    region: &str,
    service: &str,
    amz_date: &str,
) -> (String, String, String) {
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
    (scope, signed, signature)
}

/// The longest a presigned URL lasts (SigV4's limit: a week).
pub const PRESIGN_MAX: Duration = Duration::from_secs(7 * 24 * 3600);

/// What a presigned request signs in place of its body's hash.
pub const PRESIGN_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

/// A URL that lets whoever holds it `GET` `key` from `bucket`, signed at `at` and good for
/// `lasts` (at most [`PRESIGN_MAX`]): SigV4 in the query, the session token of temporary keys
/// with it — such a URL stops working when those keys expire, whatever `lasts` says.
pub fn presign_get(
    bucket: &Bucket,
    key: &str,
    at: SystemTime,
    lasts: Duration,
) -> Result<String, UploadError> {
    let url = format!(
        "{}/{}",
        bucket.url.trim_end_matches('/'),
        uri_encode(key, false)
    );
    let uri: hyper::Uri = url.parse().map_err(|e| UploadError::Failed {
        url: url.clone(),
        reason: format!("bad URL: {e}"),
    })?;
    let host = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .ok_or_else(|| UploadError::Failed {
            url: url.clone(),
            reason: "no host in the URL".into(),
        })?;
    let date = amz_date(at);
    let credential = format!(
        "{}/{}/{}/s3/aws4_request",
        bucket.access_key_id,
        &date[..8],
        bucket.region
    );
    let seconds = lasts.as_secs().clamp(1, PRESIGN_MAX.as_secs()).to_string();
    let mut pairs = vec![
        ("X-Amz-Algorithm", "AWS4-HMAC-SHA256"),
        ("X-Amz-Credential", credential.as_str()),
        ("X-Amz-Date", date.as_str()),
        ("X-Amz-Expires", seconds.as_str()),
        ("X-Amz-SignedHeaders", "host"),
    ];
    if let Some(token) = &bucket.session_token {
        pairs.push(("X-Amz-Security-Token", token.as_str()));
    }
    let query = canonical_query(&pairs);
    let signature = presigned_signature(
        "GET",
        uri.path(),
        &query,
        &host,
        &bucket.secret_access_key,
        &bucket.region,
        &date,
    );
    Ok(format!("{url}?{query}&X-Amz-Signature={signature}"))
}

/// The signature of a presigned request: `method` on `path` at `host`, its query (canonical,
/// without `X-Amz-Signature`) signed at `amz_date`, the host its one signed header.
pub fn presigned_signature(
    method: &str,
    path: &str,
    query: &str,
    host: &str,
    secret_access_key: &str,
    region: &str,
    amz_date: &str,
) -> String {
    let request = Request {
        method,
        path,
        query,
        headers: &[("host", host)],
        payload_sha256: PRESIGN_PAYLOAD,
    };
    sign(&request, secret_access_key, region, "s3", amz_date).2
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

/// S3's smallest part but the last.
pub const PART_BYTES_MIN: u64 = 5 << 20;
/// S3's largest part.
pub const PART_BYTES_MAX: u64 = 5 << 30;
/// The most parts one multipart upload has (S3's limit).
pub const PARTS_MAX: u64 = 10_000;
/// Bytes of an answer's body read: S3's answers to these requests are a few hundred bytes of
/// XML; a longer one is cut here (and then not S3's).
const ANSWER_BYTES_MAX: usize = 64 << 10;
/// The first pause between two tries of one request; it doubles.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// What a successful request brought back.
struct Answer {
    /// The object's URL (without the query).
    url: String,
    etag: Option<String>,
    body: Bytes,
}

/// One request to a bucket, for the object `key`.
struct Call<'a> {
    method: &'a str,
    key: &'a str,
    /// Unencoded (name, value) pairs.
    query: &'a [(&'a str, &'a str)],
    /// Signed by its hash.
    body: Bytes,
    content_type: Option<&'a str>,
    /// More headers to sign and send (an object's storage class and encryption).
    headers: &'a [(String, String)],
}

impl<'a> Call<'a> {
    /// `method` on `key`: no query, no body, no more headers.
    fn to(method: &'a str, key: &'a str) -> Call<'a> {
        Call {
            method,
            key,
            query: &[],
            body: Bytes::new(),
            content_type: None,
            headers: &[],
        }
    }
}

/// `call` to `bucket`, signed. An error status is an error (with the start of the store's
/// answer); the whole request, answer included, within `timeout`.
async fn send(
    bucket: &Bucket,
    call: Call<'_>,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<Answer, UploadError> {
    let Call {
        method,
        key,
        query,
        body,
        content_type,
        headers: extra,
    } = call;
    let url = format!(
        "{}/{}",
        bucket.url.trim_end_matches('/'),
        uri_encode(key, false)
    );
    let failed = |reason: String| UploadError::Failed {
        url: url.clone(),
        reason,
    };
    let query = canonical_query(query);
    let full = if query.is_empty() {
        url.clone()
    } else {
        format!("{url}?{query}")
    };
    let uri: hyper::Uri = full.parse().map_err(|e| failed(format!("bad URL: {e}")))?;
    let host = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .ok_or_else(|| failed("no host in the URL".into()))?;
    let payload = sha256_hex(&body);
    let date = amz_date(SystemTime::now());
    let mut headers = vec![
        ("host", host.as_str()),
        ("x-amz-content-sha256", payload.as_str()),
        ("x-amz-date", date.as_str()),
    ];
    if let Some(content_type) = content_type {
        headers.push(("content-type", content_type));
    }
    if let Some(token) = &bucket.session_token {
        headers.push(("x-amz-security-token", token.as_str()));
    }
    headers.extend(extra.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    let auth = authorization(
        &Request {
            method,
            path: uri.path(),
            query: &query,
            headers: &headers,
            payload_sha256: &payload,
        },
        &bucket.access_key_id,
        &bucket.secret_access_key,
        &bucket.region,
        "s3",
        &date,
    );
    let mut request = hyper::Request::builder().method(method).uri(uri.clone());
    for (name, value) in &headers {
        request = request.header(*name, *value);
    }
    let request = request
        .header("authorization", auth)
        .body(Full::new(body))
        .map_err(|e| failed(e.to_string()))?;
    let call = async {
        let client = crate::tls::client(tls, timeout);
        let (head, answer) = crate::tls::exchange(&client, request, ANSWER_BYTES_MAX)
            .await
            .map_err(failed)?;
        let status = head.status;
        let etag = head
            .headers
            .get(hyper::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if status.is_success() {
            return Ok(Answer {
                url: url.clone(),
                etag,
                body: answer,
            });
        }
        let text = String::from_utf8_lossy(&answer[..answer.len().min(ERROR_BODY_BYTES_MAX)]);
        Err(UploadError::Status {
            url: url.clone(),
            status: status.as_u16(),
            body: text.trim().to_string(),
        })
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(r) => r,
        Err(_) => Err(failed(format!("no answer within {timeout:?}"))),
    }
}

/// SigV4's canonical query string: names and values encoded (`/` too), sorted, `name=value`
/// joined by `&` — also what is sent, so the store signs over the same string.
pub fn canonical_query(pairs: &[(&str, &str)]) -> String {
    let mut encoded: Vec<(String, String)> = pairs
        .iter()
        .map(|(n, v)| (uri_encode(n, true), uri_encode(v, true)))
        .collect();
    encoded.sort_unstable();
    let parts: Vec<String> = encoded.iter().map(|(n, v)| format!("{n}={v}")).collect();
    parts.join("&")
}

/// Puts `body` into `bucket` under `key` (its `content_type` stored with it) in one request,
/// within `timeout`, `https://` checked against `tls`'s roots. The object's URL once the store
/// has it.
pub async fn put_object(
    bucket: &Bucket,
    key: &str,
    body: Bytes,
    content_type: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let call = Call {
        body,
        content_type: Some(content_type),
        headers: &bucket.object_headers,
        ..Call::to("PUT", key)
    };
    Ok(send(bucket, call, timeout, tls).await?.url)
}

/// Removes `key` from `bucket` (S3 answers `204` whether or not it was there).
pub async fn delete_object(
    bucket: &Bucket,
    key: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(), UploadError> {
    send(bucket, Call::to("DELETE", key), timeout, tls).await?;
    Ok(())
}

/// Starts a multipart upload of `key`: its upload id.
pub async fn create_multipart_upload(
    bucket: &Bucket,
    key: &str,
    content_type: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let call = Call {
        query: &[("uploads", "")],
        content_type: Some(content_type),
        headers: &bucket.object_headers,
        ..Call::to("POST", key)
    };
    let answer = send(bucket, call, timeout, tls).await?;
    let text = String::from_utf8_lossy(&answer.body);
    match xml_text(&text, "UploadId") {
        Some(id) if !id.is_empty() => Ok(id),
        _ => Err(UploadError::Unexpected {
            url: answer.url,
            reason: "no UploadId in the answer to CreateMultipartUpload".into(),
        }),
    }
}

/// Sends part `number` (1..=[`PARTS_MAX`]) of upload `upload_id`: the part's ETag, which
/// completing the upload names it by.
#[allow(clippy::too_many_arguments)]
pub async fn upload_part(
    bucket: &Bucket,
    key: &str,
    upload_id: &str,
    number: u32,
    body: Bytes,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let number = number.to_string();
    let call = Call {
        query: &[("partNumber", &number), ("uploadId", upload_id)],
        body,
        ..Call::to("PUT", key)
    };
    let answer = send(bucket, call, timeout, tls).await?;
    answer.etag.ok_or_else(|| UploadError::Unexpected {
        url: answer.url,
        reason: format!("no ETag in the answer to part {number}"),
    })
}

/// Puts upload `upload_id`'s `parts` (number, ETag), in order, together as the object: its URL.
pub async fn complete_multipart_upload(
    bucket: &Bucket,
    key: &str,
    upload_id: &str,
    parts: &[(u32, String)],
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let mut xml = String::from("<CompleteMultipartUpload>");
    for (number, etag) in parts {
        xml.push_str(&format!(
            "<Part><PartNumber>{number}</PartNumber><ETag>{}</ETag></Part>",
            xml_escape(etag)
        ));
    }
    xml.push_str("</CompleteMultipartUpload>");
    let call = Call {
        query: &[("uploadId", upload_id)],
        body: Bytes::from(xml),
        content_type: Some("application/xml"),
        ..Call::to("POST", key)
    };
    let answer = send(bucket, call, timeout, tls).await?;
    let text = String::from_utf8_lossy(&answer.body);
    if text.contains("<Error>") {
        return Err(UploadError::FailedAfterOk {
            url: answer.url,
            body: text[..text.len().min(ERROR_BODY_BYTES_MAX)]
                .trim()
                .to_string(),
        });
    }
    Ok(answer.url)
}

/// Ends upload `upload_id` without an object: the store drops the parts it holds.
pub async fn abort_multipart_upload(
    bucket: &Bucket,
    key: &str,
    upload_id: &str,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(), UploadError> {
    let call = Call {
        query: &[("uploadId", upload_id)],
        ..Call::to("DELETE", key)
    };
    send(bucket, call, timeout, tls).await?;
    Ok(())
}

/// A multipart upload a bucket holds open: started, neither completed nor aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenUpload {
    pub key: String,
    pub upload_id: String,
    pub initiated: SystemTime,
}

/// The most uploads S3 lists in one page.
pub const LIST_PAGE_MAX: u32 = 1_000;

/// The multipart uploads `bucket` holds open under `prefix`, read a page of `page`
/// (1..=[`LIST_PAGE_MAX`]) at a time, at most `pages` pages, each within `timeout`: the uploads,
/// and whether more were left unread.
pub async fn list_multipart_uploads(
    bucket: &Bucket,
    prefix: &str,
    page: u32,
    pages: u32,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(Vec<OpenUpload>, bool), UploadError> {
    let page = page.clamp(1, LIST_PAGE_MAX).to_string();
    let query = [
        ("uploads", ""),
        ("prefix", prefix),
        ("max-uploads", page.as_str()),
    ];
    list_pages(bucket, &query, pages, timeout, tls, upload_list_page).await
}

/// The keys of the objects `bucket` holds under `prefix` (`ListObjectsV2`), in the store's
/// order (UTF-8 byte order on S3), read a page of `page` (1..=[`LIST_PAGE_MAX`]) at a time, at
/// most `pages` pages, each within `timeout`: the keys, and whether more were left unread.
pub async fn list_objects(
    bucket: &Bucket,
    prefix: &str,
    page: u32,
    pages: u32,
    timeout: Duration,
    tls: &rustls::ClientConfig,
) -> Result<(Vec<String>, bool), UploadError> {
    let page = page.clamp(1, LIST_PAGE_MAX).to_string();
    let query = [
        ("list-type", "2"),
        ("prefix", prefix),
        ("max-keys", page.as_str()),
    ];
    list_pages(bucket, &query, pages, timeout, tls, object_list_page).await
}

/// One page of a bucket's listing: what it lists, and the query pairs that ask for the next
/// page (none: the list is whole).
#[derive(Debug, PartialEq)]
struct ListPage<T> {
    items: Vec<T>,
    next: Vec<(&'static str, String)>,
}

/// A listing of `bucket` (`GET` on the bucket with `query`), page after page as `read` makes
/// them out, at most `pages`, each within `timeout`: the items, and whether more were left.
async fn list_pages<T>(
    bucket: &Bucket,
    query: &[(&str, &str)],
    pages: u32,
    timeout: Duration,
    tls: &rustls::ClientConfig,
    read: fn(&str) -> Result<ListPage<T>, String>,
) -> Result<(Vec<T>, bool), UploadError> {
    let mut items = Vec::new();
    let mut next: Vec<(&'static str, String)> = Vec::new();
    for _ in 0..pages {
        let mut pairs = query.to_vec();
        pairs.extend(next.iter().map(|(n, v)| (*n, v.as_str())));
        let call = Call {
            query: &pairs,
            ..Call::to("GET", "")
        };
        let answer = send(bucket, call, timeout, tls).await?;
        let page = read(&String::from_utf8_lossy(&answer.body)).map_err(|reason| {
            UploadError::Unexpected {
                url: answer.url.clone(),
                reason,
            }
        })?;
        items.extend(page.items);
        if page.next.is_empty() {
            return Ok((items, false));
        }
        next = page.next;
    }
    Ok((items, true))
}

/// The keys a `ListObjectsV2` answer lists, and its `continuation-token`; an error names what
/// it lacks.
fn object_list_page(text: &str) -> Result<ListPage<String>, String> {
    let mut keys = Vec::new();
    for item in text.split("<Contents>").skip(1) {
        let item = item.split("</Contents>").next().unwrap_or("");
        let key = xml_text(item, "Key")
            .filter(|k| !k.is_empty())
            .ok_or("an object without Key in the list")?;
        keys.push(key);
    }
    let next = match xml_text(text, "IsTruncated").as_deref() {
        Some("true") => vec![(
            "continuation-token",
            xml_text(text, "NextContinuationToken")
                .filter(|t| !t.is_empty())
                .ok_or("a truncated list without NextContinuationToken")?,
        )],
        _ => Vec::new(),
    };
    Ok(ListPage { items: keys, next })
}

/// The uploads a `ListMultipartUploads` answer lists, and its markers; an error names what it
/// lacks.
fn upload_list_page(text: &str) -> Result<ListPage<OpenUpload>, String> {
    let mut uploads = Vec::new();
    for item in text.split("<Upload>").skip(1) {
        let item = item.split("</Upload>").next().unwrap_or("");
        let field = |name: &str| {
            xml_text(item, name)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("an upload without {name} in the list"))
        };
        let initiated = field("Initiated")?;
        uploads.push(OpenUpload {
            key: field("Key")?,
            upload_id: field("UploadId")?,
            initiated: crate::sts::parse_utc(&initiated)
                .ok_or_else(|| format!("an Initiated that is not a UTC time: {initiated:?}"))?,
        });
    }
    if xml_text(text, "IsTruncated").as_deref() != Some("true") {
        return Ok(ListPage {
            items: uploads,
            next: Vec::new(),
        });
    }
    let next = |name: &str| {
        xml_text(text, name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("a truncated list without {name}"))
    };
    Ok(ListPage {
        items: uploads,
        next: vec![
            ("key-marker", next("NextKeyMarker")?),
            ("upload-id-marker", next("NextUploadIdMarker")?),
        ],
    })
}

/// The text of the first `<name>` element in `xml`, its entities decoded.
pub(crate) fn xml_text(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = xml.find(&open)? + open.len();
    let end = start + xml[start..].find(&format!("</{name}>"))?;
    Some(
        xml[start..end]
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

pub(crate) fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// How [`upload_file`] sends a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// A file up to this goes in one `PUT`; a larger one in parts of this size (the last
    /// smaller). The most of the file held in memory at once.
    pub part_bytes: u64,
    /// Tries of each request, while its trouble is the store's or the network's (0.5 s apart,
    /// doubling).
    pub attempts: u32,
    /// Parts sent at once (at least 1): the file is held in memory up to this many parts.
    pub parts_in_flight: usize,
}

/// Sends `f()` up to `plan.attempts` times while its trouble is retryable and `deadline`
/// leaves room for the pause; `f` gets the time left.
async fn tried<T, F, Fut>(
    plan: &Plan,
    deadline: Instant,
    what: &str,
    mut f: F,
) -> Result<T, UploadError>
where
    F: FnMut(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T, UploadError>>,
{
    let mut pause = RETRY_PAUSE;
    let mut tries = 0;
    loop {
        tries += 1;
        match f(deadline.saturating_duration_since(Instant::now())).await {
            Ok(v) => return Ok(v),
            Err(e)
                if e.is_retryable()
                    && tries < plan.attempts
                    && Instant::now() + pause < deadline =>
            {
                tracing::warn!("{what} failed (try {tries}), trying again: {e}");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Puts the file at `path` into `bucket` as `key`, all within `deadline`: in one `PUT` up to
/// `plan.part_bytes`, else as a multipart upload of parts that size, `plan.parts_in_flight`
/// read and sent at once (an upload that fails is aborted, so the store keeps none of its
/// parts). Each request is tried per `plan`. The object's URL.
pub async fn upload_file(
    bucket: &Bucket,
    key: &str,
    path: &std::path::Path,
    content_type: &str,
    plan: &Plan,
    deadline: Instant,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    let never = std::sync::atomic::AtomicBool::new(false);
    upload_file_until(bucket, key, path, content_type, plan, deadline, &never, tls).await
}

/// [`upload_file`], stopping a multipart upload before its next part once `stop` is set (a
/// canceled job): the upload is aborted and the answer is [`UploadError::Stopped`].
#[allow(clippy::too_many_arguments)]
pub async fn upload_file_until(
    bucket: &Bucket,
    key: &str,
    path: &std::path::Path,
    content_type: &str,
    plan: &Plan,
    deadline: Instant,
    stop: &std::sync::atomic::AtomicBool,
    tls: &rustls::ClientConfig,
) -> Result<String, UploadError> {
    use tokio::io::AsyncReadExt;
    let unreadable = |e: std::io::Error| UploadError::Failed {
        url: key.to_string(),
        reason: format!("reading {}: {e}", path.display()),
    };
    let part_bytes = plan.part_bytes.max(1);
    let file = tokio::fs::File::open(path).await.map_err(unreadable)?;
    let size = file.metadata().await.map_err(unreadable)?.len();
    if size <= part_bytes {
        let mut body = Vec::with_capacity(size as usize);
        // Never more than a part, should the file have grown since.
        file.take(part_bytes)
            .read_to_end(&mut body)
            .await
            .map_err(unreadable)?;
        let body = Bytes::from(body);
        return tried(plan, deadline, &format!("upload of {key}"), |left| {
            put_object(bucket, key, body.clone(), content_type, left, tls)
        })
        .await;
    }
    let parts = size.div_ceil(part_bytes);
    if parts > PARTS_MAX {
        // Not the store's trouble: trying again will not shrink it.
        return Err(UploadError::TooLarge {
            url: key.to_string(),
            bytes: size,
            max: part_bytes.saturating_mul(PARTS_MAX),
        });
    }
    let id = tried(
        plan,
        deadline,
        &format!("starting the upload of {key}"),
        |left| create_multipart_upload(bucket, key, content_type, left, tls),
    )
    .await?;
    let sent = async {
        use futures_util::stream::{self, StreamExt, TryStreamExt};
        // Each part read on its own handle, up to `parts_in_flight` at once, their ETags kept
        // in part order whatever order they finish in.
        let etags: Vec<(u32, String)> = stream::iter(1..=parts as u32)
            .map(|number| {
                let id = &id;
                async move {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(UploadError::Stopped {
                            url: key.to_string(),
                        });
                    }
                    let offset = u64::from(number - 1) * part_bytes;
                    let len = part_bytes.min(size - offset) as usize;
                    let body = read_part(path, offset, len).await.map_err(unreadable)?;
                    let what = format!("part {number} of {parts} of {key}");
                    let etag = tried(plan, deadline, &what, |left| {
                        upload_part(bucket, key, id, number, body.clone(), left, tls)
                    })
                    .await?;
                    Ok::<_, UploadError>((number, etag))
                }
            })
            .buffered(plan.parts_in_flight.max(1))
            .try_collect()
            .await?;
        tried(
            plan,
            deadline,
            &format!("completing the upload of {key}"),
            |left| complete_multipart_upload(bucket, key, &id, &etags, left, tls),
        )
        .await
    }
    .await;
    if let Err(e) = &sent {
        // The store would keep (and bill) the parts until told; the failure is the one to tell.
        if let Err(abort) = abort_multipart_upload(bucket, key, &id, ABORT_TIMEOUT, tls).await {
            tracing::warn!("upload of {key} failed ({e}); aborting it failed too: {abort}");
        }
    }
    sent
}

/// `len` bytes of the file at `path` from `offset`, read on a handle of their own.
async fn read_part(path: &std::path::Path, offset: u64, len: usize) -> std::io::Result<Bytes> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut file = tokio::fs::File::open(path).await?;
    file.seek(std::io::SeekFrom::Start(offset)).await?;
    let mut body = vec![0; len];
    file.read_exact(&mut body).await?;
    Ok(Bytes::from(body))
}

/// The time an abort gets, whatever is left of the job's: without it the parts stay.
const ABORT_TIMEOUT: Duration = Duration::from_secs(10);

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

    /// A profile's keys are read from a shared credentials file, comments and other profiles
    /// aside; what is missing is named.
    #[test]
    fn credentials_files_are_read_by_profile() {
        let dir = std::env::temp_dir().join(format!("spindle-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("credentials");
        std::fs::write(
            &path,
            "# rotated by the agent\n[default]\naws_access_key_id = AKIDDEFAULT\n\
             aws_secret_access_key = s1\n\n[renditions]\n; temporary\n\
             aws_access_key_id=ASIATEMP\naws_secret_access_key=s2\naws_session_token = tok\n\
             region = eu-west-1\n",
        )
        .unwrap();
        let default = credentials_from_file(&path, "default").unwrap();
        assert_eq!(
            (
                default.access_key_id.as_str(),
                default.secret_access_key.as_str()
            ),
            ("AKIDDEFAULT", "s1")
        );
        assert_eq!(default.session_token, None);
        let temp = credentials_from_file(&path, "renditions").unwrap();
        assert_eq!(
            (temp.access_key_id.as_str(), temp.session_token.as_deref()),
            ("ASIATEMP", Some("tok"))
        );
        assert!(!format!("{temp:?}").contains("s2"), "the secret in Debug");
        let name = path.display().to_string();
        let e = credentials_from_file(&path, "other").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("credentials: {name}: no [other] profile")
        );
        assert!(!e.is_retryable());
        std::fs::write(&path, "[default]\naws_access_key_id = A\n").unwrap();
        let e = credentials_from_file(&path, "default").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "credentials: {name}: [default] lacks aws_access_key_id or aws_secret_access_key"
            )
        );
        let e = credentials_from_file(&dir.join("none"), "default").unwrap_err();
        assert!(e.to_string().contains("No such file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// AWS's published example of a presigned GET (the S3 guide, "Authenticating Requests:
    /// Using Query Parameters").
    #[test]
    fn the_presigned_get_example_signs_as_aws_publishes() {
        let bucket = Bucket {
            url: "https://examplebucket.s3.amazonaws.com".into(),
            region: "us-east-1".into(),
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
            object_headers: Vec::new(),
        };
        let at = UNIX_EPOCH + Duration::from_secs(1_369_353_600); // 2013-05-24T00:00:00Z
        let url = presign_get(&bucket, "test.txt", at, Duration::from_secs(86_400)).unwrap();
        assert_eq!(
            url,
            "https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256\
             &X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request\
             &X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host\
             &X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
        );
        // Longer than SigV4 allows is cut to a week; temporary keys' token rides along.
        let temporary = Bucket {
            session_token: Some("tok/en".into()),
            ..bucket
        };
        let url = presign_get(&temporary, "a b.mp4", at, Duration::from_secs(30 * 86_400)).unwrap();
        assert!(url.contains("X-Amz-Expires=604800&"), "{url}");
        assert!(url.contains("&X-Amz-Security-Token=tok%2Fen&"), "{url}");
        assert!(
            url.starts_with("https://examplebucket.s3.amazonaws.com/a%20b.mp4?"),
            "{url}"
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

    /// A `ListMultipartUploads` answer as S3 documents it (entities in a key, a truncated
    /// page's markers), and answers lacking what a sweep needs, each named.
    #[test]
    fn upload_lists_are_read_and_what_they_lack_is_named() {
        let upload = |key: &str, id: &str, at: &str| {
            format!(
                "<Upload><Key>{key}</Key><UploadId>{id}</UploadId><Initiator><ID>x</ID>\
                 </Initiator><StorageClass>STANDARD</StorageClass><Initiated>{at}</Initiated>\
                 </Upload>"
            )
        };
        let answer = |truncated: &str, markers: &str, uploads: &[String]| {
            format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListMultipartUploadsResult>\
                 <Bucket>b</Bucket><KeyMarker></KeyMarker>{markers}<MaxUploads>2</MaxUploads>\
                 <IsTruncated>{truncated}</IsTruncated>{}</ListMultipartUploadsResult>",
                uploads.concat()
            )
        };
        let two = [
            upload(
                "r/task-1-7-720p.mp4",
                "VXBsb2FkIElE",
                "2010-11-10T20:48:33.000Z",
            ),
            upload("r/a&amp;b", "id2", "2010-11-10T20:49:33Z"),
        ];
        let page = upload_list_page(&answer(
            "true",
            "<NextKeyMarker>r/a&amp;b</NextKeyMarker><NextUploadIdMarker>id2</NextUploadIdMarker>",
            &two,
        ))
        .unwrap();
        let at = |s: &str| crate::sts::parse_utc(s).unwrap();
        assert_eq!(
            page,
            ListPage {
                items: vec![
                    OpenUpload {
                        key: "r/task-1-7-720p.mp4".into(),
                        upload_id: "VXBsb2FkIElE".into(),
                        initiated: at("2010-11-10T20:48:33Z"),
                    },
                    OpenUpload {
                        key: "r/a&b".into(),
                        upload_id: "id2".into(),
                        initiated: at("2010-11-10T20:49:33Z"),
                    },
                ],
                next: vec![
                    ("key-marker", "r/a&b".into()),
                    ("upload-id-marker", "id2".into())
                ],
            }
        );
        let last = upload_list_page(&answer("false", "", &two[..1])).unwrap();
        assert_eq!((last.items.len(), last.next), (1, vec![]));
        let empty = upload_list_page(&answer("false", "", &[])).unwrap();
        assert_eq!(empty.items, vec![]);

        let broken = |uploads: &[String], markers: &str| {
            upload_list_page(&answer("true", markers, uploads)).unwrap_err()
        };
        let markers = "<NextKeyMarker>k</NextKeyMarker><NextUploadIdMarker>i</NextUploadIdMarker>";
        for (field, why) in [
            ("Key", "an upload without Key in the list"),
            ("UploadId", "an upload without UploadId in the list"),
            ("Initiated", "an upload without Initiated in the list"),
        ] {
            let lacking = two[0]
                .replace(&format!("<{field}>"), "<Other>")
                .replace(&format!("</{field}>"), "</Other>");
            assert_eq!(broken(&[lacking], markers), why);
        }
        assert_eq!(
            broken(&[upload("k", "i", "yesterday")], markers),
            "an Initiated that is not a UTC time: \"yesterday\""
        );
        assert_eq!(
            broken(&two, "<NextUploadIdMarker>i</NextUploadIdMarker>"),
            "a truncated list without NextKeyMarker"
        );
        assert_eq!(
            broken(&two, "<NextKeyMarker>k</NextKeyMarker>"),
            "a truncated list without NextUploadIdMarker"
        );
    }

    /// A `ListObjectsV2` answer as S3 documents it, and answers lacking what is needed.
    #[test]
    fn object_lists_are_read_and_what_they_lack_is_named() {
        let answer = |truncated: &str, token: &str, keys: &[&str]| {
            let contents: String = keys
                .iter()
                .map(|k| {
                    format!(
                        "<Contents><Key>{k}</Key><LastModified>2009-10-12T17:50:30.000Z\
                         </LastModified><ETag>&quot;fba9dede5f27731c9771645a39863328&quot;\
                         </ETag><Size>434234</Size><StorageClass>STANDARD</StorageClass>\
                         </Contents>"
                    )
                })
                .collect();
            format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name>\
                 <Prefix>r/</Prefix><KeyCount>{}</KeyCount><MaxKeys>2</MaxKeys>\
                 <IsTruncated>{truncated}</IsTruncated>{token}{contents}</ListBucketResult>",
                keys.len()
            )
        };
        let token = "<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=\
                     </NextContinuationToken>";
        assert_eq!(
            object_list_page(&answer(
                "true",
                token,
                &["r/a&amp;b", "r/task-1-7-720p.mp4"]
            )),
            Ok(ListPage {
                items: vec!["r/a&b".into(), "r/task-1-7-720p.mp4".into()],
                next: vec![(
                    "continuation-token",
                    "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=".into()
                )],
            })
        );
        assert_eq!(
            object_list_page(&answer("false", "", &[])),
            Ok(ListPage {
                items: vec![],
                next: vec![]
            })
        );
        assert_eq!(
            object_list_page(&answer("true", "", &["k"])),
            Err("a truncated list without NextContinuationToken".into())
        );
        assert_eq!(
            object_list_page(&answer("false", "", &["k"]).replace("<Key>k</Key>", "")),
            Err("an object without Key in the list".into())
        );
    }
}
