//! `[media.upload]`: renditions put into an S3-compatible bucket once made — the section's
//! configuration and its checks, and the puts (`spindle_providers::object_store`: one `PUT` or
//! a multipart upload per rendition), which delete what a failed job already put.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_core::{FencingToken, TaskId};
use spindle_providers::temporary_keys::TemporaryKeys;

pub use spindle_node_base::config::{
    KeySource, UploadConfig, UPLOAD_ATTEMPTS_MAX, UPLOAD_PARTS_IN_FLIGHT_MAX, UPLOAD_PART_MB_MAX,
    UPLOAD_PREFIX_BYTES_MAX,
};

use super::{MediaStats, Uploaded, STAGE_UPLOAD};
use spindle_node_base::limits::SWEEP_PAGES_MAX;

/// How long a trade of the web identity at STS, or a read of the instance profile's keys, may
/// take.
const STS_TIMEOUT: Duration = Duration::from_secs(10);

/// An upload's keys, resolved.
#[derive(Clone)]
enum Keys {
    Fixed,
    File(PathBuf, String),
    Temporary(Arc<TemporaryKeys>),
}

/// `[media.upload]`, resolved at start.
#[derive(Clone)]
pub(super) struct Upload {
    bucket: spindle_providers::object_store::Bucket,
    /// Where the keys come from (a file read again per job; the web identity that trades for
    /// them, or the instance profile they are read from: shared by the workers, so one trade
    /// or read serves them all).
    keys: Keys,
    tls: Arc<spindle_providers::tls::ClientConfig>,
    prefix: String,
    /// `public_url` without a trailing `/`.
    public_url: Option<String>,
    /// How long the presigned URLs results name last (none: plain URLs).
    presign: Option<Duration>,
    keep_local: bool,
    plan: spindle_providers::object_store::Plan,
}

impl Upload {
    /// `[media.upload]` resolved: its credentials, roots and plan.
    pub(super) fn resolve(u: &UploadConfig) -> anyhow::Result<Upload> {
        Ok(Upload {
            bucket: u.bucket()?,
            keys: match u.key_source()? {
                KeySource::File(path, profile) => Keys::File(path, profile),
                KeySource::Keys(_) => Keys::Fixed,
                KeySource::Temporary(issuer) => {
                    Keys::Temporary(Arc::new(TemporaryKeys::new(issuer)))
                }
            },
            tls: u.tls()?,
            prefix: u.prefix.clone(),
            presign: (u.presign_s > 0).then(|| Duration::from_secs(u.presign_s)),
            public_url: u
                .public_url
                .as_deref()
                .map(|p| p.trim_end_matches('/').to_string()),
            keep_local: u.keep_local,
            plan: spindle_providers::object_store::Plan {
                part_bytes: u.part_mb << 20,
                attempts: u.attempts,
                parts_in_flight: u.parts_in_flight,
            },
        })
    }

    /// The bucket with the keys as they are now: read again from the credentials file, or
    /// traded for at STS or read from the metadata service as they near expiry, where they
    /// come from one of those.
    fn bucket_now(
        &self,
        rt: &tokio::runtime::Runtime,
    ) -> Result<spindle_providers::object_store::Bucket, spindle_providers::object_store::UploadError>
    {
        let keys = match &self.keys {
            Keys::Fixed => return Ok(self.bucket.clone()),
            Keys::File(file, profile) => {
                spindle_providers::object_store::credentials_from_file(file, profile)?
            }
            Keys::Temporary(keys) => rt.block_on(keys.credentials(STS_TIMEOUT, &self.tls))?,
        };
        let mut bucket = self.bucket.clone();
        bucket.access_key_id = keys.access_key_id;
        bucket.secret_access_key = keys.secret_access_key;
        bucket.session_token = keys.session_token;
        Ok(bucket)
    }

    /// Whether the renditions stay in `output_dir` after their upload.
    pub(super) fn keep_local(&self) -> bool {
        self.keep_local
    }

