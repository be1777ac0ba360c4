//! GPU/CPU slot ledger and NVML inventory (filled by issue 6).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
