//! Keys for an EC2 instance's role: read from the metadata service the IMDSv2 way
//! (`TemporaryKeys` of an instance profile, against `fake_imds`, which refuses any read without a session
//! token), kept while they have more than `REFRESH_BEFORE` left and read again after; an
//! instance without a role, and a metadata service that does not answer, named as such.

use std::time::Duration;

use spindle_providers::fake_imds::FakeImds;
use spindle_providers::object_store::{Credentials, UploadError};
use spindle_providers::temporary_keys::{Issuer, TemporaryKeys};

fn profile(url: String) -> TemporaryKeys {
    TemporaryKeys::new(Issuer::InstanceProfile(url))
}

fn keys(id: &str) -> Credentials {
    Credentials {
        access_key_id: id.into(),
        secret_access_key: format!("secret-of-{id}"),
        session_token: Some(format!("token-of-{id}")),
    }
}

#[tokio::test]
async fn the_roles_keys_are_read_with_a_session_token_kept_and_read_again_near_expiry() {
    // Keys valid for 2 minutes: under REFRESH_BEFORE, so every ask reads again.
    let imds = FakeImds::start(Some("gpu-node"), keys("ASIAONE"), Duration::from_secs(120))
        .await
        .unwrap();
    let profile = profile(imds.url());
    let tls = spindle_providers::tls::public_roots();
    let within = Duration::from_secs(10);
    assert_eq!(
        profile.credentials(within, &tls).await.unwrap(),
        keys("ASIAONE")
    );
    assert_eq!((imds.tokens(), imds.key_reads()), (1, 1));
    imds.issue(keys("ASIATWO"), Duration::from_secs(6 * 3600));
    assert_eq!(
        profile.credentials(within, &tls).await.unwrap(),
        keys("ASIATWO")
    );
    assert_eq!(imds.key_reads(), 2, "keys near their expiry read again");
    for _ in 0..3 {
        assert_eq!(
            profile.credentials(within, &tls).await.unwrap(),
            keys("ASIATWO")
        );
    }
    assert_eq!(imds.key_reads(), 2, "keys with hours left kept");
    assert_eq!(imds.refused(), 0, "every read carried its session token");
    // What that count rests on: a read without a token (IMDSv1) is refused.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut v1 = tokio::net::TcpStream::connect(imds.addr).await.unwrap();
    v1.write_all(
        b"GET /latest/meta-data/iam/security-credentials/ HTTP/1.1\r\nhost: imds\r\n\
          connection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    v1.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert_eq!(imds.refused(), 1);
}

#[tokio::test]
async fn an_instance_without_a_role_is_told_so() {
    let imds = FakeImds::start(None, keys("A"), Duration::from_secs(3600))
        .await
        .unwrap();
    let tls = spindle_providers::tls::public_roots();
    let e = profile(imds.url())
        .credentials(Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, UploadError::Credentials(w) if w.contains("no IAM role is attached")),
        "{e}"
    );
}

#[tokio::test]
async fn a_metadata_service_that_does_not_answer_is_named_within_the_timeout() {
    // A socket that takes connections and never answers (a container whose hop limit drops
    // the token's answer looks the same).
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let tls = spindle_providers::tls::public_roots();
    let started = std::time::Instant::now();
    let e = profile(url)
        .credentials(Duration::from_millis(300), &tls)
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by its timeout"
    );
    assert!(
        matches!(&e, UploadError::Credentials(w) if w.contains("no answer from") && w.contains("hop limit")),
        "{e}"
    );
}

/// Keys the metadata service says it could not get (the role's trust policy refuses EC2, say)
/// are an error naming its code, not keys.
#[tokio::test]
async fn an_answer_that_is_not_a_success_is_named() {
    let imds = FakeImds::start(Some("gpu-node"), keys("A"), Duration::from_secs(3600))
        .await
        .unwrap();
    imds.answer_code("AssumeRoleUnauthorizedAccess");
    let tls = spindle_providers::tls::public_roots();
    let e = profile(imds.url())
        .credentials(Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, UploadError::Credentials(w)
            if w.contains("role gpu-node") && w.contains("AssumeRoleUnauthorizedAccess")),
        "{e}"
    );
}
