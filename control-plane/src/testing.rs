//! A fresh database per test on a real PostgreSQL. The test command (`scripts/test-all`) starts
//! one private server and exports `SPINDLE_TEST_PG` (a conninfo for its `postgres` database);
//! without it each `TestDb` starts a private server of its own (slower, same behaviour).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tokio_postgres::NoTls;

use crate::db::{Db, DbConfig};
use crate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use crate::error::StoreError;

/// The environment variable naming a running server for tests.
pub const TEST_PG_ENV: &str = "SPINDLE_TEST_PG";

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

pub struct TestDb {
    config: DbConfig,
    /// The private server when no shared one was given; dropped (stopped) with the test.
    server: Option<Arc<EmbeddedPostgres>>,
}

impl TestDb {
    /// Creates an empty database named after the test process, a counter and the clock.
    pub async fn new() -> TestDb {
        let (admin_conninfo, server) = match std::env::var(TEST_PG_ENV) {
            Ok(conninfo) => (conninfo, None),
            Err(_) => {
                let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
                    .unwrap_or_else(|e| panic!("starting a private PostgreSQL for the test: {e}"));
                (pg.conninfo("postgres"), Some(Arc::new(pg)))
            }
        };
        // The clock too: process ids come round again on a server that outlives many runs.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() % 1_000_000_000_000);
        let name = format!(
            "spindle_test_{}_{}_{nanos}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let (client, connection) = tokio_postgres::connect(&admin_conninfo, NoTls)
            .await
            .unwrap_or_else(|e| panic!("connecting to the test server ({admin_conninfo}): {e}"));
        let conn = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("CREATE DATABASE");
        drop(client);
        conn.await
            .expect("admin connection task")
            .expect("admin connection");
        let conninfo = replace_dbname(&admin_conninfo, &name);
        TestDb {
            config: DbConfig::new(conninfo),
            server,
        }
    }

    pub fn config(&self) -> &DbConfig {
        &self.config
    }

    /// A migrated connection.
    pub async fn open(&self) -> Db {
        Db::open(&self.config)
            .await
            .expect("open the test database")
    }

    /// The private server, when this test has one (tests that stop and restart it need it).
    pub fn private_server(&self) -> Option<&Arc<EmbeddedPostgres>> {
        self.server.as_ref()
    }

    /// A plain client for assertions in SQL.
    pub async fn sql(&self) -> Result<tokio_postgres::Client, StoreError> {
        let (client, connection) = tokio_postgres::connect(&self.config.conninfo, NoTls).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

fn replace_dbname(conninfo: &str, dbname: &str) -> String {
    let mut parts: Vec<String> = conninfo
        .split_whitespace()
        .filter(|p| !p.starts_with("dbname="))
        .map(str::to_string)
        .collect();
    parts.push(format!("dbname={dbname}"));
    parts.join(" ")
}
