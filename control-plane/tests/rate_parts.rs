//! A cluster's rates divided among its nodes in PostgreSQL (`Db::allot_rate_parts`): three
//! nodes, each its own connection, allot concurrently and in turns. Their effective parts as
//! stored never add up to more than the whole; a busy node gets what idle ones give back (after
//! the grace of their lowering); a node not heard from counts nothing.

use spindle_control::rate_parts::WHOLE;
use spindle_control::testing::TestDb;
use spindle_control::Db;

const RATE: &str = "provider:0:rpm";
const LIVE_MS: u32 = 3_000;

async fn node(test: &TestDb, name: &str) -> Db {
    let db = test.open().await;
    db.register_node(name, "").await.unwrap();
    db
}

/// The stored effective parts of `RATE` (a lowered part counts while its grace runs), over the
/// nodes heard from within `LIVE_MS`.
async fn held(sql: &tokio_postgres::Client) -> i64 {
    sql.query_one(
        "SELECT coalesce(sum(greatest(r.part_ppm,
                                      CASE WHEN r.lowered_until > now()
                                           THEN r.lowered_from_ppm ELSE 0 END)), 0)::bigint
           FROM node_rate_part r JOIN node n USING (node_id)
          WHERE r.rate = $1 AND n.heartbeat_at > now() - $2::float8 * interval '1 millisecond'",
        &[&RATE, &f64::from(LIVE_MS)],
    )
    .await
    .unwrap()
    .get(0)
}

/// Every lowering's grace ends now (as if `rate_parts::LOWERED_GRACE_MS` had passed).
async fn end_graces(sql: &tokio_postgres::Client) {
    sql.execute(
        "UPDATE node_rate_part SET lowered_until = now() - interval '1 millisecond'
          WHERE lowered_until IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
}

async fn allot(db: &mut Db, name: &str, weight: u64) -> u32 {
    db.allot_rate_parts(name, LIVE_MS, &[(RATE.to_string(), weight)])
        .await
        .unwrap()[0]
}

#[tokio::test]
async fn a_busy_node_gets_what_idle_ones_give_back_and_the_parts_never_pass_the_whole() {
    let test = TestDb::new().await;
    let sql = test.sql().await.unwrap();
    let mut a = node(&test, "a").await;
    let mut b = node(&test, "b").await;
    let mut c = node(&test, "c").await;
    // All idle: the first takes the whole, the others what is left (nothing) until it lowers.
    assert_eq!(allot(&mut a, "a", 0).await, WHOLE);
    assert_eq!(allot(&mut b, "b", 0).await, 0);
    assert_eq!(allot(&mut c, "c", 0).await, 0);
    assert!(held(&sql).await <= i64::from(WHOLE));
    // a lowers to its even third; b and c get theirs once its grace has passed.
    assert_eq!(allot(&mut a, "a", 0).await, WHOLE / 3);
    assert_eq!(allot(&mut b, "b", 0).await, 0, "a's lowering still counts");
    end_graces(&sql).await;
    assert_eq!(allot(&mut b, "b", 0).await, WHOLE / 3);
    assert_eq!(allot(&mut c, "c", 0).await, WHOLE / 3);
    assert!(held(&sql).await <= i64::from(WHOLE));

    // c's tenants wait: a and b lower to a standby part, c takes the rest.
    let standby = WHOLE / 3 / 16;
    assert_eq!(
        allot(&mut c, "c", 10).await,
        WHOLE - 2 * (WHOLE / 3),
        "only the unheld rest yet"
    );
    assert_eq!(allot(&mut a, "a", 0).await, standby);
    assert_eq!(allot(&mut b, "b", 0).await, standby);
    assert!(held(&sql).await <= i64::from(WHOLE));
    end_graces(&sql).await;
    assert_eq!(allot(&mut c, "c", 10).await, WHOLE - 2 * standby);
    assert_eq!(held(&sql).await, i64::from(WHOLE));

    // b is not heard from past the live window: c takes its part too (but a's standby part,
    // now of an even half).
    sql.execute(
        "UPDATE node SET heartbeat_at = now() - interval '1 hour' WHERE node_id = 'b'",
        &[],
    )
    .await
    .unwrap();
    let c_part = allot(&mut c, "c", 10).await;
    assert_eq!(c_part, WHOLE - WHOLE / 2 / 16);
    // b comes back: it gets no more than what is left, and gives up the rest of its old part.
    b.heartbeat("b").await.unwrap();
    assert_eq!(allot(&mut b, "b", 0).await, WHOLE - standby - c_part);
    end_graces(&sql).await;
    assert_eq!(held(&sql).await, i64::from(WHOLE));
}

/// Many rounds of concurrent allotments with changing weights: after every round, the stored
/// effective parts of the live nodes stay within the whole.
#[tokio::test]
async fn concurrent_allotments_never_pass_the_whole() {
    let test = TestDb::new().await;
    let sql = test.sql().await.unwrap();
    let names = ["n0", "n1", "n2"];
    let mut dbs = Vec::new();
    for n in names {
        dbs.push(node(&test, n).await);
    }
    for round in 0..30u64 {
        let calls = dbs.iter_mut().zip(names).enumerate().map(|(i, (db, n))| {
            // Each node's weight moves between idle and busy, out of step with the others.
            let weight = (round + i as u64) % 3 * 7;
            async move { allot(db, n, weight).await }
        });
        let parts = futures_util::future::join_all(calls).await;
        let stored = held(&sql).await;
        assert!(
            stored <= i64::from(WHOLE),
            "round {round}: {parts:?} hold {stored}"
        );
        if round % 5 == 4 {
            end_graces(&sql).await;
        }
    }
}
