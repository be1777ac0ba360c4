//! spindle-gpu: the node's media hardware (NVML inventory, or a declared one where NVML is
//! absent), a ledger of units per engine shared lock-free by every shard and media worker, and
//! placement by best fit with affinity.

pub mod inventory;
pub mod ledger;
pub mod placement;

pub use inventory::{Declared, Device, Inventory, Source};
pub use ledger::{Engine, Exhausted, Grant, MediaLedger};
pub use placement::{place, MediaDemand, Placement, TRANSCODE_DEMAND};
