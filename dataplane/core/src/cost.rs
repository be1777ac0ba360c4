//! Cost estimation from the model capability matrix (design.md §4, "Resource units").
//!
//! `fairness_units = max(provider_s / provider_s_base, cost / cost_base, gpu_s / gpu_s_base)`: the
//! dominant bottleneck, used only to choose between tenants. The per-dimension demands (provider
//! slot, GPU, CPU, temp disk, cost) are checked separately at dispatch.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{ModelId, ProviderId};
use crate::limits::{DURATION_MS_MAX, PIXELS_MAX, REFERENCES_MAX};
use crate::units::{Units, MILLI_PER_UNIT};

/// What a client asks for. Every field is a claim the server re-derives cost from; none of them
/// sets lane, weight or priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskSpec {
    pub model: ModelId,
    pub width: u32,
    pub height: u32,
    pub duration_ms: u32,
    pub fps: u32,
    pub audio: bool,
    pub references: u8,
}

impl TaskSpec {
    /// A 720p clip of 5 s at 24 fps without audio or references of `model`: the everyday small
    /// task of tests, examples, benches and the loadgen.
    pub const fn clip_720p(model: ModelId) -> TaskSpec {
        TaskSpec {
            model,
            width: 1280,
            height: 720,
            duration_ms: 5_000,
            fps: 24,
            audio: false,
            references: 0,
        }
    }
}

/// One resolution tier of a model: up to `max_pixels`, the factor on provider time and cost, and
/// what the media stage needs to transcode it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolutionTier {
    pub max_pixels: u64,
    pub factor_milli: u64,
    /// Concurrency a running task of this tier holds in lane pools and running-unit limits.
    pub slot_units: u32,
    pub cpu_units: u32,
    pub gpu_units: u32,
    pub gpu_mem_mb: u32,
}

/// When a task counts as high-cost and goes to the EXPENSIVE lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpensiveRule {
    pub min_pixels: u64,
    pub min_duration_ms: u32,
    pub min_references: u8,
    pub audio: bool,
}

/// One row of the model capability matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCapability {
    pub id: ModelId,
    pub name: String,
    /// Provider seconds (in ms) per second of output at tier factor 1, `fps_base`, no audio.
    pub provider_ms_per_output_s: u64,
    /// Cost in milli cost-units per second of output at tier factor 1.
    pub cost_milli_per_output_s: u64,
    /// GPU ms the media stage spends per second of output at tier factor 1.
    pub media_gpu_ms_per_output_s: u64,
    /// Temp disk the media stage needs per second of output.
    pub temp_disk_mb_per_output_s: u32,
    pub fps_base: u32,
    pub fps_max: u32,
    /// Multiplier (milli) when audio is generated.
    pub audio_factor_milli: u64,
    /// Added factor (milli) per reference input.
    pub reference_factor_milli: u64,
    pub max_duration_ms: u32,
    /// Sorted by `max_pixels`; a frame above the last tier is refused.
    pub tiers: Vec<ResolutionTier>,
    pub expensive: ExpensiveRule,
    /// Providers able to serve the model, in preference order.
    pub providers: Vec<ProviderId>,
}

/// The denominators of the fairness unit (design.md §4: 30 s, 0.1 cost, 30 GPU s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostBases {
    pub provider_ms: u64,
    pub cost_milli: u64,
    pub gpu_ms: u64,
}

impl Default for CostBases {
    fn default() -> Self {
        CostBases {
            provider_ms: 30_000,
            cost_milli: 100,
            gpu_ms: 30_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// Four bytes, not one: placed last in a `CostEstimate`, a one-byte class left seven bytes
// of padding that copies of the estimate moved as a byte and two overlapping 4-byte moves,
// and reading the admission's copy back then waited on a store-forwarding stall (perf
// annotate: 29 % of `handle_submit`'s samples on that load; docs/benchmarks/journal.md, eighth
// round).
#[repr(u32)]
pub enum ResourceClass {
    Standard,
    Expensive,
}

/// What the media stage holds while it transcodes one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MediaDemand {
    pub cpu_units: u32,
    pub gpu_units: u32,
    pub gpu_mem_mb: u32,
    pub temp_disk_mb: u32,
}

/// The server's estimate of a task, derived only from the spec and the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostEstimate {
    pub provider_ms: u64,
    pub cost_milli: u64,
    pub media_gpu_ms: u64,
    /// Dominant-resource cost over the task's whole run: what DRR charges.
    pub fairness: Units,
    /// Concurrency held while running (lane pools, running units): not scaled by duration,
    /// because holding a slot longer is already what `fairness` charges for.
    pub slots: Units,
    pub class: ResourceClass,
    pub media: MediaDemand,
}

/// A spec the matrix cannot price. Each names the field and the bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostError {
    UnknownModel(ModelId),
    ZeroField(&'static str),
    DurationTooLong { duration_ms: u32, max_ms: u32 },
    FrameTooLarge { pixels: u64, max_pixels: u64 },
    FpsTooHigh { fps: u32, max: u32 },
    TooManyReferences { references: u8, max: u8 },
}

impl fmt::Display for CostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CostError::UnknownModel(m) => write!(f, "model {m} is not in the capability matrix"),
            CostError::ZeroField(field) => write!(f, "field `{field}` must be greater than zero"),
            CostError::DurationTooLong {
                duration_ms,
                max_ms,
            } => {
                write!(
                    f,
                    "duration_ms {duration_ms} exceeds the model's maximum {max_ms}"
                )
            }
            CostError::FrameTooLarge { pixels, max_pixels } => {
                write!(
                    f,
                    "frame of {pixels} pixels exceeds the maximum {max_pixels}"
                )
            }
            CostError::FpsTooHigh { fps, max } => write!(f, "fps {fps} exceeds the maximum {max}"),
            CostError::TooManyReferences { references, max } => {
                write!(f, "{references} references exceed the maximum {max}")
            }
        }
    }
}

