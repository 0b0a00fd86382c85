//! Setup messages from a peer (crates/ferry/src/backend/setup_msg.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::setup_message(data));
