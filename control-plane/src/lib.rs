//! The thin control plane: PostgreSQL store, batched claims, fencing, leases (filled by issue 3).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
