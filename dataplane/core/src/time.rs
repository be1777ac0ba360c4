//! Injected time. The core never reads a clock: every `handle_*`/`poll_*` gets `now`.

use serde::{Deserialize, Serialize};

/// Nanoseconds since an epoch chosen by the shell (process start, or the simulator's zero).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Time(pub u64);

pub const NANOS_PER_MS: u64 = 1_000_000;
pub const NANOS_PER_S: u64 = 1_000_000_000;

impl Time {
    pub const ZERO: Time = Time(0);

    pub fn from_ms(ms: u64) -> Time {
        Time(ms * NANOS_PER_MS)
    }

    pub fn from_secs(s: u64) -> Time {
        Time(s * NANOS_PER_S)
    }

    pub fn as_nanos(self) -> u64 {
        self.0
    }

    pub fn as_ms(self) -> u64 {
        self.0 / NANOS_PER_MS
    }

    pub fn plus_ns(self, ns: u64) -> Time {
        Time(self.0.saturating_add(ns))
    }

    /// Nanoseconds from `earlier` to `self`, zero if `earlier` is later (a clock that jumped back).
    pub fn since(self, earlier: Time) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}
