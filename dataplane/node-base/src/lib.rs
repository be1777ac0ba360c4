//! The node's floor, below every other part of `spindled` (ARCHITECTURE.md, "Architecture
//! invariants"): the configuration as plain data — each section with its `check()`, and the
//! lower-layer values it derives (TLS roots, a bucket's description) — the policy a node runs
//! with, tenant credentials, which partition and shard a tenant lives on, the messages between
//! the node's parts, its named maxima, and the exposition's grouping — and the state the
//! node's parts share without owning each other: what the node counts (`metrics`), the
//! overload gate's gauges, provider health, the ownership of partitions and shared limits, the
//! tenants suspended and the Hello throttle. Nothing here runs: listeners, threads and
//! connections are built by their owners from this.

pub mod auth_guard;
pub mod config;
pub mod credential;
pub mod exposition;
pub mod health;
pub mod jitter;
pub mod limits;
pub mod messages;
pub mod metrics;
pub mod overload;
pub mod ownership;
pub mod policy;
pub mod suspensions;
