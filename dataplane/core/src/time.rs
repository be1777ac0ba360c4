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

    /// The time of the instant `at` on a clock whose zero is the instant `epoch` (zero for an
    /// `at` before it): how a shell turns its clock's readings into the core's time.
    pub fn of(at: std::time::Instant, epoch: std::time::Instant) -> Time {
        Time(at.saturating_duration_since(epoch).as_nanos() as u64)
    }

    /// Nanoseconds from `earlier` to `self`, zero if `earlier` is later (a clock that jumped back).
    pub fn since(self, earlier: Time) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn an_instant_is_its_distance_from_the_epoch_and_never_before_zero() {
        let epoch = Instant::now();
        let later = epoch + Duration::from_millis(1_500);
        assert_eq!(Time::of(later, epoch), Time::from_ms(1_500));
        assert_eq!(Time::of(epoch, later), Time::ZERO);
    }
}
