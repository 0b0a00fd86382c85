//! Test-only infrastructure shared by integration tests: a fault-injecting
//! TCP proxy, network namespaces joined by a veth pair, the payload
//! pattern and child-process helpers of the multi-process tests, a TCP
//! peer that writes raw frames, and scenarios several transports' tests run.
#![allow(dead_code)]

pub mod fault_proxy;
pub mod mux_peer;
pub mod netns;
pub mod payload;
pub mod raw_peer;
pub mod scenarios;
pub mod tls_pki;

/// A name no other test of any process uses at the same time (abstract
/// socket names, endpoint names): `ferry-{tag}-{pid}-{n}`.
pub fn unique_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("ferry-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Whether `fd` becomes readable within `within` (`poll(2)`).
pub fn readable(fd: std::os::fd::BorrowedFd<'_>, within: std::time::Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: within.as_secs() as i64, tv_nsec: i64::from(within.subsec_nanos()) };
    loop {
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(n) => return n > 0,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => panic!("poll: {e}"),
        }
    }
}
