//! The GPU engines as this machine has them. Where NVML shows device 0 with NVDEC (or NVENC), a
//! transcode decodes (or encodes) there and its output is verified frame by frame; where it
//! does not (no GPU, as on CI; no encoder, as on an H100/H200), asking for the engine fails with
//! `MediaError::Hardware` naming the device and leaves nothing behind: the node's cue to run
//! the job on the CPU.

mod common;

use std::path::{Path, PathBuf};

use common::{clip, files_in};
use spindle_gpu::{Declared, Device, Inventory};
use spindle_transcode::{
    decode, decode_all, transcode, verify_encoders, Accel, JobLimits, MediaError, Ran, Rendition,
    Source,
};

/// The clip every test here starts from ([`clip`]'s name for it).
const SRC: &str = "src-1280x720.mp4";

/// Device 0 as the node sees it: NVML's, with an encoder only if it opens a session.
fn gpu0() -> Option<Device> {
    let mut inventory = Inventory::discover(&Declared::default());
    verify_encoders(&mut inventory);
    inventory.devices.into_iter().find(|d| d.index == 0)
}

/// A 360p rendition of a 2 s 720p clip on `accel`'s engines.
fn rendition_on(
    accel: Accel,
) -> (
    tempfile::TempDir,
    PathBuf,
    Result<spindle_transcode::Transcoded, MediaError>,
) {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 1280, 720);
    let out = dir.path().join("360p.mp4");
    let limits = JobLimits {
        accel,
        ..JobLimits::default()
    };
    let rendition = Rendition {
        name: "360p".into(),
        height: 360,
        crf: 28,
        preset: "veryfast".into(),
    };
    let got = transcode(&Source::File(src), &out, &rendition, &limits, &mut |_| {});
    (dir, out, got)
}

fn verified(out: &Path) {
    let (frames, w, h) = decode_all(out).unwrap();
    assert_eq!((frames, w, h), (50, 640, 360));
}

fn refused_on(device: u32, dir: &Path, got: Result<spindle_transcode::Transcoded, MediaError>) {
    match got {
        Err(MediaError::Hardware { device: d, reason }) => {
            assert_eq!(d, device, "{reason}");
            assert!(!reason.is_empty());
        }
        other => panic!("expected gpu{device} to be refused, got {other:?}"),
    }
    assert_eq!(files_in(dir), [SRC], "the failed rendition is removed");
}

#[test]
fn nvdec_decodes_where_the_device_has_it_and_is_refused_where_not() {
    let (dir, out, got) = rendition_on(Accel {
        nvdec: Some(0),
        nvenc: None,
    });
    match gpu0() {
        Some(d) if d.nvdec_sessions > 0 => {
            let t = got.unwrap();
            assert_eq!((t.decoded_on, t.encoded_on), (Ran::Gpu(0), Ran::Cpu));
            assert_eq!((t.frames, t.width, t.height), (50, 640, 360));
            verified(&out);
            // Decoding alone: every frame stays on the GPU.
            let d = decode(&dir.path().join(SRC), Some(0), 1).unwrap();
            assert_eq!((d.frames, d.width, d.height), (50, 1280, 720));
            assert_eq!(d.decoded_on, Ran::Gpu(0));
        }
        _ => refused_on(0, dir.path(), got),
    }
}

#[test]
fn nvenc_encodes_where_the_device_has_it_and_is_refused_where_not() {
    let (dir, out, got) = rendition_on(Accel {
        nvdec: None,
        nvenc: Some(0),
    });
    match gpu0() {
        Some(d) if d.nvenc_sessions > 0 => {
            let t = got.unwrap();
            assert_eq!((t.decoded_on, t.encoded_on), (Ran::Cpu, Ran::Gpu(0)));
            verified(&out);
        }
        _ => refused_on(0, dir.path(), got),
    }
}

#[test]
fn a_device_that_is_not_there_is_refused_by_number() {
    let (dir, _, got) = rendition_on(Accel {
        nvdec: Some(97),
        nvenc: None,
    });
    refused_on(97, dir.path(), got);
    let (dir, _, got) = rendition_on(Accel {
        nvdec: None,
        nvenc: Some(98),
    });
    refused_on(98, dir.path(), got);
}

/// A damaged input placed on NVDEC fails as the engine's fault (it could be one), so the node
/// hands it to the CPU, which names the input's fault: not retryable, nothing left behind.
#[test]
fn a_damaged_input_on_nvdec_is_handed_to_the_cpu_which_names_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    let src = clip(dir.path(), 1280, 720);
    // The container stays whole (it opens and probes); the video inside is wiped from a
    // quarter of the way on, so decoding finds the fault.
    let mut bytes = std::fs::read(&src).unwrap();
    let n = bytes.len();
    bytes[n / 4..n * 3 / 4].fill(0xff);
    let cut = dir.path().join("cut.mp4");
    std::fs::write(&cut, &bytes).unwrap();
    let out = dir.path().join("360p.mp4");
    let rendition = Rendition {
        name: "360p".into(),
        height: 360,
        crf: 28,
        preset: "veryfast".into(),
    };
    let on = |accel| {
        let limits = JobLimits {
            accel,
            ..JobLimits::default()
        };
        transcode(
            &Source::File(cut.clone()),
            &out,
            &rendition,
            &limits,
            &mut |_| {},
        )
    };
    let gpu = on(Accel {
        nvdec: Some(0),
        nvenc: None,
    });
    assert!(
        matches!(gpu, Err(MediaError::Hardware { device: 0, .. })),
        "{gpu:?}"
    );
    let cpu = on(Accel::CPU);
    match cpu {
        Err(e @ MediaError::Corrupt { .. }) => {
            assert!(!e.is_retryable());
            // Found by decoding, not by opening: NVDEC would meet it the same way.
            let found = e.to_string();
            assert!(
                [
                    "undecodable packet",
                    "no frame could be decoded",
                    "truncated"
                ]
                .iter()
                .any(|w| found.contains(w)),
                "{found}"
            );
        }
        other => panic!("expected the CPU to name the input's fault, got {other:?}"),
    }
    assert_eq!(files_in(dir.path()), ["cut.mp4", SRC]);
}
