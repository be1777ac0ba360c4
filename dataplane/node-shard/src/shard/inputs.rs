//! The inputs of a shard's live tasks (`SubmitTask.input`: what to generate, for the provider),
//! kept from admission until the task ends or is canceled, since every attempt at a provider
//! sends it again. Only tasks submitted with an input have an entry. The bytes held in memory
//! are bounded (`task_inputs_mb`, split among the shards): past the bound a task's input is
//! not held but left where it is durable anyway — in the task's stored request, in
//! PostgreSQL — and read back when an attempt goes to its provider (one read per batch of
//! attempts, `shard::provider::stored_inputs`). So a long queue of tasks with large inputs
//! costs the node a few bytes per task beyond the bound, not a refusal.

use spindle_core::hash::RunMap;
use spindle_core::TaskId;

pub(super) struct Inputs {
    /// `None`: the task's input was left in its stored request.
    held: RunMap<TaskId, Option<Box<str>>>,
    bytes: usize,
    bytes_max: usize,
    stored: usize,
}

/// Where a task's input is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Input<'a> {
    /// It was submitted without one.
    None,
    Held(&'a str),
    /// Only in its stored request (the bound was reached when it was kept).
    Stored,
}

impl Inputs {
    pub(super) fn new(bytes_max: usize) -> Inputs {
        Inputs {
            held: RunMap::default(),
            bytes: 0,
            bytes_max,
            stored: 0,
        }
    }

    /// Keeps `task`'s input: in memory while the bound has room for it, else only the mark that
    /// its stored request has it. True when it is held in memory.
    pub(super) fn keep(&mut self, task: TaskId, input: Box<str>) -> bool {
        self.release(task);
        let held = self.bytes + input.len() <= self.bytes_max;
        if held {
            self.bytes += input.len();
            self.held.insert(task, Some(input));
        } else {
            self.stored += 1;
            self.held.insert(task, None);
        }
        held
    }

    pub(super) fn get(&self, task: TaskId) -> Input<'_> {
        match self.held.get(&task) {
            None => Input::None,
            Some(Some(i)) => Input::Held(i),
            Some(None) => Input::Stored,
        }
    }

    /// Lets `task`'s input go (the task ended or was never stored).
    pub(super) fn release(&mut self, task: TaskId) {
        match self.held.remove(&task) {
            Some(Some(old)) => self.bytes -= old.len(),
            Some(None) => self.stored -= 1,
            None => {}
        }
    }

    /// Bytes held in memory now.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Live tasks whose input is only in their stored request.
    pub(super) fn stored(&self) -> usize {
        self.stored
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_held_up_to_the_bound_and_left_in_the_store_past_it() {
        let mut inputs = Inputs::new(10);
        assert!(inputs.keep(TaskId(1), "abcdef".into()));
        assert_eq!((inputs.bytes(), inputs.stored()), (6, 0));
        assert_eq!(inputs.get(TaskId(1)), Input::Held("abcdef"));
        // Past the bound: only marked.
        assert!(!inputs.keep(TaskId(2), "01234".into()));
        assert_eq!((inputs.bytes(), inputs.stored()), (6, 1));
        assert_eq!(inputs.get(TaskId(2)), Input::Stored);
        assert_eq!(inputs.get(TaskId(3)), Input::None);
        // What fits still goes to memory.
        assert!(inputs.keep(TaskId(3), "0123".into()));
        assert_eq!(inputs.bytes(), 10);
        // Kept again (a restore of a task kept already): counted once, where it is now.
        assert!(!inputs.keep(TaskId(1), "abcdefg".into()));
        assert_eq!((inputs.bytes(), inputs.stored()), (4, 2));
        assert!(inputs.keep(TaskId(2), "012345".into()));
        assert_eq!((inputs.bytes(), inputs.stored()), (10, 1));
        for t in [1, 2, 3, 3] {
            inputs.release(TaskId(t));
        }
        assert_eq!((inputs.bytes(), inputs.stored()), (0, 0));
        assert_eq!(inputs.get(TaskId(2)), Input::None);
    }
}
