//! Every maximum of the protocol in one place. The node announces the frame and batch maxima in
//! HelloOk; everything else is fixed by the protocol version.

/// Bytes of one frame's FlatBuffer (the u32 length prefix not counted).
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// Bytes of the frames a connection may send before its Hello: a Hello is well under 1 KiB, and
/// nothing bigger is buffered before the node knows who is sending.
pub const HELLO_FRAME_BYTES_MAX: usize = 4096;
/// Tasks in one SubmitBatch.
pub const BATCH_MAX: usize = 1024;
/// Bytes of an idempotency key.
pub const KEY_BYTES_MAX: usize = 128;
/// Bytes of a tenant credential.
pub const CREDENTIAL_BYTES_MAX: usize = 256;
/// Bytes of a client or node name.
pub const NAME_BYTES_MAX: usize = 64;
/// Bytes of a task's input (`SubmitTask.input`, one JSON value); a provider's body holds it
/// with room to spare (`spindle_providers::api::BODY_BYTES_MAX`, 64 KiB).
pub const INPUT_BYTES_MAX: usize = 16 * 1024;
/// How deep a task's input may nest arrays and objects: deeper than the node could parse it
/// back for the provider (serde_json stops at 128) is refused when it arrives, never sent on
/// as something else.
pub const INPUT_DEPTH_MAX: usize = 64;
/// Bytes of a succeeded task's result (`TaskStatus.result`, JSON).
pub const RESULT_BYTES_MAX: usize = 4096;
/// Bytes of a reason or error message the node sends.
pub const MESSAGE_BYTES_MAX: usize = 1024;
/// Bytes of a node's client address in a WrongNode answer (`Error.redirect`, "host:port").
pub const ADDRESS_BYTES_MAX: usize = 256;
/// Verifier limits: nesting depth and tables per frame (a full batch plus its specs and slack).
pub const VERIFY_DEPTH_MAX: usize = 8;
pub const VERIFY_TABLES_MAX: usize = 2 * BATCH_MAX + 16;

/// Task spec ranges the node accepts.
pub const DIMENSION_MAX: u32 = 8192;
pub const DURATION_MS_MAX: u32 = 10 * 60 * 1000;
pub const FPS_MAX: u32 = 120;
pub const REFERENCES_MAX: u8 = 8;
pub const DEADLINE_MS_MAX: u32 = 24 * 60 * 60 * 1000;
