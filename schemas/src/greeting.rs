//! A connection before its Hello, sans-IO: what the bytes it has sent so far amount to. The
//! node reads a new connection with a [`FrameReader`] held to [`HELLO_FRAME_BYTES_MAX`] and asks
//! [`first_request`] after every read; the fuzz target drives the same function
//! (`crate::fuzzing::pre_hello`).

use crate::error::{ErrorCode, WireError};
use crate::frame::FrameReader;
use crate::limits::HELLO_FRAME_BYTES_MAX;
use crate::{decode_request, request_id_of, Hello, Request};

/// What a connection's first frame is.
#[derive(Debug)]
pub enum FirstRequest {
    /// No whole frame yet: read more (never more than a Hello's frame is buffered).
    More,
    /// A Hello: the node checks it.
    Hello { request_id: u64, hello: Hello },
    /// A frame that is not a Hello, or not a request at all: answered with this error (in
    /// reply to `request_id`, where the frame had one), then the connection closes.
    Refused { request_id: u64, error: WireError },
    /// A framing error (zero length, or longer than a Hello may be): answered, then closed.
    Fatal(WireError),
}

/// A reader for a connection that has not said Hello.
pub fn reader() -> FrameReader {
    FrameReader::with_limit(HELLO_FRAME_BYTES_MAX)
}

/// The first request in `frames` (a [`reader`]), or that more bytes are needed.
pub fn first_request(frames: &mut FrameReader) -> FirstRequest {
    let payload = match frames.next_frame() {
        Ok(None) => return FirstRequest::More,
        Err(e) => return FirstRequest::Fatal(e),
        Ok(Some(payload)) => payload,
    };
    match decode_request(payload) {
        Ok(r) => match r.body {
            Request::Hello(hello) => FirstRequest::Hello {
                request_id: r.request_id,
                hello,
            },
            _ => FirstRequest::Refused {
                request_id: r.request_id,
                error: WireError::new(
                    ErrorCode::NotAuthenticated,
                    "the first request must be Hello",
                ),
            },
        },
        Err(error) => FirstRequest::Refused {
            request_id: request_id_of(payload),
            error,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Encoder, RequestFrame};
    use spindle_core::{TaskId, TenantId};

    fn encoded(body: Request) -> Vec<u8> {
        let mut out = Vec::new();
        Encoder::new().request(
            &RequestFrame {
                request_id: 7,
                body,
            },
            &mut out,
        );
        out
    }

    fn hello() -> Request {
        Request::Hello(Hello {
            protocol_version: 1,
            tenant: TenantId(3),
            credential: "tenant-3-credential".into(),
            client_name: None,
        })
    }

    #[test]
    fn a_hello_is_read_however_its_bytes_arrive_and_nothing_else_is_taken_first() {
        let bytes = encoded(hello());
        let mut frames = reader();
        for b in &bytes[..bytes.len() - 1] {
            frames.extend(std::slice::from_ref(b));
            assert!(matches!(first_request(&mut frames), FirstRequest::More));
        }
        frames.extend(&bytes[bytes.len() - 1..]);
        match first_request(&mut frames) {
            FirstRequest::Hello { request_id, hello } => {
                assert_eq!((request_id, hello.tenant), (7, TenantId(3)));
            }
            other => panic!("{other:?}"),
        }
        let mut frames = reader();
        frames.extend(&encoded(Request::Get(TaskId(1))));
        match first_request(&mut frames) {
            FirstRequest::Refused { request_id, error } => {
                assert_eq!(request_id, 7);
                assert_eq!(error.code, ErrorCode::NotAuthenticated);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_frame_longer_than_a_hello_is_refused_from_its_length_alone() {
        // A 1 MiB frame announced: refused on its four length bytes, none of it buffered.
        let mut frames = reader();
        frames.extend(&(1u32 << 20).to_le_bytes());
        match first_request(&mut frames) {
            FirstRequest::Fatal(e) => assert_eq!(e.code, ErrorCode::FrameTooLarge),
            other => panic!("{other:?}"),
        }
        // The fuzz body holds the same line, fed the node's way.
        let mut data = vec![255u8];
        data.extend(&((HELLO_FRAME_BYTES_MAX + 1) as u32).to_le_bytes());
        data.extend(vec![0u8; 3 * HELLO_FRAME_BYTES_MAX]);
        crate::fuzzing::pre_hello(&data);
        let mut data = vec![0u8];
        data.extend(encoded(hello()));
        crate::fuzzing::pre_hello(&data);
    }
}
