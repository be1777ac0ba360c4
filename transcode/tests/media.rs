//! Real FFmpeg, clips made here from lavfi test sources (no downloads): probe values, renditions
//! verified frame by frame, corrupt and truncated inputs refused with nothing left behind,
//! cancellation, timeouts and quotas.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use common::{clip, files_in};
use spindle_transcode::{
    decode_all, probe, transcode, JobLimits, MediaError, Rendition, Source, MILESTONES,
};

#[test]
fn probe_reports_what_the_clip_is() {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 640, 360);
    let info = probe(&src).unwrap();
    assert_eq!((info.width, info.height), (640, 360));
    assert!((info.fps - 25.0).abs() < 0.01, "{info:?}");
    assert!((1_900..=2_100).contains(&info.duration_ms), "{info:?}");
    assert_eq!(info.video_codec, "h264");
    assert_eq!(info.audio, None);
    assert!(info.container.contains("mp4"), "{info:?}");
}

#[test]
fn a_rendition_has_its_size_its_duration_and_every_frame_decodes() {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 1280, 720);
    let out = dir.path().join("preview.mp4");
    let preview = Rendition {
        name: "360p".into(),
        height: 360,
        crf: 28,
        preset: "veryfast".into(),
    };
    let mut seen = Vec::new();
    let done = transcode(
        &Source::File(src.clone()),
        &out,
        &preview,
        &JobLimits::default(),
        &mut |p| seen.push(p),
    )
    .unwrap();
    assert_eq!(seen, MILESTONES.to_vec(), "each milestone once, in order");
    assert_eq!((done.width, done.height), (640, 360));
    assert_eq!(done.frames, 50);
    let (frames, w, h) = decode_all(&out).unwrap();
    assert_eq!((frames, w, h), (50, 640, 360), "every frame decodes");
    let info = probe(&out).unwrap();
    // Within a frame or two of the source (2 s at 25 fps: 40 ms a frame).
    assert!(info.duration_ms.abs_diff(2_000) <= 80, "{info:?}");
}

#[test]
fn corrupt_and_truncated_inputs_are_refused_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 320, 240);
    let bytes = std::fs::read(&src).unwrap();
    let garbage = dir.path().join("garbage.mp4");
    std::fs::write(&garbage, b"this is not a video at all").unwrap();
    let truncated = dir.path().join("truncated.mp4");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let before = files_in(dir.path());
    for input in [&garbage, &truncated] {
        let out = dir.path().join("out.mp4");
        let e = transcode(
            &Source::File(input.clone()),
            &out,
            &Rendition::preview_720p(),
            &JobLimits::default(),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(matches!(e, MediaError::Corrupt { .. }), "{input:?}: {e}");
        assert!(!e.is_retryable());
        assert!(probe(input).is_err(), "{input:?} probes");
    }
    assert_eq!(files_in(dir.path()), before, "no output left behind");
}

#[test]
fn cancel_timeout_and_quota_stop_a_job_and_remove_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 640, 360);
    let out = dir.path().join("out.mp4");
    let canceled = JobLimits {
        cancel: Arc::new(AtomicBool::new(true)),
        ..JobLimits::default()
    };
    let timed = JobLimits {
        timeout: Duration::ZERO,
        ..JobLimits::default()
    };
    let tiny = JobLimits {
        quota_bytes: 1_000,
        ..JobLimits::default()
    };
    let r = Rendition::preview_720p();
    let run = |limits: &JobLimits| {
        transcode(&Source::File(src.clone()), &out, &r, limits, &mut |_| {}).unwrap_err()
    };
    assert!(matches!(run(&canceled), MediaError::Canceled));
    assert!(matches!(run(&timed), MediaError::TimedOut(_)));
    assert!(matches!(
        run(&tiny),
        MediaError::QuotaExceeded { quota_bytes: 1_000 }
    ));
    assert!(!out.exists(), "the output of a stopped job is removed");
}

#[test]
fn a_missing_input_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.mp4");
    let e = probe(&missing).unwrap_err();
    assert!(e.to_string().contains("nope.mp4"), "{e}");
    assert!(e.is_retryable());
}

#[test]
fn audio_mp4_can_carry_goes_through_and_is_probed() {
    let dir = tempfile::tempdir().unwrap();
    // A clip with AAC audio, made here with the ffmpeg CLI from lavfi sources (ffmpeg-next can
    // read but this crate does not encode audio).
    let src = dir.path().join("av.mp4");
    let status = std::process::Command::new("ffmpeg")
        .args([
            "-hide_banner",
            "-loglevel",
            "error",
            "-y",
            "-f",
            "lavfi",
            "-i",
        ])
        .arg("testsrc2=size=640x360:rate=25:duration=2")
        .args([
            "-f",
            "lavfi",
            "-i",
            "sine=frequency=440:sample_rate=48000:duration=2",
        ])
        .args([
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-c:a",
            "aac",
            "-shortest",
        ])
        .arg(&src)
        .status()
        .expect("the ffmpeg CLI (scripts/setup-system installs it)");
    assert!(status.success());
    let info = probe(&src).unwrap();
    let audio = info.audio.clone().expect("the clip has audio");
    assert_eq!((audio.codec.as_str(), audio.sample_rate), ("aac", 48_000));

    let out = dir.path().join("out.mp4");
    transcode(
        &Source::File(src),
        &out,
        &Rendition {
            name: "180p".into(),
            height: 180,
            crf: 30,
            preset: "veryfast".into(),
        },
        &JobLimits::default(),
        &mut |_| {},
    )
    .unwrap();
    let out_info = probe(&out).unwrap();
    assert_eq!((out_info.width, out_info.height), (320, 180));
    assert_eq!(
        out_info.audio,
        Some(audio),
        "the audio is carried unchanged"
    );
    assert!(out_info.duration_ms.abs_diff(2_000) <= 80, "{out_info:?}");
    assert_eq!(decode_all(&out).unwrap().0, 50);
}
