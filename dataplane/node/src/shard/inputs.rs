//! The inputs of a shard's live tasks (`SubmitTask.input`: what to generate, for the provider),
//! held from admission until the task ends or is canceled, since every attempt at a provider
//! sends it again. Only tasks submitted with an input have an entry, and the bytes held are bounded
//! (`task_inputs_mb`, split among the shards): past the bound, a task with an input is
//! rejected as overloaded (`RejectPlatformOverloaded`, with the reason) rather than held;
//! tasks without one are not affected. Tasks put back by a restart or takeover are held past it:
//! they were accepted once, and the bound only refuses new work until they end.

use spindle_core::hash::RunMap;
use spindle_core::TaskId;

pub(super) struct Inputs {
    held: RunMap<TaskId, Box<str>>,
    bytes: usize,
    bytes_max: usize,
}

impl Inputs {
    pub(super) fn new(bytes_max: usize) -> Inputs {
        Inputs {
            held: RunMap::default(),
            bytes: 0,
            bytes_max,
        }
    }

    /// Why a new task's input of `len` bytes cannot be held now, if it cannot.
    pub(super) fn refusal(&self, len: usize) -> Option<String> {
        (self.bytes + len > self.bytes_max).then(|| {
            format!(
                "task inputs held by this shard at their limit ({} of {} bytes; \
                 task_inputs_mb): retry as tasks end",
                self.bytes, self.bytes_max
            )
        })
    }

    /// Holds `task`'s input (a restored task's may go past the bound).
    pub(super) fn hold(&mut self, task: TaskId, input: Box<str>) {
        self.bytes += input.len();
        if let Some(old) = self.held.insert(task, input) {
            self.bytes -= old.len();
        }
    }

    pub(super) fn get(&self, task: TaskId) -> Option<&str> {
        self.held.get(&task).map(|i| &**i)
    }

    /// Lets `task`'s input go (the task ended or was never stored).
    pub(super) fn release(&mut self, task: TaskId) {
        if let Some(old) = self.held.remove(&task) {
            self.bytes -= old.len();
        }
    }

    /// Bytes held now.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_follow_what_is_held_and_the_bound_refuses_past_it() {
        let mut inputs = Inputs::new(10);
        assert_eq!(inputs.refusal(10), None);
        inputs.hold(TaskId(1), "abcdef".into());
        assert_eq!(inputs.bytes(), 6);
        assert!(inputs
            .refusal(5)
            .is_some_and(|r| r.contains("6 of 10 bytes")));
        assert_eq!(inputs.refusal(4), None);
        // Held again (a restore of a task held already): counted once.
        inputs.hold(TaskId(1), "abc".into());
        assert_eq!(inputs.bytes(), 3);
        // A restored task's input goes past the bound; new ones are refused until it ends.
        inputs.hold(TaskId(2), "0123456789".into());
        assert_eq!(inputs.bytes(), 13);
        assert!(inputs.refusal(1).is_some());
        assert_eq!(inputs.get(TaskId(2)), Some("0123456789"));
        inputs.release(TaskId(2));
        inputs.release(TaskId(2));
        assert_eq!(inputs.bytes(), 3);
        assert_eq!(inputs.get(TaskId(2)), None);
        inputs.release(TaskId(1));
        assert_eq!(inputs.bytes(), 0);
    }
}
