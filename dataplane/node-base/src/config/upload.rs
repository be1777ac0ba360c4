//! `[media.upload]`: the S3-compatible bucket renditions go to, and where its keys come from.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
use spindle_providers::temporary_keys::Issuer;

use super::media::check_url;

/// The longest key prefix of uploaded renditions.
pub const UPLOAD_PREFIX_BYTES_MAX: usize = 256;

/// Tries of one request of an upload (the store's or the network's trouble is tried again).
pub const UPLOAD_ATTEMPTS_MAX: u32 = 10;

/// The largest part of a multipart upload, in MiB: a media worker holds `parts_in_flight` parts
/// in memory while it sends them.
pub const UPLOAD_PART_MB_MAX: u64 = 512;

/// `[media.upload]`: the bucket renditions go to.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadConfig {
    /// The bucket's URL: virtual-hosted (`https://BUCKET.s3.REGION.amazonaws.com`) or
    /// path-style (`http://minio:9000/BUCKET`).
    pub url: String,
    pub region: String,
    /// Default: the `AWS_ACCESS_KEY_ID` environment variable.
    #[serde(default)]
    pub access_key_id: Option<String>,
    /// Default: `AWS_SECRET_ACCESS_KEY`.
    #[serde(default)]
    pub secret_access_key: Option<String>,
    /// Default: `AWS_SESSION_TOKEN`, if set.
    #[serde(default)]
    pub session_token: Option<String>,
    /// An AWS shared credentials file to take the keys from instead, read again for every
    /// job: temporary credentials an agent rotates there (`aws_session_token` with them) are
    /// used as they change, without a restart.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// The credentials file's profile (default: `default`).
    #[serde(default)]
    pub profile: Option<String>,
    /// A role to assume with a Kubernetes service account's web identity token (EKS "IAM
    /// roles for service accounts"), used where no keys are given here or in the environment.
    /// Default: `AWS_ROLE_ARN`.
    #[serde(default)]
    pub role_arn: Option<String>,
    /// The projected token. Default: `AWS_WEB_IDENTITY_TOKEN_FILE`.
    #[serde(default)]
    pub web_identity_token_file: Option<PathBuf>,
    /// STS's URL (default: `https://sts.REGION.amazonaws.com`).
    #[serde(default)]
    pub sts_url: Option<String>,
    /// The EC2 instance's role (its instance profile): keys read from the instance metadata
    /// service (IMDSv2), used where no keys, credentials file or web identity is given. Off by
    /// default: off EC2 nothing answers there.
    #[serde(default)]
    pub instance_profile: bool,
    /// The instance metadata service (default: `http://169.254.169.254`).
    #[serde(default)]
    pub imds_url: Option<String>,
    /// Put before each object's key (`renditions/`, say); the key is then the file's name,
    /// `task-<task>-<attempt token>-<height>p.mp4`.
    #[serde(default)]
    pub prefix: String,
    /// The URL objects are read from, where that is not the bucket's (a CDN in front of it):
    /// results name each object as this, `/`, its key. Default: the bucket's URL.
    #[serde(default)]
    pub public_url: Option<String>,
    /// Name each object in results by a presigned URL good for this many seconds (1..=604800,
    /// SigV4's week) from the job's end, so that a client reads a private bucket without keys;
    /// with temporary keys (STS, an instance profile, a rotated file) such a URL stops working
    /// when they expire. 0 (the default): the object's plain URL. Not with `public_url`.
    #[serde(default)]
    pub presign_s: u64,
    /// Keep the files in `output_dir` after their upload (default: removed).
    #[serde(default)]
    pub keep_local: bool,
    /// Abort, at start and hourly, the multipart uploads of renditions under `prefix` left
    /// open longer than a job may run (a node that died mid-upload; the store bills their
    /// parts until then). Needs `s3:ListBucketMultipartUploads` and `s3:AbortMultipartUpload`;
    /// turn it off where a lifecycle rule does this instead. Default: on.
    #[serde(default = "default_sweep_uploads")]
    pub sweep_uploads: bool,
    /// Tries of each request (1..=10); between them 0.5 s, doubling, within the job's timeout.
    #[serde(default = "default_upload_attempts")]
    pub attempts: u32,
    /// A rendition up to this many MiB goes in one `PUT`; a larger one as a multipart upload
    /// of parts this size (5..=512; S3's smallest part is 5 MiB, and it takes at most 10,000
    /// parts: 160 GiB at the default 16).
    #[serde(default = "default_upload_part_mb")]
    pub part_mb: u64,
    /// Parts of one multipart upload sent at once (1..=16): a worker holds up to this many
    /// parts in memory; more hide a far store's latency.
    #[serde(default = "default_upload_parts_in_flight")]
    pub parts_in_flight: usize,
    /// The objects' storage class (`x-amz-storage-class`: `STANDARD_IA`, `INTELLIGENT_TIERING`,
    /// …; default: the bucket's).
    #[serde(default)]
    pub storage_class: Option<String>,
    /// Server-side encryption of the objects (`x-amz-server-side-encryption`): `AES256`,
    /// `aws:kms` or `aws:kms:dsse` (default: the bucket's).
    #[serde(default)]
    pub server_side_encryption: Option<String>,
    /// The KMS key of `aws:kms` encryption (its id or ARN; default: the account's S3 key).
    #[serde(default)]
    pub sse_kms_key_id: Option<String>,
    /// PEM certificates of a private CA the store's `https://` certificate may chain to,
    /// beside the public web's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for UploadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadConfig")
            .field("url", &self.url)
            .field("region", &self.region)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn default_upload_attempts() -> u32 {
    3
}

