//! `object_store::upload_file` against the stand-in bucket (`fake_s3`), which checks every
//! request's SigV4 signature and a multipart upload's parts the way S3 does.

use std::time::{Duration, Instant};

use spindle_providers::fake_s3::FakeS3;
use spindle_providers::object_store::{
    create_multipart_upload, list_multipart_uploads, list_objects, presign_get, put_object,
    upload_file, upload_file_until, Plan, UploadError,
};

const PART: u64 = 64 << 10;

async fn bucket() -> FakeS3 {
    let s3 = FakeS3::start("videos", "us-test-1", "AKIDTEST", "secret")
        .await
        .unwrap();
    s3.set_min_part_bytes(PART);
    s3
}

/// A file of `len` bytes that differ from part to part (a part sent twice or out of order
/// would show).
fn file(dir: &tempfile::TempDir, len: usize) -> (std::path::PathBuf, Vec<u8>) {
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    let path = dir.path().join("rendition.mp4");
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// Parts one at a time (their order in the bucket's log is then the file's).
fn plan(attempts: u32) -> Plan {
    Plan {
        part_bytes: PART,
        attempts,
        parts_in_flight: 1,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

async fn upload(
    s3: &FakeS3,
    key: &str,
    path: &std::path::Path,
    plan: &Plan,
) -> Result<String, UploadError> {
    let tls = spindle_providers::tls::public_roots();
    upload_file(&s3.bucket(), key, path, "video/mp4", plan, soon(), &tls).await
}

#[tokio::test]
async fn a_file_up_to_a_part_goes_in_one_put() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = file(&dir, PART as usize);
    let url = upload(&s3, "r/one part.mp4", &path, &plan(1))
        .await
        .unwrap();
    assert_eq!(url, format!("{}/r/one%20part.mp4", s3.url()));
    assert_eq!(s3.object("r/one part.mp4"), Some(data));
    assert_eq!(s3.log(), ["PUT object r/one part.mp4"]);
    assert_eq!(s3.bad_signatures(), 0);
}

/// A larger file goes in parts, read one at a time, put together in order by the store; every
/// request signed (the upload id, which holds `/`, `+` and `=`, encoded as SigV4 signs it).
#[tokio::test]
async fn a_larger_file_goes_in_parts_and_arrives_whole() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = file(&dir, 2 * PART as usize + 1000);
    let key = "renditions/ключ 720p.mp4";
    let url = upload(&s3, key, &path, &plan(1)).await.unwrap();
    assert!(
        url.ends_with("/renditions/%D0%BA%D0%BB%D1%8E%D1%87%20720p.mp4"),
        "{url}"
    );
    assert_eq!(s3.object(key).as_deref(), Some(&data[..]));
    let log = s3.log();
    let expected: Vec<String> = [
        "POST uploads",
        "PUT part 1",
        "PUT part 2",
        "PUT part 3",
        "POST complete",
    ]
    .iter()
    .map(|w| format!("{w} {key}"))
    .collect();
    assert_eq!(log, expected);
    assert_eq!(s3.open_uploads(), 0);
    assert_eq!(s3.bad_signatures(), 0);
}

/// The store's trouble (503s, a completion that fails after its `200`) is tried again, each
/// request on its own; the object is whole.
#[tokio::test]
async fn the_stores_trouble_is_tried_again_request_by_request() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = file(&dir, 3 * PART as usize);
    s3.unavailable_for(2);
    s3.fail_completions_after_ok(1);
    upload(&s3, "k", &path, &plan(3)).await.unwrap();
    assert_eq!(s3.object("k"), Some(data));
    assert_eq!(
        s3.log(),
        [
            "refused 503",
            "refused 503",
            "POST uploads k",
            "PUT part 1 k",
            "PUT part 2 k",
            "PUT part 3 k",
            "POST complete k",
            "POST complete k",
        ]
    );
    assert_eq!(s3.open_uploads(), 0);

    // Tries run out: the error is the store's last answer.
    s3.unavailable_for(2);
    let e = upload(&s3, "k2", &path, &plan(2)).await.unwrap_err();
    assert!(matches!(e, UploadError::Status { status: 503, .. }), "{e}");
    assert_eq!(s3.object("k2"), None);
}

