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
                name: "schema"
            }
        ),
        "{err:?}"
    );
}

/// Version 18: an idempotency key compares as bytes whatever the database's collation. In a
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

/// Version 5 moves live attempts and their reservations into their task rows, ended attempts
/// into the history and events into batches: a database with work in flight at version 4 comes
/// out with the same facts, readable under the old names, and the work goes on.
#[tokio::test]
async fn version_5_carries_work_in_flight_over() {
    let test = TestDb::new().await;
    let mut sql = test.sql().await.unwrap();
    migrate::apply_through(&mut sql, 4).await.unwrap();
    sql.batch_execute(
        "INSERT INTO node (node_id) VALUES ('n');
         INSERT INTO partition_lease VALUES (0, 'n', now() + interval '1 hour', 1);
         INSERT INTO resource_pool_shard (pool_key, shard, capacity, used)
              VALUES ('p', 0, 10, 2), ('q', 0, 10, 1);
         INSERT INTO task (task_id, tenant_id, user_id, idempotency_key, payload, partition, lane,
                           band, state, version, policy_version, cost_estimate_milli,
                           fairness_milli, attempt_no, current_attempt, current_fencing)
              VALUES (1, 7, 70, 'live', '\\x01', 0, 2, 2, 'RUNNING', 3, 1, 100, 10, 2, 12, 22),
                     (2, 7, 70, 'done', '\\x02', 0, 2, 2, 'SUCCEEDED', 4, 1, 100, 10, 1, NULL,
                      NULL);
         INSERT INTO task_attempt (attempt_id, task_id, attempt_no, fencing_token, node_id,
                                   provider, provider_request_key, lease_until, ended_at, outcome)
              VALUES (11, 1, 1, 21, 'n', 'acme', 'spindle-1-1', now(), now(), 'QUEUED'),
                     (12, 1, 2, 22, 'n', 'acme', 'spindle-1-2', now() + interval '1 hour', NULL,
                      NULL),
                     (13, 2, 1, 23, 'n', 'acme', 'spindle-2-1', now(), now(), 'SUCCEEDED');
         INSERT INTO resource_reservation (attempt_id, pool_key, shard, task_id, amount, status,
                                           fencing_token)
              VALUES (12, 'p', 0, 1, 2, 'ACTIVE', 22), (12, 'q', 0, 1, 1, 'ACTIVE', 22),
                     (13, 'p', 0, 2, 2, 'RELEASED', 23);
         INSERT INTO outbox_event (task_id, tenant_id, kind, body, delivered_at)
              VALUES (2, 7, 'DISPATCHING', '{}', now()),
                     (2, 7, 'SUCCEEDED', '{\"reason\": \"moved\"}', NULL);",
    )
    .await
    .unwrap();
    let mut db = test.open().await;
    let active: Vec<(String, i64)> = sql
        .query(
            "SELECT pool_key, amount FROM resource_reservation
              WHERE status = 'ACTIVE' AND attempt_id = 12 ORDER BY pool_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(active, vec![("p".into(), 2), ("q".into(), 1)]);
    let attempts: Vec<(i64, i32, Option<String>)> = sql
        .query(
            "SELECT attempt_id, attempt_no, outcome FROM task_attempt ORDER BY attempt_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        attempts,
        vec![
            (11, 1, Some("QUEUED".into())),
            (12, 2, None),
            (13, 1, Some("SUCCEEDED".into())),
        ]
    );
    assert!(db.rebuild_counters().await.unwrap().is_empty(), "no drift");
    assert_eq!(
        db.pending_events().await.unwrap(),
        1,
        "the undelivered event"
    );
    let live = db
        .live_attempts_in(&[spindle_control::PartitionId(0)], None, 10)
        .await
        .unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].request_key, "spindle-1-2");
    // The live attempt finishes and gives back what it held.
    let done = db
        .report_batch(&[spindle_control::Report::new(
            spindle_core::TaskId(1),
            Some(live[0].token),
            spindle_control::ReportAction::Finish {
                state: TaskState::Failed,
                cost_actual_milli: None,
                reason: Some("migrated".into()),
                result: None,
            },
        )])
        .await
        .unwrap();
    assert!(
        matches!(
            done[0],
            spindle_control::ReportResult::Applied { released: 2, .. }
        ),
        "{done:?}"
    );
    let used: Vec<i64> = common::column(
        &sql,
        "SELECT used FROM resource_pool_shard ORDER BY pool_key",
    )
    .await;
    assert_eq!(used, vec![0, 0]);
}

/// Version 9: the functions every batch runs plan once per session (generic plans), and keep
/// the settings that make those plans probe indexes instead of scanning (version 15's pick of
/// pool shards too).
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
-- The schema the migrations build, as one file to read: every table, index and function as it
-- stands after the last migration (a function restated by several migrations is here once, in
-- its latest form). Generated by `pg_dump --schema-only` of a freshly migrated database; do not
-- edit. The migrations are the source; after adding one, rewrite this file with
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
