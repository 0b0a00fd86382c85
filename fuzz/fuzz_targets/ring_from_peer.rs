//! A ring segment written by a hostile peer (crates/ferry/src/ring/).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::ring_from_peer(data));
