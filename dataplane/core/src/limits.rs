//! Every named maximum of the core, in one place (TIGER_STYLE). Configuration may lower them;
//! nothing raises them.

/// Tenants one shard will hold state for.
pub const TENANTS_MAX: usize = 1 << 20;
/// Users one shard will hold state for.
pub const USERS_MAX: usize = 1 << 22;
/// Users one tenant may have records for on its shard at once: one with work here (queued or
/// running) or a submit rate still refilling. Records are keyed by tenant and user, and an idle
/// one is freed (`Shard::sweep_users`), so a tenant cycling user ids holds at most this many
/// and never reaches another tenant's users or the shard's bound.
pub const USERS_PER_TENANT_MAX: usize = 1 << 16;
/// Tasks one shard tracks at once (queued + running + media).
pub const TASKS_MAX: usize = 1 << 24;
/// Rows of the model capability matrix.
pub const MODELS_MAX: usize = 1024;
/// Provider quota boundaries (provider + account + region + model).
pub const PROVIDERS_MAX: usize = 1024;
/// Providers one model may be served by.
pub const PROVIDERS_PER_MODEL_MAX: usize = 8;
/// Limit keys one step may need (the provider stage needs at most 16).
pub const DEMAND_KEYS_MAX: usize = 16;
/// Tasks looked at behind a head that does not fit, per tenant turn.
pub const FIT_SCAN_MAX: usize = 64;
/// Skips of the same head before the tenant stops skipping and lets credit accumulate.
pub const SKIPS_MAX: u32 = 64;
/// Tenants visited in one `poll_dispatch` call before it yields to the shell.
pub const TENANT_VISITS_PER_POLL_MAX: usize = 256;
/// Tasks waiting for a retry (backoff) per shard.
pub const DELAYED_MAX: usize = 1 << 20;
/// Tasks waiting for a media slot per shard.
pub const MEDIA_QUEUE_MAX: usize = 1 << 20;
/// DRR burst rounds a deficit may accumulate.
pub const BURST_ROUNDS_MAX: u32 = 64;
/// Tenant weight bounds.
pub const WEIGHT_MAX: u32 = 10_000;
/// Attempts per task, whatever the lane says.
pub const ATTEMPTS_MAX: u32 = 64;
/// Longest execution timeout a lane may set (a week).
pub const EXECUTION_TIMEOUT_MS_MAX: u64 = 7 * 24 * 3_600_000;
/// Longest output a task may ask for.
pub const DURATION_MS_MAX: u32 = 10 * 60 * 1000;
/// Largest output frame a task may ask for (8K).
pub const PIXELS_MAX: u64 = 7680 * 4320;
/// Reference inputs per task.
pub const REFERENCES_MAX: u8 = 16;

/// Completions per model a shard keeps the cost ratio of, for its estimates' calibration
/// (`policy::CalibrationPolicy`).
pub const CALIBRATION_WINDOW: usize = 64;
