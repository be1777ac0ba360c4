//! A stand-in S3 bucket for tests and local runs: in memory, on a real socket, path-style
//! (`http://ADDR/BUCKET/KEY`), speaking the part of S3's API spindle uses — `PUT` an object,
//! a multipart upload (create, parts, complete, abort), `DELETE` and `GET` an object — and
//! checking each request the way S3 does: its SigV4 signature against the bucket's
//! credentials, its payload hash against the body that came, a multipart upload's parts
//! against their ETags and S3's smallest part. What does not check out is refused with S3's
//! error code, and counted.
//!
//! It also misbehaves when told (a number of `503`s, a status for every request, a part that
//! is always refused, a completion that fails after its `200`), so tests can show what the
//! uploader does then.

use crate::adapter::decode as percent_decode;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};

use crate::object_store::{
    authorization, canonical_query, sha256_hex, xml_escape, Bucket, PART_BYTES_MIN,
};

/// The largest request body taken (a part or an object): larger is `413 EntityTooLarge`.
pub const BODY_BYTES_MAX: usize = 64 << 20;

/// A running fake bucket; it stops when dropped.
pub struct FakeS3 {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeS3 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    name: String,
    region: String,
    /// The key requests must be signed with, and the session token they must carry (temporary
    /// credentials), if any.
    key: Mutex<crate::object_store::Credentials>,
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
    /// The storage class and encryption headers each object was created with.
    created_with: Mutex<BTreeMap<String, Vec<(String, String)>>>,
    uploads: Mutex<HashMap<String, Upload>>,
    next_upload: AtomicU64,
    /// Every request answered, as "METHOD what" (`PUT object k`, `PUT part 2 k`, …).
    log: Mutex<Vec<String>>,
    bad_signatures: AtomicU32,
    unavailable: AtomicU32,
    refuse_with: AtomicU16,
    refuse_part: AtomicU32,
    refuse_keys_with: Mutex<Option<String>>,
    fail_after_ok: AtomicU32,
    min_part_bytes: AtomicU64,
    /// Milliseconds each part takes to answer, and the most parts seen in flight at once.
    part_delay_ms: AtomicU64,
    /// While set, a `PUT` of an object stores it and then waits for `released` to answer.
    hold_puts: std::sync::atomic::AtomicBool,
    released: tokio::sync::Notify,
    parts_in_flight: AtomicU32,
    parts_in_flight_max: AtomicU32,
}

struct Upload {
    key: String,
    /// When it was started (as `backdate_uploads` has it).
    initiated: SystemTime,
    parts: BTreeMap<u32, (String, Bytes)>,
    /// What the upload was created with, for its object.
    created_with: Vec<(String, String)>,
}

