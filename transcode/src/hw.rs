//! NVIDIA video engines through FFmpeg's CUDA device contexts: NVDEC decode (the `nvdec`
//! hwaccel of FFmpeg's own decoders, frames copied back to system memory for scaling) and NVENC
//! encode (`h264_nvenc`, fed system-memory frames on the device's context).
//!
//! A CUDA context takes a good part of a second to make, so each device's is made once and
//! shared by every job on every worker thread (FFmpeg pushes and pops it around each use).
//! Without the driver (no GPU, as on CI) making one fails, and the job is told so with
//! [`MediaError::Hardware`], which the node answers by running the job on the CPU.
// ffmpeg-next has no safe binding of FFmpeg's hardware API; each unsafe block says why it holds.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ptr;
use std::sync::{Mutex, OnceLock};

use ffmpeg_next::ffi;

use crate::error::MediaError;

/// Which engines of which device a job uses; `None` is the CPU (FFmpeg's decoder, libx264).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accel {
    /// Decode on this device's NVDEC.
    pub nvdec: Option<u32>,
    /// Encode on this device's NVENC.
    pub nvenc: Option<u32>,
}

impl Accel {
    pub const CPU: Accel = Accel {
        nvdec: None,
        nvenc: None,
    };
}

/// Where a stage of a finished transcode ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ran {
    Cpu,
    Gpu(u32),
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ran::Cpu => f.write_str("cpu"),
            Ran::Gpu(d) => write!(f, "gpu{d}"),
        }
    }
}

/// A reference to one device's CUDA context (an `AVBufferRef` of an `AVHWDeviceContext`).
pub(crate) struct CudaDevice {
    buf: *mut ffi::AVBufferRef,
}

// SAFETY: an AVBufferRef's count is atomic, and FFmpeg's CUDA device context is meant to be
// used from any thread (each use pushes the context onto the calling thread and pops it).
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: `buf` is a reference this value owns.
        unsafe { ffi::av_buffer_unref(&mut self.buf) };
    }
}

impl CudaDevice {
    /// Has the unopened decoder `ctx` decode on this device (NVDEC), taking CUDA frames
    /// whenever FFmpeg offers them.
    pub(crate) fn attach_decoder(&self, ctx: &mut ffmpeg_next::codec::context::Context) {
        // SAFETY: the context is not open yet; it owns the new reference and frees it.
        unsafe {
            let ctx = ctx.as_mut_ptr();
            (*ctx).hw_device_ctx = ffi::av_buffer_ref(self.buf);
            (*ctx).get_format = Some(prefer_cuda);
        }
    }

    /// Has the unopened encoder `ctx` (NVENC) open its session on this device's context.
    pub(crate) fn attach_encoder(&self, ctx: &mut ffmpeg_next::codec::context::Context) {
        // SAFETY: as above.
        unsafe { (*ctx.as_mut_ptr()).hw_device_ctx = ffi::av_buffer_ref(self.buf) };
    }
}

/// Device `index`'s CUDA context, made on first use. A device that failed is tried again on
/// the next call (a driver can come back), which costs that call the attempt.
pub(crate) fn cuda(index: u32) -> Result<std::sync::Arc<CudaDevice>, MediaError> {
    static DEVICES: OnceLock<Mutex<HashMap<u32, std::sync::Arc<CudaDevice>>>> = OnceLock::new();
    crate::init();
    let devices = DEVICES.get_or_init(Mutex::default);
    let mut devices = devices.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&index) {
        return Ok(d.clone());
    }
    let name = std::ffi::CString::new(index.to_string()).expect("digits have no NUL");
    let mut buf = ptr::null_mut();
    // SAFETY: plain FFI call; `buf` receives a new reference on success.
    let rc = unsafe {
        ffi::av_hwdevice_ctx_create(
            &mut buf,
            ffi::AVHWDeviceType::AV_HWDEVICE_TYPE_CUDA,
            name.as_ptr(),
            ptr::null_mut(),
            0,
        )
    };
    if rc < 0 || buf.is_null() {
        return Err(MediaError::Hardware {
            device: index,
            reason: format!(
                "no CUDA context: {} (no NVIDIA driver or no such device)",
                ffmpeg_next::Error::from(rc)
            ),
        });
    }
    let d = std::sync::Arc::new(CudaDevice { buf });
    devices.insert(index, d.clone());
    Ok(d)
}

