//! What the load generator offers: tenants with a rate, the arrival process, the task mix.

use std::time::Duration;

use spindle_core::{Band, ModelId, TaskSpec, UserId};
use spindle_wire::SubmitTask;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Arrival {
    /// Evenly spaced sends; tenants' first frames offset across one frame period.
    Fixed,
    /// Exponential gaps (seeded): bursts and lulls at the same mean rate.
    Poisson,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TenantLoad {
    pub tenant: u32,
    #[serde(skip)]
    pub credential: String,
    /// Tasks per second offered.
    pub rate: f64,
    /// A spell at another rate (the demo's spike).
    #[serde(skip)]
    pub spike: Option<Spike>,
}

/// A spell during which a tenant offers `rate` instead of its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spike {
    /// From this long after the start, for `lasting`.
    pub at: Duration,
    pub lasting: Duration,
    pub rate: f64,
}

impl TenantLoad {
    /// The rate offered `elapsed` after the start.
    pub fn rate_at(&self, elapsed: Duration) -> f64 {
        match self.spike {
            Some(s) if elapsed >= s.at && elapsed < s.at + s.lasting => s.rate,
            _ => self.rate,
        }
    }

    /// Tasks offered over `duration` from the start, on average a second.
    pub fn mean_rate(&self, duration: Duration) -> f64 {
        let Some(s) = self.spike else {
            return self.rate;
        };
        let total = duration.as_secs_f64().max(1e-9);
        let end = (s.at + s.lasting).min(duration);
        let spiked = end.saturating_sub(s.at).as_secs_f64();
        (self.rate * (total - spiked) + s.rate * spiked) / total
    }
}

impl TenantLoad {
    /// `ID:CREDENTIAL:RATE`.
    pub fn parse(s: &str) -> anyhow::Result<TenantLoad> {
        let parts: Vec<&str> = s.split(':').collect();
        anyhow::ensure!(
            parts.len() == 3,
            "tenant load {s:?} is not ID:CREDENTIAL:RATE"
        );
        let rate: f64 = parts[2].parse()?;
        anyhow::ensure!(
            rate > 0.0 && rate <= 1_000_000.0,
            "rate {rate} out of range"
        );
        Ok(TenantLoad {
            tenant: parts[0].parse()?,
            credential: parts[1].to_string(),
            rate,
            spike: None,
        })
    }
}

/// splitmix64: a seeded, dependency-free generator for arrival gaps and task mixes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// The gap before the next arrival at `rate` per second.
pub fn gap(arrival: Arrival, rate: f64, rng: &mut Rng) -> Duration {
    let mean = 1.0 / rate;
    match arrival {
        Arrival::Fixed => Duration::from_secs_f64(mean),
        Arrival::Poisson => Duration::from_secs_f64(-mean * rng.unit().ln()),
    }
}

/// A JSON input of exactly `bytes` bytes (`{"prompt":"xx…"}`); `None` for 0.
pub fn input_of(bytes: usize) -> anyhow::Result<Option<String>> {
    const FRAME: usize = r#"{"prompt":""}"#.len();
    let max = spindle_wire::limits::INPUT_BYTES_MAX;
    match bytes {
        0 => Ok(None),
        n if (FRAME..=max).contains(&n) => {
            Ok(Some(format!(r#"{{"prompt":"{}"}}"#, "x".repeat(n - FRAME))))
        }
        n => anyhow::bail!("--input-bytes must be 0 or {FRAME}..={max}, not {n}"),
    }
}

/// The simulator's mix, smallest first: mostly 720p/5 s, some 1080p/10 s with audio, a few
/// 1080p/30 s with references.
pub fn task(key: String, user: u32, rng: &mut Rng) -> SubmitTask {
    let roll = rng.next_u64() % 100;
    let (width, height, duration_ms, audio, references) = match roll {
        0..=69 => (1280, 720, 5_000, false, 0),
        70..=94 => (1920, 1080, 10_000, true, 0),
        _ => (1920, 1080, 30_000, true, 2),
    };
    SubmitTask {
        idempotency_key: key,
        user: UserId(user),
        spec: TaskSpec {
            model: ModelId(0),
            width,
            height,
            duration_ms,
            fps: 24,
            audio,
            references,
        },
        band_hint: Some(Band::P3),
        deadline_ms: None,
        input: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_have_the_asked_size_and_parse() {
        assert_eq!(input_of(0).unwrap(), None);
        for n in [13, 14, 1024, spindle_wire::limits::INPUT_BYTES_MAX] {
            let input = input_of(n).unwrap().unwrap();
            assert_eq!(input.len(), n);
            serde_json::from_str::<serde_json::Value>(&input).unwrap();
        }
        assert!(input_of(12).is_err());
        assert!(input_of(spindle_wire::limits::INPUT_BYTES_MAX + 1).is_err());
    }

    #[test]
    fn a_spike_changes_the_rate_for_its_spell_only() {
        let s = Duration::from_secs;
        let mut load = TenantLoad::parse("1:a:100").unwrap();
        assert_eq!(load.rate_at(s(5)), 100.0);
        assert_eq!(load.mean_rate(s(10)), 100.0);
        load.spike = Some(Spike {
            at: s(4),
            lasting: s(2),
            rate: 600.0,
        });
        assert_eq!(load.rate_at(Duration::from_millis(3_999)), 100.0);
        assert_eq!(load.rate_at(s(4)), 600.0);
        assert_eq!(load.rate_at(Duration::from_millis(5_999)), 600.0);
        assert_eq!(load.rate_at(s(6)), 100.0);
        // 8 s at 100 and 2 s at 600 over 10 s; a window ending inside the spike counts its part.
        assert_eq!(load.mean_rate(s(10)), 200.0);
        assert_eq!(load.mean_rate(s(5)), 200.0);
    }
}
