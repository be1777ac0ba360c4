//! The client protocol: FlatBuffers schema, generated code and framing codec (filled by issue 4).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
