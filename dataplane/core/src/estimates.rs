//! The shard's interned cost estimates: every live task with the same spec shares one entry, so
//! a task carries a 4-byte [`EstimateRef`] instead of a 64-byte [`CostEstimate`], and pricing a
//! spec that live tasks already have costs one lookup.
//!
//! Entries are reference counted by the tasks that hold them and freed with the last one, so the
//! table never holds more entries than there are live tasks (`TASKS_MAX`). A shard's capability
//! matrix and cost bases are fixed for its life, so an entry never goes stale. Errors are not
//! interned: an unpriceable spec is priced again each time it is submitted.

use crate::cost::{CostError, CostEstimate, TaskSpec};
use crate::hash::IdMap;
use crate::ids::ModelId;

/// A task's interned estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EstimateRef(u32);

impl EstimateRef {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Debug, Clone)]
struct Entry {
    estimate: CostEstimate,
    spec: TaskSpec,
    /// Tasks holding this entry; zero only for a free slot.
    refs: u32,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Estimates {
    entries: Vec<Entry>,
    free: Vec<u32>,
    index: IdMap<TaskSpec, u32>,
}

impl Estimates {
    /// The estimate of `spec` with one more holder, pricing it with `price` if no live task has
    /// it. Pair with [`Estimates::release`].
    pub fn acquire(
        &mut self,
        spec: &TaskSpec,
        price: impl FnOnce() -> Result<CostEstimate, CostError>,
    ) -> Result<EstimateRef, CostError> {
        if let Some(&i) = self.index.get(spec) {
            self.entries[i as usize].refs += 1;
            return Ok(EstimateRef(i));
        }
        let entry = Entry {
            estimate: price()?,
            spec: *spec,
            refs: 1,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = entry;
                i
            }
            None => {
                self.entries.push(entry);
                u32::try_from(self.entries.len() - 1).expect("fewer estimates than TASKS_MAX")
            }
        };
        self.index.insert(*spec, i);
        Ok(EstimateRef(i))
    }

    /// One holder fewer; the entry goes with its last one.
    pub fn release(&mut self, r: EstimateRef) {
        let entry = &mut self.entries[r.0 as usize];
        entry.refs = entry
            .refs
            .checked_sub(1)
            .expect("an estimate released more often than acquired");
        if entry.refs == 0 {
            self.index.remove(&entry.spec);
            self.free.push(r.0);
        }
    }

    #[inline]
    pub fn get(&self, r: EstimateRef) -> &CostEstimate {
        &self.entries[r.0 as usize].estimate
    }

    #[inline]
    pub fn model(&self, r: EstimateRef) -> ModelId {
        self.entries[r.0 as usize].spec.model
    }

    /// Slots in the table, live or free (holder counts are indexed by [`EstimateRef::index`]).
    pub fn slots(&self) -> usize {
        self.entries.len()
    }

    /// Every live entry has exactly the holders counted in `holders` (by slot), free slots none.
    pub fn check_invariants(&self, holders: &[u32]) {
        for (&spec, &i) in &self.index {
            let entry = &self.entries[i as usize];
            assert_eq!(entry.spec, spec, "estimate index points at another spec");
            assert_eq!(entry.refs, holders[i as usize], "estimate holders drifted");
        }
        for &i in &self.free {
            assert_eq!(holders[i as usize], 0, "a task holds a freed estimate");
        }
        assert_eq!(
            self.index.len() + self.free.len(),
            self.entries.len(),
            "estimate slots leaked"
        );
    }
}
