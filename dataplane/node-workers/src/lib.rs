//! The node's workers (ARCHITECTURE.md, "Architecture invariants"): each on a thread of its
//! own with a tokio runtime (`runtime`), fed by the shards and answering them through their
//! inboxes (`spindle_node_base::messages`). `dispatch` submits to providers, paced per account,
//! and follows each job to its end by callbacks and staged polls; `media` runs ffmpeg on the
//! GPU and CPU units it accounts, and uploads the renditions.

pub mod dispatch;
pub mod media;
pub mod runtime;
