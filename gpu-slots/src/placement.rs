//! Where a media job runs: best fit over the devices that have the engines it can use, with
//! affinity (a task's later stages prefer the device that ran its earlier ones). Decode goes to
//! a device's NVDEC when it has one; encode to its NVENC when it has one and to the CPU
//! otherwise (H100/H200 decode on the GPU and encode on the CPU). Without a fitting device the
//! whole job runs on the CPU.

use std::sync::Arc;

use crate::ledger::{Engine, Exhausted, Grant, MediaLedger};

/// What a job needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaDemand {
    /// GPU compute units when it runs on a device.
    pub gpu_units: u64,
    pub gpu_mem_mb: u64,
    /// CPU units for each CPU-side stage (decode, encode) it cannot put on a device.
    pub cpu_units_per_stage: u64,
    pub temp_disk_mb: u64,
}

/// What one transcode job (a rendition ladder) holds: CPU units for each stage that cannot run
/// on a device, and its temp disk. NVDEC and NVENC are engines of their own, so a job on a
/// device takes few of its compute units (the SMs only copy frames out).
pub const TRANSCODE_DEMAND: MediaDemand = MediaDemand {
    gpu_units: 5,
    gpu_mem_mb: 2_048,
    cpu_units_per_stage: 1,
    temp_disk_mb: 256,
};

#[derive(Debug)]
pub struct Placement {
    /// The device, if any stage runs on one.
    pub device: Option<u32>,
    pub decode_on_gpu: bool,
    pub encode_on_gpu: bool,
    pub grant: Grant,
}

/// Places `demand`: on `affinity` if it fits there, else on the device it fits most tightly
/// (least compute left after it: the emptier devices stay free for larger jobs), else on the
/// CPU. Returns why nothing fits when even the CPU is full.
pub fn place(
    ledger: &Arc<MediaLedger>,
    devices: &[u32],
    demand: MediaDemand,
    affinity: Option<u32>,
) -> Result<Placement, Exhausted> {
    let mut candidates: Vec<(u64, u32)> = devices
        .iter()
        .filter_map(|&d| {
            let (cap, used) = ledger.usage(Engine::GpuCompute(d))?;
            let left = cap.checked_sub(used)?.checked_sub(demand.gpu_units)?;
            let has_engine = ledger.has(Engine::Nvdec(d)) || ledger.has(Engine::Nvenc(d));
            has_engine.then_some((left, d))
        })
        .collect();
    candidates.sort();
    if let Some(a) = affinity {
        if let Some(i) = candidates.iter().position(|&(_, d)| d == a) {
            let preferred = candidates.remove(i);
            candidates.insert(0, preferred);
        }
    }
    for (_, d) in candidates {
        let decode_on_gpu = ledger.has(Engine::Nvdec(d));
        let encode_on_gpu = ledger.has(Engine::Nvenc(d));
        let cpu_stages = u64::from(!decode_on_gpu) + u64::from(!encode_on_gpu);
        let mut want = vec![
            (Engine::GpuCompute(d), demand.gpu_units),
            (Engine::GpuMemMb(d), demand.gpu_mem_mb),
            (Engine::Cpu, cpu_stages * demand.cpu_units_per_stage),
            (Engine::TempDiskMb, demand.temp_disk_mb),
        ];
        if decode_on_gpu {
            want.push((Engine::Nvdec(d), 1));
        }
        if encode_on_gpu {
            want.push((Engine::Nvenc(d), 1));
        }
        if let Ok(grant) = ledger.try_acquire(&want) {
            return Ok(Placement {
                device: Some(d),
                decode_on_gpu,
                encode_on_gpu,
                grant,
            });
        }
    }
    let grant = ledger.try_acquire(&[
        (Engine::Cpu, 2 * demand.cpu_units_per_stage),
        (Engine::TempDiskMb, demand.temp_disk_mb),
    ])?;
    Ok(Placement {
        device: None,
        decode_on_gpu: false,
        encode_on_gpu: false,
        grant,
    })
}
