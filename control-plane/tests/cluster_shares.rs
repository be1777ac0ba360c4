//! A cluster's shared limits divided among its nodes in PostgreSQL (`Db::allot_shares`): three
//! nodes, each its own connection, allot concurrently and in turns. Their effective parts as
//! stored never add up to more than the whole; a busy node gets what idle ones give back (after
//! the grace of their lowering, and for slots once its work ends); a node not heard from counts
//! nothing.

use spindle_control::cluster_shares::{Want, WHOLE};
use spindle_control::testing::TestDb;
use spindle_control::Db;

const RATE: &str = "provider:0:rpm";
const SLOTS: &str = "provider:0:concurrency";
const LIVE_MS: u32 = 3_000;

async fn node(test: &TestDb, name: &str) -> Db {
    let db = test.open().await;
    db.register_node(name, "").await.unwrap();
    db
}

/// The stored effective parts of `limit` (a lowered part counts while its grace runs; a slot
/// in use always), over the nodes heard from within `LIVE_MS`.
async fn held_of(sql: &tokio_postgres::Client, limit: &str) -> i64 {
    sql.query_one(
        "SELECT coalesce(sum(greatest(s.part, s.used,
                                      CASE WHEN s.lowered_until > now()
                                           THEN s.lowered_from ELSE 0 END)), 0)::bigint
           FROM node_share s JOIN node n USING (node_id)
          WHERE s.limit_key = $1 AND n.heartbeat_at > now() - $2::float8 * interval '1 millisecond'",
        &[&limit, &f64::from(LIVE_MS)],
    )
    .await
    .unwrap()
    .get(0)
}

async fn held(sql: &tokio_postgres::Client) -> i64 {
    held_of(sql, RATE).await
}

/// Every lowering's grace ends now (as if `cluster_shares::LOWERED_GRACE_MS` had passed).
async fn end_graces(sql: &tokio_postgres::Client) {
    sql.execute(
        "UPDATE node_share SET lowered_until = now() - interval '1 millisecond'
          WHERE lowered_until IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
}

async fn allot(db: &mut Db, name: &str, weight: u64) -> u64 {
    let want = Want {
        limit: RATE.into(),
        whole: WHOLE,
        rate: true,
        weight,
        used: 0,
    };
    db.allot_shares(name, LIVE_MS, &[want]).await.unwrap()[0]
}

/// `name`'s part of an account's 4 slots, using `used`.
async fn allot_slots(db: &mut Db, name: &str, weight: u64, used: u64) -> u64 {
    let want = Want {
        limit: SLOTS.into(),
        whole: 4,
        rate: false,
        weight,
        used,
    };
    db.allot_shares(name, LIVE_MS, &[want]).await.unwrap()[0]
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
    assert!(held(&sql).await <= WHOLE as i64);
    // a lowers to its even third; b and c get theirs once its grace has passed.
    assert_eq!(
        allot(&mut a, "a", 0).await,
        WHOLE / 3 + 1,
        "the remainder's unit"
    );
    assert_eq!(allot(&mut b, "b", 0).await, 0, "a's lowering still counts");
    end_graces(&sql).await;
    assert_eq!(allot(&mut b, "b", 0).await, WHOLE / 3);
    assert_eq!(allot(&mut c, "c", 0).await, WHOLE / 3);
    assert!(held(&sql).await <= WHOLE as i64);

    // c's tenants wait: a and b lower to a standby part, c takes the rest.
    let standby = WHOLE / 3 / 16;
    assert_eq!(
        allot(&mut c, "c", 10).await,
        WHOLE / 3,
        "no room beyond its third yet"
    );
    assert_eq!(allot(&mut a, "a", 0).await, standby);
    assert_eq!(allot(&mut b, "b", 0).await, standby);
    assert!(held(&sql).await <= WHOLE as i64);
    end_graces(&sql).await;
    assert_eq!(allot(&mut c, "c", 10).await, WHOLE - 2 * standby);
    assert_eq!(held(&sql).await, WHOLE as i64);

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
    assert_eq!(held(&sql).await, WHOLE as i64);
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
            stored <= WHOLE as i64,
            "round {round}: {parts:?} hold {stored}"
        );
        if round % 5 == 4 {
            end_graces(&sql).await;
        }
    }
}

/// Slots: a node keeps what it runs (never preempted), claims no more past its part, and each
/// slot its work frees goes to a peer below its share.
#[tokio::test]
async fn a_slot_in_use_stays_with_its_node_and_a_freed_one_goes_to_the_peer() {
    let test = TestDb::new().await;
    let sql = test.sql().await.unwrap();
    let mut a = node(&test, "a").await;
    let mut b = node(&test, "b").await;
    assert_eq!(allot_slots(&mut a, "a", 1, 0).await, 4, "alone and waiting");
    assert_eq!(allot_slots(&mut a, "a", 1, 4).await, 4);
    // b waits too: a's part falls to its half at once (it claims no more), but b gets nothing
    // while a still runs all four.
    assert_eq!(allot_slots(&mut b, "b", 1, 0).await, 0);
    assert_eq!(allot_slots(&mut a, "a", 1, 4).await, 2);
    assert_eq!(allot_slots(&mut b, "b", 1, 0).await, 0);
    assert_eq!(held_of(&sql, SLOTS).await, 4);
    // One of a's tasks ends: b has the slot at once (slots need no grace: what a node runs is
    // its `used`, counted as it is).
    assert_eq!(allot_slots(&mut a, "a", 1, 3).await, 2);
    assert_eq!(allot_slots(&mut b, "b", 1, 0).await, 1);
    assert!(held_of(&sql, SLOTS).await <= 4);
    // Another: even halves, never more than the four between them.
    assert_eq!(allot_slots(&mut a, "a", 1, 2).await, 2);
    assert_eq!(allot_slots(&mut b, "b", 1, 1).await, 2);
    assert_eq!(held_of(&sql, SLOTS).await, 4);
}

/// A limit's name past its bound, or an empty one, is refused by name before anything is
/// written.
#[tokio::test]
async fn a_limit_name_out_of_bounds_is_refused_by_name() {
    use spindle_control::cluster_shares::LIMIT_NAME_BYTES_MAX;
    use spindle_control::{InputError, StoreError};
    let test = TestDb::new().await;
    let mut a = node(&test, "a").await;
    let want = |limit: String| Want {
        limit,
        whole: 4,
        rate: false,
        weight: 1,
        used: 0,
    };
    let long = want("x".repeat(LIMIT_NAME_BYTES_MAX + 1));
    match a
        .allot_shares("a", LIVE_MS, &[want(SLOTS.into()), long])
        .await
    {
        Err(StoreError::Invalid(InputError::TooLong {
            row: 1,
            field: "limit",
            ..
        })) => {}
        other => panic!("{other:?}"),
    }
    match a.allot_shares("a", LIVE_MS, &[want(String::new())]).await {
        Err(StoreError::Invalid(InputError::Empty {
            row: 0,
            field: "limit",
        })) => {}
        other => panic!("{other:?}"),
    }
    let sql = test.sql().await.unwrap();
    assert_eq!(held_of(&sql, SLOTS).await, 0, "nothing written");
}
