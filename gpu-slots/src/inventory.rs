//! What media hardware this node has: GPUs with their memory, compute and video engines (from
//! NVML), CPU units and temp disk. Where NVML is absent (no driver, no GPU) the node runs on a
//! declared inventory — CPU slots only unless the configuration declares devices — and says so.

use serde::{Deserialize, Serialize};

/// One GPU. Engines are counted per device: H100/H200 have NVDEC but no NVENC, so encode work
/// placed on them runs on the CPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    pub index: u32,
    pub name: String,
    pub memory_mb: u64,
    /// Compute units the ledger hands out (100 per device: a percentage of its SMs).
    pub compute_units: u64,
    /// Concurrent NVENC sessions the ledger allows (0: no encoder).
    pub nvenc_sessions: u64,
    /// Concurrent NVDEC sessions the ledger allows (0: no decoder).
    pub nvdec_sessions: u64,
    pub mig: bool,
    /// GPU utilization at the last refresh, when NVML reports it.
    #[serde(default)]
    pub utilization_pct: Option<u32>,
}

impl std::fmt::Display for Device {
    /// One line, as the examples and the GPU check print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gpu{}: {} | {} MB | NVENC sessions {} | NVDEC sessions {} | MIG {}",
            self.index,
            self.name,
            self.memory_mb,
            self.nvenc_sessions,
            self.nvdec_sessions,
            self.mig
        )?;
        match self.utilization_pct {
            Some(u) => write!(f, " | utilization {u} %"),
            None => Ok(()),
        }
    }
}

/// Where an inventory came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    Nvml {
        driver: String,
    },
    /// NVML could not be used; `why` says what failed.
    Declared {
        why: String,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Nvml { driver } => write!(f, "NVML, driver {driver}"),
            Source::Declared { why } => write!(f, "declared (NVML unavailable: {why})"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub source: Source,
    pub devices: Vec<Device>,
    pub cpu_units: u64,
    pub temp_disk_mb: u64,
}

/// The configuration's part: CPU units, temp disk, and devices to assume without NVML.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declared {
    pub cpu_units: u64,
    pub temp_disk_mb: u64,
    #[serde(default)]
    pub devices: Vec<Device>,
}

/// Sessions per engine the ledger allows on a device that has the engine (NVML reports
/// capacity, not a session cap; this keeps each engine's queue short).
pub const SESSIONS_PER_ENGINE: u64 = 8;
/// Compute units per device.
pub const COMPUTE_UNITS_PER_DEVICE: u64 = 100;

impl Inventory {
    /// NVML's view of the machine, or `declared` with the reason NVML was not used.
    pub fn discover(declared: &Declared) -> Inventory {
        match nvml(declared) {
            Ok(inv) => inv,
            Err(why) => {
                tracing::warn!("NVML unavailable ({why}); media runs on the declared inventory");
                Inventory::declared(declared, why)
            }
        }
    }

    pub fn declared(declared: &Declared, why: String) -> Inventory {
        Inventory {
            source: Source::Declared { why },
            devices: declared.devices.clone(),
            cpu_units: declared.cpu_units,
            temp_disk_mb: declared.temp_disk_mb,
        }
    }
}

/// Whether this process can load the driver library `name`. NVML reports a card's engines, but
/// FFmpeg reaches them through `libcuda` and, per engine, `libnvcuvid` (NVDEC) and
/// `libnvidia-encode` (NVENC): a container started without the driver's `video` capability
/// has NVML and CUDA and lacks the last two.
#[allow(unsafe_code)] // loading a library runs its initializers; nothing else is called
fn loadable(name: &str) -> bool {
    // SAFETY: the library is only loaded and unloaded; NVIDIA's driver libraries do no work
    // at load that depends on the caller.
    unsafe { libloading::Library::new(name) }.is_ok()
}

fn nvml(declared: &Declared) -> Result<Inventory, String> {
    use nvml_wrapper::enum_wrappers::device::EncoderType;
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| e.to_string())?;
    let driver = nvml.sys_driver_version().map_err(|e| e.to_string())?;
    let count = nvml.device_count().map_err(|e| e.to_string())?;
    let cuda = loadable("libcuda.so.1");
    let cuvid = cuda && loadable("libnvcuvid.so.1");
    let encode = cuda && loadable("libnvidia-encode.so.1");
    let mut devices = Vec::new();
    for index in 0..count {
        let d = nvml.device_by_index(index).map_err(|e| e.to_string())?;
        let memory_mb = d.memory_info().map_err(|e| e.to_string())?.total / (1 << 20);
        // A device without an encoder answers "not supported" (or a capacity of 0).
        let has_nvenc = d.encoder_capacity(EncoderType::H264).is_ok_and(|c| c > 0);
        let has_nvdec = d.decoder_utilization().is_ok();
        for (engine, has, usable, lib) in [
            ("NVDEC", has_nvdec, cuvid, "libnvcuvid.so.1"),
            ("NVENC", has_nvenc, encode, "libnvidia-encode.so.1"),
        ] {
            if has && !usable {
                tracing::warn!(
                    "gpu{index} has {engine}, but libcuda.so.1 or {lib} cannot be loaded \
                     (a container without the driver's video capability?): its work stays on \
                     the CPU"
                );
            }
        }
        let (has_nvdec, has_nvenc) = (has_nvdec && cuvid, has_nvenc && encode);
        devices.push(Device {
            index,
            name: d.name().map_err(|e| e.to_string())?,
            memory_mb,
            compute_units: COMPUTE_UNITS_PER_DEVICE,
            nvenc_sessions: if has_nvenc { SESSIONS_PER_ENGINE } else { 0 },
            nvdec_sessions: if has_nvdec { SESSIONS_PER_ENGINE } else { 0 },
            mig: d.mig_mode().is_ok_and(|m| m.current == 1),
            utilization_pct: d.utilization_rates().ok().map(|u| u.gpu),
        });
    }
    Ok(Inventory {
        source: Source::Nvml { driver },
        devices,
        cpu_units: declared.cpu_units,
        temp_disk_mb: declared.temp_disk_mb,
    })
}
