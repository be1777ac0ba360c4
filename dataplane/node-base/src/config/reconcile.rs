//! `[reconcile]`: the reconcilers' periods and bounds per pass.

use std::time::Duration;

/// The longest period of any job: a day.
pub const EVERY_MS_MAX: u64 = 86_400_000;

/// The reconcilers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    Attempts = 0,
    Orphans = 1,
    Costs = 2,
    Starvation = 3,
}

impl Job {
    pub const COUNT: usize = 4;
    pub const ALL: [Job; Job::COUNT] = [Job::Attempts, Job::Orphans, Job::Costs, Job::Starvation];

    pub fn name(self) -> &'static str {
        match self {
            Job::Attempts => "attempts",
            Job::Orphans => "orphans",
            Job::Costs => "costs",
            Job::Starvation => "starvation",
        }
    }
}

/// The `[reconcile]` section: each job's period (0 turns it off) and bound per pass.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcileConfig {
    pub attempts_every_ms: u64,
    /// Live attempts one pass hands the shards.
    pub attempts_rows_max: usize,
    /// An attempt in DISPATCHING or SUBMIT_UNKNOWN this long is looked at even with its lease
    /// renewed.
    pub stuck_after_ms: u64,
    pub orphans_every_ms: u64,
    /// Provider jobs one pass looks at (over all accounts).
    pub orphans_jobs_max: usize,
    pub costs_every_ms: u64,
    /// Succeeded tasks one pass asks the provider about.
    pub costs_rows_max: usize,
    /// A settled cost this far (‰) from the provider's is drift.
    pub cost_tolerance_permille: u64,
    pub starvation_every_ms: u64,
    /// Starving tasks one pass reads (and logs).
    pub starvation_rows_max: usize,
    /// A task that may start and has waited this long since its submission is starving.
    pub starved_after_ms: u64,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig {
            attempts_every_ms: 60_000,
            attempts_rows_max: 256,
            stuck_after_ms: 300_000,
            orphans_every_ms: 60_000,
            orphans_jobs_max: 1_000,
            costs_every_ms: 300_000,
            costs_rows_max: 256,
            cost_tolerance_permille: 10,
            starvation_every_ms: 60_000,
            starvation_rows_max: 100,
            starved_after_ms: 900_000,
        }
    }
}

impl ReconcileConfig {
    pub fn check(&self) -> anyhow::Result<()> {
        let scan = spindle_control::limits::SCAN_MAX;
        for (name, every, rows) in [
            ("attempts", self.attempts_every_ms, self.attempts_rows_max),
            ("orphans", self.orphans_every_ms, self.orphans_jobs_max),
            ("costs", self.costs_every_ms, self.costs_rows_max),
            (
                "starvation",
                self.starvation_every_ms,
                self.starvation_rows_max,
            ),
        ] {
            anyhow::ensure!(
                every == 0 || (100..=EVERY_MS_MAX).contains(&every),
                "reconcile.{name}_every_ms must be 0 (off) or 100..={EVERY_MS_MAX}"
            );
            anyhow::ensure!(
                (1..=scan).contains(&rows),
                "reconcile: the {name} job's bound per pass must be 1..={scan}"
            );
        }
        anyhow::ensure!(
            (1_000..=EVERY_MS_MAX).contains(&self.stuck_after_ms),
            "reconcile.stuck_after_ms must be 1000..={EVERY_MS_MAX}"
        );
        anyhow::ensure!(
            (1_000..=EVERY_MS_MAX).contains(&self.starved_after_ms),
            "reconcile.starved_after_ms must be 1000..={EVERY_MS_MAX}"
        );
        anyhow::ensure!(
            self.cost_tolerance_permille <= 1_000,
            "reconcile.cost_tolerance_permille must be 0..=1000"
        );
        Ok(())
    }

    pub fn every(&self, job: Job) -> Option<Duration> {
        let ms = match job {
            Job::Attempts => self.attempts_every_ms,
            Job::Orphans => self.orphans_every_ms,
            Job::Costs => self.costs_every_ms,
            Job::Starvation => self.starvation_every_ms,
        };
        (ms > 0).then(|| Duration::from_millis(ms))
    }
}
