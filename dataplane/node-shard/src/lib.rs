//! The node's glommio shards (ARCHITECTURE.md, "Architecture invariants"): each owns a
//! partition of tenants and runs the core for them (`shard`), serves their FlatBuffers
//! connections (`server`, TLS in `tls`, the tenant `breaker`), and hands durable work to the
//! control plane (`spindle_node_control`) and side effects to the workers
//! (`spindle_node_workers`). Above it only the HTTP port and the daemon's wiring.

pub mod breaker;
pub mod server;
pub mod shard;
pub mod tls;
