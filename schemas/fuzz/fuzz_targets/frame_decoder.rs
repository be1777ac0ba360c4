//! Fuzzes the frame reader and both decoders; the body is `spindle_wire::fuzzing::frame_decoder`
//! so the stable test suite replays the committed corpus through the same code.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| spindle_wire::fuzzing::frame_decoder(data));
