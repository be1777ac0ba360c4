//! Migrations and the schema's contract with the core.

mod common;

use spindle_control::report::core_transitions;
use spindle_control::submit::SubmitOutcome;
use spindle_control::testing::{self, TestDb};
use spindle_control::{migrate, Db, DbConfig, StoreError};
use spindle_core::{PolicyVersion, TaskId, TaskState};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_starting_at_once_apply_each_migration_exactly_once() {
    let test = TestDb::new().await;
    let opens: Vec<_> = (0..6).map(|_| Db::open(test.config())).collect();
    for db in futures_util::future::join_all(opens).await {
        db.unwrap();
    }
    let sql = test.sql().await.unwrap();
    let versions: Vec<i32> = common::column(
        &sql,
        "SELECT version FROM schema_migrations ORDER BY version",
    )
    .await;
    let carried: Vec<i32> = migrate::MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(versions, carried);
}

#[tokio::test]
async fn an_applied_migration_that_changed_is_an_error_not_a_rerun() {
    let test = TestDb::new().await;
    test.open().await;
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE schema_migrations SET checksum = checksum + 1 WHERE version = 1",
        &[],
    )
    .await
    .unwrap();
    let err = Db::open(test.config()).await.err().expect("must refuse");
    assert!(
        matches!(
            err,
            StoreError::MigrationChanged {
                version: 1,
                name: "baseline"
            }
        ),
        "{err:?}"
    );
}

/// An idempotency key compares as bytes whatever the database's collation. In a
/// database created with ICU's en-US (which puts "a" before "B"), the keys come out of their
/// index in byte order ("B" first), and a resubmit of a key still finds its task.
#[tokio::test]
async fn idempotency_keys_compare_as_bytes_in_a_database_of_another_collation() {
    let test = TestDb::new().await;
    let admin = test.sql().await.unwrap();
    let name = format!("{}_en_us", test.name());
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' \
             LOCALE 'C'"
        ))
        .await
        .unwrap();
    let config = DbConfig::new(testing::replace_dbname(&test.config().conninfo, &name));
    let db = Db::open(&config).await.unwrap();
    let (sql, connection) = tokio_postgres::connect(&config.conninfo, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let default_order: Vec<String> = common::column(
        &sql,
        "SELECT k FROM (VALUES ('B'), ('a')) AS v (k) ORDER BY k",
    )
    .await;
    assert_eq!(
        default_order,
        ["a", "B"],
        "the database's own order is en-US's"
    );

    db.submit_batch(
        &[common::task(1, 1, "a"), common::task(2, 1, "B")],
        PolicyVersion(1),
    )
    .await
    .unwrap();
    let keys: Vec<String> = common::column(
        &sql,
        "SELECT idempotency_key FROM task ORDER BY tenant_id, idempotency_key",
    )
    .await;
    assert_eq!(keys, ["B", "a"]);
    let again = db
        .submit_batch(&[common::task(3, 1, "a")], PolicyVersion(1))
        .await
        .unwrap();
    assert_eq!(
        again,
        [SubmitOutcome::Replay {
            task: TaskId(1),
            state: TaskState::Queued
        }]
    );
}

