//! spindle's client protocol (design.md §7): the FlatBuffers schema `fbs/spindle.fbs` is the one
//! source of truth; `src/generated/` is what `flatc --rust` makes of it (a test checks it is
//! current: regenerate with `scripts/gen-wire`). On top: length-prefixed framing
//! ([`frame::FrameReader`]), verification with tight limits and semantic validation into owned
//! values ([`codec::decode_request`]), and encoding ([`codec::Encoder`]). Pure: no I/O.

#[allow(
    unsafe_code,
    unused_imports,
    dead_code,
    deprecated,
    non_camel_case_types,
    non_snake_case,
    clippy::all,
    clippy::pedantic
)]
#[rustfmt::skip]
mod generated {
    include!("generated/spindle_generated.rs");
}

pub mod codec;
pub mod error;
pub mod frame;
#[doc(hidden)]
pub mod fuzzing;
pub mod greeting;
pub mod limits;
pub mod message;
#[doc(hidden)]
pub mod testkit;

/// The generated FlatBuffers types (`spindle.wire` namespace).
pub use generated::spindle::wire as fb;

pub use codec::{
    decode_request, decode_response, json_depth, request_id_of, response_id_of, Encoder,
};
pub use error::{ErrorCode, WireError};
pub use frame::FrameReader;
pub use message::*;
