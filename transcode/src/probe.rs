//! Probing: what a media file really is (duration, resolution, frame rate, codecs, audio), to
//! check what a client declared and to re-derive the task's cost from the truth.

use std::path::Path;

use ffmpeg_next::{format, media};

use crate::error::MediaError;

#[derive(Debug, Clone, PartialEq)]
pub struct MediaInfo {
    pub duration_ms: u64,
    pub width: u32,
    pub height: u32,
    /// Frames per second of the video stream (its average rate).
    pub fps: f64,
    pub video_codec: String,
    pub audio: Option<AudioInfo>,
    /// The container's name(s), as FFmpeg reports them.
    pub container: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudioInfo {
    pub codec: String,
    pub sample_rate: u32,
    pub channels: u16,
}

/// Reads `path`'s headers (and enough packets to find its streams).
pub fn probe(path: &Path) -> Result<MediaInfo, MediaError> {
    crate::init();
    let corrupt = |reason: String| MediaError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    if !path.exists() {
        return Err(MediaError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
    }
    let ictx = format::input(path).map_err(|e| corrupt(e.to_string()))?;
    let video = ictx
        .streams()
        .best(media::Type::Video)
        .ok_or_else(|| corrupt("no video stream".into()))?;
    let vctx = ffmpeg_next::codec::context::Context::from_parameters(video.parameters())
        .map_err(|e| corrupt(e.to_string()))?;
    let decoder = vctx.decoder().video().map_err(|e| corrupt(e.to_string()))?;
    let rate = video.avg_frame_rate();
    let fps = if rate.denominator() != 0 {
        f64::from(rate.numerator()) / f64::from(rate.denominator())
    } else {
        0.0
    };
    let duration_ms = if ictx.duration() > 0 {
        (ictx.duration() as u64) * 1_000 / ffmpeg_next::ffi::AV_TIME_BASE as u64
    } else {
        let tb = video.time_base();
        (video.duration().max(0) as u64) * 1_000 * tb.numerator() as u64
            / tb.denominator().max(1) as u64
    };
    if decoder.width() == 0 || decoder.height() == 0 {
        return Err(corrupt("video stream without dimensions".into()));
    }
    let audio = match ictx.streams().best(media::Type::Audio) {
        Some(a) => {
            let actx = ffmpeg_next::codec::context::Context::from_parameters(a.parameters())
                .map_err(|e| corrupt(e.to_string()))?;
            let adec = actx.decoder().audio().map_err(|e| corrupt(e.to_string()))?;
            Some(AudioInfo {
                codec: adec.id().name().to_string(),
                sample_rate: adec.rate(),
                channels: adec.channels(),
            })
        }
        None => None,
    };
    Ok(MediaInfo {
        duration_ms,
        width: decoder.width(),
        height: decoder.height(),
        fps,
        video_codec: decoder.id().name().to_string(),
        audio,
        container: ictx.format().name().to_string(),
    })
}