    /// Aborts this node kind's multipart uploads under the prefix (keys named as renditions
    /// are, `task-…p.mp4`: a bucket shared with others keeps their uploads) that were started
    /// more than `older_than` ago — the parts of an upload whose node died mid-way, which the
    /// store keeps, and bills, until they are aborted. The number aborted.
    pub(super) fn sweep(
        &self,
        rt: &tokio::runtime::Runtime,
        older_than: Duration,
    ) -> Result<u64, spindle_providers::object_store::UploadError> {
        use spindle_providers::object_store::{
            abort_multipart_upload, list_multipart_uploads, LIST_PAGE_MAX,
        };
        let bucket = self.bucket_now(rt)?;
        rt.block_on(async {
            let (open, more) = list_multipart_uploads(
                &bucket,
                &self.prefix,
                LIST_PAGE_MAX,
                SWEEP_PAGES_MAX,
                DELETE_TIMEOUT,
                &self.tls,
            )
            .await?;
            let cutoff = std::time::SystemTime::now() - older_than;
            let mut aborted = 0;
            for u in open
                .iter()
                .filter(|u| u.initiated < cutoff && is_rendition_key(&self.prefix, &u.key))
            {
                match abort_multipart_upload(
                    &bucket,
                    &u.key,
                    &u.upload_id,
                    DELETE_TIMEOUT,
                    &self.tls,
                )
                .await
                {
                    Ok(()) => aborted += 1,
                    Err(e) => tracing::warn!("media: the upload left open of {} stays: {e}", u.key),
                }
            }
            if more {
                tracing::info!(
                    "media: more uploads open under {:?} than one sweep reads; the next sweep \
                     takes the rest",
                    self.prefix
                );
            }
            Ok(aborted)
        })
    }

    /// Deletes what the task's earlier attempts put into the bucket: the renditions under
    /// `prefix` named with the task and a fencing token older than `token` (tokens grow, and
    /// an attempt's report is refused once a newer one exists, so no result names them). An
    /// attempt after the first calls this once its own renditions are in; how many it
    /// deleted. A failure is logged, not the job's: what stays is left to a lifecycle rule.
    pub(super) fn delete_superseded(
        &self,
        rt: &tokio::runtime::Runtime,
        task: TaskId,
        token: FencingToken,
    ) -> u64 {
        let under = format!("{}task-{}-", self.prefix, task.0);
        self.delete_listed(rt, task, &under, |t| t < token)
    }

    /// Deletes the renditions the task's attempt of `token` put (its finish was refused: a
    /// newer attempt holds the task): how many went.
    pub(super) fn delete_attempt(
        &self,
        rt: &tokio::runtime::Runtime,
        task: TaskId,
        token: FencingToken,
    ) -> u64 {
        let under = format!("{}task-{}-{}-", self.prefix, task.0, token.0);
        self.delete_listed(rt, task, &under, |t| t == token)
    }

    /// Lists the keys under `under` (one page: a task's 64 attempts of up to 8 renditions fit)
    /// and deletes the renditions of `task` whose token `which` picks: how many went.
    fn delete_listed(
        &self,
        rt: &tokio::runtime::Runtime,
        task: TaskId,
        under: &str,
        which: impl Fn(FencingToken) -> bool,
    ) -> u64 {
        use spindle_providers::object_store::{list_objects, LIST_PAGE_MAX};
        let listed = self.bucket_now(rt).and_then(|bucket| {
            let keys = rt.block_on(list_objects(
                &bucket,
                under,
                LIST_PAGE_MAX,
                TASK_KEYS_PAGES,
                DELETE_TIMEOUT,
                &self.tls,
            ))?;
            Ok((bucket, keys.0))
        });
        let (bucket, keys) = match listed {
            Ok(listed) => listed,
            Err(e) => {
                tracing::warn!(task = %task, "media: {task}'s renditions under {under} stay: {e}");
                return 0;
            }
        };
        let picked: Vec<String> = keys
            .into_iter()
            .filter(|k| {
                rendition_key(&self.prefix, k).is_some_and(|(t, token)| t == task && which(token))
            })
            .collect();
        delete_keys(rt, &bucket, &self.tls, &picked)
    }

