//! The embedded PostgreSQL takes no connection without its password: no `trust`, even on
//! 127.0.0.1, where any local user could otherwise act as its superuser.

use spindle_control::{EmbeddedOptions, EmbeddedPostgres};
use std::os::unix::fs::PermissionsExt;

async fn connect(conninfo: &str) -> Result<(), tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client.simple_query("SELECT 1").await.map(drop)
}

#[tokio::test]
async fn the_embedded_server_refuses_a_connection_without_its_password() {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    // With the password it names, the server answers.
    connect(&pg.conninfo("postgres")).await.unwrap();

    // Without one, or with another, it refuses: the server itself (it asked for a password),
    // not a port that nobody listens on.
    let public = pg.conninfo_public("postgres");
    assert!(!public.contains("password"), "{public}");
    let none = format!("{:?}", connect(&public).await.unwrap_err());
    assert!(none.contains("password"), "no password: {none}");
    let wrong = connect(&format!("{public} password=0123456789abcdef"))
        .await
        .unwrap_err();
    let db = wrong.as_db_error().map(|e| e.code().clone());
    assert_eq!(
        db,
        Some(tokio_postgres::error::SqlState::INVALID_PASSWORD),
        "a wrong password: {wrong}"
    );

    // The password file for libpq tools is the node's user's alone and names that password.
    let pgpass = pg.pgpass();
    let mode = std::fs::metadata(&pgpass).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", pgpass.display());
    let line = std::fs::read_to_string(&pgpass).unwrap();
    let password = line.trim().rsplit(':').next().unwrap();
    assert!(password.len() >= 32, "{line}");
    connect(&format!("{public} password={password}"))
        .await
        .unwrap();
}