#[tokio::test]
async fn the_stored_transition_whitelist_is_the_cores() {
    let test = TestDb::new().await;
    test.open().await;
    let sql = test.sql().await.unwrap();
    let mut stored: Vec<(String, String, bool)> = sql
        .query(
            "SELECT from_state, to_state, operator_only FROM task_transition",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    stored.sort();
    let mut core: Vec<(String, String, bool)> = core_transitions()
        .into_iter()
        .map(|(f, t, op)| (f.name().to_string(), t.name().to_string(), op))
        .collect();
    core.sort();
    assert_eq!(stored, core);
    // And every state the core has is one the store knows.
    for s in TaskState::ALL {
        assert_eq!(spindle_control::types::parse_state(s.name()).unwrap(), s);
    }
}

/// Every file under `sql/functions/` is carried ([`migrate::FUNCTIONS`]) under its own name and
/// holds one `CREATE OR REPLACE FUNCTION` of the function it is named after; no migration calls
/// one of them (a later version of the file may change what it does).
#[test]
fn each_function_has_its_own_file_and_no_migration_calls_one() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql/functions");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let mut carried: Vec<String> = migrate::FUNCTIONS
        .iter()
        .map(|f| format!("{}.sql", f.name))
        .collect();
    carried.sort();
    assert_eq!(
        files, carried,
        "sql/functions/ and migrate::FUNCTIONS differ"
    );
    for f in migrate::FUNCTIONS {
        let creates = f.sql.matches("CREATE OR REPLACE FUNCTION ").count()
            + f.sql.matches("CREATE FUNCTION ").count();
        assert_eq!(creates, 1, "{}.sql creates {creates} functions", f.name);
        assert!(
            f.sql
                .contains(&format!("CREATE OR REPLACE FUNCTION {}(", f.name)),
            "{}.sql does not create {}",
            f.name,
            f.name
        );
    }
    for m in migrate::MIGRATIONS {
        for f in migrate::FUNCTIONS {
            // As a word: spindle_submit is a prefix of spindle_submit_claim.
            let called = m.sql.match_indices(f.name).any(|(i, _)| {
                !m.sql[i + f.name.len()..].starts_with(|c: char| c == '_' || c.is_alphanumeric())
            });
            assert!(!called, "migration {} names function {}", m.version, f.name);
        }
    }
}