impl FakeS3 {
    /// Serves bucket `name` on a loopback port of the current tokio runtime, taking requests
    /// signed for `region` with this key pair.
    pub async fn start(
        name: &str,
        region: &str,
        access_key_id: &str,
        secret_access_key: &str,
    ) -> std::io::Result<FakeS3> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            name: name.to_string(),
            region: region.to_string(),
            key: Mutex::new(crate::object_store::Credentials {
                access_key_id: access_key_id.to_string(),
                secret_access_key: secret_access_key.to_string(),
                session_token: None,
            }),
            objects: Mutex::default(),
            created_with: Mutex::default(),
            uploads: Mutex::default(),
            next_upload: AtomicU64::new(1),
            log: Mutex::default(),
            bad_signatures: AtomicU32::new(0),
            unavailable: AtomicU32::new(0),
            refuse_with: AtomicU16::new(0),
            refuse_part: AtomicU32::new(0),
            refuse_keys_with: Mutex::default(),
            fail_after_ok: AtomicU32::new(0),
            min_part_bytes: AtomicU64::new(PART_BYTES_MIN),
            part_delay_ms: AtomicU64::new(0),
            hold_puts: std::sync::atomic::AtomicBool::new(false),
            released: tokio::sync::Notify::new(),
            parts_in_flight: AtomicU32::new(0),
            parts_in_flight_max: AtomicU32::new(0),
        });
        let shared = state.clone();
        let task = crate::serve::serve(listener, None, move |req| {
            let state = shared.clone();
            async move { answer(&state, req).await }
        });
        Ok(FakeS3 { addr, state, task })
    }

    /// The bucket's URL (path-style).
    pub fn url(&self) -> String {
        format!("http://{}/{}", self.addr, self.state.name)
    }

    /// The bucket as a client addresses it, with the credentials it takes.
    pub fn bucket(&self) -> Bucket {
        let key = lock(&self.state.key).clone();
        Bucket {
            url: self.url(),
            region: self.state.region.clone(),
            access_key_id: key.access_key_id,
            secret_access_key: key.secret_access_key,
            session_token: key.session_token,
            object_headers: Vec::new(),
        }
    }

    /// From now on requests must be signed with this key and, with temporary credentials,
    /// carry their session token (`x-amz-security-token`), as after a rotation: the old key is
    /// refused.
    pub fn rotate_key(&self, key: crate::object_store::Credentials) {
        *lock(&self.state.key) = key;
    }

    /// The object stored under `key`.
    pub fn object(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.state.objects).get(key).cloned()
    }

    /// The storage class and server-side encryption headers (`x-amz-storage-class`,
    /// `x-amz-server-side-encryption…`) the object at `key` was created with, by name.
    pub fn created_with(&self, key: &str) -> Vec<(String, String)> {
        lock(&self.state.created_with)
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// The keys stored, in order.
    pub fn keys(&self) -> Vec<String> {
        lock(&self.state.objects).keys().cloned().collect()
    }

    /// Multipart uploads started and neither completed nor aborted.
    pub fn open_uploads(&self) -> usize {
        lock(&self.state.uploads).len()
    }

    /// The keys of the open multipart uploads, in order.
    pub fn open_upload_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = lock(&self.state.uploads)
            .values()
            .map(|u| u.key.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Makes every open multipart upload `by` older (as a node that died long ago left it).
    pub fn backdate_uploads(&self, by: Duration) {
        for u in lock(&self.state.uploads).values_mut() {
            u.initiated -= by;
        }
    }

    /// Every request answered so far, as "METHOD what": `PUT object KEY`, `POST uploads KEY`,
    /// `PUT part N KEY`, `POST complete KEY`, `DELETE upload KEY`, `DELETE object KEY`,
    /// `GET object KEY` — or `refused` with the status, for one the bucket refused before
    /// reading what it was.
    pub fn log(&self) -> Vec<String> {
        lock(&self.state.log).clone()
    }

    /// Requests whose signature or payload hash did not check out.
    pub fn bad_signatures(&self) -> u32 {
        self.state.bad_signatures.load(Ordering::Relaxed)
    }

    /// The next `n` requests are answered `503 SlowDown`.
    pub fn unavailable_for(&self, n: u32) {
        self.state.unavailable.store(n, Ordering::Relaxed);
    }

    /// Every request is answered `status` (0: none are).
    pub fn refuse_with(&self, status: u16) {
        self.state.refuse_with.store(status, Ordering::Relaxed);
    }

    /// Part `number` of any upload is answered `403 AccessDenied` (0: none is).
    pub fn refuse_part(&self, number: u32) {
        self.state.refuse_part.store(number, Ordering::Relaxed);
    }

    /// Writes to a key holding `text` are answered `403 AccessDenied` (`None`: none are).
    pub fn refuse_keys_with(&self, text: Option<&str>) {
        *lock(&self.state.refuse_keys_with) = text.map(str::to_string);
    }

    /// The next `n` completions are answered `200 OK` with an `InternalError` in the body, as
    /// S3 does when putting the parts together fails after it has begun its answer.
    pub fn fail_completions_after_ok(&self, n: u32) {
        self.state.fail_after_ok.store(n, Ordering::Relaxed);
    }

    /// Each part is answered `ms` after it arrived (a store far away), so that parts sent at
    /// once are seen at once.
    pub fn delay_parts(&self, ms: u64) {
        self.state.part_delay_ms.store(ms, Ordering::Relaxed);
    }

    /// While `hold`, each `PUT` of an object is stored at once and answered only once this is
    /// called again with `false` (an upload caught between the two).
    pub fn hold_puts(&self, hold: bool) {
        self.state.hold_puts.store(hold, Ordering::SeqCst);
        if !hold {
            self.state.released.notify_waiters();
        }
    }

    /// The most parts that were in the bucket's hands at once.
    pub fn parts_in_flight_max(&self) -> u32 {
        self.state.parts_in_flight_max.load(Ordering::Relaxed)
    }

    /// The smallest part but the last a completion takes (S3's: 5 MiB), so tests can send
    /// small files in parts.
    pub fn set_min_part_bytes(&self, bytes: u64) {
        self.state.min_part_bytes.store(bytes, Ordering::Relaxed);
    }
}

/// ListObjectsV2: the objects under `prefix`, in key order, a page of `max-keys` after the
/// `continuation-token` (here the last key of the page before; opaque to clients, as S3's).
fn list_objects(state: &State, query: &HashMap<String, String>) -> Response<Full<Bytes>> {
    lock(&state.log).push("GET objects".into());
    let get = |n: &str| query.get(n).cloned().unwrap_or_default();
    let (prefix, after) = (get("prefix"), get("continuation-token"));
    let page: usize = get("max-keys").parse().unwrap_or(1_000).clamp(1, 1_000);
    let objects = lock(&state.objects);
    let mut keys: Vec<&String> = objects
        .keys()
        .filter(|k| k.starts_with(&prefix) && (after.is_empty() || **k > after))
        .take(page + 1)
        .collect();
    let truncated = keys.len() > page;
    keys.truncate(page);
    let mut body = format!(
        "<ListBucketResult><Name>{}</Name><Prefix>{}</Prefix><KeyCount>{}</KeyCount>\
         <MaxKeys>{page}</MaxKeys><IsTruncated>{truncated}</IsTruncated>",
        state.name,
        xml_escape(&prefix),
        keys.len()
    );
    if let (true, Some(last)) = (truncated, keys.last()) {
        body.push_str(&format!(
            "<NextContinuationToken>{}</NextContinuationToken>",
            xml_escape(last)
        ));
    }
    for k in &keys {
        body.push_str(&format!(
            "<Contents><Key>{}</Key><Size>{}</Size><StorageClass>STANDARD</StorageClass>\
             </Contents>",
            xml_escape(k),
            objects[*k].len()
        ));
    }
    body.push_str("</ListBucketResult>");
    ok(StatusCode::OK, None, body)
}

/// ListMultipartUploads: the open uploads under `prefix`, ordered by key and id, a page of
/// `max-uploads` after the markers.
fn list_uploads(state: &State, query: &str) -> Response<Full<Bytes>> {
    let query: HashMap<String, String> =
        query_pairs(query).unwrap_or_default().into_iter().collect();
    if query.get("list-type").map(String::as_str) == Some("2") {
        return list_objects(state, &query);
    }
    if !query.contains_key("uploads") {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            "only ?uploads and ?list-type=2",
        );
    }
    lock(&state.log).push("GET uploads".into());
    let get = |n: &str| query.get(n).cloned().unwrap_or_default();
    let (prefix, after) = (get("prefix"), (get("key-marker"), get("upload-id-marker")));
    let page: usize = get("max-uploads").parse().unwrap_or(1_000).clamp(1, 1_000);
    let mut open: Vec<(String, String, SystemTime)> = lock(&state.uploads)
        .iter()
        .filter(|(_, u)| u.key.starts_with(&prefix))
        .map(|(id, u)| (u.key.clone(), id.clone(), u.initiated))
        .filter(|(k, id, _)| after.0.is_empty() || (k, id) > (&after.0, &after.1))
        .collect();
    open.sort();
    let truncated = open.len() > page;
    open.truncate(page);
    let mut body = format!(
        "<ListMultipartUploadsResult><Bucket>{}</Bucket><Prefix>{}</Prefix>\
         <MaxUploads>{page}</MaxUploads><IsTruncated>{truncated}</IsTruncated>",
        state.name,
        xml_escape(&prefix)
    );
    if let (true, Some((k, id, _))) = (truncated, open.last()) {
        body.push_str(&format!(
            "<NextKeyMarker>{}</NextKeyMarker><NextUploadIdMarker>{}</NextUploadIdMarker>",
            xml_escape(k),
            xml_escape(id)
        ));
    }
    for (k, id, initiated) in &open {
        // S3 writes milliseconds.
        let at = crate::sts::format_utc(*initiated).replace('Z', ".000Z");
        body.push_str(&format!(
            "<Upload><Key>{}</Key><UploadId>{}</UploadId><StorageClass>STANDARD</StorageClass>\
             <Initiated>{at}</Initiated></Upload>",
            xml_escape(k),
            xml_escape(id)
        ));
    }
    body.push_str("</ListMultipartUploadsResult>");
    ok(StatusCode::OK, None, body)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn error(status: StatusCode, code: &str, message: &str) -> Response<Full<Bytes>> {
    let body = format!("<Error><Code>{code}</Code><Message>{message}</Message></Error>");
    let mut answer = Response::new(Full::new(Bytes::from(body)));
    *answer.status_mut() = status;
    answer
}

fn ok(status: StatusCode, etag: Option<&str>, body: String) -> Response<Full<Bytes>> {
    let mut answer = Response::new(Full::new(Bytes::from(body)));
    *answer.status_mut() = status;
    if let Some(etag) = etag.and_then(|e| hyper::header::HeaderValue::from_str(e).ok()) {
        answer.headers_mut().insert(hyper::header::ETAG, etag);
    }
    answer
}

/// The request's query as decoded (name, value) pairs.
fn query_pairs(query: &str) -> Option<Vec<(String, String)>> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (n, v) = p.split_once('=').unwrap_or((p, ""));
            Some((percent_decode(n)?, percent_decode(v)?))
        })
        .collect()
}

