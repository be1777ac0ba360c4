//! The task state machine of design.md §5 as an explicit whitelist, with compare-and-set on
//! `(state, version)`. Terminal states stay terminal; FAILED → QUEUED only by an operator.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    Created,
    Queued,
    Dispatching,
    SubmitUnknown,
    Running,
    ProviderSucceeded,
    MediaProcessing,
    Succeeded,
    Failed,
    Canceled,
    Expired,
}

/// Who asks for a transition: some are reserved to operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Actor {
    System,
    Operator,
}

impl TaskState {
    pub const ALL: [TaskState; 11] = [
        TaskState::Created,
        TaskState::Queued,
        TaskState::Dispatching,
        TaskState::SubmitUnknown,
        TaskState::Running,
        TaskState::ProviderSucceeded,
        TaskState::MediaProcessing,
        TaskState::Succeeded,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Expired,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded | TaskState::Failed | TaskState::Canceled | TaskState::Expired
        )
    }

    /// The whitelist. Anything not listed is illegal.
    pub fn may_become(self, to: TaskState, actor: Actor) -> bool {
        use TaskState::*;
        match (self, to) {
            (Created, Queued | Canceled | Expired) => true,
            // FAILED: a stored task the node cannot put back (see `spindle-node-control`'s restore).
            (Queued, Dispatching | Canceled | Expired | Failed) => true,
            (Dispatching, Running | SubmitUnknown | Queued | Failed | Canceled) => true,
            (SubmitUnknown, Running | Queued | Failed | Canceled) => true,
            (Running, ProviderSucceeded | Queued | Failed | Canceled) => true,
            (ProviderSucceeded, MediaProcessing | Failed | Canceled) => true,
            (MediaProcessing, Succeeded | Failed | Canceled) => true,
            (Failed, Queued) => actor == Actor::Operator,
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TaskState::Created => "CREATED",
            TaskState::Queued => "QUEUED",
            TaskState::Dispatching => "DISPATCHING",
            TaskState::SubmitUnknown => "SUBMIT_UNKNOWN",
            TaskState::Running => "RUNNING",
            TaskState::ProviderSucceeded => "PROVIDER_SUCCEEDED",
            TaskState::MediaProcessing => "MEDIA_PROCESSING",
            TaskState::Succeeded => "SUCCEEDED",
            TaskState::Failed => "FAILED",
            TaskState::Canceled => "CANCELED",
            TaskState::Expired => "EXPIRED",
        }
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransitionError {
    /// The state or version moved since the caller read it: someone else won the race.
    Conflict {
        expected: (TaskState, u32),
        actual: (TaskState, u32),
    },
    /// Not in the whitelist.
    Illegal { from: TaskState, to: TaskState },
}

impl fmt::Display for TransitionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransitionError::Conflict { expected, actual } => write!(
                f,
                "expected {} v{} but the task is {} v{}",
                expected.0, expected.1, actual.0, actual.1
            ),
            TransitionError::Illegal { from, to } => {
                write!(f, "{from} → {to} is not a legal transition")
            }
        }
    }
}

impl std::error::Error for TransitionError {}

/// A state with its version: every change is a CAS that bumps the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Versioned {
    pub state: TaskState,
    /// Moves at most a few times per attempt, attempts are bounded: 32 bits keep a task's hot
    /// part in one cache line.
    pub version: u32,
}

impl Versioned {
    pub fn new(state: TaskState) -> Versioned {
        Versioned { state, version: 0 }
    }

    /// Moves to `to` if the caller's view `(state, version)` is still current and the move is
    /// legal. Returns the new version.
    pub fn compare_and_set(
        &mut self,
        expected: (TaskState, u32),
        to: TaskState,
        actor: Actor,
    ) -> Result<u32, TransitionError> {
        if (self.state, self.version) != expected {
            return Err(TransitionError::Conflict {
                expected,
                actual: (self.state, self.version),
            });
        }
        if !self.state.may_become(to, actor) {
            return Err(TransitionError::Illegal {
                from: self.state,
                to,
            });
        }
        self.state = to;
        self.version = self
            .version
            .checked_add(1)
            .expect("a task's version fits 32 bits");
        Ok(self.version)
    }

    /// CAS against the current value: for the single owner of the state.
    pub fn transition(&mut self, to: TaskState, actor: Actor) -> Result<u32, TransitionError> {
        self.compare_and_set((self.state, self.version), to, actor)
    }
}

#[cfg(test)]
mod tests {
    use expect_test::expect;

    use super::*;

    #[test]
    fn whitelist_table() {
        let mut table = String::new();
        for from in TaskState::ALL {
            let tos: Vec<&str> = TaskState::ALL
                .iter()
                .filter(|&&to| from.may_become(to, Actor::System))
                .map(|to| to.name())
                .collect();
            table.push_str(&format!("{from} → {}\n", tos.join(" ")));
        }
        expect![[r#"
            CREATED → QUEUED CANCELED EXPIRED
            QUEUED → DISPATCHING FAILED CANCELED EXPIRED
            DISPATCHING → QUEUED SUBMIT_UNKNOWN RUNNING FAILED CANCELED
            SUBMIT_UNKNOWN → QUEUED RUNNING FAILED CANCELED
            RUNNING → QUEUED PROVIDER_SUCCEEDED FAILED CANCELED
            PROVIDER_SUCCEEDED → MEDIA_PROCESSING FAILED CANCELED
            MEDIA_PROCESSING → SUCCEEDED FAILED CANCELED
            SUCCEEDED → 
            FAILED → 
            CANCELED → 
            EXPIRED → 
        "#]]
        .assert_eq(&table);
    }

    #[test]
    fn terminal_states_stay_terminal_except_operator_retry() {
        for from in TaskState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in TaskState::ALL {
                let operator_retry = from == TaskState::Failed && to == TaskState::Queued;
                assert_eq!(
                    from.may_become(to, Actor::Operator),
                    operator_retry,
                    "{from} → {to}"
                );
                assert!(!from.may_become(to, Actor::System), "{from} → {to}");
            }
        }
    }

    #[test]
    fn cas_refuses_a_stale_view() {
        let mut v = Versioned::new(TaskState::Queued);
        let stale = (v.state, v.version);
        v.transition(TaskState::Dispatching, Actor::System).unwrap();
        let err = v
            .compare_and_set(stale, TaskState::Canceled, Actor::System)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "expected QUEUED v0 but the task is DISPATCHING v1"
        );
        assert_eq!(v.state, TaskState::Dispatching);
    }
}
