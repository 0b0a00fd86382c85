//! A TCP byte stream of frames from a peer (crates/ferry/src/backend/net.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::net_stream_from_peer(data));
