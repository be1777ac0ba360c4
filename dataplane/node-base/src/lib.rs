//! The node's floor, below every other part of `spindled` (ARCHITECTURE.md, "Architecture
//! invariants"): the configuration as plain data — each section with its `check()`, and the
//! lower-layer values it derives (TLS roots, a bucket's description) — the policy a node runs
//! with, tenant credentials, which partition and shard a tenant lives on, the messages between
//! the node's parts, its named maxima, and the exposition's grouping. Nothing here runs:
//! listeners, threads and connections are built by their owners from this.

pub mod config;
pub mod credential;
pub mod exposition;
pub mod limits;
pub mod messages;
pub mod policy;
