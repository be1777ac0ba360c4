//! The body of the `frame_decoder` fuzz target, here so the stable test suite can replay the
//! committed corpus through exactly the same code (`tests/corpus.rs`).

use crate::{decode_request, decode_response, Encoder, FrameReader};

/// The node's inbound path on arbitrary bytes: framing, then request decoding of every frame
/// (and response decoding, the client's path). Panics if anything that decodes does not survive
/// its own round trip; must never panic otherwise.
pub fn frame_decoder(data: &[u8]) {
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
