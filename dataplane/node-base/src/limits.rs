//! Every named maximum of the node in one place: queues, tables, batches, retries and the
//! configuration's bounds (design.md §2, item 10: everything is bounded). Each is used where its
//! comment says (the file named above it); a new bound of the node goes here.

// node-base: config/mod.rs

/// The longest interval between counter checks (`counter_check_s`): a day.
pub const COUNTER_CHECK_S_MAX: u64 = 24 * 3600;

/// The longest CPU wake-up latency worth asking for: a second (PM QoS takes up to i32::MAX µs).
pub const CPU_WAKE_LATENCY_US_MAX: u32 = 1_000_000;

/// The most `task_inputs_mb` takes (1 TiB).
pub const TASK_INPUTS_MB_MAX: u32 = 1 << 20;

/// The most `http_connections_max` takes.
pub const HTTP_CONNECTIONS_MAX: usize = 65_536;

/// The most `connections_max` takes.
pub const CONNECTIONS_MAX: usize = 1 << 20;

/// The most `connection_rate_max` takes.
pub const CONNECTION_RATE_MAX: u32 = 1_000_000;

// node-base: credential.rs

/// The longest credential taken (a Hello's credential is bounded by its frame anyway).
pub const CHARS_MAX: usize = 1024;

// node-http/src/serve.rs

/// Bytes of a request's head.
pub const HEAD_BYTES_MAX: usize = 8 * 1024;

/// Callbacks remembered at most (past it the oldest are forgotten: a replay then still meets
/// the window).
pub const REPLAYS_MAX: usize = 65_536;

// node-http/src/admin.rs

/// Tasks one `POST /admin/v1/tasks/cancel` may name.
pub const CANCEL_TASKS_MAX: usize = 1_000;

// node-workers: media/upload.rs

/// Pages of open uploads one sweep reads (S3's 1,000 uploads each).
pub const SWEEP_PAGES_MAX: u32 = 10;

// node-workers: media/mod.rs

/// Jobs waiting for a worker before the shard refuses more (the task then fails with the
/// reason; nothing waits unbounded).
pub const MEDIA_QUEUE_MAX: usize = 1024;

/// Jobs' objects waiting for the bucket's thread to delete them: past this, more are left to
/// a lifecycle rule (and logged).
pub const DISCARDS_QUEUED_MAX: usize = 256;

// node-control: relay.rs

/// The longest wait between tries of a refused batch.
pub const BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(10);

// node-shard: server.rs (and the HTTP port's accept loop)

/// How long a shard (or the HTTP port's loop) pauses after a failed accept (out of
/// descriptors, say) before the next: the error is logged once a pause, not in a loop that
/// holds the thread.
pub const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// Encoded frames waiting for the socket, per connection.
pub const OUTBOUND_QUEUE_MAX: usize = 1024;

/// Refused connections one shard tells why at once; past it (a flood past the bound) they are
/// closed without a word.
pub const REFUSING_MAX: usize = 256;

/// Connections waiting to be taken up by one shard.
pub const HANDOFF_QUEUE_MAX: usize = 1024;

// node-control: live_policy.rs

/// Provider accounts a running node takes beyond those it started with, and as many models.
pub const ADDED_WHILE_RUNNING_MAX: usize = 64;

// node-control: control/pipeline.rs

/// Messages one pipeline looks at when it forms the next batch.
pub const BACKLOG_MAX: usize = 4 * PIPELINE_QUEUE_MAX;

/// Reads waiting before senders wait.
pub const READ_QUEUE_MAX: usize = 16_384;

// node-control: control/restore.rs

/// How many times in a row `control::restore::recover_attempts` reads a page again because rows changed
/// under it before it gives up (the start, or the takeover round, is then retried).
pub const RECOVER_REREADS_MAX: u32 = 8;

// node-control: control/mod.rs

/// Messages one pipeline takes at once before it pushes back.
pub const PIPELINE_QUEUE_MAX: usize = 4096;

/// The longest pause between two attempts of a starting node to reach PostgreSQL.
pub const STORE_WAIT_DELAY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Rows a provider account's pool is split into, at most.
pub const PROVIDER_POOL_SHARDS_MAX: u64 = 16;

// node-workers: dispatch.rs

/// Calls waiting for the provider thread before shards wait.
pub const CALLS_QUEUE_MAX: usize = 16_384;

/// Queries by request key in one round after an unknown outcome. A round without any answer
/// goes back to the shard, which keeps the reservation and starts another round after the last
/// polling stage (an attempt in doubt is never given up: only the provider can settle it).
pub const RESOLVE_TRIES_MAX: u32 = 20;

/// Polls after a job outlived its watch and was canceled, waiting for the provider to show it
/// ended (a callback ends the watch too). Past them the watch stops, and the attempt keeps its
/// reservation: the provider never said the job ended.
pub const POLLS_AFTER_CANCEL_MAX: u32 = 100;

// node-shard: shard/claims.rs

pub const IN_DOUBT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(2);

// node-shard: shard/subscriptions.rs

/// Subscriptions one shard holds, per task, and per tenant (a tenant's connections are all
/// served by the shard that owns it).
pub const SUBSCRIPTIONS_MAX: usize = 100_000;

pub const SUBSCRIPTIONS_PER_TASK_MAX: usize = 16;

pub const SUBSCRIPTIONS_PER_TENANT_MAX: usize = 10_000;

// node-shard: shard/mod.rs

/// Inputs one shard buffers before senders wait.
pub const SHARD_QUEUE_MAX: usize = 8192;

/// Dispatches one pump sends as one claim message.
pub const CLAIMS_PER_PUMP_MAX: usize = 512;

// node-shard: shard/submit.rs

/// The largest stored request: every field at its widest, and the largest input. The store
/// takes it (`tests::the_largest_request_fits_the_store`).
pub const STORED_REQUEST_BYTES_MAX: usize = spindle_wire::limits::INPUT_BYTES_MAX + 512;

// node-base: auth_guard.rs

pub const COOLDOWN_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// Addresses and tenants tracked at most each.
pub const TRACKED_MAX: usize = 16_384;

// node-control: reconciler.rs

/// Calls the reconcilers make at the provider at once.
pub const PROVIDER_REQUESTS_MAX: usize = 16;
