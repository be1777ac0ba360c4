//! Temporary AWS keys: fetched from where they are issued — STS for a web identity
//! ([`crate::sts`]), the instance metadata service for an EC2 instance's role
//! ([`crate::imds`]) — held, and fetched again when they have [`REFRESH_BEFORE`] left.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::object_store::{Credentials, UploadError};

/// Keys are fetched again when they have this little left.
pub const REFRESH_BEFORE: Duration = Duration::from_secs(300);

/// Where temporary keys are issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issuer {
    /// A Kubernetes service account's web identity token, traded at STS for a role's keys.
    WebIdentity(crate::sts::WebIdentityConfig),
    /// The EC2 instance's role, its keys read from the metadata service at this URL
    /// ([`crate::imds::IMDS_URL`] on EC2).
    InstanceProfile(String),
}

impl Issuer {
    /// New keys from the issuer, and when they expire.
    async fn fetch(
        &self,
        timeout: Duration,
        tls: &rustls::ClientConfig,
    ) -> Result<(Credentials, SystemTime), UploadError> {
        match self {
            Issuer::WebIdentity(config) => {
                crate::sts::assume_role_with_web_identity(config, timeout, tls).await
            }
            Issuer::InstanceProfile(url) => {
                crate::imds::instance_credentials(url, timeout, tls).await
            }
        }
    }
}

/// An issuer and the keys it last issued. Shared (behind an `Arc`) by everything that signs
/// with them, so one fetch serves all.
pub struct TemporaryKeys {
    issuer: Issuer,
    held: Mutex<Option<(Credentials, SystemTime)>>,
}

impl TemporaryKeys {
    pub fn new(issuer: Issuer) -> TemporaryKeys {
        TemporaryKeys {
            issuer,
            held: Mutex::new(None),
        }
    }

    /// Keys with more than [`REFRESH_BEFORE`] left: those held, or new ones from the issuer.
    /// Callers at once may each fetch; the last one's stay.
    pub async fn credentials(
        &self,
        timeout: Duration,
        tls: &rustls::ClientConfig,
    ) -> Result<Credentials, UploadError> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some((keys, expires)) = held {
            if SystemTime::now() + REFRESH_BEFORE < expires {
                return Ok(keys);
            }
        }
        let (keys, expires) = self.issuer.fetch(timeout, tls).await?;
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some((keys.clone(), expires));
        Ok(keys)
    }
}