    /// Deletes `keys` (renditions a job put whose result nobody took): how many went.
    pub(super) fn delete(&self, rt: &tokio::runtime::Runtime, keys: &[String]) -> u64 {
        match self.bucket_now(rt) {
            Ok(bucket) => delete_keys(rt, &bucket, &self.tls, keys),
            Err(e) => {
                tracing::warn!("media: {} object(s) stay in the bucket: {e}", keys.len());
                0
            }
        }
    }
}

/// Pages of a task's keys one listing reads: one page of 1,000 holds a task's 64 attempts of
/// up to 8 renditions each.
const TASK_KEYS_PAGES: u32 = 1;
const _: () = assert!(
    spindle_core::limits::ATTEMPTS_MAX * 8
        <= spindle_providers::object_store::LIST_PAGE_MAX * TASK_KEYS_PAGES
);

/// A rendition's key under `prefix`, `task-<task>-<token>-<height>p.mp4`, read: its task and
/// its attempt's fencing token; `None` for any other key.
fn rendition_key(prefix: &str, key: &str) -> Option<(TaskId, FencingToken)> {
    let name = key
        .strip_prefix(prefix)?
        .strip_prefix("task-")?
        .strip_suffix("p.mp4")?;
    // Digits only (`parse` alone would take a `+`); an empty one does not parse.
    let number = |n: &str| {
        n.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| n.parse::<u64>().ok())
            .flatten()
    };
    let mut numbers = name.split('-').map(number);
    match (
        numbers.next(),
        numbers.next(),
        numbers.next(),
        numbers.next(),
    ) {
        (Some(Some(task)), Some(Some(token)), Some(Some(_height)), None) => {
            Some((TaskId(task), FencingToken(token)))
        }
        _ => None,
    }
}

/// Whether `key` is a rendition's under `prefix`.
fn is_rendition_key(prefix: &str, key: &str) -> bool {
    rendition_key(prefix, key).is_some()
}

