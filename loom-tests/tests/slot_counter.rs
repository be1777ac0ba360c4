//! Loom model of the node-wide slot counter: shards acquiring and releasing across threads never
//! see usage above capacity or below zero, and no grant is lost.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use spindle_sync::SlotCounter;

/// Each thread tries to take `units`, checks the bound while holding them, then gives them back.
fn contend(capacity: u64, units: [u64; 3]) {
    loom::model(move || {
        let slots = Arc::new(SlotCounter::new(capacity));
        let handles: Vec<_> = units
            .iter()
            .map(|&n| {
                let slots = slots.clone();
                thread::spawn(move || {
                    let granted = slots.try_acquire(n).is_ok();
                    if granted {
                        let used = slots.used();
                        assert!(used >= n, "holding {n} units but the counter says {used}");
                        assert!(used <= slots.capacity(), "used {used} above capacity");
                        slots.release(n);
                    }
                    granted
                })
            })
            .collect();
        let granted: Vec<bool> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(slots.used(), 0, "every grant was released exactly once");
        // A thread whose demand alone fits must not be refused when the others take nothing
        // that could block it: with capacity for everyone at once, everyone is granted.
        if units.iter().sum::<u64>() <= capacity {
            assert!(
                granted.iter().all(|&g| g),
                "refused although all demands fit together"
            );
        }
    });
}

#[test]
fn three_threads_oversubscribed() {
    contend(2, [1, 1, 1]);
}

#[test]
fn three_threads_mixed_sizes() {
    contend(3, [2, 1, 2]);
}

#[test]
fn three_threads_all_fit() {
    contend(4, [1, 2, 1]);
}

#[test]
fn held_units_never_exceed_capacity() {
    // Two threads keep their grant until the end, so a concurrent observer would see the sum.
    loom::model(|| {
        let slots = Arc::new(SlotCounter::new(3));
        let a = {
            let slots = slots.clone();
            thread::spawn(move || slots.try_acquire(2).is_ok())
        };
        let b = {
            let slots = slots.clone();
            thread::spawn(move || slots.try_acquire(2).is_ok())
        };
        let got_a = a.join().unwrap();
        let got_b = b.join().unwrap();
        assert!(
            got_a ^ got_b,
            "exactly one of two 2-unit demands fits in 3 units"
        );
        assert_eq!(slots.used(), 2);
    });
}
