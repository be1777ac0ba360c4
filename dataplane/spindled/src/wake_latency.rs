//! How soon an idle CPU must be able to run again: Linux's PM QoS request
//! (`/dev/cpu_dma_latency`), held for as long as the node runs.
//!
//! A submit is acknowledged after its commit's WAL flush, and every step of it (the frame
//! arriving, the control plane's call, the flush completing) wakes a thread on a CPU that may be
//! idle. On a virtual machine whose idle CPUs halt (this project's bench machines: the
//! `haltpoll` idle driver with guest polling off), each such wake-up goes through the
//! hypervisor: a one-row insert and commit answered in 2.1–3.1 ms at 300 a second and in 0.8 ms
//! with this request at 0 µs, which keeps idle CPUs polling instead (docs/benchmarks/journal.md,
//! "Thirteenth round"). The price is CPUs that spin while idle (power, and host CPU on a shared
//! machine), so it is off unless `cpu_wake_latency_us` is set.
//!
//! The kernel applies the smallest value any open request asks for and drops a request when its
//! file is closed — with the process, however it ends.

use std::io::{Read, Write};

/// The kernel's interface for the CPU latency request.
pub const DEVICE: &str = "/dev/cpu_dma_latency";

/// Why the request could not be made.
#[derive(Debug, thiserror::Error)]
pub enum WakeLatencyError {
    #[error("opening {DEVICE} (needs root or CAP_SYS_ADMIN, and Linux's PM QoS): {0}")]
    Open(std::io::Error),
    #[error("writing {value} µs to {DEVICE}: {source}")]
    Write { value: u32, source: std::io::Error },
    #[error("{value} µs is more than PM QoS takes (at most {max})")]
    TooLarge { value: u32, max: u32 },
}

/// An open request: idle CPUs wake within the asked microseconds while it lives.
#[derive(Debug)]
pub struct WakeLatency {
    _file: std::fs::File,
    micros: u32,
}

impl WakeLatency {
    /// The microseconds this request asks for.
    pub fn micros(&self) -> u32 {
        self.micros
    }
}

/// Asks that no CPU take longer than `micros` µs to wake, until the returned request is dropped.
pub fn hold(micros: u32) -> Result<WakeLatency, WakeLatencyError> {
    let max = i32::MAX as u32;
    if micros > max {
        return Err(WakeLatencyError::TooLarge { value: micros, max });
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(DEVICE)
        .map_err(WakeLatencyError::Open)?;
    // The device takes a native-endian 32-bit integer.
    file.write_all(&(micros as i32).to_ne_bytes())
        .map_err(|source| WakeLatencyError::Write {
            value: micros,
            source,
        })?;
    Ok(WakeLatency {
        _file: file,
        micros,
    })
}

/// The latency in force now: the smallest any open request asks for, or the kernel's default.
pub fn current() -> std::io::Result<i32> {
    let mut bytes = [0u8; 4];
    std::fs::File::open(DEVICE)?.read_exact(&mut bytes)?;
    Ok(i32::from_ne_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_request_is_in_force_until_dropped_or_the_failure_names_the_device() {
        let before = current();
        match hold(7) {
            Ok(held) => {
                assert_eq!(held.micros(), 7);
                let before = before.expect("readable before");
                let during = current().expect("readable while held");
                assert!(during <= before.min(7), "in force while held: {during}");
                drop(held);
                let after = current().expect("readable after");
                assert_eq!(after, before, "dropped with its file");
            }
            // A machine without the device or the privilege: the node logs this and runs on.
            Err(e) => {
                let text = e.to_string();
                assert!(
                    matches!(e, WakeLatencyError::Open(_)) && text.contains(DEVICE),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn a_value_pm_qos_cannot_take_is_refused_before_the_device_is_touched() {
        let e = hold(u32::MAX).unwrap_err();
        assert!(
            matches!(
                e,
                WakeLatencyError::TooLarge {
                    value: u32::MAX,
                    ..
                }
            ),
            "{e}"
        );
    }
}
