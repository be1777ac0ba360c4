use super::*;
use std::mem::{offset_of, size_of};

const LINE: usize = 64;

fn line_of(offset: usize) -> usize {
    offset / LINE
}

/// The lines an admission reads of a tenant (0–2) and of a user (0–1) stay where the
/// records' comments say; a field added in the wrong place fails here, not in a bench.
#[test]
fn owner_records_keep_their_cache_lines() {
    assert_eq!(size_of::<TenantRt>(), 5 * LINE);
    let admission = [
        offset_of!(TenantRt, submit_rate),
        offset_of!(TenantRt, submit_rate) + size_of::<SubmitBucket>() - 1,
        offset_of!(TenantRt, gates),
        offset_of!(TenantRt, weight),
        offset_of!(TenantRt, max_wait_ms),
        offset_of!(TenantRt, cost_room_milli),
        offset_of!(TenantRt, cost_burst_milli),
        offset_of!(TenantRt, lane),
        offset_of!(TenantRt, base_band),
        offset_of!(TenantRt, wait_overflow),
        offset_of!(TenantRt, classes),
        offset_of!(TenantRt, home_lane),
        offset_of!(TenantRt, suspended),
        offset_of!(TenantRt, home) + TenantQueue::APPEND_BYTES - 1,
    ];
    for offset in admission {
        assert!(line_of(offset) <= 1, "admission field at {offset}");
    }
    let cost = offset_of!(TenantRt, cost_per_minute);
    assert_eq!(
        (line_of(cost), line_of(cost + size_of::<TokenBucket>() - 1)),
        (3, 3)
    );
    assert_eq!(line_of(offset_of!(TenantRt, running)), 4);

    assert_eq!(size_of::<UserRt>(), 2 * LINE);
    assert_eq!(offset_of!(UserRt, gates) + size_of::<OwnedPair>(), LINE);
    assert_eq!(offset_of!(UserRt, running), LINE);
}

/// A rate nobody holds goes by backlogged weight, an idle shard's standby part first: with
/// none, a shard that had nothing waiting at a split could not start one request before the
/// next split, however far the node was from the limit.
#[test]
fn an_idle_shard_keeps_a_standby_part_of_a_rate() {
    let rate = NodeCapacity::Rate(RateSpec {
        per_minute: 6_400,
        burst: 640,
    });
    let load = |weight| ShardLoad {
        used: 0,
        weight,
        share: 0,
        vtime: 0,
        refused: 0,
    };
    let targets = rate.split_targets(&[load(2), load(0)]);
    assert_eq!(targets, vec![6_200, 200]);
    assert_eq!(
        rate.part(targets[1]),
        NodeCapacity::Rate(RateSpec {
            per_minute: 200,
            burst: 20,
        })
    );
    // Nothing waits anywhere: evenly.
    assert_eq!(rate.split_targets(&[load(0), load(0)]), vec![3_200, 3_200]);
}

/// A part of a rate small enough that its burst rounds to nothing holds no request — the parts'
/// bursts never add up to more than the whole's — unless its holder has work waiting: a bucket of
/// no burst never holds a token, and its shard never sent anything (three nodes of an account at
/// 570 a minute, burst 9, stood still this way); no rate, no burst either way.
#[test]
fn a_small_part_of_a_rate_holds_one_request_only_for_a_waiting_holder() {
    let rate = NodeCapacity::Rate(RateSpec {
        per_minute: 190,
        burst: 2,
    });
    let of = |per_minute, burst| NodeCapacity::Rate(RateSpec { per_minute, burst });
    assert_eq!(rate.part(94), of(94, 0));
    assert_eq!(rate.waiting_part(94), of(94, 1));
    assert_eq!(rate.waiting_part(190), of(190, 2));
    assert_eq!(rate.part(0), of(0, 0));
    assert_eq!(rate.waiting_part(0), of(0, 0));
}
