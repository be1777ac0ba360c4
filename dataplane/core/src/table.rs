//! The shard's task table: a slab with a free list, plus an id → slot index. The scheduling path
//! reaches tasks by slot (band lists link slots) and never hashes; reports from outside arrive by
//! `TaskId` and go through the index.
//!
//! Each slot keeps a task's hot part — what admission and the pick read and write — in one
//! cache-line-aligned cell, and its cold part (what only reports touch) in a parallel vector, so
//! that the pick of a task costs one line of memory. A third vector holds one link per slot for
//! the band lists: 4 bytes a task, dense enough to stay in cache, so appending behind a task that
//! was queued long ago does not fetch that task's line.

use std::ops::Index;

use crate::hash::RunMap;
use crate::ids::TaskId;
use crate::queue::NIL;

/// A hot cell: the task id beside its hot part, one cache line for hot parts up to 56 bytes.
#[derive(Debug, Clone)]
#[repr(align(64))]
struct Cell<E>(Option<(TaskId, E)>);

#[derive(Debug, Clone)]
pub(crate) struct TaskTable<E, C> {
    hot: Vec<Cell<E>>,
    cold: Vec<C>,
    links: Vec<u32>,
    free: Vec<u32>,
    index: RunMap<TaskId, u32>,
}

impl<E, C> Default for TaskTable<E, C> {
    fn default() -> Self {
        TaskTable {
            hot: Vec::new(),
            cold: Vec::new(),
            links: Vec::new(),
            free: Vec::new(),
            index: RunMap::default(),
        }
    }
}

impl<E, C> TaskTable<E, C> {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn contains_key(&self, task: &TaskId) -> bool {
        self.index.contains_key(task)
    }

    /// The slot of a task in the table.
    pub fn slot(&self, task: TaskId) -> Option<u32> {
        self.index.get(&task).copied()
    }

    pub fn get(&self, task: &TaskId) -> Option<&E> {
        let slot = *self.index.get(task)?;
        Some(self.at(slot))
    }

    /// Inserts a task that is not in the table; returns its slot.
    pub fn insert(&mut self, task: TaskId, entry: E, cold: C) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.hot[slot as usize] = Cell(Some((task, entry)));
                self.cold[slot as usize] = cold;
                self.links[slot as usize] = NIL;
                slot
            }
            None => {
                self.hot.push(Cell(Some((task, entry))));
                self.cold.push(cold);
                self.links.push(NIL);
                u32::try_from(self.hot.len() - 1).expect("fewer than 2^32 tasks (TASKS_MAX)")
            }
        };
        let previous = self.index.insert(task, slot);
        assert!(previous.is_none(), "task {task} inserted twice");
        slot
    }

    /// Removes a task; its cold part stays in the vacant slot until the slot is reused.
    pub fn remove(&mut self, task: &TaskId) -> Option<E> {
        let slot = self.index.remove(task)?;
        let (_, entry) = self.hot[slot as usize]
            .0
            .take()
            .expect("indexed slot is occupied");
        self.free.push(slot);
        Some(entry)
    }

    pub fn id_at(&self, slot: u32) -> TaskId {
        self.hot[slot as usize].0.as_ref().expect("occupied slot").0
    }

    #[inline]
    pub fn at(&self, slot: u32) -> &E {
        &self.hot[slot as usize].0.as_ref().expect("occupied slot").1
    }

    #[inline]
    pub fn at_mut(&mut self, slot: u32) -> &mut E {
        &mut self.hot[slot as usize].0.as_mut().expect("occupied slot").1
    }

    /// Hints that the hot part in `slot` is read next (see [`crate::prefetch`]).
    #[inline]
    pub fn prefetch(&self, slot: u32) {
        if let Some(cell) = self.hot.get(slot as usize) {
            crate::prefetch::prefetch(cell);
        }
    }

    /// The slot's band-list link (`queue::NIL` when none).
    #[inline]
    pub fn link(&self, slot: u32) -> u32 {
        self.links[slot as usize]
    }

    #[inline]
    pub fn set_link(&mut self, slot: u32, next: u32) {
        self.links[slot as usize] = next;
    }

    pub fn cold(&self, slot: u32) -> &C {
        &self.cold[slot as usize]
    }

    pub fn cold_mut(&mut self, slot: u32) -> &mut C {
        &mut self.cold[slot as usize]
    }

    /// Every task with its slot.
    pub fn iter(&self) -> impl Iterator<Item = (TaskId, u32, &E)> {
        self.hot
            .iter()
            .enumerate()
            .filter_map(|(slot, cell)| cell.0.as_ref().map(|(task, e)| (*task, slot as u32, e)))
    }
}

impl<E, C> Index<&TaskId> for TaskTable<E, C> {
    type Output = E;

    fn index(&self, task: &TaskId) -> &E {
        self.get(task)
            .unwrap_or_else(|| panic!("task {task} is not in the table"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_and_the_index_follows() {
        let mut t: TaskTable<&str, u8> = TaskTable::default();
        let a = t.insert(TaskId(1), "a", 1);
        let b = t.insert(TaskId(2), "b", 2);
        assert_eq!(t.remove(&TaskId(1)), Some("a"));
        let c = t.insert(TaskId(3), "c", 3);
        assert_eq!(c, a, "a freed slot is reused");
        assert_eq!((t.len(), t[&TaskId(3)], t.id_at(b)), (2, "c", TaskId(2)));
        assert_eq!(
            (*t.cold(c), *t.cold(b)),
            (3, 2),
            "cold parts follow their slot"
        );
        assert_eq!(t.get(&TaskId(1)), None);
        let mut ids: Vec<u64> = t.iter().map(|(id, _, _)| id.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 3]);
    }
}
