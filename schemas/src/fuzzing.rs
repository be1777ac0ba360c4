//! The body of the `frame_decoder` fuzz target, here so the stable test suite can replay the
//! committed corpus through exactly the same code (`tests/corpus.rs`).

use crate::greeting::{first_request, reader, FirstRequest};
use crate::limits::HELLO_FRAME_BYTES_MAX;
use crate::{decode_request, decode_response, Encoder, FrameReader, Request, RequestFrame};

/// The node's inbound path on arbitrary bytes: framing, then request decoding of every frame
/// (and response decoding, the client's path). Panics if anything that decodes does not survive
/// its own round trip; must never panic otherwise.
pub fn frame_decoder(data: &[u8]) {
    pre_hello(data);
    // Feed in two pieces, as a socket would.
    let split = data.len() / 3;
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    'pieces: for piece in [&data[..split], &data[split..]] {
        reader.extend(piece);
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => frames.push(frame.to_vec()),
                Ok(None) => break,
                // A framing error closes the connection: nothing after it is read.
                Err(_) => break 'pieces,
            }
        }
    }
    // Also the raw bytes as one payload: most inputs never form a whole frame.
    frames.push(data.to_vec());
    let mut encoder = Encoder::new();
    for payload in frames {
        if let Ok(request) = decode_request(&payload) {
            let mut out = Vec::new();
            encoder.request(&request, &mut out);
            assert_eq!(
                decode_request(&out[4..]).expect("re-encoded request"),
                request
            );
        }
        if let Ok(response) = decode_response(&payload) {
            let mut out = Vec::new();
            encoder.response(&response, &mut out);
            assert_eq!(
                decode_response(&out[4..]).expect("re-encoded response"),
                response
            );
        }
    }
}

/// A connection before its Hello on arbitrary bytes, read as the node reads it: in pieces
/// (their size from the first byte, 1..=4096, the node's read buffer), [`first_request`] after
/// each, until it is anything but `More`. Panics if more than a Hello's frame is ever held
/// waiting, if a Hello does not survive its round trip, or if a refusal has no reason.
pub fn pre_hello(data: &[u8]) {
    let Some((&size, data)) = data.split_first() else {
        return;
    };
    let piece = 1 + usize::from(size) * HELLO_FRAME_BYTES_MAX / 256;
    let mut frames = reader();
    for chunk in data.chunks(piece) {
        frames.extend(chunk);
        match first_request(&mut frames) {
            FirstRequest::More => assert!(
                frames.pending() < 4 + HELLO_FRAME_BYTES_MAX,
                "{} bytes held before a Hello",
                frames.pending()
            ),
            FirstRequest::Hello { request_id, hello } => {
                let request = RequestFrame {
                    request_id,
                    body: Request::Hello(hello),
                };
                let mut out = Vec::new();
                Encoder::new().request(&request, &mut out);
                assert_eq!(
                    decode_request(&out[4..]).expect("re-encoded Hello"),
                    request
                );
                return;
            }
            FirstRequest::Refused { error, .. } | FirstRequest::Fatal(error) => {
                assert!(!error.message.is_empty(), "a refusal without a reason");
                return;
            }
        }
    }
}