/// Whether the request is signed as S3 would check it: the payload hash is the body's, and the
/// `Authorization` header is this bucket's key over the request as it came.
fn signed(state: &State, parts: &hyper::http::request::Parts, body: &[u8]) -> bool {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(auth), Some(payload), Some(date)) = (
        header("authorization"),
        header("x-amz-content-sha256"),
        header("x-amz-date"),
    ) else {
        return false;
    };
    if payload != sha256_hex(body) {
        return false;
    }
    let Some(names) = auth
        .split("SignedHeaders=")
        .nth(1)
        .and_then(|s| s.split(',').next())
    else {
        return false;
    };
    let host = parts.uri.authority().map(|a| a.as_str());
    let headers: Vec<(&str, &str)> = names
        .split(';')
        .map(|name| {
            let value = header(name).or(if name == "host" { host } else { None });
            (name, value.unwrap_or(""))
        })
        .collect();
    let Some(pairs) = query_pairs(parts.uri.query().unwrap_or("")) else {
        return false;
    };
    let pairs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let key = lock(&state.key).clone();
    if key.session_token.is_some() && header("x-amz-security-token") != key.session_token.as_deref()
    {
        return false;
    }
    let expected = authorization(
        &crate::object_store::Request {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: &canonical_query(&pairs),
            headers: &headers,
            payload_sha256: payload,
        },
        &key.access_key_id,
        &key.secret_access_key,
        &state.region,
        "s3",
        date,
    );
    names.split(';').any(|n| n == "host") && auth == expected
}

