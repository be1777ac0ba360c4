//! Migrations and the schema's contract with the core.

use spindle_control::report::core_transitions;
use spindle_control::testing::TestDb;
use spindle_control::{migrate, Db, StoreError};
use spindle_core::TaskState;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_starting_at_once_apply_each_migration_exactly_once() {
    let test = TestDb::new().await;
    let opens: Vec<_> = (0..6).map(|_| Db::open(test.config())).collect();
    for db in futures_util::future::join_all(opens).await {
        db.unwrap();
    }
    let sql = test.sql().await.unwrap();
    let versions: Vec<i32> = sql
        .query(
            "SELECT version FROM schema_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
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
