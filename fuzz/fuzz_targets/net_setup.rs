//! The bytes a TCP peer sends during setup (crates/ferry/src/backend/net.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::net_setup_from_peer(data));
