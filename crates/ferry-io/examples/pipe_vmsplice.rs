//! Why `Port::write` copies into a pipe instead of using `vmsplice`:
//! measures both ways of putting 1 GiB of 64 KiB pool buffers into a pipe
//! whose reader consumes it (`read` into one buffer, as a user of the data
//! would, or `splice` to /dev/null, which isolates the writer's cost).
//!
//! `vmsplice` puts references to the buffer's pages into the pipe instead
//! of copying them, but the kernel never says when the reader has taken
//! them: a buffer handed back to its allocator and filled again before
//! that would change bytes already "written". Only `SPLICE_F_GIFT` gives
//! the pages away for good, which a pool that reuses its buffers cannot
//! do. So `write` copies, and this example shows what that costs.
//!
//! ```text
//! cargo run --release -p ferry-io --example pipe_vmsplice
//! ```

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

use ferry::{Allocator, Domain, PoolConstraints};

const SIZE: usize = 64 << 10;
const TOTAL: usize = 1 << 30;

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: room for the two fds.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both new, owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETPIPE_SZ on our pipe: 1 MiB, 16 buffers in the pipe at once.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    (r, w)
}

#[derive(Clone, Copy, PartialEq)]
enum Reader {
    Read,
    SpliceToNull,
}

fn reader(r: OwnedFd, how: Reader) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut got = 0;
        let mut buf = vec![0u8; SIZE];
        let null = std::fs::OpenOptions::new().write(true).open("/dev/null").unwrap();
        loop {
            let n = match how {
                // SAFETY: `buf` is live and SIZE bytes long.
                Reader::Read => unsafe { libc::read(r.as_raw_fd(), buf.as_mut_ptr().cast(), SIZE) },
                // SAFETY: no pointers but the null offsets.
                Reader::SpliceToNull => unsafe {
                    libc::splice(
                        r.as_raw_fd(),
                        std::ptr::null_mut(),
                        null.as_raw_fd(),
                        std::ptr::null_mut(),
                        1 << 20,
                        0,
                    )
                },
            };
            if n <= 0 {
                return got;
            }
            got += n as usize;
        }
    })
}

fn main() {
    let alloc = Allocator::new(&Domain::new("pipe"), 16, SIZE, PoolConstraints::default()).unwrap();
    let mut bufs: Vec<_> = (0..16).map(|_| alloc.alloc().unwrap()).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        b.as_mut_slice().unwrap().fill(i as u8);
    }
    for how in [Reader::SpliceToNull, Reader::Read] {
        for vmsplice in [false, true] {
            let (r, w) = pipe();
            let rd = reader(r, how);
            let t0 = Instant::now();
            let mut sent = 0;
            let mut i = 0;
            while sent < TOTAL {
                let b = &bufs[i % 16];
                i += 1;
                let mut off = 0;
                while off < SIZE {
                    let iov = libc::iovec { iov_base: b[off..].as_ptr() as *mut libc::c_void, iov_len: SIZE - off };
                    // SAFETY: the iovec covers a live buffer that the kernel only reads.
                    let n = unsafe {
                        if vmsplice {
                            libc::vmsplice(w.as_raw_fd(), &iov, 1, 0)
                        } else {
                            libc::writev(w.as_raw_fd(), &iov, 1)
                        }
                    };
                    assert!(n > 0, "{}", std::io::Error::last_os_error());
                    off += n as usize;
                }
                sent += SIZE;
            }
            drop(w);
            let got = rd.join().unwrap();
            assert_eq!(got, TOTAL);
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "{:<8} into the pipe, reader {:<15}: {:.2} GB/s",
                if vmsplice { "vmsplice" } else { "write" },
                if how == Reader::Read { "read()" } else { "splice→/dev/null" },
                TOTAL as f64 / secs / 1e9
            );
        }
    }
}
