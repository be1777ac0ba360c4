//! Media capacity in units per engine — GPU compute, GPU memory, NVENC and NVDEC sessions per
//! device, CPU units, temp disk — shared by every shard and media worker. Each engine is a
//! lock-free [`SlotCounter`] (loom-checked); a demand on several engines is all-or-nothing:
//! taken in a fixed order and given back if any part does not fit, so no engine ever goes
//! above its capacity and nothing is left held by a demand that failed. A [`Grant`] gives its
//! units back when dropped, so a job that ends any way at all releases exactly once.
//!
//! A device that goes missing (an inventory refresh no longer finds it) is marked offline: its
//! engines then have no capacity for new work, while the grants already held on it are given
//! back as they end; it comes back online if a later refresh finds it again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use spindle_sync::SlotCounter;

use crate::inventory::Inventory;

/// One engine of the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Engine {
    GpuCompute(u32),
    GpuMemMb(u32),
    Nvenc(u32),
    Nvdec(u32),
    Cpu,
    TempDiskMb,
}

impl Engine {
    /// The device whose engine this is (`None` for the CPU and temp disk).
    pub fn device(self) -> Option<u32> {
        match self {
            Engine::GpuCompute(d) | Engine::GpuMemMb(d) | Engine::Nvenc(d) | Engine::Nvdec(d) => {
                Some(d)
            }
            Engine::Cpu | Engine::TempDiskMb => None,
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engine::GpuCompute(d) => write!(f, "gpu{d}:compute"),
            Engine::GpuMemMb(d) => write!(f, "gpu{d}:mem_mb"),
            Engine::Nvenc(d) => write!(f, "gpu{d}:nvenc"),
            Engine::Nvdec(d) => write!(f, "gpu{d}:nvdec"),
            Engine::Cpu => write!(f, "cpu"),
            Engine::TempDiskMb => write!(f, "temp_disk_mb"),
        }
    }
}

/// A demand on engines that did not fit: the first engine that said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{engine} has {free} of {capacity} free, {wanted} wanted")]
pub struct Exhausted {
    pub engine: Engine,
    pub free: u64,
    pub capacity: u64,
    pub wanted: u64,
}

#[derive(Debug)]
pub struct MediaLedger {
    engines: BTreeMap<Engine, SlotCounter>,
    /// Per device of the inventory: whether new work may be placed on it.
    online: BTreeMap<u32, AtomicBool>,
}

/// Units held on engines; given back on drop.
#[derive(Debug)]
pub struct Grant {
    ledger: Arc<MediaLedger>,
    held: Vec<(Engine, u64)>,
}

impl Grant {
    pub fn held(&self) -> &[(Engine, u64)] {
        &self.held
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        for &(engine, units) in &self.held {
            if let Some(c) = self.ledger.engines.get(&engine) {
                c.release(units);
            }
        }
    }
}

impl MediaLedger {
    /// Every engine of `inventory`, empty. Engines a device lacks (NVENC on an H200) are absent.
    pub fn new(inventory: &Inventory) -> MediaLedger {
        let mut engines = BTreeMap::new();
        let mut add = |e: Engine, capacity: u64| {
            if capacity > 0 {
                engines.insert(e, SlotCounter::new(capacity));
            }
        };
        for d in &inventory.devices {
            add(Engine::GpuCompute(d.index), d.compute_units);
            add(Engine::GpuMemMb(d.index), d.memory_mb);
            add(Engine::Nvenc(d.index), d.nvenc_sessions);
            add(Engine::Nvdec(d.index), d.nvdec_sessions);
        }
        add(Engine::Cpu, inventory.cpu_units);
        add(Engine::TempDiskMb, inventory.temp_disk_mb);
        let online = inventory
            .devices
            .iter()
            .map(|d| (d.index, AtomicBool::new(true)))
            .collect();
        MediaLedger { engines, online }
    }

    pub fn has(&self, engine: Engine) -> bool {
        self.engines.contains_key(&engine)
    }

    /// Whether `engine` may take new work: not an engine of an offline device.
    fn available(&self, engine: Engine) -> bool {
        engine.device().is_none_or(|d| self.is_online(d))
    }

    /// Whether new work may be placed on device `device` (false for an unknown one).
    pub fn is_online(&self, device: u32) -> bool {
        self.online
            .get(&device)
            .is_some_and(|o| o.load(Ordering::Acquire))
    }

    /// Marks `device` online or offline; returns whether that changed anything. Grants held on
    /// an offline device stay valid until they are dropped.
    pub fn set_online(&self, device: u32, online: bool) -> bool {
        self.online
            .get(&device)
            .is_some_and(|o| o.swap(online, Ordering::AcqRel) != online)
    }

    /// Applies a fresh inventory: a device of the ledger that `now` no longer lists goes offline,
    /// one it lists again comes back. Returns each change (device, online) for the log.
    pub fn apply_refresh(&self, now: &Inventory) -> Vec<(u32, bool)> {
        self.online
            .keys()
            .filter_map(|&d| {
                let present = now.devices.iter().any(|n| n.index == d);
                self.set_online(d, present).then_some((d, present))
            })
            .collect()
    }

    /// (capacity, used) of `engine`; an offline device's engines have no capacity.
    pub fn usage(&self, engine: Engine) -> Option<(u64, u64)> {
        self.engines.get(&engine).map(|c| {
            (
                if self.available(engine) {
                    c.capacity()
                } else {
                    0
                },
                c.used(),
            )
        })
    }

    /// Every engine with its capacity (none while its device is offline) and usage, for
    /// `/metrics`.
    pub fn snapshot(&self) -> Vec<(Engine, u64, u64)> {
        self.engines
            .keys()
            .filter_map(|&e| self.usage(e).map(|(cap, used)| (e, cap, used)))
            .collect()
    }

    /// Takes every part of `demand` or none of it.
    pub fn try_acquire(self: &Arc<Self>, demand: &[(Engine, u64)]) -> Result<Grant, Exhausted> {
        let mut parts: Vec<(Engine, u64)> =
            demand.iter().copied().filter(|(_, u)| *u > 0).collect();
        // One order for everyone; repeated engines merged.
        parts.sort();
        parts.dedup_by(|b, a| {
            if a.0 == b.0 {
                a.1 += b.1;
                true
            } else {
                false
            }
        });
        let mut grant = Grant {
            ledger: self.clone(),
            held: Vec::with_capacity(parts.len()),
        };
        for (engine, units) in parts {
            let counter = self.engines.get(&engine).filter(|_| self.available(engine));
            let Some(counter) = counter else {
                return Err(Exhausted {
                    engine,
                    free: 0,
                    capacity: 0,
                    wanted: units,
                });
            };
            if let Err(e) = counter.try_acquire(units) {
                // `grant` gives back what it took when it drops here.
                return Err(Exhausted {
                    engine,
                    free: e.capacity - e.used.min(e.capacity),
                    capacity: e.capacity,
                    wanted: units,
                });
            }
            grant.held.push((engine, units));
        }
        Ok(grant)
    }
}
