//! The in-process media stage: probe and transcode with ffmpeg-next (filled by issue 6).
//!
//! Nothing lives here yet: the crate exists so the workspace has the layout of DESIGN.md §3.