impl std::error::Error for CostError {}

/// Prices `spec` with `model`'s row. Pure integer arithmetic: same input, same units, everywhere.
pub fn estimate(
    spec: &TaskSpec,
    model: &ModelCapability,
    bases: &CostBases,
) -> Result<CostEstimate, CostError> {
    if spec.width == 0 {
        return Err(CostError::ZeroField("width"));
    }
    if spec.height == 0 {
        return Err(CostError::ZeroField("height"));
    }
    if spec.duration_ms == 0 {
        return Err(CostError::ZeroField("duration_ms"));
    }
    if spec.fps == 0 {
        return Err(CostError::ZeroField("fps"));
    }
    let max_ms = model.max_duration_ms.min(DURATION_MS_MAX);
    if spec.duration_ms > max_ms {
        return Err(CostError::DurationTooLong {
            duration_ms: spec.duration_ms,
            max_ms,
        });
    }
    if spec.fps > model.fps_max {
        return Err(CostError::FpsTooHigh {
            fps: spec.fps,
            max: model.fps_max,
        });
    }
    if spec.references > REFERENCES_MAX {
        return Err(CostError::TooManyReferences {
            references: spec.references,
            max: REFERENCES_MAX,
        });
    }
    let pixels = u64::from(spec.width) * u64::from(spec.height);
    let max_pixels = model
        .tiers
        .last()
        .map_or(0, |t| t.max_pixels)
        .min(PIXELS_MAX);
    let tier = model
        .tiers
        .iter()
        .find(|t| pixels <= t.max_pixels && pixels <= PIXELS_MAX)
        .ok_or(CostError::FrameTooLarge { pixels, max_pixels })?;

    // factor = tier × fps/fps_base × audio × (1 + refs × reference_factor), all in milli.
    let mut factor = tier.factor_milli;
    factor = factor * u64::from(spec.fps.max(model.fps_base)) / u64::from(model.fps_base);
    if spec.audio {
        factor = factor * model.audio_factor_milli / MILLI_PER_UNIT;
    }
    factor = factor * (MILLI_PER_UNIT + u64::from(spec.references) * model.reference_factor_milli)
        / MILLI_PER_UNIT;

    let duration_ms = u64::from(spec.duration_ms);
    let scaled = |per_output_s: u64| duration_ms * per_output_s / 1000 * factor / MILLI_PER_UNIT;
    let provider_ms = scaled(model.provider_ms_per_output_s);
    let cost_milli = scaled(model.cost_milli_per_output_s);
    let media_gpu_ms = scaled(model.media_gpu_ms_per_output_s);

    let fairness_milli = fairness_milli(provider_ms, cost_milli, media_gpu_ms, bases);

    let rule = &model.expensive;
    let expensive = pixels >= rule.min_pixels
        || spec.duration_ms >= rule.min_duration_ms
        || spec.references >= rule.min_references
        || (rule.audio && spec.audio);
    let class = if expensive {
        ResourceClass::Expensive
    } else {
        ResourceClass::Standard
    };
    let output_s = spec.duration_ms.div_ceil(1000);
    Ok(CostEstimate {
        provider_ms,
        cost_milli,
        media_gpu_ms,
        fairness: Units(fairness_milli),
        slots: Units::whole(u64::from(tier.slot_units.max(1))),
        class,
        media: MediaDemand {
            cpu_units: tier.cpu_units,
            gpu_units: tier.gpu_units,
            gpu_mem_mb: tier.gpu_mem_mb,
            temp_disk_mb: model.temp_disk_mb_per_output_s * output_s,
        },
    })
}

/// The dominant resource's share of its base (design.md §4), in milli-units, at least 1.
fn fairness_milli(provider_ms: u64, cost_milli: u64, media_gpu_ms: u64, bases: &CostBases) -> u64 {
    (provider_ms * MILLI_PER_UNIT / bases.provider_ms)
        .max(cost_milli * MILLI_PER_UNIT / bases.cost_milli)
        .max(media_gpu_ms * MILLI_PER_UNIT / bases.gpu_ms)
        .max(1)
}