/// Whether FFmpeg's decoder for `id` can decode on a CUDA device context (NVDEC).
pub(crate) fn decodes_on_cuda(id: ffi::AVCodecID) -> bool {
    // SAFETY: FFmpeg's static codec tables; the loop ends at the first null config.
    unsafe {
        let codec = ffi::avcodec_find_decoder(id);
        if codec.is_null() {
            return false;
        }
        let mut i = 0;
        loop {
            let config = ffi::avcodec_get_hw_config(codec, i);
            if config.is_null() {
                return false;
            }
            let by_device = (*config).methods
                & ffi::AV_CODEC_HW_CONFIG_METHOD_HW_DEVICE_CTX as std::os::raw::c_int
                != 0;
            if by_device && (*config).device_type == ffi::AVHWDeviceType::AV_HWDEVICE_TYPE_CUDA {
                return true;
            }
            i += 1;
        }
    }
}

/// The decoder's pixel-format choice: CUDA frames when offered. When NVDEC cannot take the
/// stream (a profile it lacks, say 4:4:4 or 10-bit H.264) FFmpeg offers the software formats
/// only, and the first of them is taken: the stream still decodes, on the CPU, and the job's
/// result says so.
unsafe extern "C" fn prefer_cuda(
    _ctx: *mut ffi::AVCodecContext,
    formats: *const ffi::AVPixelFormat,
) -> ffi::AVPixelFormat {
    let mut first = ffi::AVPixelFormat::AV_PIX_FMT_NONE;
    let mut p = formats;
    // SAFETY: FFmpeg passes a list ended by AV_PIX_FMT_NONE.
    unsafe {
        while *p != ffi::AVPixelFormat::AV_PIX_FMT_NONE {
            if *p == ffi::AVPixelFormat::AV_PIX_FMT_CUDA {
                return *p;
            }
            if first == ffi::AVPixelFormat::AV_PIX_FMT_NONE {
                first = *p;
            }
            p = p.add(1);
        }
    }
    first
}

/// Copies a CUDA frame into `sw` (system memory, the device's software format: NV12 for 8-bit
/// 4:2:0), with its timestamps.
pub(crate) fn download(
    device: u32,
    hw: &ffmpeg_next::frame::Video,
    sw: &mut ffmpeg_next::frame::Video,
) -> Result<(), MediaError> {
    // SAFETY: both frames are valid; `sw` is unreferenced first, as the call expects an empty
    // destination to allocate into.
    let rc = unsafe {
        ffi::av_frame_unref(sw.as_mut_ptr());
        let rc = ffi::av_hwframe_transfer_data(sw.as_mut_ptr(), hw.as_ptr(), 0);
        if rc >= 0 {
            ffi::av_frame_copy_props(sw.as_mut_ptr(), hw.as_ptr())
        } else {
            rc
        }
    };
    if rc < 0 {
        return Err(MediaError::Hardware {
            device,
            reason: format!(
                "copying a decoded frame to memory: {}",
                ffmpeg_next::Error::from(rc)
            ),
        });
    }
    Ok(())
}

/// Whether device `index`'s NVENC opens an H.264 session. NVML reports an encoder capacity on
/// cards that have no encoder (an H200 answers as an L4 would), so the node asks the engine
/// itself before it hands out NVENC units. Costs the device's CUDA context (made once) and a
/// session opened and closed.
pub fn nvenc_opens(index: u32) -> Result<(), MediaError> {
    use ffmpeg_next::{codec, encoder, format, Rational};
    let device = cuda(index)?;
    let refused = |reason: String| MediaError::Hardware {
        device: index,
        reason,
    };
    let nvenc = encoder::find_by_name("h264_nvenc")
        .ok_or_else(|| refused("this FFmpeg has no h264_nvenc".into()))?;
    let mut ctx = codec::context::Context::new_with_codec(nvenc);
    device.attach_encoder(&mut ctx);
    let mut enc = ctx
        .encoder()
        .video()
        .map_err(|e| refused(format!("NVENC: {e}")))?;
    enc.set_width(256);
    enc.set_height(144);
    enc.set_format(format::Pixel::YUV420P);
    enc.set_time_base(Rational(1, 25));
    enc.open()
        .map(drop)
        .map_err(|e| refused(format!("NVENC refused a session: {e}")))
}

/// Takes NVENC off the NVML devices whose encoder does not open a session ([`nvenc_opens`]):
/// units of an engine that is not there would send every job placed on them through a failed
/// start and back to the CPU. Declared devices are the operator's word and are not asked.
pub fn verify_encoders(inventory: &mut spindle_gpu::Inventory) {
    if !matches!(inventory.source, spindle_gpu::Source::Nvml { .. }) {
        return;
    }
    for d in inventory
        .devices
        .iter_mut()
        .filter(|d| d.nvenc_sessions > 0)
    {
        if let Err(e) = nvenc_opens(d.index) {
            tracing::warn!(
                "{} (gpu{}) reports an encoder, but {e}: encode stays on the CPU",
                d.name,
                d.index
            );
            d.nvenc_sessions = 0;
        }
    }
}
