//! Descriptor slots from a peer (crates/ferry/src/proto.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::decode_slot(data));
