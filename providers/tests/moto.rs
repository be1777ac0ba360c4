//! The uploads against an S3 of another hand: moto's S3 server (`moto_server`, from PyPI, as
//! `scripts/test-all` installs it; `MOTO_SERVER` names it, else it is looked for on `PATH`).
//! `fake_s3` checks what spindle sends against spindle's own reading of S3; moto checks the
//! same requests against its own — the query of each multipart step, the completion's XML, the
//! part ETags it hands out, S3's smallest part — and serves the objects back. (It does not
//! check signatures; `object_store`'s tests reproduce AWS's published ones.)

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use spindle_providers::object_store::{
    abort_multipart_upload, create_multipart_upload, list_multipart_uploads, list_objects,
    upload_file, Bucket, Plan, UploadError, PART_BYTES_MIN,
};

struct Moto {
    child: Child,
    base: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const KEY_ID: &str = "AKIDSPINDLE";
const SECRET: &str = "secret";

/// An HTTP request without a body, signed as the uploads are (moto refuses an anonymous read
/// of an object put with a `PUT`): (status, headers, body).
async fn call(method: &str, url: &str) -> Result<(u16, hyper::HeaderMap, Bytes), String> {
    use spindle_providers::object_store::{amz_date, authorization, sha256_hex, Request};
    let client = spindle_providers::tls::client(
        &spindle_providers::tls::public_roots(),
        Duration::from_secs(5),
    );
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri.authority().map(|a| a.to_string()).unwrap_or_default();
    let (empty, date) = (sha256_hex(b""), amz_date(std::time::SystemTime::now()));
    let headers = [
        ("host", host.as_str()),
        ("x-amz-content-sha256", empty.as_str()),
        ("x-amz-date", date.as_str()),
    ];
    let auth = authorization(
        &Request {
            method,
            path: uri.path(),
            query: uri.query().unwrap_or(""),
            headers: &headers,
            payload_sha256: &empty,
        },
        KEY_ID,
        SECRET,
        "us-east-1",
        "s3",
        &date,
    );
    let mut request = hyper::Request::builder().method(method).uri(uri.clone());
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request
        .header("authorization", auth)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, headers, body))
}