/// Puts every output into the bucket (each request tried per the plan while its trouble is
/// the store's or the network's), all within `deadline`: their keys and URLs; `None` when
/// `cancel` was set between two of them. When one fails, or on a cancel, those already put are
/// deleted again, so a failed or canceled attempt leaves no objects behind.
pub(super) fn upload_all(
    rt: &tokio::runtime::Runtime,
    upload: &Upload,
    outputs: &[PathBuf],
    deadline: Instant,
    cancel: &std::sync::atomic::AtomicBool,
    stats: &MediaStats,
) -> Result<Option<Vec<Uploaded>>, spindle_providers::object_store::UploadError> {
    let started = Instant::now();
    let uploaded = upload_each(rt, upload, outputs, deadline, cancel);
    stats.time(STAGE_UPLOAD, started);
    if matches!(uploaded, Ok(Some(_))) {
        let bytes: u64 = outputs
            .iter()
            .filter_map(|o| std::fs::metadata(o).ok())
            .map(|m| m.len())
            .sum();
        stats.uploaded_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
    uploaded
}

/// [`upload_all`]'s puts, each in turn; those done deleted again when one fails or a cancel
/// comes between two (or between two parts of one).
fn upload_each(
    rt: &tokio::runtime::Runtime,
    upload: &Upload,
    outputs: &[PathBuf],
    deadline: Instant,
    cancel: &std::sync::atomic::AtomicBool,
) -> Result<Option<Vec<Uploaded>>, spindle_providers::object_store::UploadError> {
    use spindle_providers::object_store::{
        presign_get, upload_file_until, uri_encode, UploadError,
    };
    let bucket = upload.bucket_now(rt)?;
    let mut keys = Vec::with_capacity(outputs.len());
    let mut uploaded = Vec::with_capacity(outputs.len());
    for path in outputs {
        if cancel.load(Ordering::Relaxed) {
            delete_keys(rt, &bucket, &upload.tls, &keys);
            return Ok(None);
        }
        let name = path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let key = format!("{}{name}", upload.prefix);
        let put = upload_file_until(
            &bucket,
            &key,
            path,
            "video/mp4",
            &upload.plan,
            deadline,
            cancel,
            &upload.tls,
        );
        let put = rt.block_on(put);
        if put.is_ok() {
            keys.push(key.clone());
        }
        // Named as readers reach it.
        let named = put.and_then(|url| match (&upload.public_url, upload.presign) {
            (Some(base), _) => Ok(format!("{base}/{}", uri_encode(&key, false))),
            (None, Some(lasts)) => presign_get(&bucket, &key, std::time::SystemTime::now(), lasts),
            (None, None) => Ok(url),
        });
        match named {
            Ok(url) => uploaded.push(Uploaded { key, url }),
            // A cancel in the middle of a multipart upload: aborted, and the rest as below.
            Err(UploadError::Stopped { .. }) => {
                delete_keys(rt, &bucket, &upload.tls, &keys);
                return Ok(None);
            }
            Err(e) => {
                delete_keys(rt, &bucket, &upload.tls, &keys);
                return Err(e);
            }
        }
    }
    Ok(Some(uploaded))
}

/// Deletes `keys` from `bucket`, each within [`DELETE_TIMEOUT`]: how many went. One that
/// fails is logged and stays.
fn delete_keys(
    rt: &tokio::runtime::Runtime,
    bucket: &spindle_providers::object_store::Bucket,
    tls: &spindle_providers::tls::ClientConfig,
    keys: &[String],
) -> u64 {
    let mut deleted = 0;
    for key in keys {
        let gone = spindle_providers::object_store::delete_object(bucket, key, DELETE_TIMEOUT, tls);
        match rt.block_on(gone) {
            Ok(()) => deleted += 1,
            Err(e) => tracing::warn!("media: {key} stays in the bucket: deleting it failed: {e}"),
        }
    }
    deleted
}

/// The time the delete of an object a failed attempt put gets.
const DELETE_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::super::MediaConfig;
    use super::*;
    use spindle_providers::temporary_keys::Issuer;

    #[test]
    fn a_sweep_and_a_later_attempt_take_only_keys_named_as_renditions_are() {
        for (key, task, token) in [
            ("r/task-12-3-720p.mp4", 12, 3),
            ("r/task-1-1-96p.mp4", 1, 1),
        ] {
            assert!(is_rendition_key("r/", key), "{key}");
            assert_eq!(
                rendition_key("r/", key),
                Some((TaskId(task), FencingToken(token))),
                "{key}"
            );
        }
        for key in [
            "r/task-1-2-3-4p.mp4",
            "r/task-+1-3-720p.mp4",
            "r/task-1-99999999999999999999-96p.mp4",
            "task-12-3-720p.mp4",
            "r/backup.tar",
            "r/task-12-3p.mp4",
            "r/task-12-3-720.mp4",
            "r/task-1a-3-720p.mp4",
            "r/task--3-720p.mp4",
            "r/sub/task-12-3-720p.mp4",
        ] {
            assert!(!is_rendition_key("r/", key), "{key}");
        }
    }

    fn checked(text: &str) -> anyhow::Result<()> {
        toml::from_str::<MediaConfig>(text)?.check()
    }

    /// A `[media]` section with an `[upload]` to an S3 bucket with keys, and `rest`.
    fn upload(rest: &str) -> String {
        format!(
            "[upload]\nurl = \"https://b.s3.eu-west-1.amazonaws.com\"\nregion = \"eu-west-1\"\n\
             access_key_id = \"AKID\"\nsecret_access_key = \"s\"\n{rest}"
        )
    }

    /// `[media.upload]`'s credentials are checked at load, each missing or doubled one named.
    #[test]
    fn the_upload_section_is_checked_at_load() {
        checked(&upload("prefix = \"renditions/\"\nattempts = 10\n")).unwrap();
        // Keys from a credentials file, not beside it; a profile only with one.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("credentials");
        std::fs::write(
            &file,
            "[uploads]\naws_access_key_id = ASIA1\naws_secret_access_key = s\n\
             aws_session_token = t\n",
        )
        .unwrap();
        let from_file = |rest: &str| {
            format!(
                "[upload]\nurl = \"https://b.s3.eu-west-1.amazonaws.com\"\n\
                 region = \"eu-west-1\"\ncredentials_file = {:?}\n{rest}",
                file.display().to_string()
            )
        };
        checked(&from_file("profile = \"uploads\"\n")).unwrap();
        let config: MediaConfig = toml::from_str(&from_file("profile = \"uploads\"\n")).unwrap();
        let b = config.upload.unwrap().bucket().unwrap();
        assert_eq!(
            (b.access_key_id.as_str(), b.session_token.as_deref()),
            ("ASIA1", Some("t"))
        );
        let e = checked(&from_file("")).unwrap_err().to_string();
        assert!(
            e.starts_with("media.upload.credentials_file: credentials: ")
                && e.ends_with("no [default] profile"),
            "{e}"
        );
        let e = checked(&from_file(
            "profile = \"uploads\"\naccess_key_id = \"AKID\"\n",
        ))
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "media.upload: credentials_file or access_key_id / secret_access_key / \
             session_token, not both"
        );
        let e = checked(&upload("profile = \"uploads\"\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "media.upload.profile names a profile of credentials_file, which is not set"
        );
    }

    /// Where no keys are given, a web identity (STS in the bucket's region by default) or the
    /// instance profile; half a pair of keys is named, not taken for none.
    #[test]
    fn the_upload_sections_other_key_sources_are_checked_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "a web identity token").unwrap();
        // A web identity where no keys are given: STS in the bucket's region by default.
        let no_keys = |rest: &str| {
            format!(
                "[upload]\nurl = \"https://b.s3.eu-west-1.amazonaws.com\"\n\
                 region = \"eu-west-1\"\n{rest}"
            )
        };
        let web = no_keys(&format!(
            "role_arn = \"arn:aws:iam::1:role/r\"\nweb_identity_token_file = {:?}\n",
            file.display().to_string()
        ));
        checked(&web).unwrap();
        let config: MediaConfig = toml::from_str(&web).unwrap();
        match config.upload.unwrap().key_source().unwrap() {
            KeySource::Temporary(Issuer::WebIdentity(w)) => assert_eq!(
                (w.sts_url.as_str(), w.role_arn.as_str()),
                (
                    "https://sts.eu-west-1.amazonaws.com",
                    "arn:aws:iam::1:role/r"
                )
            ),
            other => panic!("{other:?}"),
        }
        let e = checked(&no_keys(
            "role_arn = \"r\"\nweb_identity_token_file = \"/nonexistent/token\"\n",
        ))
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "media.upload.web_identity_token_file: /nonexistent/token: No such file or directory \
             (os error 2)"
        );
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
            && std::env::var_os("AWS_ROLE_ARN").is_none()
        {
            let e = checked(&no_keys("")).unwrap_err().to_string();
            assert!(
                e.starts_with("media.upload has no keys: set access_key_id")
                    && e.ends_with("or instance_profile = true"),
                "{e}"
            );
            // The instance profile, last: the metadata service's usual address by default.
            let config: MediaConfig = toml::from_str(&no_keys(
                "instance_profile = true
",
            ))
            .unwrap();
            assert_eq!(
                config.upload.unwrap().key_source().unwrap(),
                KeySource::Temporary(Issuer::InstanceProfile("http://169.254.169.254".into()))
            );
            checked(&no_keys(
                "instance_profile = true
imds_url = \"http://127.0.0.1:1338\"\n",
            ))
            .unwrap();
        }
        let e = checked(&no_keys("imds_url = \"http://127.0.0.1:1338\"\n"))
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("and instance_profile is not set"), "{e}");
        let e = checked(&no_keys(
            "instance_profile = true\nimds_url = \"file:///x\"\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("media.upload.imds_url must be"), "{e}");
        // Half a pair of keys is named, not taken for none.
        if std::env::var_os("AWS_SECRET_ACCESS_KEY").is_none() {
            let e = checked(&no_keys("access_key_id = \"AKID\"\n"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                "media.upload.secret_access_key is not set (nor AWS_SECRET_ACCESS_KEY)"
            );
        }
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
            let e = checked(&no_keys("secret_access_key = \"s\"\n"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                "media.upload.access_key_id is not set (nor AWS_ACCESS_KEY_ID)"
            );
        }
    }

    /// `[media.upload]`'s storage class and encryption become the objects' headers, and its
    /// bounds are checked at load, each named.
    #[test]
    fn the_upload_sections_headers_and_bounds_are_checked_at_load() {
        // Storage class and encryption become the headers objects are created with.
        let kms = upload(
            "storage_class = \"STANDARD_IA\"\nserver_side_encryption = \"aws:kms\"\n\
             sse_kms_key_id = \"arn:aws:kms:eu-west-1:111122223333:key/k\"\n",
        );
        checked(&kms).unwrap();
        let config: MediaConfig = toml::from_str(&kms).unwrap();
        let headers = config.upload.unwrap().bucket().unwrap().object_headers;
        assert_eq!(
            headers,
            [
                ("x-amz-server-side-encryption", "aws:kms"),
                (
                    "x-amz-server-side-encryption-aws-kms-key-id",
                    "arn:aws:kms:eu-west-1:111122223333:key/k"
                ),
                ("x-amz-storage-class", "STANDARD_IA"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        let config: MediaConfig = toml::from_str(&upload("")).unwrap();
        let u = config.upload.unwrap();
        assert_eq!(
            (
                u.attempts,
                u.keep_local,
                u.prefix.as_str(),
                u.part_mb,
                u.parts_in_flight
            ),
            (3, false, "", 16, 4)
        );
        // The secret is not in the configuration's debug form (logs).
        assert!(!format!("{u:?}").contains("secret"), "{u:?}");
        for (rest, why) in [
            ("attempts = 0\n", "media.upload.attempts must be 1..=10"),
            ("attempts = 11\n", "media.upload.attempts must be 1..=10"),
            ("part_mb = 4\n", "media.upload.part_mb must be 5..=512"),
            ("part_mb = 513\n", "media.upload.part_mb must be 5..=512"),
            (
                "storage_class = \"standard ia\"\n",
                "media.upload.storage_class must be 1..=32 of A-Z, 0-9 and _ (STANDARD_IA, …), \
                 not \"standard ia\"",
            ),
            (
                "server_side_encryption = \"rot13\"\n",
                "media.upload.server_side_encryption must be AES256, aws:kms or aws:kms:dsse, \
                 not \"rot13\"",
            ),
            (
                "server_side_encryption = \"AES256\"\nsse_kms_key_id = \"k\"\n",
                "media.upload.sse_kms_key_id needs server_side_encryption = \"aws:kms\" (or \
                 \"aws:kms:dsse\")",
            ),
            (
                "parts_in_flight = 0\n",
                "media.upload.parts_in_flight must be 1..=16",
            ),
            (
                "parts_in_flight = 17\n",
                "media.upload.parts_in_flight must be 1..=16",
            ),
            (
                &format!("prefix = \"{}\"\n", "p".repeat(UPLOAD_PREFIX_BYTES_MAX + 1)),
                "media.upload.prefix must be at most 256 bytes",
            ),
            (
                "ca_file = \"/nonexistent/ca.pem\"\n",
                "media.upload.ca_file: /nonexistent/ca.pem: No such file or directory (os error 2)",
            ),
        ] {
            let e = checked(&upload(rest)).unwrap_err().to_string();
            assert_eq!(e, why, "{rest}");
        }
        let e = checked(&upload("").replace("https://", "ftp://"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("media.upload.url must be"), "{e}");
        checked(&upload("public_url = \"https://cdn.example.com/r/\"\n")).unwrap();
        checked(&upload("presign_s = 604800\n")).unwrap();
        let e = checked(&upload("presign_s = 604801\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("media.upload.presign_s must be 0..=604800"),
            "{e}"
        );
        let e = checked(&upload(
            "presign_s = 3600\npublic_url = \"https://cdn.example.com/r/\"\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.ends_with("not both"), "{e}");
        let e = checked(&upload("public_url = \"cdn.example.com\"\n"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("media.upload.public_url must be"), "{e}");
        let e = checked(&upload("").replace("region = \"eu-west-1\"", "region = \"\""))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "media.upload.region must be 1..=64 bytes");
    }
}
