//! A multiplexed session's byte stream from a peer (crates/ferry/src/backend/mux/).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::mux_stream_from_peer(data));
