//! What a media job can fail with: each error names the problem and says whether a retry could
//! help.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    /// The input is not media we can read: corrupt, truncated, or no video stream. Never retried.
    #[error("unreadable input {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    /// The input's video cannot be decoded or the rendition cannot be encoded here.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the job was canceled")]
    Canceled,
    #[error("the job ran past its deadline of {0:?}")]
    TimedOut(std::time::Duration),
    /// The output grew beyond the job's temp-disk quota.
    #[error("output exceeded its quota of {quota_bytes} bytes")]
    QuotaExceeded { quota_bytes: u64 },
    /// A GPU engine the job was placed on could not be used (no driver, no such device, the
    /// engine refused the session). The same job can run on the CPU.
    #[error("GPU {device}: {reason}")]
    Hardware { device: u32, reason: String },
    /// An FFmpeg call failed mid-job (the message is FFmpeg's).
    #[error("ffmpeg: {0}")]
    Ffmpeg(String),
}

impl MediaError {
    /// Whether running the same job again could succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            MediaError::Io { .. }
                | MediaError::TimedOut(_)
                | MediaError::Ffmpeg(_)
                | MediaError::Hardware { .. }
        )
    }
}

pub(crate) fn ff(e: ffmpeg_next::Error) -> MediaError {
    MediaError::Ffmpeg(e.to_string())
}
