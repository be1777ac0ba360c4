//! Every maximum of the control plane in one place.

/// Rows in one submit, claim or report batch: one transaction, one round trip.
pub const BATCH_MAX: usize = 4096;
/// Pool shards one claim may demand (the core's `Demand` holds at most 16 needs).
pub const DEMANDS_PER_CLAIM_MAX: usize = 16;
/// Bytes of a client's idempotency key.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 128;
/// Bytes of a task's canonical payload (the request a replay is compared against: its spec and
/// its input for the provider, up to 16 KiB of it).
pub const PAYLOAD_BYTES_MAX: usize = 20 * 1024;
/// Bytes of a pool key, a provider name, a node id, a reason.
pub const NAME_BYTES_MAX: usize = 128;
pub const POOL_KEY_BYTES_MAX: usize = 200;
pub const REASON_BYTES_MAX: usize = 1024;
/// Bytes of a succeeded task's result (its outputs' locations, as JSON).
pub const RESULT_BYTES_MAX: usize = 4096;
/// Shards one pool may be split into.
pub const POOL_SHARDS_MAX: u16 = 256;
/// Partitions tenants hash into.
pub const PARTITIONS_MAX: u32 = 65_536;
/// Rows one reconciler pass or one relay pass looks at.
pub const SCAN_MAX: usize = 10_000;
/// Connection attempts of `Db::open_with_backoff` before it reports `Unavailable`.
pub const CONNECT_ATTEMPTS_MAX: u32 = 10;
