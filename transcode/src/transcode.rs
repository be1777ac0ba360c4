//! One transcode: decode the input's video (on the CPU, or on a GPU's NVDEC), scale it to a
//! rendition, encode H.264 (libx264 on the CPU, or a GPU's NVENC), mux MP4. Runs on the calling
//! thread (a media worker, never a shard), checks cancellation and the deadline between
//! packets, keeps the output under its quota, and removes the output whenever it does not
//! finish.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ffmpeg_next::{
    codec, encoder, format, frame, media, software::scaling, Dictionary, Packet, Rational, Rescale,
};

use crate::error::{ff, MediaError};
use crate::hw::{self, Accel, Ran};

/// Where frames come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    /// A libavfilter source graph (`testsrc2=size=320x240:rate=25:duration=2`): test clips made
    /// on the spot, no files to download.
    Lavfi(String),
}

impl Source {
    fn describe(&self) -> PathBuf {
        match self {
            Source::File(p) => p.clone(),
            Source::Lavfi(g) => PathBuf::from(format!("lavfi:{g}")),
        }
    }
}

/// A rung of the ladder: its height (the width follows the input's aspect, rounded to even).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendition {
    pub name: String,
    pub height: u32,
    pub crf: u8,
    /// libx264 preset (ultrafast … veryslow).
    pub preset: String,
}

impl Rendition {
    /// The 720p H.264 preview.
    pub fn preview_720p() -> Rendition {
        Rendition {
            name: "720p".into(),
            height: 720,
            crf: 28,
            preset: "veryfast".into(),
        }
    }

    pub fn hd_1080p() -> Rendition {
        Rendition {
            name: "1080p".into(),
            height: 1080,
            crf: 23,
            preset: "fast".into(),
        }
    }
}

/// What bounds one job.
#[derive(Debug, Clone)]
pub struct JobLimits {
    /// Encoder and decoder threads (one per CPU slot the job holds).
    pub threads: usize,
    pub timeout: Duration,
    /// Bytes the output may take on the job's temp disk.
    pub quota_bytes: u64,
    pub cancel: Arc<AtomicBool>,
    /// The GPU engines the job was placed on (the CPU for a stage without one).
    pub accel: Accel,
}

