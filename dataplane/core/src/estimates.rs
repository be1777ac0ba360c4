//! The shard's interned cost estimates: every live task with the same spec shares one entry, so
//! a task carries a 4-byte [`EstimateRef`] instead of a 64-byte [`CostEstimate`], and pricing a
//! spec that live tasks already have costs one lookup.
//!
//! Entries are reference counted by the tasks that hold them and freed with the last one, so the
//! table never holds more entries than there are live tasks (`TASKS_MAX`). When a model's row of
//! the capability matrix changes, its entries leave the index ([`Estimates::forget_model`]):
//! the tasks holding them keep the estimate they were admitted with, new tasks are priced
//! afresh. Errors are not interned: an unpriceable spec is priced again each time it is
//! submitted.

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
            // A forgotten entry may share its spec with a newer, indexed one.
            if self.index.get(&entry.spec) == Some(&r.0) {
                self.index.remove(&entry.spec);
            }
            self.free.push(r.0);
        }
    }

    /// `model`'s price changed: its live entries stay with the tasks that hold them, and the
    /// next task of such a spec is priced again.
    pub fn forget_model(&mut self, model: ModelId) {
        self.index.retain(|spec, _| spec.model != model);
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

    /// Every live entry has exactly the holders counted in `holders` (by slot), free slots none,
    /// and the index points only at live entries of the spec it names.
    pub fn check_invariants(&self, holders: &[u32]) {
        let mut free = vec![false; self.entries.len()];
        for &i in &self.free {
            assert!(!free[i as usize], "an estimate slot freed twice");
            free[i as usize] = true;
        }
        for (i, entry) in self.entries.iter().enumerate() {
            let held = if free[i] { 0 } else { entry.refs };
            assert_eq!(held, holders[i], "estimate holders drifted");
            assert!(free[i] || entry.refs > 0, "a live estimate without holders");
        }
        for (&spec, &i) in &self.index {
            assert!(!free[i as usize], "estimate index points at a free slot");
            assert_eq!(
                self.entries[i as usize].spec, spec,
                "estimate index points at another spec"
            );
        }
    }
}
