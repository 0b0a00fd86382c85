//! Helpers the multi-process tests share: a verifiable payload pattern and
//! waiting for a child process with a bound.
#![allow(dead_code)]

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Fill `buf` with the pattern of sequence number `seq`.
pub fn fill(buf: &mut [u8], seq: u64) {
    for (i, c) in buf.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).to_le_bytes());
    }
}

/// Whether `buf` holds exactly the pattern of `seq`.
pub fn check(buf: &[u8], seq: u64) -> bool {
    buf.chunks_exact(8)
        .enumerate()
        .all(|(i, c)| c == (seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).to_le_bytes())
}

/// Wait for `child` to exit, failing the test after `limit`.
pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t.elapsed() < limit, "child did not exit");
        std::thread::sleep(Duration::from_millis(5));
    }
}
