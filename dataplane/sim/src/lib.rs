//! spindle's deterministic discrete-event simulator. It replays the same seeded trace through
//! spindle's policy (several shards of the real core sharing node limits through the split rule)
//! and through three baselines — a global FIFO, WRR by task count, a global priority queue — and
//! reports fairness, starvation, limit safety and waits side by side.
//!
//! Pure: no threads, sockets or wall clock inside a run (the binary times runs from outside).

pub mod engine;
pub mod metrics;
pub mod random;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod sched;

pub use engine::{run, PolicyKind, RunOptions};
pub use metrics::PolicyReport;
pub use scenario::{Scenario, ScenarioError};
