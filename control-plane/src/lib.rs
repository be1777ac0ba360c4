//! spindle's thin control plane: PostgreSQL as the source of truth. It turns many small requests
//! from the shards into few transactions — group-committed submits, batched claims with fencing
//! tokens, batched fenced reports and lease renewals — and runs the reconciler and the policy
//! store. It decides nothing about fairness: the scheduling core does.
//!
//! Every hot path is one PL/pgSQL function call per batch (one round trip, one transaction) with
//! a result row per input row; see `migrations/` for the SQL and its lock order.

pub mod autofailover;
pub mod claim;
pub mod cluster_shares;
pub mod db;
pub mod embedded;
pub mod error;
pub mod events;
pub mod lease;
pub mod limits;
pub mod migrate;
pub mod pg_tls;
pub mod policy;
pub mod pools;
pub mod query;
pub mod reconcile;
pub mod report;
pub mod requeue;
pub mod retention;
pub mod submit;
pub mod testing;
pub mod types;
pub mod warm;
pub mod work;

pub use claim::{ClaimRefusal, ClaimRequest, ClaimResult, Demand};
pub use db::{Db, DbConfig, SyncStandby};
pub use embedded::{EmbedError, EmbeddedOptions, EmbeddedPostgres};
pub use error::{InputError, StoreError};
pub use report::{Report, ReportAction, ReportResult};
pub use requeue::RequeueOutcome;
pub use retention::{Pruned, Retention};
pub use submit::{NewTask, SubmitOutcome};
pub use types::{PartitionId, PoolShard};
pub use warm::{WarmUp, Warmed};

/// FNV-1a, 64 bits: a hash that is the same across builds, platforms and processes (migration
/// checksums; which pool rows a node's shards ask for first).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
