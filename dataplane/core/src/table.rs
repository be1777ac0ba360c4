//! The shard's task table: a slab with a free list, plus an id → slot index. The scheduling path
//! reaches tasks by slot (the band deque carries it) and never hashes; reports from outside
//! arrive by `TaskId` and go through the index.

use std::ops::Index;

use crate::hash::IdMap;
use crate::ids::TaskId;

#[derive(Debug, Clone)]
pub(crate) struct TaskTable<E> {
    slots: Vec<Option<(TaskId, E)>>,
    free: Vec<u32>,
    index: IdMap<TaskId, u32>,
}

impl<E> Default for TaskTable<E> {
    fn default() -> Self {
        TaskTable {
            slots: Vec::new(),
            free: Vec::new(),
            index: IdMap::default(),
        }
    }
}

impl<E> TaskTable<E> {
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

    pub fn get_mut(&mut self, task: &TaskId) -> Option<&mut E> {
        let slot = *self.index.get(task)?;
        Some(self.at_mut(slot))
    }

    /// Inserts a task that is not in the table; returns its slot.
    pub fn insert(&mut self, task: TaskId, entry: E) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some((task, entry));
                slot
            }
            None => {
                self.slots.push(Some((task, entry)));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 tasks (TASKS_MAX)")
            }
        };
        let previous = self.index.insert(task, slot);
        assert!(previous.is_none(), "task {task} inserted twice");
        slot
    }

    pub fn remove(&mut self, task: &TaskId) -> Option<E> {
        let slot = self.index.remove(task)?;
        let (_, entry) = self.slots[slot as usize]
            .take()
            .expect("indexed slot is occupied");
        self.free.push(slot);
        Some(entry)
    }

    pub fn id_at(&self, slot: u32) -> TaskId {
        self.slots[slot as usize].as_ref().expect("occupied slot").0
    }

    pub fn at(&self, slot: u32) -> &E {
        &self.slots[slot as usize].as_ref().expect("occupied slot").1
    }

    pub fn at_mut(&mut self, slot: u32) -> &mut E {
        &mut self.slots[slot as usize].as_mut().expect("occupied slot").1
    }

    pub fn iter(&self) -> impl Iterator<Item = (TaskId, &E)> {
        self.slots
            .iter()
            .flatten()
            .map(|(task, entry)| (*task, entry))
    }
}

impl<E> Index<&TaskId> for TaskTable<E> {
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
        let mut t: TaskTable<&str> = TaskTable::default();
        let a = t.insert(TaskId(1), "a");
        let b = t.insert(TaskId(2), "b");
        assert_eq!(t.remove(&TaskId(1)), Some("a"));
        let c = t.insert(TaskId(3), "c");
        assert_eq!(c, a, "a freed slot is reused");
        assert_eq!((t.len(), t[&TaskId(3)], t.id_at(b)), (2, "c", TaskId(2)));
        assert_eq!(t.get(&TaskId(1)), None);
        let mut ids: Vec<u64> = t.iter().map(|(id, _)| id.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 3]);
    }
}