/// A refused part is not tried again, and the upload is aborted: the store keeps none of its
/// parts. The same when the store refuses the parts as too small (S3's 5 MiB rule).
/// Told to stop while a part is in the store's hands (a canceled job), a multipart upload
/// sends no further part and is aborted: the store keeps nothing.
#[tokio::test]
async fn a_stopped_multipart_upload_sends_no_more_parts_and_is_aborted() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = file(&dir, 3 * PART as usize);
    // Part 1's answer held back long enough for the stop to land while it is in flight.
    s3.delay_parts(300);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let tls = spindle_providers::tls::public_roots();
    let (b, plan) = (s3.bucket(), plan(3));
    let upload = upload_file_until(&b, "k", &path, "video/mp4", &plan, soon(), &stop, &tls);
    let stopper = async {
        while !s3.log().iter().any(|l| l == "PUT part 1 k") {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    };
    let (sent, ()) = tokio::join!(upload, stopper);
    let e = sent.unwrap_err();
    assert!(matches!(&e, UploadError::Stopped { .. }), "{e}");
    assert!(!e.is_retryable());
    assert_eq!(
        s3.log(),
        ["POST uploads k", "PUT part 1 k", "DELETE upload k"]
    );
    assert_eq!((s3.open_uploads(), s3.object("k")), (0, None));
}

#[tokio::test]
async fn a_failed_multipart_upload_is_aborted() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = file(&dir, 3 * PART as usize);
    s3.refuse_part(2);
    let e = upload(&s3, "k", &path, &plan(3)).await.unwrap_err();
    assert!(
        matches!(&e, UploadError::Status { status: 403, body, .. } if body.contains("AccessDenied")),
        "{e}"
    );
    assert_eq!(
        s3.log(),
        [
            "POST uploads k",
            "PUT part 1 k",
            "PUT part 2 k",
            "DELETE upload k"
        ]
    );
    assert_eq!((s3.open_uploads(), s3.object("k")), (0, None));

    s3.refuse_part(0);
    s3.set_min_part_bytes(5 << 20);
    let e = upload(&s3, "small", &path, &plan(3)).await.unwrap_err();
    assert!(
        matches!(&e, UploadError::Status { status: 400, body, .. } if body.contains("EntityTooSmall")),
        "{e}"
    );
    assert_eq!(s3.log().last().unwrap(), "DELETE upload small");
    assert_eq!(s3.open_uploads(), 0);
}

/// A file that would need more than S3's 10,000 parts is refused before any request, naming
/// its size and the most the plan takes.
#[tokio::test]
async fn a_file_of_more_parts_than_s3_takes_is_refused_up_front() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = file(&dir, 10_001);
    let tiny = Plan {
        part_bytes: 1,
        attempts: 3,
        parts_in_flight: 4,
    };
    let e = upload(&s3, "k", &path, &tiny).await.unwrap_err();
    assert_eq!(
        e,
        UploadError::TooLarge {
            url: "k".into(),
            bytes: 10_001,
            max: 10_000
        }
    );
    assert!(!e.is_retryable());
    assert!(s3.log().is_empty());
}

/// Wrong credentials: the store refuses the signature, which is not tried again.
#[tokio::test]
async fn a_wrong_secret_is_refused_once() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = file(&dir, 100);
    let mut bucket = s3.bucket();
    bucket.secret_access_key = "not it".into();
    let tls = spindle_providers::tls::public_roots();
    let e = upload_file(&bucket, "k", &path, "video/mp4", &plan(3), soon(), &tls)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, UploadError::Status { status: 403, body, .. } if body.contains("SignatureDoesNotMatch")),
        "{e}"
    );
    assert_eq!(s3.bad_signatures(), 1);
    assert_eq!(s3.log(), ["refused 403"]);
}

