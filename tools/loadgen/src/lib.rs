//! Open-loop load generator for spindled (filled by issue 4).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
