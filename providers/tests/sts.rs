//! Keys for a Kubernetes service account: the web identity token traded at STS
//! (`TemporaryKeys` of a web identity, against `fake_sts`), kept while they have more than `REFRESH_BEFORE`
//! left and traded again after.

use std::time::Duration;

use spindle_providers::fake_sts::FakeSts;
use spindle_providers::object_store::{Credentials, UploadError};
use spindle_providers::sts::WebIdentityConfig;
use spindle_providers::temporary_keys::{Issuer, TemporaryKeys};

const ROLE: &str = "arn:aws:iam::111122223333:role/renditions";

fn keys(id: &str) -> Credentials {
    Credentials {
        access_key_id: id.into(),
        secret_access_key: format!("secret-of-{id}"),
        session_token: Some(format!("token-of-{id}")),
    }
}

fn identity(sts: &FakeSts, token_file: &std::path::Path) -> TemporaryKeys {
    TemporaryKeys::new(Issuer::WebIdentity(WebIdentityConfig {
        sts_url: sts.url(),
        role_arn: ROLE.into(),
        token_file: token_file.into(),
        session_name: "spindle".into(),
    }))
}

#[tokio::test]
async fn keys_are_traded_for_kept_and_traded_again_near_their_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    // Kubernetes' projected token, a JWT with characters a form must encode.
    let jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2ln+/=";
    std::fs::write(&token, format!("{jwt}\n")).unwrap();
    // Keys valid for 2 minutes: under REFRESH_BEFORE, so every ask trades again.
    let sts = FakeSts::start(ROLE, jwt, keys("ASIAONE"), Duration::from_secs(120))
        .await
        .unwrap();
    let web = identity(&sts, &token);
    let tls = spindle_providers::tls::public_roots();
    let within = Duration::from_secs(10);
    assert_eq!(
        web.credentials(within, &tls).await.unwrap(),
        keys("ASIAONE")
    );
    assert_eq!(sts.trades(), 1);
    sts.issue(keys("ASIATWO"), Duration::from_secs(3600));
    assert_eq!(
        web.credentials(within, &tls).await.unwrap(),
        keys("ASIATWO")
    );
    assert_eq!(sts.trades(), 2, "keys near their expiry traded again");
    // An hour left: kept.
    for _ in 0..3 {
        assert_eq!(
            web.credentials(within, &tls).await.unwrap(),
            keys("ASIATWO")
        );
    }
    assert_eq!(sts.trades(), 2, "keys with an hour left kept");
}

#[tokio::test]
async fn a_token_sts_refuses_is_an_error_naming_stss_answer() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "not-the-token").unwrap();
    let sts = FakeSts::start(ROLE, "the-token", keys("A"), Duration::from_secs(3600))
        .await
        .unwrap();
    let tls = spindle_providers::tls::public_roots();
    let e = identity(&sts, &token)
        .credentials(Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, UploadError::Credentials(w) if w.contains("400") && w.contains("InvalidIdentityToken")),
        "{e}"
    );
    assert!(!e.is_retryable());
    assert_eq!((sts.trades(), sts.refused()), (0, 1));
    let e = identity(&sts, &dir.path().join("none"))
        .credentials(Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("No such file"), "{e}");
}
