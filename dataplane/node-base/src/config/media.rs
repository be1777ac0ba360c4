//! `[media]`: the media stage's workers, outputs and what it may fetch.

use std::path::PathBuf;

use serde::Deserialize;

use super::upload::UploadConfig;

/// The longest `media.output_url`: a result names up to 8 renditions by path and by URL within
/// the store's bound on a result.
pub const OUTPUT_URL_BYTES_MAX: usize = 256;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MediaConfig {
    /// Worker threads (each job runs on one, with one decoder and one encoder thread).
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Where outputs go (one file per task); default: the system temp dir.
    #[serde(default)]
    pub output_dir: Option<PathBuf>,
    /// The URL `output_dir` is served under (a CDN, or an HTTP server in front of a volume the
    /// platform shares): a task's result then also names each rendition by URL (`urls`), which
    /// a client elsewhere can fetch; without it, only by path on this node.
    #[serde(default)]
    pub output_url: Option<String>,
    /// Bytes one job's output may take.
    #[serde(default = "default_quota_mb")]
    pub quota_mb: u64,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// The ladder: one rendition per height (each width follows the input's aspect), made in
    /// this order within the job.
    #[serde(default = "default_heights")]
    pub renditions: Vec<u32>,
    /// What to do when the probe finds more than the task declared (longer, or more pixels):
    /// `correct` charges what the video really is, `reject` fails the task.
    #[serde(default)]
    pub declaration: DeclarationPolicy,
    /// What to assume where NVML is absent; CPU units default to two per worker.
    #[serde(default)]
    pub declared: Option<spindle_gpu::Declared>,
    /// Renditions put into an S3-compatible bucket once made (`[media.upload]`): a task's
    /// result then names them by their objects' URLs.
    #[serde(default)]
    pub upload: Option<UploadConfig>,
    /// The hosts (`host` or `host:port`) a provider's video may be fetched from; empty: any.
    /// Whatever it lists, link-local addresses (the clouds' metadata services), unspecified,
    /// multicast and broadcast ones are never fetched from (`spindle_providers::sources`).
    #[serde(default)]
    pub fetch_hosts: Vec<String>,
    /// The folder a `file://` video may be read from (the whole path, resolved, must be under
    /// it); none: `file://` URLs are refused.
    #[serde(default)]
    pub fetch_root: Option<PathBuf>,
}

/// `url`, named `key` in the error, is an `http://` or `https://` URL of at most
/// [`OUTPUT_URL_BYTES_MAX`] bytes without spaces.
pub(crate) fn check_url(key: &str, url: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        spindle_providers::tls::is_http_url(url)
            && url.len() <= OUTPUT_URL_BYTES_MAX
            && !url.contains(char::is_whitespace),
        "{key} must be an http:// or https:// URL of at most {OUTPUT_URL_BYTES_MAX} bytes \
         without spaces, not {url:?}"
    );
    Ok(())
}

fn default_workers() -> usize {
    2
}

fn default_quota_mb() -> u64 {
    2_048
}

fn default_timeout_ms() -> u64 {
    600_000
}

fn default_heights() -> Vec<u32> {
    vec![720]
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeclarationPolicy {
    #[default]
    Correct,
    Reject,
}

impl MediaConfig {
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=256).contains(&self.workers),
            "media.workers must be 1..=256"
        );
        anyhow::ensure!(
            (1..=1_000_000).contains(&self.quota_mb),
            "media.quota_mb must be 1..=1000000"
        );
        anyhow::ensure!(
            (1_000..=86_400_000).contains(&self.timeout_ms),
            "media.timeout_ms must be 1000..=86400000"
        );
        anyhow::ensure!(
            !self.renditions.is_empty()
                && self.renditions.len() <= 8
                && self.renditions.iter().all(|h| (2..=4_320).contains(h)),
            "media.renditions must hold 1..=8 heights of 2..=4320"
        );
        if let Some(url) = &self.output_url {
            check_url("media.output_url", url)?;
        }
        if let Some(u) = &self.upload {
            u.check()?;
        }
        Ok(())
    }
}