fn default_sweep_uploads() -> bool {
    true
}

fn default_upload_part_mb() -> u64 {
    16
}

fn default_upload_parts_in_flight() -> usize {
    4
}

/// The most parts of one upload sent at once.
pub const UPLOAD_PARTS_IN_FLIGHT_MAX: usize = 16;

/// Where an upload's keys come from.
#[derive(Debug, Clone, PartialEq)]
pub enum KeySource {
    /// A credentials file and its profile, read again for every job.
    File(PathBuf, String),
    /// Keys given in the configuration or the environment.
    Keys(spindle_providers::object_store::Credentials),
    /// Temporary keys from their issuer (STS for a web identity token, the metadata service
    /// for the instance's role), again as they near expiry.
    Temporary(Issuer),
}

impl UploadConfig {
    /// Where the keys come from, in this order: the credentials file, keys given here or in
    /// the environment, a web identity (a role and a token file, here or in the environment),
    /// the instance profile where `instance_profile` is set; an error names what is missing
    /// or wrong.
    pub fn key_source(&self) -> anyhow::Result<KeySource> {
        if let Some(path) = &self.credentials_file {
            spindle_providers::object_store::credentials_from_file(path, self.profile())
                .map_err(|e| anyhow::anyhow!("media.upload.credentials_file: {e}"))?;
            return Ok(KeySource::File(path.clone(), self.profile().to_string()));
        }
        if let Some(keys) = self.keys()? {
            return Ok(KeySource::Keys(keys));
        }
        let from_env = |var: &str| std::env::var(var).ok().filter(|v| !v.is_empty());
        let role_arn = self.role_arn.clone().or_else(|| from_env("AWS_ROLE_ARN"));
        let token_file = self
            .web_identity_token_file
            .clone()
            .or_else(|| from_env("AWS_WEB_IDENTITY_TOKEN_FILE").map(PathBuf::from));
        let (Some(role_arn), Some(token_file)) = (role_arn, token_file) else {
            if self.instance_profile {
                return Ok(KeySource::Temporary(Issuer::InstanceProfile(
                    self.imds_url
                        .clone()
                        .unwrap_or_else(|| spindle_providers::imds::IMDS_URL.into()),
                )));
            }
            anyhow::bail!(
                "media.upload has no keys: set access_key_id and secret_access_key (or \
                 AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), credentials_file, role_arn and \
                 web_identity_token_file (or AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE), or \
                 instance_profile = true"
            );
        };
        std::fs::metadata(&token_file).map_err(|e| {
            anyhow::anyhow!(
                "media.upload.web_identity_token_file: {}: {e}",
                token_file.display()
            )
        })?;
        Ok(KeySource::Temporary(Issuer::WebIdentity(
            spindle_providers::sts::WebIdentityConfig {
                sts_url: self
                    .sts_url
                    .clone()
                    .unwrap_or_else(|| format!("https://sts.{}.amazonaws.com", self.region)),
                role_arn,
                token_file,
                session_name: "spindle".into(),
            },
        )))
    }

