//! A bounded counter of slot units: all-or-nothing `try_acquire`, `release` that can never go
//! below zero. It never waits: a caller that cannot acquire goes on to another candidate.

use crate::primitive::{AtomicU64, Ordering};

/// `try_acquire` could not take the units: `used + units` would exceed `capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotsExhausted {
    pub used: u64,
    pub capacity: u64,
    pub requested: u64,
}

/// A node-wide semaphore of `capacity` units shared by shard threads.
#[derive(Debug)]
pub struct SlotCounter {
    used: AtomicU64,
    capacity: u64,
}

impl SlotCounter {
    pub fn new(capacity: u64) -> Self {
        SlotCounter {
            used: AtomicU64::new(0),
            capacity,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Takes `units` if they fit, in one compare-and-swap; otherwise changes nothing.
    pub fn try_acquire(&self, units: u64) -> Result<(), SlotsExhausted> {
        assert!(units > 0, "acquiring zero units is a caller bug");
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let fits = used
                .checked_add(units)
                .is_some_and(|after| after <= self.capacity);
            if !fits {
                return Err(SlotsExhausted {
                    used,
                    capacity: self.capacity,
                    requested: units,
                });
            }
            match self.used.compare_exchange_weak(
                used,
                used + units,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => used = actual,
            }
        }
    }

    /// Gives back `units` taken by a successful `try_acquire`. Releasing more than is held is a
    /// bug (a double release) and panics rather than wrapping below zero.
    pub fn release(&self, units: u64) {
        assert!(units > 0, "releasing zero units is a caller bug");
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let after = used.checked_sub(units).unwrap_or_else(|| {
                panic!("release of {units} units with only {used} held: double release")
            });
            match self
                .used
                .compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(actual) => used = actual,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn acquire_is_all_or_nothing() {
        let slots = SlotCounter::new(5);
        slots.try_acquire(3).unwrap();
        let refused = slots.try_acquire(3).unwrap_err();
        assert_eq!(
            refused,
            SlotsExhausted {
                used: 3,
                capacity: 5,
                requested: 3
            }
        );
        assert_eq!(slots.used(), 3);
        slots.try_acquire(2).unwrap();
        slots.release(5);
        assert_eq!(slots.used(), 0);
    }

    #[test]
    #[should_panic(expected = "double release")]
    fn release_below_zero_panics() {
        let slots = SlotCounter::new(2);
        slots.try_acquire(1).unwrap();
        slots.release(2);
    }
}
