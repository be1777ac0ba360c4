//! What the transcode tests share: clips made here, and what a folder holds.

use std::path::{Path, PathBuf};

use spindle_transcode::{transcode, JobLimits, Rendition, Source};

/// A 2 s, 25 fps clip of `w`x`h` in `dir`, made by transcoding a lavfi source.
pub fn clip(dir: &Path, w: u32, h: u32) -> PathBuf {
    let out = dir.join(format!("src-{w}x{h}.mp4"));
    let source = Source::Lavfi(format!("testsrc2=size={w}x{h}:rate=25:duration=2"));
    let lossless = Rendition {
        name: "source".into(),
        height: h,
        crf: 18,
        preset: "ultrafast".into(),
    };
    transcode(&source, &out, &lossless, &JobLimits::default(), &mut |_| {}).unwrap();
    out
}

pub fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
