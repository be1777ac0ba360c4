//! `[breaker]`: when a tenant refused too fast is suspended.

use serde::Deserialize;
use spindle_core::policy::RateSpec;

/// `[breaker]` in the configuration file.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Refusals a second a tenant may keep up; 0 turns the breaker off.
    #[serde(default = "default_refusals_per_s")]
    pub refusals_per_s: u64,
    /// Seconds' worth of them it may send at once.
    #[serde(default = "default_burst_s")]
    pub burst_s: u64,
    /// The first suspension.
    #[serde(default = "default_cooldown_ms")]
    pub cooldown_ms: u64,
    /// The longest: a trip within this long of the last one's end doubles the cooldown, up to
    /// this; a tenant quiet for this long starts again from `cooldown_ms`.
    #[serde(default = "default_cooldown_max_ms")]
    pub cooldown_max_ms: u64,
}

fn default_refusals_per_s() -> u64 {
    5_000
}

fn default_burst_s() -> u64 {
    10
}

fn default_cooldown_ms() -> u64 {
    1_000
}

fn default_cooldown_max_ms() -> u64 {
    60_000
}

impl Default for BreakerConfig {
    fn default() -> BreakerConfig {
        BreakerConfig {
            refusals_per_s: default_refusals_per_s(),
            burst_s: default_burst_s(),
            cooldown_ms: default_cooldown_ms(),
            cooldown_max_ms: default_cooldown_max_ms(),
        }
    }
}

impl BreakerConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.refusals_per_s <= 10_000_000,
            "breaker.refusals_per_s must be 0..=10000000"
        );
        anyhow::ensure!(
            (1..=3_600).contains(&self.burst_s),
            "breaker.burst_s must be 1..=3600"
        );
        anyhow::ensure!(
            (1..=self.cooldown_max_ms).contains(&self.cooldown_ms),
            "breaker.cooldown_ms must be 1..=cooldown_max_ms"
        );
        anyhow::ensure!(
            self.cooldown_max_ms <= 86_400_000,
            "breaker.cooldown_max_ms must be at most 86400000 (a day)"
        );
        Ok(())
    }

    /// The refusals a tenant may keep up, per minute, and at once.
    pub fn rate(&self) -> RateSpec {
        RateSpec {
            per_minute: self.refusals_per_s.saturating_mul(60),
            burst: self.refusals_per_s.saturating_mul(self.burst_s),
        }
    }
}
