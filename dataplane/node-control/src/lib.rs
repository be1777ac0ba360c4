//! The node's control plane (ARCHITECTURE.md, "Architecture invariants"): one thread with a
//! tokio runtime, the only part of the node that talks to PostgreSQL. `control` runs the
//! durable pipelines (submits, claims, reports, reads), the leases and takeover of partitions,
//! restore, and the cluster's shares of limits; beside it `live_policy` follows the policy
//! store, `relay` sends the cluster's events, `counter_check` compares reservations with their
//! rows, and `reconciler` runs the periodic repairs. Shards reach it through the senders it
//! hands out and hear from it through their inboxes.

pub mod control;
pub mod counter_check;
pub mod live_policy;
pub mod reconciler;
pub mod relay;
