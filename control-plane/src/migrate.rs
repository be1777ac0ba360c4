//! Versioned migrations, carried in the binary and applied at start. Several nodes may start at
//! once: the whole run holds a transaction-scoped advisory lock, so one applies and the others
//! find the work done. An applied migration whose text changed is an error, never re-run.

use tokio_postgres::Client;

use crate::db::Deadline;
use crate::error::StoreError;

/// The advisory lock key all spindle migrators share ("spindle" in ASCII, as a number).
const MIGRATION_LOCK_KEY: i64 = 0x0073_7069_6e64_6c65;

pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "schema",
        sql: include_str!("../migrations/0001_schema.sql"),
    },
    Migration {
        version: 2,
        name: "batch_functions",
        sql: include_str!("../migrations/0002_batch_functions.sql"),
    },
    Migration {
        version: 3,
        name: "report_via",
        sql: include_str!("../migrations/0003_report_via.sql"),
    },
    Migration {
        version: 4,
        name: "dead_letter",
        sql: include_str!("../migrations/0004_dead_letter.sql"),
    },
    Migration {
        version: 5,
        name: "lean_hot_path",
        sql: include_str!("../migrations/0005_lean_hot_path.sql"),
    },
    Migration {
        version: 6,
        name: "submit_fast_path",
        sql: include_str!("../migrations/0006_submit_fast_path.sql"),
    },
    Migration {
        version: 7,
        name: "claim_fast_path",
        sql: include_str!("../migrations/0007_claim_fast_path.sql"),
    },
    Migration {
        version: 8,
        name: "report_batch_check",
        sql: include_str!("../migrations/0008_report_batch_check.sql"),
    },
    Migration {
        version: 9,
        name: "generic_plans",
        sql: include_str!("../migrations/0009_generic_plans.sql"),
    },
    Migration {
        version: 10,
        name: "operator_requeue",
        sql: include_str!("../migrations/0010_operator_requeue.sql"),
    },
    Migration {
        version: 11,
        name: "submit_fenced_by_lease",
        sql: include_str!("../migrations/0011_submit_fenced_by_lease.sql"),
    },
    Migration {
        version: 12,
        name: "final_attempt_in_row",
        sql: include_str!("../migrations/0012_final_attempt_in_row.sql"),
    },
    Migration {
        version: 13,
        name: "unrestorable_queued_fails",
        sql: include_str!("../migrations/0013_unrestorable_queued_fails.sql"),
    },
    Migration {
        version: 14,
        name: "submit_claimed",
        sql: include_str!("../migrations/0014_submit_claimed.sql"),
    },
    Migration {
        version: 15,
        name: "pool_shard_choice",
        sql: include_str!("../migrations/0015_pool_shard_choice.sql"),
    },
    Migration {
        version: 16,
        name: "report_sorts_once",
        sql: include_str!("../migrations/0016_report_sorts_once.sql"),
    },
    Migration {
        version: 17,
        name: "fewer_statements",
        sql: include_str!("../migrations/0017_fewer_statements.sql"),
    },
    Migration {
        version: 18,
        name: "byte_order_keys",
        sql: include_str!("../migrations/0018_byte_order_keys.sql"),
    },
    Migration {
        version: 19,
        name: "cancel_request",
        sql: include_str!("../migrations/0019_cancel_request.sql"),
    },
    Migration {
        version: 20,
        name: "task_result",
        sql: include_str!("../migrations/0020_task_result.sql"),
    },
    Migration {
        version: 21,
        name: "cluster_relay_and_shares",
        sql: include_str!("../migrations/0021_cluster_relay_and_shares.sql"),
    },
    Migration {
        version: 22,
        name: "work_call",
        sql: include_str!("../migrations/0022_work_call.sql"),
    },
    Migration {
        version: 23,
        name: "quota_reset",
        sql: include_str!("../migrations/0023_quota_reset.sql"),
    },
];

/// FNV-1a over the migration's text: stable across builds and platforms.
fn checksum(sql: &str) -> i64 {
    crate::fnv1a(sql.as_bytes()) as i64
}

/// Applies every migration not yet applied; returns the versions this call applied. Unbounded:
/// for a plain client (tests, tools); [`crate::Db::open`] gives every step a deadline.
pub async fn apply(client: &mut Client) -> Result<Vec<i32>, StoreError> {
    apply_through(client, i32::MAX).await
}

/// Applies the migrations not yet applied up to and including version `last` (tests of a
/// migration start from the schema before it). Unbounded, as [`apply`].
pub async fn apply_through(client: &mut Client, last: i32) -> Result<Vec<i32>, StoreError> {
    run(client, last, None).await
}

/// [`apply`] with every step under a deadline from `deadline(statements)`: the lock and the
/// read of what is applied, then each migration (its statements, counted generously as its
/// semicolons, may each run to `statement_timeout`), then the commit. A server that stops
/// answering mid-migration is given up on instead of holding the node's start forever.
pub(crate) async fn apply_bounded(
    client: &mut Client,
    deadline: &(dyn Fn(u32) -> Deadline + Sync),
) -> Result<Vec<i32>, StoreError> {
    run(client, i32::MAX, Some(deadline)).await
}

/// Statements a migration may run, at most: one per semicolon (those inside function bodies
/// count too), and the insert that records it.
fn statements_bound(m: &Migration) -> u32 {
    u32::try_from(m.sql.matches(';').count() + 2).unwrap_or(u32::MAX)
}

async fn run(
    client: &mut Client,
    last: i32,
    deadline: Option<&(dyn Fn(u32) -> Deadline + Sync)>,
) -> Result<Vec<i32>, StoreError> {
    // Each step under its deadline, when there is one. Nothing here is in doubt: a migration
    // either committed or not, and the next start finds out which.
    async fn step<T>(
        deadline: Option<&(dyn Fn(u32) -> Deadline + Sync)>,
        statements: u32,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match deadline {
            Some(d) => d(statements).run(false, work).await,
            None => work.await,
        }
    }
    let pending = |applied: &[(i32, i64)]| -> Result<Vec<&'static Migration>, StoreError> {
        let mut pending = Vec::new();
        for m in MIGRATIONS.iter().filter(|m| m.version <= last) {
            match applied.iter().find(|(v, _)| *v == m.version) {
                Some((_, sum)) if *sum == checksum(m.sql) => {}
                Some(_) => {
                    return Err(StoreError::MigrationChanged {
                        version: m.version,
                        name: m.name,
                    })
                }
                None => pending.push(m),
            }
        }
        Ok(pending)
    };
    let tx = step(deadline, 1, async { Ok(client.transaction().await?) }).await?;
    let applied: Vec<(i32, i64)> = step(deadline, 3, async {
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_KEY])
            .await?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                 version     integer PRIMARY KEY,
                 name        text NOT NULL,
                 checksum    bigint NOT NULL,
                 applied_at  timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await?;
        Ok(tx
            .query("SELECT version, checksum FROM schema_migrations", &[])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
    })
    .await?;
    let mut done = Vec::new();
    for m in pending(&applied)? {
        step(deadline, statements_bound(m), async {
            tx.batch_execute(m.sql).await?;
            tx.execute(
                "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                &[&m.version, &m.name, &checksum(m.sql)],
            )
            .await?;
            Ok(())
        })
        .await?;
        done.push(m.version);
    }
    step(deadline, 1, async move { Ok(tx.commit().await?) }).await?;
    Ok(done)
}