/// Whether a presigned request (SigV4 in its query) checks out: a `GET`, signed with this
/// bucket's key (and session token) over its host alone, not expired. Else S3's code and why.
fn presigned(
    state: &State,
    parts: &hyper::http::request::Parts,
) -> Result<(), (&'static str, &'static str)> {
    let mismatch = ("SignatureDoesNotMatch", "the signature does not check out");
    let pairs = query_pairs(parts.uri.query().unwrap_or("")).ok_or(mismatch)?;
    let get = |name: &str| {
        pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let key = lock(&state.key).clone();
    let (Some(signature), Some(date), Some(expires), Some(credential)) = (
        get("X-Amz-Signature"),
        get("X-Amz-Date"),
        get("X-Amz-Expires").and_then(|e| e.parse::<u64>().ok()),
        get("X-Amz-Credential"),
    ) else {
        return Err(mismatch);
    };
    let day = date.get(..8).unwrap_or("");
    if parts.method != hyper::Method::GET
        || get("X-Amz-Algorithm") != Some("AWS4-HMAC-SHA256")
        || get("X-Amz-SignedHeaders") != Some("host")
        || credential
            != format!(
                "{}/{day}/{}/s3/aws4_request",
                key.access_key_id, state.region
            )
        || !(1..=604_800).contains(&expires)
        || (key.session_token.is_some()
            && get("X-Amz-Security-Token") != key.session_token.as_deref())
    {
        return Err(mismatch);
    }
    let rest: Vec<(&str, &str)> = pairs
        .iter()
        .filter(|(n, _)| n != "X-Amz-Signature")
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let host = parts
        .headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let expected = crate::object_store::presigned_signature(
        "GET",
        parts.uri.path(),
        &canonical_query(&rest),
        host,
        &key.secret_access_key,
        &state.region,
        date,
    );
    if signature != expected {
        return Err(mismatch);
    }
    let signed_at = crate::sts::utc_of_amz_date(date)
        .and_then(|d| crate::sts::parse_utc(&d))
        .ok_or(mismatch)?;
    if SystemTime::now() > signed_at + Duration::from_secs(expires) {
        return Err(("AccessDenied", "Request has expired"));
    }
    Ok(())
}

async fn answer(state: &State, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let Ok(body) = http_body_util::Limited::new(body, BODY_BYTES_MAX)
        .collect()
        .await
        .map(|b| b.to_bytes())
    else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "EntityTooLarge",
            "the body is larger than this bucket takes",
        );
    };
    let log = |what: String| lock(&state.log).push(what);
    let by_query = parts
        .uri
        .query()
        .is_some_and(|q| q.contains("X-Amz-Signature="));
    if by_query {
        // A presigned URL: reads only.
        if let Err((code, message)) = presigned(state, &parts) {
            state.bad_signatures.fetch_add(1, Ordering::Relaxed);
            log("refused 403".into());
            return error(StatusCode::FORBIDDEN, code, message);
        }
    } else if !signed(state, &parts, &body) {
        state.bad_signatures.fetch_add(1, Ordering::Relaxed);
        log("refused 403".into());
        return error(
            StatusCode::FORBIDDEN,
            "SignatureDoesNotMatch",
            "the signature does not check out",
        );
    }
    let refuse = state.refuse_with.load(Ordering::Relaxed);
    if refuse != 0 {
        log(format!("refused {refuse}"));
        let status = StatusCode::from_u16(refuse).unwrap_or(StatusCode::FORBIDDEN);
        return error(status, "AccessDenied", "refused as told");
    }
    if state
        .unavailable
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
    {
        log("refused 503".into());
        return error(StatusCode::SERVICE_UNAVAILABLE, "SlowDown", "try again");
    }
    let prefix = format!("/{}/", state.name);
    if parts.method == hyper::Method::GET && parts.uri.path() == prefix {
        return list_uploads(state, parts.uri.query().unwrap_or(""));
    }
    let Some(key) = parts
        .uri
        .path()
        .strip_prefix(&prefix)
        .and_then(percent_decode)
        .filter(|k| !k.is_empty())
    else {
        return error(
            StatusCode::NOT_FOUND,
            "NoSuchBucket",
            "no such bucket or key",
        );
    };
    let query: HashMap<String, String> = query_pairs(parts.uri.query().unwrap_or(""))
        .unwrap_or_default()
        .into_iter()
        .collect();
    let upload_id = query.get("uploadId");
    let mut created_with: Vec<(String, String)> = parts
        .headers
        .iter()
        .filter(|(n, _)| {
            let n = n.as_str();
            n == "x-amz-storage-class" || n.starts_with("x-amz-server-side-encryption")
        })
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    created_with.sort();
    let refused_key = lock(&state.refuse_keys_with)
        .as_deref()
        .is_some_and(|text| key.contains(text));
    if refused_key && matches!(parts.method.as_str(), "PUT" | "POST") {
        log(format!("refused 403 {key}"));
        return error(StatusCode::FORBIDDEN, "AccessDenied", "this key is refused");
    }
    let etag = |body: &[u8]| format!("\"{}\"", &sha256_hex(body)[..32]);
    match (parts.method.as_str(), upload_id) {
        ("PUT", None) => {
            log(format!("PUT object {key}"));
            let tag = etag(&body);
            lock(&state.created_with).insert(key.clone(), created_with);
            lock(&state.objects).insert(key, body.to_vec());
            loop {
                let released = state.released.notified();
                if !state.hold_puts.load(Ordering::SeqCst) {
                    break;
                }
                released.await;
            }
            ok(StatusCode::OK, Some(&tag), String::new())
        }
        ("POST", None) if query.contains_key("uploads") => {
            log(format!("POST uploads {key}"));
            // An id with characters that must be encoded, as S3's may.
            let n = state.next_upload.fetch_add(1, Ordering::Relaxed);
            let id = format!("up/{n}+x=");
            lock(&state.uploads).insert(
                id.clone(),
                Upload {
                    key: key.clone(),
                    initiated: SystemTime::now(),
                    parts: BTreeMap::new(),
                    created_with,
                },
            );
            ok(
                StatusCode::OK,
                None,
                format!(
                    "<InitiateMultipartUploadResult><Bucket>{}</Bucket><Key>{key}</Key>\
                     <UploadId>{id}</UploadId></InitiateMultipartUploadResult>",
                    state.name
                ),
            )
        }
        ("PUT" | "POST", Some(_)) if !created_with.is_empty() => error(
            StatusCode::BAD_REQUEST,
            "InvalidArgument",
            "storage class and encryption go with the upload's creation, not its parts",
        ),
        ("PUT", Some(id)) => {
            let Some(number) = query
                .get("partNumber")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| (1..=10_000).contains(n))
            else {
                return error(StatusCode::BAD_REQUEST, "InvalidArgument", "partNumber");
            };
            log(format!("PUT part {number} {key}"));
            if state.refuse_part.load(Ordering::Relaxed) == number {
                return error(
                    StatusCode::FORBIDDEN,
                    "AccessDenied",
                    "this part is refused",
                );
            }
            let now = state.parts_in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            state.parts_in_flight_max.fetch_max(now, Ordering::Relaxed);
            let delay = state.part_delay_ms.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            state.parts_in_flight.fetch_sub(1, Ordering::Relaxed);
            let tag = etag(&body);
            match lock(&state.uploads).get_mut(id) {
                Some(u) if u.key == key => {
                    u.parts.insert(number, (tag.clone(), body));
                    ok(StatusCode::OK, Some(&tag), String::new())
                }
                _ => error(StatusCode::NOT_FOUND, "NoSuchUpload", "no such upload"),
            }
        }
        ("POST", Some(id)) => {
            log(format!("POST complete {key}"));
            complete(state, &key, id, &body)
        }
        ("DELETE", Some(id)) => {
            log(format!("DELETE upload {key}"));
            match lock(&state.uploads).remove(id) {
                Some(_) => ok(StatusCode::NO_CONTENT, None, String::new()),
                None => error(StatusCode::NOT_FOUND, "NoSuchUpload", "no such upload"),
            }
        }
        ("DELETE", None) => {
            log(format!("DELETE object {key}"));
            lock(&state.created_with).remove(&key);
            lock(&state.objects).remove(&key);
            ok(StatusCode::NO_CONTENT, None, String::new())
        }
        ("GET", None) => {
            log(format!("GET object {key}"));
            match lock(&state.objects).get(&key) {
                Some(object) => {
                    let mut answer = Response::new(Full::new(Bytes::from(object.clone())));
                    *answer.status_mut() = StatusCode::OK;
                    answer
                }
                None => error(StatusCode::NOT_FOUND, "NoSuchKey", "no such key"),
            }
        }
        _ => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "not a request this bucket takes",
        ),
    }
}

