//! The embedded PostgreSQL takes no connection without its password: no `trust`, even on
//! 127.0.0.1, where any local user could otherwise act as its superuser.

use spindle_control::{Db, DbConfig, EmbeddedOptions, EmbeddedPostgres, StoreError};
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

/// A CA and a certificate it issued for 127.0.0.1 and localhost, written to `dir` where the
/// server's user can read them: (the CA's certificate, the server's, its key).
fn server_ca(dir: &std::path::Path) -> [std::path::PathBuf; 3] {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "spindle test database CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let paths = [
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    ];
    std::fs::write(&paths[0], ca.pem()).unwrap();
    std::fs::write(&paths[1], server.pem()).unwrap();
    std::fs::write(&paths[2], key.serialize_pem()).unwrap();
    std::fs::set_permissions(&paths[2], std::fs::Permissions::from_mode(0o600)).unwrap();
    // As root the server runs as `postgres`, which must own its key.
    if std::process::Command::new("id")
        .arg("-u")
        .output()
        .unwrap()
        .stdout
        == b"0\n"
    {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let status = std::process::Command::new("chown")
            .arg("postgres")
            .args(&paths[1..])
            .status()
            .unwrap();
        assert!(status.success());
    }
    paths
}

async fn ssl_in_use(db: &Db) -> bool {
    db.client()
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn the_store_speaks_verified_tls_where_the_conninfo_asks_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, cert, key] = server_ca(dir.path());
    let other = tempfile::tempdir().unwrap();
    let [other_ca, _, _] = server_ca(other.path());
    let mut options = EmbeddedOptions::default();
    options.settings.extend([
        ("ssl".to_string(), "on".to_string()),
        ("ssl_cert_file".into(), cert.display().to_string()),
        ("ssl_key_file".into(), key.display().to_string()),
    ]);
    let pg = EmbeddedPostgres::start(options).unwrap();
    let base = pg.conninfo("postgres");

    // Asked for, with the CA the server's certificate chains to: TLS, checked by the server.
    let verified = format!("{base} sslmode=verify-full sslrootcert={}", ca.display());
    let db = Db::open(&DbConfig::new(verified)).await.unwrap();
    assert!(ssl_in_use(&db).await, "sslmode=verify-full went plain");
    let required = format!("{base} sslmode=require sslrootcert={}", ca.display());
    assert!(ssl_in_use(&Db::open(&DbConfig::new(required)).await.unwrap()).await);

    // Not asked for: plain, as before.
    assert!(!ssl_in_use(&Db::open(&DbConfig::new(base.clone())).await.unwrap()).await);

    // A certificate from another CA: no connection, the cause named.
    let stranger = format!(
        "{base} sslmode=verify-full sslrootcert={}",
        other_ca.display()
    );
    match Db::open(&DbConfig::new(stranger)).await {
        Err(StoreError::Unavailable(why)) => {
            assert!(why.contains("certificate"), "{why}");
        }
        other => panic!(
            "a server another CA vouches for was taken: {:?}",
            other.err()
        ),
    }
    // The public web's roots do not vouch for it either.
    let public = format!("{base} sslmode=require");
    assert!(Db::open(&DbConfig::new(public)).await.is_err());
}

#[tokio::test]
async fn tls_required_of_a_server_without_it_is_refused() {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let [ca, _, _] = server_ca(dir.path());
    let required = format!(
        "{} sslmode=verify-full sslrootcert={}",
        pg.conninfo("postgres"),
        ca.display()
    );
    match Db::open(&DbConfig::new(required)).await {
        Err(StoreError::Unavailable(why)) => assert!(why.contains("TLS"), "{why}"),
        other => panic!("went plain where TLS was required: {:?}", other.err()),
    }
}