/// With a store far away, parts go several at once — never more than the plan's — and the
/// object is still the file, in order; a part refused among them aborts the upload.
#[tokio::test]
async fn parts_go_several_at_once_and_arrive_in_order() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = file(&dir, 7 * PART as usize + 5);
    s3.delay_parts(100);
    let three = Plan {
        parts_in_flight: 3,
        ..plan(1)
    };
    upload(&s3, "k", &path, &three).await.unwrap();
    assert_eq!(s3.object("k"), Some(data));
    assert_eq!(s3.parts_in_flight_max(), 3);
    let log = s3.log();
    let mut parts: Vec<&String> = log.iter().filter(|l| l.starts_with("PUT part")).collect();
    parts.sort();
    parts.dedup();
    assert_eq!(parts.len(), 8, "{log:?}");

    s3.refuse_part(5);
    let e = upload(&s3, "k2", &path, &three).await.unwrap_err();
    assert!(matches!(e, UploadError::Status { status: 403, .. }), "{e}");
    assert!(
        s3.log().iter().any(|l| l == "DELETE upload k2"),
        "not aborted"
    );
    assert_eq!((s3.open_uploads(), s3.object("k2")), (0, None));
}

/// A bucket's object headers (storage class, server-side encryption) go, signed, with every
/// object's creation — its one `PUT`, or its multipart upload's start — and with nothing else.
#[tokio::test]
async fn objects_are_created_with_the_buckets_storage_class_and_encryption() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let mut bucket = s3.bucket();
    let headers = vec![
        (
            "x-amz-server-side-encryption".to_string(),
            "aws:kms".to_string(),
        ),
        (
            "x-amz-server-side-encryption-aws-kms-key-id".to_string(),
            "arn:aws:kms:us-test-1:111122223333:key/k-1".to_string(),
        ),
        ("x-amz-storage-class".to_string(), "STANDARD_IA".to_string()),
    ];
    bucket.object_headers = headers.clone();
    let tls = spindle_providers::tls::public_roots();
    for (key, len) in [("one", 100), ("parts", 2 * PART as usize + 1)] {
        let (path, data) = file(&dir, len);
        upload_file(&bucket, key, &path, "video/mp4", &plan(1), soon(), &tls)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(s3.object(key), Some(data));
        assert_eq!(s3.created_with(key), headers, "{key}");
    }
    assert_eq!(s3.bad_signatures(), 0);
}

/// The multipart uploads a bucket holds open under a prefix, read page by page (S3's markers),
/// bounded by the pages asked for, each with when it was started.
#[tokio::test]
async fn open_uploads_are_listed_page_by_page_within_the_pages_asked() {
    let s3 = bucket().await;
    let tls = spindle_providers::tls::public_roots();
    let within = Duration::from_secs(10);
    let b = s3.bucket();
    let mut started = Vec::new();
    for key in ["r/a", "r/b", "r/b", "r/c", "r/d", "other/e"] {
        let id = create_multipart_upload(&b, key, "video/mp4", within, &tls)
            .await
            .unwrap();
        started.push((key.to_string(), id));
    }
    let before = std::time::SystemTime::now();
    s3.backdate_uploads(Duration::from_secs(3600));
    let (all, more) = list_multipart_uploads(&b, "r/", 2, 10, within, &tls)
        .await
        .unwrap();
    assert!(!more);
    let mut listed: Vec<(String, String)> = all
        .iter()
        .map(|u| (u.key.clone(), u.upload_id.clone()))
        .collect();
    listed.sort();
    let mut expected: Vec<(String, String)> = started
        .iter()
        .filter(|(k, _)| k.starts_with("r/"))
        .cloned()
        .collect();
    expected.sort();
    assert_eq!(listed, expected, "five uploads under r/, two of one key");
    for u in &all {
        let age = before.duration_since(u.initiated).unwrap();
        assert!(
            (3_590..3_610).contains(&age.as_secs()),
            "{u:?} started {age:?} ago"
        );
    }
    assert_eq!(
        s3.log().iter().filter(|l| *l == "GET uploads").count(),
        3,
        "five uploads in pages of two"
    );
    let (first, more) = list_multipart_uploads(&b, "r/", 2, 2, within, &tls)
        .await
        .unwrap();
    assert!(more, "two pages read, more left");
    assert_eq!(first.len(), 4);
}

