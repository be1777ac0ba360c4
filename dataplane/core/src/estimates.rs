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
    /// The entry the last acquisition found or made, while it is live and indexed: a run of
    /// submits of one spec (a client's batch, a tenant's everyday clip) compares 20 bytes
    /// instead of hashing the spec and probing.
    last: Option<u32>,
}

impl Estimates {
    /// The estimate of `spec` with one more holder, pricing it with `price` if no live task has
    /// it. Pair with [`Estimates::release`].
    pub fn acquire(
        &mut self,
        spec: &TaskSpec,
        price: impl FnOnce() -> Result<CostEstimate, CostError>,
    ) -> Result<EstimateRef, CostError> {
        if let Some(i) = self.last {
            let entry = &mut self.entries[i as usize];
            if entry.spec == *spec {
                entry.refs += 1;
                return Ok(EstimateRef(i));
            }
        }
        if let Some(&i) = self.index.get(spec) {
            self.entries[i as usize].refs += 1;
            self.last = Some(i);
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
        self.last = Some(i);
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
            if self.last == Some(r.0) {
                self.last = None;
            }
            self.free.push(r.0);
        }
    }

    /// `model`'s price changed: its live entries stay with the tasks that hold them, and the
    /// next task of such a spec is priced again.
    pub fn forget_model(&mut self, model: ModelId) {
        self.index.retain(|spec, _| spec.model != model);
        if self
            .last
            .is_some_and(|i| self.entries[i as usize].spec.model == model)
        {
            self.last = None;
        }
    }

    #[inline]
    pub fn get(&self, r: EstimateRef) -> &CostEstimate {
        &self.entries[r.0 as usize].estimate
    }

    /// The spec the estimate prices.
    #[inline]
    pub fn spec(&self, r: EstimateRef) -> TaskSpec {
        self.entries[r.0 as usize].spec
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
        if let Some(i) = self.last {
            assert!(!free[i as usize], "the last estimate is a free slot");
            assert_eq!(
                self.index.get(&self.entries[i as usize].spec),
                Some(&i),
                "the last estimate is not the indexed one of its spec"
            );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::estimate;
    use crate::presets::small_node;

    /// Acquires `spec`, counting how often it had to be priced.
    fn acquire(e: &mut Estimates, spec: &TaskSpec, priced: &mut u32) -> EstimateRef {
        let policy = small_node();
        let model = &policy.models[spec.model.0 as usize];
        e.acquire(spec, || {
            *priced += 1;
            estimate(spec, model, &policy.cost_bases)
        })
        .expect("the preset prices a 720p clip")
    }

    #[test]
    fn a_spec_is_priced_once_while_live_and_again_after_its_model_changed() {
        let mut e = Estimates::default();
        let mut priced = 0;
        let a = TaskSpec::clip_720p(ModelId(0));
        let mut b = a;
        b.duration_ms *= 2;
        let r1 = acquire(&mut e, &a, &mut priced);
        let r2 = acquire(&mut e, &a, &mut priced);
        let r3 = acquire(&mut e, &b, &mut priced);
        let r4 = acquire(&mut e, &a, &mut priced);
        assert_eq!((r1, r2, r4), (r1, r1, r1));
        assert_ne!(r1, r3);
        assert_eq!(priced, 2, "each spec priced once while live");
        let holders = |e: &Estimates, refs: &[EstimateRef]| {
            let mut h = vec![0; e.slots()];
            for r in refs {
                h[r.index()] += 1;
            }
            h
        };
        e.check_invariants(&holders(&e, &[r1, r2, r3, r4]));
        // The last holder of `a` goes: its entry is freed, and `a` is priced again.
        for r in [r1, r2, r4] {
            e.release(r);
        }
        e.check_invariants(&holders(&e, &[r3]));
        let r5 = acquire(&mut e, &a, &mut priced);
        assert_eq!(priced, 3);
        // The model's price changed: live tasks keep their entries, new ones are priced afresh.
        e.forget_model(ModelId(0));
        e.check_invariants(&holders(&e, &[r3, r5]));
        let r6 = acquire(&mut e, &a, &mut priced);
        assert_eq!(priced, 4);
        assert_ne!(r6, r5);
        e.check_invariants(&holders(&e, &[r3, r5, r6]));
    }
}