impl CostEstimate {
    /// This estimate with its cost × `factor_milli` / 1000 (a model's calibration: what its
    /// tasks really cost, `shard::calibration`), its fairness recomputed over the new cost.
    pub fn with_cost_factor(mut self, factor_milli: u32, bases: &CostBases) -> CostEstimate {
        if factor_milli == 1_000 {
            return self;
        }
        let cost = u128::from(self.cost_milli) * u128::from(factor_milli) / 1_000;
        self.cost_milli = u64::try_from(cost).unwrap_or(u64::MAX / MILLI_PER_UNIT);
        self.fairness = Units(fairness_milli(
            self.provider_ms,
            self.cost_milli,
            self.media_gpu_ms,
            bases,
        ));
        self
    }
}

/// A small matrix row used by tests, benches and the default scenarios: 720p ×1, 1080p ×1.5,
/// 4K ×3 (and two slots); 6 provider-seconds per output second; 4K or ≥30 s or audio counts as
/// expensive.
pub fn example_model(id: ModelId, providers: Vec<ProviderId>) -> ModelCapability {
    ModelCapability {
        id,
        name: format!("video-model-{}", id.0),
        provider_ms_per_output_s: 6_000,
        cost_milli_per_output_s: 10,
        media_gpu_ms_per_output_s: 1_500,
        temp_disk_mb_per_output_s: 20,
        fps_base: 24,
        fps_max: 60,
        audio_factor_milli: 1_300,
        reference_factor_milli: 100,
        max_duration_ms: 120_000,
        tiers: vec![
            ResolutionTier {
                max_pixels: 1280 * 720,
                factor_milli: 1_000,
                slot_units: 1,
                cpu_units: 1,
                gpu_units: 0,
                gpu_mem_mb: 0,
            },
            ResolutionTier {
                max_pixels: 1920 * 1080,
                factor_milli: 1_500,
                slot_units: 1,
                cpu_units: 2,
                gpu_units: 0,
                gpu_mem_mb: 0,
            },
            ResolutionTier {
                max_pixels: 3840 * 2160,
                factor_milli: 3_000,
                slot_units: 2,
                cpu_units: 6,
                gpu_units: 1,
                gpu_mem_mb: 4_096,
            },
        ],
        expensive: ExpensiveRule {
            min_pixels: 3840 * 2160,
            min_duration_ms: 30_000,
            min_references: 3,
            audio: true,
        },
        providers,
    }
}

#[cfg(test)]
mod tests {
    use expect_test::{expect, Expect};

    use super::*;

    fn check(spec: TaskSpec, expected: Expect) {
        let model = example_model(ModelId(0), vec![ProviderId(0)]);
        let actual = match estimate(&spec, &model, &CostBases::default()) {
            Ok(e) => format!(
                "fairness={} provider_ms={} cost_milli={} gpu_ms={} class={:?} cpu={} gpu={}",
                e.fairness,
                e.provider_ms,
                e.cost_milli,
                e.media_gpu_ms,
                e.class,
                e.media.cpu_units,
                e.media.gpu_units
            ),
            Err(err) => format!("error: {err}"),
        };
        expected.assert_eq(&actual);
    }

    fn spec(w: u32, h: u32, duration_s: u32) -> TaskSpec {
        TaskSpec {
            model: ModelId(0),
            width: w,
            height: h,
            duration_ms: duration_s * 1000,
            fps: 24,
            audio: false,
            references: 0,
        }
    }

    #[test]
    fn short_720p_is_one_unit() {
        check(
            spec(1280, 720, 5),
            expect!["fairness=1.000u provider_ms=30000 cost_milli=50 gpu_ms=7500 class=Standard cpu=1 gpu=0"],
        );
    }

    #[test]
    fn long_4k_is_dominated_by_provider_time() {
        check(
            spec(3840, 2160, 60),
            expect!["fairness=36.000u provider_ms=1080000 cost_milli=1800 gpu_ms=270000 class=Expensive cpu=6 gpu=1"],
        );
    }

    #[test]
    fn audio_and_references_raise_the_factor() {
        let mut s = spec(1920, 1080, 10);
        s.audio = true;
        s.references = 2;
        check(
            s,
            expect!["fairness=4.680u provider_ms=140400 cost_milli=234 gpu_ms=35100 class=Expensive cpu=2 gpu=0"],
        );
    }

    #[test]
    fn bad_specs_name_the_problem() {
        check(
            spec(7680, 4320, 5),
            expect!["error: frame of 33177600 pixels exceeds the maximum 8294400"],
        );
        check(
            spec(1280, 720, 0),
            expect!["error: field `duration_ms` must be greater than zero"],
        );
        check(
            spec(1280, 720, 600),
            expect!["error: duration_ms 600000 exceeds the model's maximum 120000"],
        );
        let mut s = spec(1280, 720, 5);
        s.fps = 240;
        check(s, expect!["error: fps 240 exceeds the maximum 60"]);
    }
}
