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

/// Move `total` buffers of `alloc` over `ch`, each filled with the pattern
/// of its sequence number (also its meta), as fast as buffers come back,
/// and take every pass back: each must hold the pattern of `want(seq)`.
/// Returns the sequence numbers in the order they came back. Any other
/// event, or none within 10 s, fails the test.
pub fn move_and_take_back(
    ch: &mut ferry::Channel,
    alloc: &ferry::Allocator,
    total: u64,
    want: impl Fn(u64) -> u64,
) -> Vec<u64> {
    let (mut sent, mut back) = (0u64, Vec::new());
    while (back.len() as u64) < total {
        while sent < total {
            let Some(mut b) = alloc.alloc() else { break };
            fill(b.as_mut_slice().unwrap(), sent);
            ch.move_buffer(b, &sent.to_le_bytes()).unwrap();
            sent += 1;
        }
        match ch.wait(Some(Duration::from_secs(10))) {
            Ok(ferry::Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, want(seq)), "buffer {seq} came back with the wrong bytes");
                back.push(seq);
            }
            ev => panic!("while moving buffers: unexpected {ev:?} (state {:?})", ch.state()),
        }
    }
    back
}
