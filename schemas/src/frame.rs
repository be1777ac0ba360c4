//! Length-prefixed framing, sans-IO: bytes go in as they arrive, whole frames come out. A frame
//! is a little-endian u32 length and that many bytes. A zero or oversized length is a framing
//! error: the stream cannot be resynchronized, so the connection sends an error frame and closes.

use crate::error::WireError;
use crate::limits::FRAME_BYTES_MAX;

const PREFIX: usize = 4;

/// Accumulates a byte stream and cuts it into frames.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    /// The largest frame taken now: `FRAME_BYTES_MAX`, or less (the node reads a connection's
    /// Hello with [`crate::limits::HELLO_FRAME_BYTES_MAX`] so that nothing big is buffered before it knows
    /// who is sending).
    limit: usize,
}

impl Default for FrameReader {
    fn default() -> FrameReader {
        FrameReader {
            buf: Vec::new(),
            start: 0,
            limit: FRAME_BYTES_MAX,
        }
    }
}

impl FrameReader {
    pub fn new() -> FrameReader {
        FrameReader::default()
    }

    /// A reader that takes frames of at most `limit` bytes (at most `FRAME_BYTES_MAX`).
    pub fn with_limit(limit: usize) -> FrameReader {
        FrameReader {
            limit: limit.min(FRAME_BYTES_MAX),
            ..FrameReader::default()
        }
    }

    /// From now on, frames of at most `limit` bytes (at most `FRAME_BYTES_MAX`).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(FRAME_BYTES_MAX);
    }

    /// Appends bytes read from the connection.
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start >= self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet returned as a frame.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next whole frame's payload, `None` until one has fully arrived.
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, WireError> {
        let avail = &self.buf[self.start..];
        let Some(prefix) = avail.first_chunk::<PREFIX>() else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(*prefix) as usize;
        if len == 0 {
            return Err(WireError::frame_empty());
        }
        if len > self.limit {
            return Err(WireError::frame_too_large(len, self.limit));
        }
        if avail.len() < PREFIX + len {
            return Ok(None);
        }
        let from = self.start + PREFIX;
        self.start = from + len;
        Ok(Some(&self.buf[from..from + len]))
    }
}

/// Appends `payload` to `out` as one frame.
pub fn write_frame(out: &mut Vec<u8>, payload: &[u8]) {
    assert!(
        payload.len() <= FRAME_BYTES_MAX,
        "frames we send stay under the maximum"
    );
    // One allocation for prefix and payload (an empty `out` would otherwise grow twice).
    out.reserve(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn frames_come_out_whole_however_the_bytes_arrive() {
        let mut stream = Vec::new();
        write_frame(&mut stream, b"hello");
        write_frame(&mut stream, b"");
        let mut stream = stream[..stream.len() - 4].to_vec(); // drop the empty frame again
        write_frame(&mut stream, b"world!");
        let mut r = FrameReader::new();
        let mut got = Vec::new();
        for b in &stream {
            r.extend(std::slice::from_ref(b));
            while let Some(f) = r.next_frame().unwrap() {
                got.push(f.to_vec());
            }
        }
        assert_eq!(got, vec![b"hello".to_vec(), b"world!".to_vec()]);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn zero_and_oversized_lengths_are_framing_errors() {
        let mut r = FrameReader::new();
        r.extend(&0u32.to_le_bytes());
        assert_eq!(r.next_frame().unwrap_err().code, ErrorCode::FrameEmpty);
        let mut r = FrameReader::new();
        r.extend(&((FRAME_BYTES_MAX + 1) as u32).to_le_bytes());
        let e = r.next_frame().unwrap_err();
        assert_eq!(e.code, ErrorCode::FrameTooLarge);
        assert_eq!(
            e.message,
            "frame of 1048577 bytes exceeds the maximum of 1048576"
        );
    }

    /// Before its Hello a connection's frames are held to a few KiB: a length past it is a
    /// framing error at once, with nothing of the frame buffered; the limit lifts after.
    #[test]
    fn a_reader_with_a_limit_refuses_longer_frames_at_their_prefix() {
        use crate::limits::HELLO_FRAME_BYTES_MAX;
        let mut r = FrameReader::with_limit(HELLO_FRAME_BYTES_MAX);
        r.extend(&((HELLO_FRAME_BYTES_MAX + 1) as u32).to_le_bytes());
        let e = r.next_frame().unwrap_err();
        assert_eq!(e.code, ErrorCode::FrameTooLarge);
        assert_eq!(
            e.message,
            "frame of 4097 bytes exceeds the maximum of 4096 before a Hello"
        );
        let mut r = FrameReader::with_limit(HELLO_FRAME_BYTES_MAX);
        let mut stream = Vec::new();
        write_frame(&mut stream, &[7; 4096]);
        write_frame(&mut stream, &[8; 10_000]);
        r.extend(&stream);
        assert_eq!(r.next_frame().unwrap().map(<[u8]>::len), Some(4096));
        assert!(r.next_frame().is_err(), "the next is past the limit");
        r.set_limit(FRAME_BYTES_MAX);
        assert_eq!(r.next_frame().unwrap().map(<[u8]>::len), Some(10_000));
    }
}
