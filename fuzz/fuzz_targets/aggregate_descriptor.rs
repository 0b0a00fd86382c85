//! Aggregate descriptors from a peer: header and fragment-table slots
//! (crates/ferry/src/proto.rs, `decode_descriptor`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry::fuzzing::aggregate_descriptor(data));
