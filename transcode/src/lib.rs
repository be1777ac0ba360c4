//! The in-process media stage: probe and transcode with ffmpeg-next against the system's FFmpeg.
//! Every call here blocks; the node runs them on media worker threads, never on a shard.

pub mod error;
mod hw;
pub mod probe;
pub mod transcode;

pub use error::MediaError;
pub use hw::{nvenc_opens, verify_encoders, Accel, Ran};
pub use probe::{probe, AudioInfo, MediaInfo};
pub use transcode::{
    decode, decode_all, transcode, Decoded, JobLimits, Rendition, Source, Transcoded, MILESTONES,
};

/// Initializes FFmpeg (and its devices, for lavfi sources) once; quiets its log to errors.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = ffmpeg_next::init() {
            tracing::error!("initializing FFmpeg: {e}");
        }
        ffmpeg_next::device::register_all();
        ffmpeg_next::log::set_level(ffmpeg_next::log::Level::Error);
    });
}