impl Default for JobLimits {
    fn default() -> JobLimits {
        JobLimits {
            threads: 1,
            timeout: Duration::from_secs(600),
            quota_bytes: 1 << 30,
            cancel: Arc::new(AtomicBool::new(false)),
            accel: Accel::CPU,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Transcoded {
    pub frames: u64,
    pub bytes: u64,
    pub width: u32,
    pub height: u32,
    pub duration_ms: u64,
    /// Where the video was decoded: a GPU only when every frame came from its NVDEC.
    pub decoded_on: Ran,
    pub encoded_on: Ran,
}

/// Progress milestones a job reports (each once, in order).
pub const MILESTONES: [u8; 4] = [10, 30, 60, 90];

/// Transcodes `source` into `output` (MP4). On any failure the output is removed.
pub fn transcode(
    source: &Source,
    output: &Path,
    rendition: &Rendition,
    limits: &JobLimits,
    progress: &mut dyn FnMut(u8),
) -> Result<Transcoded, MediaError> {
    crate::init();
    let result = run(source, output, rendition, limits, progress);
    if result.is_err() {
        let _ = std::fs::remove_file(output);
    }
    result
}

fn open(source: &Source) -> Result<format::context::Input, MediaError> {
    let corrupt = |reason: String| MediaError::Corrupt {
        path: source.describe(),
        reason,
    };
    match source {
        Source::File(path) => {
            if !path.exists() {
                return Err(MediaError::Io {
                    path: path.clone(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                });
            }
            format::input(path).map_err(|e| corrupt(e.to_string()))
        }
        Source::Lavfi(graph) => {
            let lavfi = ffmpeg_next::device::input::video()
                .find(|f| f.name() == "lavfi")
                .ok_or_else(|| MediaError::Unsupported("FFmpeg has no lavfi input".into()))?;
            format::open_with(graph, &lavfi, Dictionary::new())
                .map_err(|e| corrupt(e.to_string()))
                .map(format::context::Context::input)
        }
    }
}

fn run(
    source: &Source,
    output: &Path,
    rendition: &Rendition,
    limits: &JobLimits,
    progress: &mut dyn FnMut(u8),
) -> Result<Transcoded, MediaError> {
    let started = Instant::now();
    let corrupt = |reason: String| MediaError::Corrupt {
        path: source.describe(),
        reason,
    };
    let mut ictx = open(source)?;
    let (ist_index, ist_tb, mut decoder, frame_rate, in_duration_ms, nvdec) = {
        let ist = ictx
            .streams()
            .best(media::Type::Video)
            .ok_or_else(|| corrupt("no video stream".into()))?;
        let mut dctx = codec::context::Context::from_parameters(ist.parameters())
            .map_err(|e| corrupt(e.to_string()))?;
        let nvdec = set_up_decoder(
            &mut dctx,
            ist.parameters().id(),
            limits.accel.nvdec,
            limits.threads,
        )?;
        let decoder = dctx
            .decoder()
            .video()
            .map_err(|e| corrupt(format!("no decoder: {e}")))?;
        let rate = if ist.avg_frame_rate().numerator() > 0 {
            ist.avg_frame_rate()
        } else {
            ist.rate()
        };
        let duration_ms = if ictx.duration() > 0 {
            ictx.duration() as u64 * 1_000 / ffmpeg_next::ffi::AV_TIME_BASE as u64
        } else {
            0
        };
        (
            ist.index(),
            ist.time_base(),
            decoder,
            rate,
            duration_ms,
            nvdec,
        )
    };
    // What decoding finds wrong: the input's fault on the CPU; on NVDEC, possibly the
    // engine's, so the job is handed to the CPU, which names the input's fault if it is one.
    let undecodable = |reason: String| match nvdec {
        Some(device) => MediaError::Hardware {
            device,
            reason: format!("NVDEC: {reason}"),
        },
        None => corrupt(reason),
    };
    if decoder.width() == 0 || decoder.height() == 0 {
        return Err(corrupt("video stream without dimensions".into()));
    }
    if frame_rate.numerator() <= 0 || frame_rate.denominator() <= 0 {
        return Err(corrupt("video stream without a frame rate".into()));
    }
    // The rendition keeps the input's aspect; never upscale; even sides for 4:2:0.
    let height = rendition.height.min(decoder.height()) & !1;
    let width = ((u64::from(decoder.width()) * u64::from(height) / u64::from(decoder.height()))
        as u32)
        & !1;
    if width == 0 || height == 0 {
        return Err(MediaError::Unsupported(format!(
            "{}x{} cannot be scaled to {}",
            decoder.width(),
            decoder.height(),
            rendition.name
        )));
    }

    let mut octx = format::output(&output).map_err(|e| MediaError::Io {
        path: output.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let h264 = match limits.accel.nvenc {
        Some(device) => encoder::find_by_name("h264_nvenc").ok_or(MediaError::Hardware {
            device,
            reason: "this FFmpeg has no h264_nvenc".into(),
        })?,
        None => encoder::find_by_name("libx264")
            .ok_or_else(|| MediaError::Unsupported("libx264 is not in this FFmpeg".into()))?,
    };
    let enc_tb = frame_rate.invert();
    let mut ectx = codec::context::Context::new_with_codec(h264);
    if let Some(d) = limits.accel.nvenc {
        hw::cuda(d)?.attach_encoder(&mut ectx);
    } else {
        ectx.set_threading(codec::threading::Config {
            kind: codec::threading::Type::Frame,
            count: limits.threads.max(1),
            ..Default::default()
        });
    }
    let mut enc = ectx.encoder().video().map_err(ff)?;
    enc.set_width(width);
    enc.set_height(height);
    enc.set_format(format::Pixel::YUV420P);
    enc.set_time_base(enc_tb);
    enc.set_frame_rate(Some(frame_rate));
    if octx.format().flags().contains(format::Flags::GLOBAL_HEADER) {
        enc.set_flags(codec::Flags::GLOBAL_HEADER);
    }
    let mut opts = Dictionary::new();
    let mut enc = match limits.accel.nvenc {
        Some(device) => {
            // Constant quality, as libx264's CRF: NVENC's VBR with a CQ target and no bitrate
            // cap; p4 is its middle preset.
            enc.set_bit_rate(0);
            opts.set("preset", "p4");
            opts.set("rc", "vbr");
            opts.set("cq", &rendition.crf.to_string());
            enc.open_with(opts).map_err(|e| MediaError::Hardware {
                device,
                reason: format!("NVENC refused the session: {e}"),
            })?
        }
        None => {
            opts.set("preset", &rendition.preset);
            opts.set("crf", &rendition.crf.to_string());
            enc.open_with(opts).map_err(ff)?
        }
    };
    let ost_index = {
        let mut ost = octx.add_stream(h264).map_err(ff)?;
        ost.set_parameters(&enc);
        ost.set_time_base(enc_tb);
        ost.set_avg_frame_rate(frame_rate);
        ost.set_rate(frame_rate);
        ost.index()
    };
    // Audio MP4 can carry as it is goes through untouched; anything else is left out (said in
    // the log): renditions are for viewing, and a re-encode would cost a CPU slot of its own.
    let audio = ictx.streams().best(media::Type::Audio).and_then(|ast| {
        let id = ast.parameters().id();
        let fits = matches!(
            id,
            codec::Id::AAC | codec::Id::MP3 | codec::Id::OPUS | codec::Id::AC3
        );
        if !fits {
            tracing::info!("audio {id:?} is left out of the rendition");
            return None;
        }
        let mut aost = octx.add_stream(encoder::find(codec::Id::None)).ok()?;
        aost.set_parameters(ast.parameters());
        aost.set_time_base(ast.time_base());
        Some((ast.index(), ast.time_base(), aost.index()))
    });
    octx.write_header().map_err(ff)?;
    let ost_tb = octx
        .stream(ost_index)
        .map(|s| s.time_base())
        .unwrap_or(enc_tb);
    let audio = audio.map(|(ist, ist_tb, ost)| {
        let ost_tb = octx.stream(ost).map_or(ist_tb, |s| s.time_base());
        (ist, ist_tb, ost, ost_tb)
    });

    let mut job = Job {
        nvdec,
        gpu_frames: 0,
        scaler: None,
        width,
        height,
        started,
        limits,
        bytes: 0,
        frames: 0,
        last_pts_ms: 0,
        next_milestone: 0,
        in_duration_ms,
        ist_tb,
        enc_tb,
        ost_tb,
        ost_index,
    };
    let mut frames = Frames {
        decoded: frame::Video::empty(),
        downloaded: frame::Video::empty(),
        scaled: frame::Video::empty(),
    };
    for (stream, mut packet) in ictx.packets() {
        job.check()?;
        if let Some((a_ist, a_ist_tb, a_ost, a_ost_tb)) = audio {
            if stream.index() == a_ist {
                job.bytes += packet.size() as u64;
                packet.rescale_ts(a_ist_tb, a_ost_tb);
                packet.set_position(-1);
                packet.set_stream(a_ost);
                packet.write_interleaved(&mut octx).map_err(ff)?;
                continue;
            }
        }
        if stream.index() != ist_index {
            continue;
        }
        if let Err(e) = decoder.send_packet(&packet) {
            return Err(undecodable(format!("undecodable packet: {e}")));
        }
        job.drain_decoder(&mut decoder, &mut enc, &mut octx, &mut frames, progress)?;
    }
    decoder.send_eof().map_err(ff)?;
    job.drain_decoder(&mut decoder, &mut enc, &mut octx, &mut frames, progress)?;
    enc.send_eof().map_err(ff)?;
    job.drain_encoder(&mut enc, &mut octx)?;
    octx.write_trailer().map_err(ff)?;
    if job.frames == 0 {
        return Err(undecodable("no frame could be decoded".into()));
    }
    // A file cut short still has headers that promise the whole duration.
    let covered = job.last_pts_ms + frame_ms(frame_rate);
    if in_duration_ms > 0 && covered * 10 < in_duration_ms * 9 {
        return Err(undecodable(format!(
            "truncated: decoded {covered} ms of {in_duration_ms} ms"
        )));
    }
    for &m in &MILESTONES[job.next_milestone..] {
        progress(m);
    }
    let bytes = std::fs::metadata(output)
        .map(|m| m.len())
        .unwrap_or(job.bytes);
    Ok(Transcoded {
        frames: job.frames,
        bytes,
        width,
        height,
        duration_ms: covered,
        decoded_on: decoded_on(nvdec, job.gpu_frames, job.frames),
        encoded_on: limits.accel.nvenc.map_or(Ran::Cpu, Ran::Gpu),
    })
}

/// Has the unopened decoder `dctx` (of codec `id`) decode on `nvdec`'s device where NVDEC
/// takes the codec, with one thread (NVDEC does the work: more threads only hold more frames in
/// flight), else on the CPU with `threads`: the device it decodes on.
fn set_up_decoder(
    dctx: &mut codec::context::Context,
    id: codec::Id,
    nvdec: Option<u32>,
    threads: usize,
) -> Result<Option<u32>, MediaError> {
    let nvdec = match nvdec {
        Some(d) if hw::decodes_on_cuda(id.into()) => {
            hw::cuda(d)?.attach_decoder(dctx);
            Some(d)
        }
        Some(d) => {
            tracing::info!("NVDEC cannot decode {id:?}: decoding on the CPU, not gpu{d}");
            None
        }
        None => None,
    };
    dctx.set_threading(codec::threading::Config {
        kind: codec::threading::Type::Frame,
        count: if nvdec.is_some() { 1 } else { threads.max(1) },
        ..Default::default()
    });
    Ok(nvdec)
}

/// Where a stream was decoded: on `nvdec`'s device only when every one of its `frames` came
/// from it (`on_gpu` of them did).
fn decoded_on(nvdec: Option<u32>, on_gpu: u64, frames: u64) -> Ran {
    match nvdec {
        Some(d) if on_gpu == frames && frames > 0 => Ran::Gpu(d),
        _ => Ran::Cpu,
    }
}

fn frame_ms(rate: Rational) -> u64 {
    (1_000 * i64::from(rate.denominator()) / i64::from(rate.numerator()).max(1)) as u64
}

/// The frames a job reuses: as decoded, copied from the GPU, scaled.
struct Frames {
    decoded: frame::Video,
    downloaded: frame::Video,
    scaled: frame::Video,
}

struct Job<'a> {
    /// The device whose NVDEC decodes, if any, and how many frames came from it.
    nvdec: Option<u32>,
    gpu_frames: u64,
    /// Made for the first frame's format and size (CUDA frames come back as NV12), made again
    /// if a stream changes them.
    scaler: Option<scaling::Context>,
    width: u32,
    height: u32,
    started: Instant,
    limits: &'a JobLimits,
    bytes: u64,
    frames: u64,
    last_pts_ms: u64,
    next_milestone: usize,
    in_duration_ms: u64,
    ist_tb: Rational,
    enc_tb: Rational,
    ost_tb: Rational,
    ost_index: usize,
}

impl Job<'_> {
    fn check(&self) -> Result<(), MediaError> {
        if self.limits.cancel.load(Ordering::Relaxed) {
            return Err(MediaError::Canceled);
        }
        if self.started.elapsed() > self.limits.timeout {
            return Err(MediaError::TimedOut(self.limits.timeout));
        }
        if self.bytes > self.limits.quota_bytes {
            return Err(MediaError::QuotaExceeded {
                quota_bytes: self.limits.quota_bytes,
            });
        }
        Ok(())
    }

    /// The scaler from `src`'s format and size to the rendition's.
    fn scaler_for(&mut self, src: &frame::Video) -> Result<&mut scaling::Context, MediaError> {
        let fits = self.scaler.as_ref().is_some_and(|s| {
            let i = s.input();
            (i.format, i.width, i.height) == (src.format(), src.width(), src.height())
        });
        if !fits {
            let made = scaling::Context::get(
                src.format(),
                src.width(),
                src.height(),
                format::Pixel::YUV420P,
                self.width,
                self.height,
                scaling::Flags::BILINEAR,
            )
            .map_err(|e| MediaError::Unsupported(format!("scaling {:?}: {e}", src.format())))?;
            self.scaler = Some(made);
        }
        Ok(self.scaler.as_mut().expect("made above"))
    }

    fn drain_decoder(
        &mut self,
        decoder: &mut ffmpeg_next::decoder::Video,
        enc: &mut encoder::Video,
        octx: &mut format::context::Output,
        frames: &mut Frames,
        progress: &mut dyn FnMut(u8),
    ) -> Result<(), MediaError> {
        let Frames {
            decoded,
            downloaded,
            scaled,
        } = frames;
        while decoder.receive_frame(decoded).is_ok() {
            self.check()?;
            let ts = decoded.timestamp().unwrap_or(0);
            let src = match self.nvdec {
                Some(device) if decoded.format() == format::Pixel::CUDA => {
                    hw::download(device, decoded, downloaded)?;
                    self.gpu_frames += 1;
                    &*downloaded
                }
                _ => &*decoded,
            };
            self.scaler_for(src)?.run(src, scaled).map_err(ff)?;
            let pts = ts.rescale(self.ist_tb, self.enc_tb);
            scaled.set_pts(Some(pts));
            scaled.set_kind(ffmpeg_next::picture::Type::None);
            enc.send_frame(scaled).map_err(ff)?;
            self.frames += 1;
            self.last_pts_ms = ts.max(0).rescale(self.ist_tb, Rational(1, 1_000)) as u64;
            if let Some(pct) = (self.last_pts_ms * 100).checked_div(self.in_duration_ms) {
                let pct = pct.min(100) as u8;
                while self.next_milestone < MILESTONES.len()
                    && pct >= MILESTONES[self.next_milestone]
                {
                    progress(MILESTONES[self.next_milestone]);
                    self.next_milestone += 1;
                }
            }
            self.drain_encoder(enc, octx)?;
        }
        Ok(())
    }

    fn drain_encoder(
        &mut self,
        enc: &mut encoder::Video,
        octx: &mut format::context::Output,
    ) -> Result<(), MediaError> {
        let mut packet = Packet::empty();
        while enc.receive_packet(&mut packet).is_ok() {
            self.bytes += packet.size() as u64;
            if packet.duration() <= 0 {
                // One frame in the encoder's time base: the muxer needs it for the last frame
                // (an edit list would otherwise cut it off).
                packet.set_duration(1);
            }
            packet.set_stream(self.ost_index);
            packet.rescale_ts(self.enc_tb, self.ost_tb);
            packet.write_interleaved(octx).map_err(ff)?;
            self.check()?;
        }
        Ok(())
    }
}

/// Decodes every frame of `path`'s video on the CPU: (frames, width, height). Used to verify
/// outputs.
pub fn decode_all(path: &Path) -> Result<(u64, u32, u32), MediaError> {
    decode(path, None, 1).map(|d| (d.frames, d.width, d.height))
}

/// What [`decode`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub frames: u64,
    pub width: u32,
    pub height: u32,
    /// A GPU only when every frame came from its NVDEC.
    pub decoded_on: Ran,
}

/// Decodes every frame of `path`'s video, on `nvdec`'s device if given (frames stay on the
/// GPU), else with `threads` CPU threads.
pub fn decode(path: &Path, nvdec: Option<u32>, threads: usize) -> Result<Decoded, MediaError> {
    crate::init();
    let corrupt = |reason: String| MediaError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let mut ictx = format::input(&path).map_err(|e| corrupt(e.to_string()))?;
    let ist = ictx
        .streams()
        .best(media::Type::Video)
        .ok_or_else(|| corrupt("no video stream".into()))?;
    let index = ist.index();
    let mut dctx = codec::context::Context::from_parameters(ist.parameters()).map_err(ff)?;
    let nvdec = set_up_decoder(&mut dctx, ist.parameters().id(), nvdec, threads)?;
    let mut decoder = dctx.decoder().video().map_err(ff)?;
    let (mut frames, mut on_gpu) = (0, 0);
    let mut f = frame::Video::empty();
    let mut count = |decoder: &mut ffmpeg_next::decoder::Video| {
        while decoder.receive_frame(&mut f).is_ok() {
            frames += 1;
            on_gpu += u64::from(f.format() == format::Pixel::CUDA);
        }
    };
    for (stream, packet) in ictx.packets() {
        if stream.index() != index {
            continue;
        }
        decoder
            .send_packet(&packet)
            .map_err(|e| corrupt(e.to_string()))?;
        count(&mut decoder);
    }
    decoder.send_eof().map_err(ff)?;
    count(&mut decoder);
    Ok(Decoded {
        frames,
        width: decoder.width(),
        height: decoder.height(),
        decoded_on: decoded_on(nvdec, on_gpu, frames),
    })
}