/// `CompleteMultipartUpload`: the parts named, in ascending order, each with its ETag, every
/// one but the last at least the smallest part.
fn complete(state: &State, key: &str, id: &str, body: &[u8]) -> Response<Full<Bytes>> {
    let xml = String::from_utf8_lossy(body);
    let mut named = Vec::new();
    for part in xml.split("<Part>").skip(1) {
        let field = |name: &str| {
            let open = format!("<{name}>");
            let start = part.find(&open)? + open.len();
            let end = start + part[start..].find(&format!("</{name}>"))?;
            Some(part[start..end].replace("&quot;", "\""))
        };
        match (
            field("PartNumber").and_then(|n| n.parse::<u32>().ok()),
            field("ETag"),
        ) {
            (Some(n), Some(tag)) => named.push((n, tag)),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "MalformedXML",
                    "a part without both",
                )
            }
        }
    }
    let mut uploads = lock(&state.uploads);
    let Some(upload) = uploads.get(id).filter(|u| u.key == key) else {
        return error(StatusCode::NOT_FOUND, "NoSuchUpload", "no such upload");
    };
    if named.is_empty() || named.windows(2).any(|w| w[0].0 >= w[1].0) {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidPartOrder",
            "parts out of order",
        );
    }
    let min = state.min_part_bytes.load(Ordering::Relaxed);
    let mut object = Vec::new();
    for (i, (number, tag)) in named.iter().enumerate() {
        let Some((_, data)) = upload.parts.get(number).filter(|(t, _)| t == tag) else {
            return error(
                StatusCode::BAD_REQUEST,
                "InvalidPart",
                "a part missing or changed",
            );
        };
        if i + 1 < named.len() && (data.len() as u64) < min {
            return error(
                StatusCode::BAD_REQUEST,
                "EntityTooSmall",
                "a part is too small",
            );
        }
        object.extend_from_slice(data);
    }
    if state
        .fail_after_ok
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
    {
        // The upload stays open: S3 takes the completion again.
        return ok(
            StatusCode::OK,
            None,
            "<Error><Code>InternalError</Code><Message>try again</Message></Error>".into(),
        );
    }
    let created_with = uploads
        .remove(id)
        .map(|u| u.created_with)
        .unwrap_or_default();
    drop(uploads);
    lock(&state.created_with).insert(key.to_string(), created_with);
    lock(&state.objects).insert(key.to_string(), object);
    ok(
        StatusCode::OK,
        None,
        format!("<CompleteMultipartUploadResult><Key>{key}</Key></CompleteMultipartUploadResult>"),
    )
}
