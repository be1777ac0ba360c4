//! spindle's scheduling core: a pure, deterministic state machine. It owns admission, lanes, the
//! per-lane Deficit Round Robin over tenants, priority bands with lazy aging, every limit as a
//! non-blocking all-or-nothing try-acquire, cost units and the task state machine.
//!
//! It never does I/O, reads a clock, spawns a thread or talks to PostgreSQL: time arrives as a
//! [`Time`] argument, decisions leave as values. The node daemon, the simulator, the property tests
//! and the benches all drive this same code.
//!
//! Shape (str0m/quinn-proto style): getters take `&self`, `handle_*` applies an input, `poll_*`
//! drains the next output. The shell applies one input and then drains every `poll_*`.

pub mod admission;
pub mod cost;
mod estimates;
pub mod fairness;
pub mod hash;
pub mod ids;
pub mod ledger;
pub mod limits;
pub mod policy;
mod prefetch;
pub mod presets;
mod queue;
pub mod quota;
pub mod shard;
pub mod share;
pub mod state;
mod table;
pub mod time;
pub mod units;

pub use admission::{Admission, Decision, QueueLevel, RejectReason, SubmitError};
pub use cost::{CostEstimate, ModelCapability, ResourceClass, TaskSpec};
pub use ids::{
    AttemptId, Band, FencingToken, Lane, ModelId, PolicyVersion, ProviderId, TaskId, TenantId,
    UserId,
};
pub use ledger::{Demand, Ledger, LimitId, LimitKey};
pub use policy::{Policy, PolicyError};
pub use shard::{
    CancelOutcome, CapacityMode, ClaimOutcome, Command, CommandLimited, CompleteOutcome, Dispatch,
    FailOutcome, Failure, MediaStart, NodeCapacity, Poll, RestoreRequest, ResumeRequest, Shard,
    ShardError, ShardStats, SubmitRequest,
};
pub use state::{TaskState, TransitionError};
pub use time::Time;
pub use units::Units;