/// moto's server on a free loopback port, answering (within 60 s), with bucket `videos`.
async fn moto() -> Moto {
    let exe = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(&exe)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{exe}: {e} (install it: python3 -m pip install 'moto[server]==5.2.1')")
        });
    let moto = Moto {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call("PUT", &format!("{}/videos", moto.base)).await {
            Ok((200, _, _)) => return moto,
            Ok((status, _, body)) => panic!("creating the bucket: {status} {body:?}"),
            Err(e) if Instant::now() > deadline => panic!("moto did not answer in 60 s: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_are_taken_by_motos_s3_and_read_back_whole() {
    let moto = moto().await;
    let bucket = Bucket {
        url: format!("{}/videos", moto.base),
        region: "us-east-1".into(),
        access_key_id: KEY_ID.into(),
        secret_access_key: SECRET.into(),
        session_token: None,
        object_headers: Vec::new(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rendition.mp4");
    let data: Vec<u8> = (0..(12usize << 20) + 77)
        .map(|i| (i * 31 + i / 4096) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let tls = spindle_providers::tls::public_roots();
    let soon = || Instant::now() + Duration::from_secs(60);
    let plan = |part_bytes: u64| Plan {
        part_bytes,
        attempts: 1,
        parts_in_flight: 2,
    };

    // One PUT (the file under a part), then three parts of S3's smallest size, two at once; a
    // key with a space and non-ASCII letters.
    for (key, part) in [
        ("one put.mp4", 16 << 20),
        ("renditions/три части.mp4", PART_BYTES_MIN),
    ] {
        let url = upload_file(&bucket, key, &path, "video/mp4", &plan(part), soon(), &tls)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        let (status, _, body) = call("GET", &url).await.unwrap();
        assert_eq!(status, 200, "{url}");
        assert!(body[..] == data[..], "{key} read back differs");
    }
    // Listed by prefix, a page of one at a time (moto's continuation tokens, its XML).
    let within = Duration::from_secs(10);
    let (keys, more) = list_objects(&bucket, "", 1, 10, within, &tls)
        .await
        .unwrap();
    assert_eq!(
        (keys, more),
        (
            vec!["one put.mp4".into(), "renditions/три части.mp4".into()],
            false
        )
    );
    let (keys, more) = list_objects(&bucket, "renditions/т", 1_000, 1, within, &tls)
        .await
        .unwrap();
    assert_eq!(
        (keys, more),
        (vec!["renditions/три части.mp4".into()], false)
    );
    let (keys, more) = list_objects(&bucket, "", 1, 1, within, &tls).await.unwrap();
    assert_eq!((keys.len(), more), (1, true));
    // The multipart object's ETag is moto's for three parts.
    let (_, _, listing) = call("GET", &format!("{}/videos", moto.base)).await.unwrap();
    let listing = String::from_utf8_lossy(&listing);
    assert!(
        listing.contains("-3&#34;</ETag>") || listing.contains("-3\"</ETag>"),
        "{listing}"
    );

    // Parts below S3's smallest: moto refuses the completion, and the upload is aborted —
    // none is left open.
    let e = upload_file(
        &bucket,
        "small-parts",
        &path,
        "video/mp4",
        &plan(1 << 20),
        soon(),
        &tls,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, UploadError::Status { status: 400, body, .. } if body.contains("EntityTooSmall")),
        "{e}"
    );
    let (open, _) = list_multipart_uploads(&bucket, "", 1_000, 1, Duration::from_secs(10), &tls)
        .await
        .unwrap();
    assert!(open.is_empty(), "an upload left open: {open:?}");
    // One left open (a node that died mid-upload) is listed and aborted by its id.
    let id = create_multipart_upload(
        &bucket,
        "left/open.mp4",
        "video/mp4",
        Duration::from_secs(10),
        &tls,
    )
    .await
    .unwrap();
    let (open, more) =
        list_multipart_uploads(&bucket, "left/", 1_000, 1, Duration::from_secs(10), &tls)
            .await
            .unwrap();
    assert!(!more);
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(
        (open[0].key.as_str(), open[0].upload_id.as_str()),
        ("left/open.mp4", id.as_str())
    );
    // (moto writes one fixed date, 2010-11-10, as every upload's start: read, not checked.)
    assert!(open[0].initiated < std::time::SystemTime::now());
    abort_multipart_upload(&bucket, "left/open.mp4", &id, Duration::from_secs(10), &tls)
        .await
        .unwrap();
    let (open, _) =
        list_multipart_uploads(&bucket, "left/", 1_000, 1, Duration::from_secs(10), &tls)
            .await
            .unwrap();
    assert!(open.is_empty(), "{open:?}");
    let (status, _, _) = call("GET", &format!("{}/videos/small-parts", moto.base))
        .await
        .unwrap();
    assert_eq!(status, 404);

    // Objects created with a storage class and server-side encryption are read back with
    // them, whether put whole or in parts.
    let mut encrypted = bucket.clone();
    encrypted.object_headers = vec![
        ("x-amz-server-side-encryption".into(), "AES256".into()),
        ("x-amz-storage-class".into(), "STANDARD_IA".into()),
    ];
    for (key, part) in [("ia-one", 16 << 20), ("ia-parts", PART_BYTES_MIN)] {
        let url = upload_file(
            &encrypted,
            key,
            &path,
            "video/mp4",
            &plan(part),
            soon(),
            &tls,
        )
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
        let (status, headers, body) = call("GET", &url).await.unwrap();
        assert_eq!(status, 200, "{url}");
        assert!(body[..] == data[..], "{key} read back differs");
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        assert_eq!(
            (
                header("x-amz-server-side-encryption"),
                header("x-amz-storage-class")
            ),
            (Some("AES256"), Some("STANDARD_IA")),
            "{key}: {headers:?}"
        );
    }
}
