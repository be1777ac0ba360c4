//! The node's runtime, between its floor (`spindle-node-base`) and its HTTP port
//! (`spindle-node-http`); the `spindled` crate wires them into the daemon. Here: the glommio
//! shards (`shard`, connections in `server` and `tls`, the tenant breaker and Hello throttling),
//! the control plane's thread (`control`: pipelines, leases, restore, rates; `relay`,
//! `counter_check`, `reconciler`, `live_policy`), the workers (`dispatch` to providers with
//! `health`, the `media` stage), the overload gate, and what the node counts (`metrics`).

pub mod auth_guard;
pub mod breaker;
pub mod control;
pub mod counter_check;
pub mod dispatch;
pub mod health;
pub mod live_policy;
pub mod media;
pub mod metrics;
pub mod overload;
pub mod ownership;
pub mod reconciler;
pub mod relay;
pub mod runtime;
pub mod server;
pub mod shard;
pub mod systemd;
pub mod tls;
pub mod wake_latency;

pub use spindle_node_base::policy::policy;
pub use spindle_node_base::{config, credential};