/// The functions of a store of one name, as `(signature, result, body)`.
async fn signatures(sql: &tokio_postgres::Client, name: &str) -> Vec<(String, String, String)> {
    sql.query(
        "SELECT oid::regprocedure::text, pg_get_function_result(oid), prosrc FROM pg_proc
          WHERE proname = $1 ORDER BY 1",
        &[&name],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// A function whose file changed is created again at the next start, whatever changed in it:
/// the body (replaced in place), the parameter types (a new overload; the old one dropped) or
/// the result (`CREATE OR REPLACE` cannot; dropped and created). Each case is set up by making
/// the store hold another version and its recorded checksum stale, as an older binary's would.
#[tokio::test]
async fn a_changed_function_file_replaces_the_function_at_the_next_start() {
    let test = TestDb::new().await;
    test.open().await;
    let sql = test.sql().await.unwrap();
    let name = "spindle_renew";
    let carried = signatures(&sql, name).await;
    assert_eq!(carried.len(), 1, "{carried:?}");
    let older_versions = [
        // Another body.
        "CREATE OR REPLACE FUNCTION spindle_renew(p_task bigint[], p_token bigint[],
                                                 p_lease_ms bigint)
         RETURNS TABLE(o_attempt bigint) LANGUAGE sql AS 'SELECT NULL::bigint WHERE false'",
        // Other parameter types: an overload beside the carried one, which is dropped here.
        "DROP FUNCTION spindle_renew(bigint[], bigint[], bigint);
         CREATE FUNCTION spindle_renew(p_task integer[]) RETURNS TABLE(o_attempt bigint)
         LANGUAGE sql AS 'SELECT NULL::bigint WHERE false'",
        // Another result.
        "DROP FUNCTION spindle_renew(bigint[], bigint[], bigint);
         CREATE FUNCTION spindle_renew(p_task bigint[], p_token bigint[], p_lease_ms bigint)
         RETURNS integer LANGUAGE sql AS 'SELECT 1'",
    ];
    for older in older_versions {
        sql.batch_execute(older).await.unwrap();
        sql.execute(
            "UPDATE schema_functions SET checksum = 0 WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap();
        assert_ne!(signatures(&sql, name).await, carried, "{older}");
        Db::open(test.config()).await.unwrap();
        assert_eq!(signatures(&sql, name).await, carried, "after {older}");
        let body: String = sql
            .query_one("SELECT prosrc FROM pg_proc WHERE proname = $1", &[&name])
            .await
            .unwrap()
            .get(0);
        assert!(body.contains("attempt_lease_until"), "{body}");
    }
    // Recorded and unchanged: left alone (a hand-made body stays until the file changes).
    sql.batch_execute(older_versions[0]).await.unwrap();
    Db::open(test.config()).await.unwrap();
    let body: String = sql
        .query_one("SELECT prosrc FROM pg_proc WHERE proname = $1", &[&name])
        .await
        .unwrap()
        .get(0);
    assert!(body.contains("WHERE false"), "{body}");
}

/// The functions every batch runs plan once per session (generic plans), and keep
/// the settings that make those plans probe indexes instead of scanning (the pick of pool shards
/// too).
#[tokio::test]
async fn the_batch_functions_use_generic_plans_over_index_probes() {
    let test = TestDb::new().await;
    test.open().await;
    let sql = test.sql().await.unwrap();
    let rows = sql
        .query(
            "SELECT proname, array_to_string(proconfig, ' ') FROM pg_proc
              WHERE proname IN ('spindle_submit', 'spindle_claim', 'spindle_report',
                                'spindle_submit_checked', 'spindle_claim_checked',
                                'spindle_submit_leased', 'spindle_submit_claim',
                                'spindle_pick_shards')
              ORDER BY proname",
            &[],
        )
        .await
        .unwrap();
    let config: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(config.len(), 8, "{config:?}");
    for (name, settings) in &config {
        let generic = settings.contains("plan_cache_mode=force_generic_plan");
        let hot = !name.ends_with("_checked");
        assert_eq!(generic, hot, "{name}: {settings}");
        assert!(
            settings.contains("enable_seqscan=off"),
            "{name}: {settings}"
        );
    }
    for name in ["spindle_claim", "spindle_submit_claim"] {
        let claim = &config.iter().find(|(n, _)| n == name).unwrap().1;
        assert!(
            claim.contains("enable_mergejoin=off") && claim.contains("enable_hashjoin=off"),
            "{name}: {claim}"
        );
    }
}

/// The header of `control-plane/schema.sql`, ahead of the dump.
const SNAPSHOT_HEADER: &str = "\
-- The schema a node builds, as one file to read: every table, index and function as it stands
-- after the migrations (migrations/) and the functions (sql/functions/). Generated by
-- `pg_dump --schema-only` of a freshly migrated database; do not edit. Those two folders are
-- the source; after changing either, rewrite this file with
--     SPINDLE_BLESS=1 cargo nextest run -p spindle-control -E 'test(schema_snapshot)'
-- (the test `the_schema_snapshot_is_what_the_migrations_build` fails while it is stale).
";

/// `control-plane/schema.sql` is what the migrations build: a migration that changes the schema
/// without the snapshot changing with it fails here, with the first line that differs.
#[tokio::test]
async fn the_schema_snapshot_is_what_the_migrations_build() {
    let test = TestDb::new().await;
    test.open().await;
    let pg_dump = spindle_control::embedded::find_bin_dir()
        .expect("PostgreSQL's binaries")
        .join("pg_dump");
    let out = std::process::Command::new(&pg_dump)
        .args(["--schema-only", "--no-owner", "--no-privileges"])
        .arg(&test.config().conninfo)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", pg_dump.display()));
    assert!(
        out.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump = String::from_utf8(out.stdout).expect("pg_dump writes UTF-8");
    // What changes from run to run or between patch releases: the dump's random restrict key
    // and the server's and pg_dump's versions.
    let kept: Vec<&str> = dump
        .lines()
        .filter(|l| {
            !(l.starts_with("\\restrict")
                || l.starts_with("\\unrestrict")
                || l.starts_with("-- Dumped from")
                || l.starts_with("-- Dumped by"))
        })
        .collect();
    let built = format!("{SNAPSHOT_HEADER}{}\n", kept.join("\n").trim());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schema.sql");
    if std::env::var_os("SPINDLE_BLESS").is_some() {
        std::fs::write(&path, &built).expect("write schema.sql");
        return;
    }
    let stored = std::fs::read_to_string(&path).unwrap_or_default();
    if !stored.lines().eq(built.lines()) {
        let (want, got): (Vec<&str>, Vec<&str>) =
            (built.lines().collect(), stored.lines().collect());
        let end = "<end of file>";
        let line = (0..=want.len().max(got.len()))
            .find(|&i| want.get(i) != got.get(i))
            .unwrap_or(want.len());
        let (want, got) = (
            want.get(line).copied().unwrap_or(end),
            got.get(line).copied().unwrap_or(end),
        );
        panic!(
            "control-plane/schema.sql is not what the migrations build; line {}: the migrations \
             give {want:?}, the file has {got:?}. Rewrite it with SPINDLE_BLESS=1 cargo nextest \
             run -p spindle-control -E 'test(schema_snapshot)'",
            line + 1
        );
    }
}