#[tokio::test]
async fn objects_are_listed_by_prefix_page_by_page_within_the_pages_asked() {
    let s3 = bucket().await;
    let tls = spindle_providers::tls::public_roots();
    let within = Duration::from_secs(10);
    let b = s3.bucket();
    // Keys a URL or an XML answer must encode, and one under another prefix.
    let under = ["r/a b", "r/a&b", "r/c", "r/d/e", "r/\u{e9}"];
    for key in under.iter().chain(&["other/f"]) {
        put_object(
            &b,
            key,
            bytes::Bytes::from_static(b"x"),
            "video/mp4",
            within,
            &tls,
        )
        .await
        .unwrap();
    }
    let (keys, more) = list_objects(&b, "r/", 2, 10, within, &tls).await.unwrap();
    assert!(!more);
    assert_eq!(keys, under, "every key under r/, in byte order");
    let pages = |log: Vec<String>| log.iter().filter(|l| *l == "GET objects").count();
    assert_eq!(pages(s3.log()), 3, "five objects in pages of two");
    let (first, more) = list_objects(&b, "r/", 2, 2, within, &tls).await.unwrap();
    assert!(more, "two pages read, more left");
    assert_eq!(first, under[..4]);
    let (none, more) = list_objects(&b, "nothing/", 1000, 1, within, &tls)
        .await
        .unwrap();
    assert_eq!((none.len(), more), (0, false));
}

/// A plain `GET` of `url`, as a browser or a CDN would send it: the status and the body.
async fn fetch(url: &str) -> (u16, Vec<u8>) {
    use http_body_util::BodyExt;
    let tls = spindle_providers::tls::public_roots();
    let client = spindle_providers::tls::client(&tls, Duration::from_secs(10));
    let request = hyper::Request::get(url)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body.to_vec())
}

/// A presigned `GET` reads the object without keys, until it expires; the bucket refuses one
/// whose signature does not cover what is asked, and one past its time.
#[tokio::test]
async fn a_presigned_url_reads_the_object_until_it_expires() {
    let s3 = bucket().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = file(&dir, 1000);
    upload(&s3, "r/a b.mp4", &path, &plan(1)).await.unwrap();
    let now = std::time::SystemTime::now();
    let url = presign_get(&s3.bucket(), "r/a b.mp4", now, Duration::from_secs(3600)).unwrap();
    assert_eq!(fetch(&url).await, (200, data));
    // Another object with the same signature; a longer life than signed.
    let (status, _) = fetch(&url.replace("a%20b.mp4", "other.mp4")).await;
    assert_eq!(status, 403);
    let (status, _) = fetch(&url.replace("X-Amz-Expires=3600", "X-Amz-Expires=7200")).await;
    assert_eq!(status, 403);
    // Signed two hours ago for one hour.
    let old = presign_get(
        &s3.bucket(),
        "r/a b.mp4",
        now - Duration::from_secs(7200),
        Duration::from_secs(3600),
    )
    .unwrap();
    let (status, body) = fetch(&old).await;
    assert_eq!(status, 403);
    assert!(String::from_utf8_lossy(&body).contains("Request has expired"));
    assert_eq!(s3.bad_signatures(), 3);
}
