//! The node daemon: glommio shards, acceptor, routing, drivers, metrics (filled by issue 4).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