    /// The bucket, with the keys as they are at load (none yet for a web identity: they are
    /// traded for per job).
    pub fn bucket(&self) -> anyhow::Result<spindle_providers::object_store::Bucket> {
        let keys = match self.key_source()? {
            KeySource::File(path, profile) => {
                spindle_providers::object_store::credentials_from_file(&path, &profile)?
            }
            KeySource::Keys(keys) => keys,
            KeySource::Temporary(_) => spindle_providers::object_store::Credentials {
                access_key_id: String::new(),
                secret_access_key: String::new(),
                session_token: None,
            },
        };
        let spindle_providers::object_store::Credentials {
            access_key_id,
            secret_access_key,
            session_token,
        } = keys;
        let object_headers = [
            ("x-amz-server-side-encryption", &self.server_side_encryption),
            (
                "x-amz-server-side-encryption-aws-kms-key-id",
                &self.sse_kms_key_id,
            ),
            ("x-amz-storage-class", &self.storage_class),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name.to_string(), value.clone()?)))
        .collect();
        Ok(spindle_providers::object_store::Bucket {
            url: self.url.trim_end_matches('/').to_string(),
            region: self.region.clone(),
            access_key_id,
            secret_access_key,
            session_token,
            object_headers,
        })
    }

    fn profile(&self) -> &str {
        self.profile.as_deref().unwrap_or("default")
    }

    /// The keys given here or in the environment: none when neither is given, an error when
    /// only one half of a pair is.
    fn keys(&self) -> anyhow::Result<Option<spindle_providers::object_store::Credentials>> {
        let from_env = |given: &Option<String>, var: &str| {
            given
                .clone()
                .or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()))
        };
        let id = from_env(&self.access_key_id, "AWS_ACCESS_KEY_ID");
        let secret = from_env(&self.secret_access_key, "AWS_SECRET_ACCESS_KEY");
        match (id, secret) {
            (None, None) => Ok(None),
            (Some(access_key_id), Some(secret_access_key)) => {
                Ok(Some(spindle_providers::object_store::Credentials {
                    access_key_id,
                    secret_access_key,
                    session_token: from_env(&self.session_token, "AWS_SESSION_TOKEN"),
                }))
            }
            (Some(_), None) => anyhow::bail!(
                "media.upload.secret_access_key is not set (nor AWS_SECRET_ACCESS_KEY)"
            ),
            (None, Some(_)) => {
                anyhow::bail!("media.upload.access_key_id is not set (nor AWS_ACCESS_KEY_ID)")
            }
        }
    }

    /// The roots the store's `https://` certificate is checked against.
    pub fn tls(&self) -> anyhow::Result<Arc<spindle_providers::tls::ClientConfig>> {
        spindle_providers::tls::roots_with(self.ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("media.upload.ca_file: {e}"))
    }

    pub(crate) fn check(&self) -> anyhow::Result<()> {
        check_url("media.upload.url", &self.url)?;
        anyhow::ensure!(
            !self.region.is_empty() && self.region.len() <= 64,
            "media.upload.region must be 1..=64 bytes"
        );
        anyhow::ensure!(
            self.presign_s <= spindle_providers::object_store::PRESIGN_MAX.as_secs(),
            "media.upload.presign_s must be 0..={} (SigV4's longest: a week)",
            spindle_providers::object_store::PRESIGN_MAX.as_secs()
        );
        anyhow::ensure!(
            self.presign_s == 0 || self.public_url.is_none(),
            "media.upload: presign_s (objects read from the bucket by a signed URL) or \
             public_url (read from elsewhere), not both"
        );
        if let Some(url) = &self.public_url {
            check_url("media.upload.public_url", url)?;
        }
        anyhow::ensure!(
            self.prefix.len() <= UPLOAD_PREFIX_BYTES_MAX,
            "media.upload.prefix must be at most {UPLOAD_PREFIX_BYTES_MAX} bytes"
        );
        anyhow::ensure!(
            (1..=UPLOAD_ATTEMPTS_MAX).contains(&self.attempts),
            "media.upload.attempts must be 1..={UPLOAD_ATTEMPTS_MAX}"
        );
        let min = spindle_providers::object_store::PART_BYTES_MIN >> 20;
        anyhow::ensure!(
            (min..=UPLOAD_PART_MB_MAX).contains(&self.part_mb),
            "media.upload.part_mb must be {min}..={UPLOAD_PART_MB_MAX}"
        );
        anyhow::ensure!(
            (1..=UPLOAD_PARTS_IN_FLIGHT_MAX).contains(&self.parts_in_flight),
            "media.upload.parts_in_flight must be 1..={UPLOAD_PARTS_IN_FLIGHT_MAX}"
        );
        if let Some(class) = &self.storage_class {
            anyhow::ensure!(
                (1..=32).contains(&class.len())
                    && class
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
                "media.upload.storage_class must be 1..=32 of A-Z, 0-9 and _ (STANDARD_IA, …), \
                 not {class:?}"
            );
        }
        if let Some(sse) = &self.server_side_encryption {
            anyhow::ensure!(
                ["AES256", "aws:kms", "aws:kms:dsse"].contains(&sse.as_str()),
                "media.upload.server_side_encryption must be AES256, aws:kms or aws:kms:dsse, \
                 not {sse:?}"
            );
        }
        if let Some(key) = &self.sse_kms_key_id {
            anyhow::ensure!(
                self.server_side_encryption
                    .as_deref()
                    .is_some_and(|s| s.starts_with("aws:kms")),
                "media.upload.sse_kms_key_id needs server_side_encryption = \"aws:kms\" (or \
                 \"aws:kms:dsse\")"
            );
            anyhow::ensure!(
                (1..=2048).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic()),
                "media.upload.sse_kms_key_id must be 1..=2048 printable ASCII bytes"
            );
        }
        if let Some(url) = &self.sts_url {
            check_url("media.upload.sts_url", url)?;
        }
        if let Some(url) = &self.imds_url {
            check_url("media.upload.imds_url", url)?;
            anyhow::ensure!(
                self.instance_profile,
                "media.upload.imds_url is where instance_profile's keys are read, and \
                 instance_profile is not set"
            );
        }
        if self.credentials_file.is_some() {
            anyhow::ensure!(
                self.access_key_id.is_none()
                    && self.secret_access_key.is_none()
                    && self.session_token.is_none(),
                "media.upload: credentials_file or access_key_id / secret_access_key / \
                 session_token, not both"
            );
        } else {
            anyhow::ensure!(
                self.profile.is_none(),
                "media.upload.profile names a profile of credentials_file, which is not set"
            );
        }
        self.bucket()?;
        self.tls()?;
        Ok(())
    }
}
