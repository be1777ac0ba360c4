//! Estimates that follow what a model's tasks really cost (`policy::CalibrationPolicy`; seed
//! 000 §18.17.7). Per model, the shard keeps the ratio of reported to base cost (the matrix's
//! price, uncalibrated) of its last [`CALIBRATION_WINDOW`] completions; with enough of them,
//! new tasks are priced at the window's 95th percentile of it, within ×0.5..×4. The factor in
//! force moves only when that percentile moves by a tenth or more, so that the estimate cache
//! is not emptied at every completion; it is looked at once enough are seen and then every
//! [`REVIEW_EVERY`] completions (a sort of the window, kept off most completions).

use super::*;
use crate::limits::CALIBRATION_WINDOW;

/// Completions between two looks at the window's percentile.
const REVIEW_EVERY: u32 = 8;

/// The factor's bounds, in milli.
const FACTOR_MIN_MILLI: u32 = 500;
const FACTOR_MAX_MILLI: u32 = 4_000;

/// One model's window of cost ratios (milli, each within the factor's bounds) and the factor
/// new tasks are priced with.
#[derive(Debug, Clone)]
pub(super) struct ModelCalibration {
    ratios: [u16; CALIBRATION_WINDOW],
    len: u8,
    next: u8,
    factor_milli: u32,
    /// Completions recorded (wrapping).
    seen: u32,
}

impl Default for ModelCalibration {
    fn default() -> ModelCalibration {
        ModelCalibration {
            ratios: [0; CALIBRATION_WINDOW],
            len: 0,
            next: 0,
            factor_milli: 1_000,
            seen: 0,
        }
    }
}

impl ModelCalibration {
    pub(super) fn factor_milli(&self) -> u32 {
        self.factor_milli
    }

    /// Records one completion's ratio; the new factor when it moved (the caller re-prices).
    fn record(&mut self, ratio_milli: u64, samples_min: u32) -> Option<u32> {
        let ratio = ratio_milli.clamp(FACTOR_MIN_MILLI.into(), FACTOR_MAX_MILLI.into()) as u16;
        self.ratios[usize::from(self.next)] = ratio;
        self.next = ((usize::from(self.next) + 1) % CALIBRATION_WINDOW) as u8;
        self.len = (usize::from(self.len) + 1).min(CALIBRATION_WINDOW) as u8;
        self.seen = self.seen.wrapping_add(1);
        let len = u32::from(self.len);
        let review = len == samples_min || self.seen % REVIEW_EVERY == 0;
        if samples_min == 0 || len < samples_min || !review {
            return None;
        }
        let mut sorted = self.ratios;
        let seen = &mut sorted[..usize::from(self.len)];
        seen.sort_unstable();
        // The 95th percentile: the smallest ratio at or above 95 % of the window.
        let at = (seen.len() * 95).div_ceil(100) - 1;
        let p95 = u32::from(seen[at]);
        let moved = p95.abs_diff(self.factor_milli) * 10 >= self.factor_milli;
        moved.then(|| {
            self.factor_milli = p95;
            p95
        })
    }
}

/// The factor new tasks of `model` are priced with (milli; 1000 uncalibrated).
fn factor_of(calibration: &[ModelCalibration], model: crate::ModelId) -> u32 {
    calibration
        .get(usize::from(model.0))
        .map_or(1_000, ModelCalibration::factor_milli)
}

/// What `spec` costs by its model's row in `policy`, × the model's factor in `calibration`:
/// what a new task of it is priced at (its fields apart, so that the estimate cache can price
/// with it while it is borrowed).
pub(super) fn price_in(
    policy: &Policy,
    calibration: &[ModelCalibration],
    spec: &TaskSpec,
) -> Result<CostEstimate, crate::cost::CostError> {
    let model = policy
        .models
        .get(usize::from(spec.model.0))
        .ok_or(crate::cost::CostError::UnknownModel(spec.model))?;
    let bases = &policy.cost_bases;
    Ok(estimate(spec, model, bases)?.with_cost_factor(factor_of(calibration, spec.model), bases))
}

impl Shard {
    /// What `spec` costs by the model's row, calibrated: what a new task of it is priced at.
    pub fn price(&self, spec: &TaskSpec) -> Result<CostEstimate, crate::cost::CostError> {
        price_in(&self.policy, &self.calibration, spec)
    }

    /// The factor new tasks of `model` are priced with (milli; 1000 uncalibrated).
    pub fn cost_factor(&self, model: crate::ModelId) -> u32 {
        factor_of(&self.calibration, model)
    }

    /// Forgets what `model`'s completions said (its row changed).
    pub(super) fn reset_calibration(&mut self, model: crate::ModelId) {
        if let Some(c) = self.calibration.get_mut(usize::from(model.0)) {
            *c = ModelCalibration::default();
        }
    }

    /// A completion of a task priced `est` (for `spec`) whose measured fairness cost is
    /// `actual`: the node measures it as the estimate × reported / estimated cost, so the
    /// reported cost over the base price is `actual` / `est.fairness` × `est.cost` / base.
    pub(super) fn calibrate(&mut self, spec: &TaskSpec, est: &CostEstimate, actual: Units) {
        let samples_min = self.policy.calibration.samples_min;
        if samples_min == 0 || est.cost_milli == 0 {
            return;
        }
        let Some(model) = self.policy.models.get(usize::from(spec.model.0)) else {
            return;
        };
        let Ok(base) = estimate(spec, model, &self.policy.cost_bases) else {
            return;
        };
        if base.cost_milli == 0 {
            return;
        }
        let ratio = u128::from(actual.milli()) * u128::from(est.cost_milli) * 1_000
            / (u128::from(est.fairness.milli().max(1)) * u128::from(base.cost_milli));
        let i = usize::from(spec.model.0);
        if self.calibration.len() <= i {
            self.calibration
                .resize_with(i + 1, ModelCalibration::default);
        }
        let ratio = u64::try_from(ratio).unwrap_or(u64::MAX);
        if self.calibration[i].record(ratio, samples_min).is_some() {
            // New tasks of the model are priced anew; admitted ones keep their estimate.
            self.estimates.forget_model(spec.model);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_factor_is_the_windows_95th_percentile_once_enough_completions_are_seen() {
        let mut c = ModelCalibration::default();
        for _ in 0..15 {
            assert_eq!(c.record(2_000, 16), None, "fewer than 16 seen");
        }
        assert_eq!(c.factor_milli(), 1_000);
        assert_eq!(c.record(2_000, 16), Some(2_000));
        // Within a tenth of the factor: no change (the estimate cache stays).
        assert_eq!(c.record(2_150, 16), None);
        // 64 ratios 1.00, 1.01, …, 1.63: their 95th percentile is the 61st, 1.60.
        let mut c = ModelCalibration::default();
        for r in 0..64u64 {
            c.record(1_000 + 10 * r, 64);
        }
        assert_eq!(c.factor_milli(), 1_600);
        // The window forgets: 64 completions at 3.0 later, the factor is 3.0.
        for _ in 0..64 {
            c.record(3_000, 64);
        }
        assert_eq!(c.factor_milli(), 3_000);
    }

    #[test]
    fn ratios_are_held_within_half_and_four_times() {
        let mut c = ModelCalibration::default();
        assert_eq!(c.record(50_000, 1), Some(4_000));
        let mut c = ModelCalibration::default();
        assert_eq!(c.record(0, 1), Some(500));
    }
}
