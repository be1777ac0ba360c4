//! The node's HTTP port, on hyper, above the rest of the node (ARCHITECTURE.md, "Architecture
//! invariants"): probes (`/livez`, `/readyz`), `/metrics` rendered from what the node counts,
//! the operator dashboard, the admin API (`/admin/v1/…`) and the providers' signed callbacks.
//! It reaches the node only through what it is handed ([`serve::Port`], [`admin::Shards`]):
//! nothing below it knows it exists.

pub mod admin;
pub mod serve;
