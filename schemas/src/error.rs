//! Protocol errors: a stable code (the schema's `ErrorCode`) and a message naming the problem.
//! The same type describes what the node refuses in a frame and what it answers in an Error.

use std::fmt;

use crate::fb;
use crate::limits::FRAME_BYTES_MAX;

/// The schema's error codes as a Rust enum (numbers are the wire values; never renumbered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    FrameEmpty = 1,
    FrameTooLarge = 2,
    BadIdentifier = 3,
    Malformed = 4,
    UnknownRequest = 5,
    MissingField = 6,
    OutOfRange = 7,
    TooLong = 8,
    BatchTooLarge = 9,
    BadUtf8 = 10,
    InvalidInput = 11,
    UnsupportedVersion = 20,
    NotAuthenticated = 21,
    AuthFailed = 22,
    AlreadyAuthenticated = 23,
    WrongNode = 24,
    TenantSuspended = 25,
    NotFound = 40,
    IdempotencyConflict = 41,
    InvalidSpec = 42,
    TooManySubscriptions = 43,
    RateLimited = 44,
    Overloaded = 60,
    Unavailable = 61,
    Draining = 62,
    Internal = 63,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 26] = [
        ErrorCode::FrameEmpty,
        ErrorCode::FrameTooLarge,
        ErrorCode::BadIdentifier,
        ErrorCode::Malformed,
        ErrorCode::UnknownRequest,
        ErrorCode::MissingField,
        ErrorCode::OutOfRange,
        ErrorCode::TooLong,
        ErrorCode::BatchTooLarge,
        ErrorCode::BadUtf8,
        ErrorCode::InvalidInput,
        ErrorCode::UnsupportedVersion,
        ErrorCode::NotAuthenticated,
        ErrorCode::AuthFailed,
        ErrorCode::AlreadyAuthenticated,
        ErrorCode::WrongNode,
        ErrorCode::TenantSuspended,
        ErrorCode::NotFound,
        ErrorCode::IdempotencyConflict,
        ErrorCode::InvalidSpec,
        ErrorCode::TooManySubscriptions,
        ErrorCode::RateLimited,
        ErrorCode::Overloaded,
        ErrorCode::Unavailable,
        ErrorCode::Draining,
        ErrorCode::Internal,
    ];

    pub fn to_wire(self) -> fb::ErrorCode {
        fb::ErrorCode(self as u16)
    }

    /// `None` for 0 (no error) and for codes this build does not know.
    pub fn from_wire(code: fb::ErrorCode) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| *c as u16 == code.0)
    }

    /// A framing error leaves the byte stream unreadable: the connection must close.
    pub fn closes_connection(self) -> bool {
        matches!(self, ErrorCode::FrameEmpty | ErrorCode::FrameTooLarge)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = fb::ErrorCode(*self as u16)
            .variant_name()
            .unwrap_or("Unknown");
        f.write_str(name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
    /// With [`ErrorCode::WrongNode`]: the client address of the node that serves the tenant,
    /// when the refusing node knows one.
    pub redirect: Option<String>,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
            redirect: None,
        }
    }

    /// This error, naming `address` as the node to ask instead.
    pub fn redirecting_to(mut self, address: impl Into<String>) -> WireError {
        self.redirect = Some(address.into());
        self
    }

    pub(crate) fn frame_empty() -> WireError {
        WireError::new(ErrorCode::FrameEmpty, "frame length is zero")
    }

    pub(crate) fn frame_too_large(len: usize, max: usize) -> WireError {
        let what = if max < FRAME_BYTES_MAX {
            " before a Hello"
        } else {
            ""
        };
        WireError::new(
            ErrorCode::FrameTooLarge,
            format!("frame of {len} bytes exceeds the maximum of {max}{what}"),
        )
    }

    pub(crate) fn missing(field: &str) -> WireError {
        WireError::new(ErrorCode::MissingField, format!("`{field}` is required"))
    }

    pub(crate) fn range(field: &str, value: impl fmt::Display, range: &str) -> WireError {
        WireError::new(
            ErrorCode::OutOfRange,
            format!("`{field}` is {value}, outside {range}"),
        )
    }

    pub(crate) fn too_long(field: &str, len: usize, max: usize) -> WireError {
        WireError::new(
            ErrorCode::TooLong,
            format!("`{field}` is {len} bytes, more than {max}"),
        )
    }

    /// Maps the verifier's refusal to a code and a message naming where it happened.
    pub(crate) fn from_verifier(e: &flatbuffers::InvalidFlatbuffer) -> WireError {
        use flatbuffers::InvalidFlatbuffer as I;
        let code = match e {
            I::MissingRequiredField { .. } => ErrorCode::MissingField,
            I::Utf8Error { .. } => ErrorCode::BadUtf8,
            _ => ErrorCode::Malformed,
        };
        // The verifier's Display names the field path ("…while verifying ….body").
        WireError::new(code, e.to_string())
    }
}
