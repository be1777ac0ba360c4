//! The store's schema, carried in the binary and brought up to date at start: versioned
//! migrations (DDL and data, `control-plane/migrations/`), then the functions
//! (`control-plane/sql/functions/`, one file each), each created again whenever its text
//! changed. Several nodes may start at once: the whole run is one transaction holding an
//! advisory lock, so one does the work and the others find it done. An applied migration whose
//! text changed is an error, never re-run; a function whose text changed is simply replaced.

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Transaction};

use crate::db::{Call, Deadline};
use crate::error::StoreError;

/// The advisory lock key all spindle migrators share ("spindle" in ASCII, as a number).
const MIGRATION_LOCK_KEY: i64 = 0x0073_7069_6e64_6c65;

pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// The versioned migrations: DDL and data only, never a call of a [`FUNCTIONS`] function (a
/// later version of its file may change what it does). Version 1 is the baseline the project's
/// first 23 migrations were squashed into before any deployment existed.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "baseline",
    sql: include_str!("../migrations/0001_baseline.sql"),
}];

/// One function of the store, in its own file under `control-plane/sql/functions/` (named
/// after it): a single `CREATE OR REPLACE FUNCTION`, created again whenever its text changes.
pub struct Function {
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every function the node calls, each created after the migrations under their lock when its
/// checksum differs from the one recorded in `schema_functions`.
pub const FUNCTIONS: &[Function] = &[
    Function {
        name: "spindle_claim",
        sql: include_str!("../sql/functions/spindle_claim.sql"),
    },
    Function {
        name: "spindle_claim_checked",
        sql: include_str!("../sql/functions/spindle_claim_checked.sql"),
    },
    Function {
        name: "spindle_pick_shards",
        sql: include_str!("../sql/functions/spindle_pick_shards.sql"),
    },
    Function {
        name: "spindle_renew",
        sql: include_str!("../sql/functions/spindle_renew.sql"),
    },
    Function {
        name: "spindle_report",
        sql: include_str!("../sql/functions/spindle_report.sql"),
    },
    Function {
        name: "spindle_submit",
        sql: include_str!("../sql/functions/spindle_submit.sql"),
    },
    Function {
        name: "spindle_submit_checked",
        sql: include_str!("../sql/functions/spindle_submit_checked.sql"),
    },
    Function {
        name: "spindle_submit_claim",
        sql: include_str!("../sql/functions/spindle_submit_claim.sql"),
    },
    Function {
        name: "spindle_submit_leased",
        sql: include_str!("../sql/functions/spindle_submit_leased.sql"),
    },
    Function {
        name: "spindle_work",
        sql: include_str!("../sql/functions/spindle_work.sql"),
    },
];

/// FNV-1a over the migration's text: stable across builds and platforms.
fn checksum(sql: &str) -> i64 {
    crate::fnv1a(sql.as_bytes()) as i64
}

/// Applies every migration not yet applied and creates every function whose text changed;
/// returns the versions this call applied. Unbounded: for a plain client (tests, tools);
/// [`crate::Db::open`] gives every step a deadline.
pub async fn apply(client: &mut Client) -> Result<Vec<i32>, StoreError> {
    run(client, None).await
}

/// [`apply`] with every step under a deadline from `deadline(statements)`: the lock and the
/// read of what is applied, then each migration (its statements, counted generously as its
/// semicolons, may each run to `statement_timeout`), then the commit. A server that stops
/// answering mid-migration is given up on instead of holding the node's start forever.
pub(crate) async fn apply_bounded(
    client: &mut Client,
    deadline: &(dyn Fn(u32) -> Deadline + Sync),
) -> Result<Vec<i32>, StoreError> {
    run(client, Some(deadline)).await
}

/// Statements a migration or a function's file may run, at most: one per semicolon (those
/// inside function bodies count too), and those that look around it and record it.
fn statements_bound(sql: &str) -> u32 {
    u32::try_from(sql.matches(';').count() + 8).unwrap_or(u32::MAX)
}

async fn run(
    client: &mut Client,
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
            Some(d) => d(statements).run(Call::Reads, work).await,
            None => work.await,
        }
    }
    let pending = |applied: &[(i32, i64)]| -> Result<Vec<&'static Migration>, StoreError> {
        let mut pending = Vec::new();
        for m in MIGRATIONS {
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
        step(deadline, statements_bound(m.sql), async {
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
    let recorded: Vec<(String, i64)> = step(deadline, 2, async {
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_functions (
                 name        text PRIMARY KEY,
                 checksum    bigint NOT NULL,
                 applied_at  timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await?;
        Ok(tx
            .query("SELECT name, checksum FROM schema_functions", &[])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
    })
    .await?;
    for f in FUNCTIONS {
        let sum = checksum(f.sql);
        if recorded.iter().any(|(n, s)| n == f.name && *s == sum) {
            continue;
        }
        step(deadline, statements_bound(f.sql), create_function(&tx, f)).await?;
    }
    for (gone, _) in recorded
        .iter()
        .filter(|(n, _)| !FUNCTIONS.iter().any(|f| f.name == n))
    {
        step(deadline, 2, async {
            drop_overloads(&tx, gone, &[]).await?;
            tx.execute("DELETE FROM schema_functions WHERE name = $1", &[gone])
                .await?;
            Ok(())
        })
        .await?;
    }
    step(deadline, 1, async move { Ok(tx.commit().await?) }).await?;
    Ok(done)
}

/// The overloads of function `name` in the current schema (by oid), as `regprocedure` text
/// for a `DROP FUNCTION`.
async fn overloads(tx: &Transaction<'_>, name: &str) -> Result<Vec<(u32, String)>, StoreError> {
    Ok(tx
        .query(
            "SELECT oid, oid::regprocedure::text FROM pg_proc
              WHERE proname = $1 AND pronamespace = to_regnamespace(current_schema())",
            &[&name],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Drops every overload of `name` but those in `keep`.
async fn drop_overloads(tx: &Transaction<'_>, name: &str, keep: &[u32]) -> Result<(), StoreError> {
    for (oid, signature) in overloads(tx, name).await? {
        if !keep.contains(&oid) {
            tx.batch_execute(&format!("DROP FUNCTION {signature}"))
                .await?;
        }
    }
    Ok(())
}

/// Creates function `f` from its file and records its checksum. `CREATE OR REPLACE` keeps the
/// function (and the plans that use it) when its signature stays; a file whose return type or
/// parameter names changed cannot replace it (42P13), so every overload is dropped first; a
/// file whose parameter types changed creates a new overload, and the old ones are dropped
/// after. Whatever was there, exactly one function of that name remains: the file's.
async fn create_function(tx: &Transaction<'_>, f: &Function) -> Result<(), StoreError> {
    let before: Vec<u32> = overloads(tx, f.name)
        .await?
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    tx.batch_execute("SAVEPOINT spindle_function").await?;
    match tx.batch_execute(f.sql).await {
        Ok(()) => {
            tx.batch_execute("RELEASE SAVEPOINT spindle_function")
                .await?
        }
        Err(e) if e.code() == Some(&SqlState::INVALID_FUNCTION_DEFINITION) => {
            tx.batch_execute("ROLLBACK TO SAVEPOINT spindle_function")
                .await?;
            drop_overloads(tx, f.name, &[]).await?;
            tx.batch_execute(f.sql).await?;
        }
        Err(e) => return Err(e.into()),
    }
    let now = overloads(tx, f.name).await?;
    let created: Vec<u32> = now
        .iter()
        .map(|(o, _)| *o)
        .filter(|o| !before.contains(o))
        .collect();
    if now.len() > 1 {
        match created.as_slice() {
            // A new overload: the others are older versions.
            [new] => drop_overloads(tx, f.name, &[*new]).await?,
            // Replaced one of several in place (overloads made by hand): only the file's stays.
            _ => {
                drop_overloads(tx, f.name, &[]).await?;
                tx.batch_execute(f.sql).await?;
            }
        }
    }
    tx.execute(
        "INSERT INTO schema_functions (name, checksum) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()",
        &[&f.name, &checksum(f.sql)],
    )
    .await?;
    Ok(())
}
