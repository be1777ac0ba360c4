//! Loom model of the sub-leased node limits: shards moving their holdings toward targets that
//! a coordinator changes under them never hold more, together, than the capacity, and no unit is
//! lost or created.
#![cfg(loom)]

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use spindle_sync::ShareBoard;

/// A shard thread: rebalances, uses what it holds (counted in `in_use`, checked against the
/// capacity), rebalances again after releasing it.
fn shard(board: &ShareBoard, in_use: &AtomicU64, i: usize, capacity: u64) {
    let held = board.rebalance(0, i, 0);
    if held > 0 {
        let now = in_use.fetch_add(held, Ordering::AcqRel) + held;
        assert!(now <= capacity, "{now} units in use, capacity {capacity}");
        in_use.fetch_sub(held, Ordering::AcqRel);
    }
    board.rebalance(0, i, 0);
}

fn model(capacity: u64, first: [u64; 2], second: [u64; 2]) {
    loom::model(move || {
        let board = Arc::new(ShareBoard::new(&[capacity], 2));
        let in_use = Arc::new(AtomicU64::new(0));
        board.set_targets(0, &first);
        let coordinator = {
            let board = board.clone();
            thread::spawn(move || board.set_targets(0, &second))
        };
        let shards: Vec<_> = (0..2)
            .map(|i| {
                let (board, in_use) = (board.clone(), in_use.clone());
                thread::spawn(move || shard(&board, &in_use, i, capacity))
            })
            .collect();
        coordinator.join().unwrap();
        for s in shards {
            s.join().unwrap();
        }
        assert_eq!(board.accounted(0), capacity, "units lost or created");
    });
}

#[test]
fn shares_swap_while_shards_use_them() {
    model(4, [4, 0], [0, 4]);
}

#[test]
fn overcommitted_targets_never_overshoot() {
    // A stale target plus a fresh one can ask for more than exists: the free pool says no.
    model(3, [3, 3], [1, 3]);
}

/// The coordinator lowers the capacity while both shards move toward (stale) targets and use
/// what they hold: in-use never passes the capacity it was when the shards started, and once
/// the shards are done and hold nothing, nothing is owed and the free pool is exactly the new
/// capacity.
#[test]
fn a_capacity_lowered_under_the_shards_is_paid_back_exactly() {
    loom::model(|| {
        let board = Arc::new(ShareBoard::new(&[4], 2));
        let in_use = Arc::new(AtomicU64::new(0));
        board.set_targets(0, &[2, 2]);
        let coordinator = {
            let board = board.clone();
            thread::spawn(move || {
                board.set_capacity(0, 1);
                board.set_targets(0, &[0, 0]);
            })
        };
        let shards: Vec<_> = (0..2)
            .map(|i| {
                let (board, in_use) = (board.clone(), in_use.clone());
                thread::spawn(move || shard(&board, &in_use, i, 4))
            })
            .collect();
        coordinator.join().unwrap();
        for s in shards {
            s.join().unwrap();
        }
        // Every shard gives back what it still holds beyond its target of 0.
        board.set_targets(0, &[0, 0]);
        for i in 0..2 {
            board.rebalance(0, i, 0);
        }
        assert_eq!(board.owed(0), 0, "units still owed");
        assert_eq!(board.free(0), 1, "the free pool is the new capacity");
        assert_eq!(board.accounted(0), 1);
    });
}

/// A limit added while the node runs (a new provider account's): its entry starts with no
/// capacity and nobody holding any, the coordinator gives it one while the shards already move
/// toward targets and use what they hold; they never use more than it, and no unit is lost or
/// created.
#[test]
fn a_limit_added_with_no_capacity_is_filled_under_the_shards() {
    loom::model(|| {
        let board = Arc::new(ShareBoard::new(&[0], 2));
        let in_use = Arc::new(AtomicU64::new(0));
        board.set_targets(0, &[2, 2]);
        let coordinator = {
            let board = board.clone();
            thread::spawn(move || {
                board.set_capacity(0, 3);
                board.set_targets(0, &[2, 1]);
            })
        };
        let shards: Vec<_> = (0..2)
            .map(|i| {
                let (board, in_use) = (board.clone(), in_use.clone());
                thread::spawn(move || shard(&board, &in_use, i, 3))
            })
            .collect();
        coordinator.join().unwrap();
        for s in shards {
            s.join().unwrap();
        }
        assert_eq!(board.owed(0), 0);
        assert_eq!(board.accounted(0), 3, "units lost or created");
    });
}
