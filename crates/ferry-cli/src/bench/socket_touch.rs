//! `ferry bench socket-touch`: the experiment of Container Shipping's
//! Fig. 4 (Pasquale, Anderson and Muller) on Linux. Two processes joined by
//! an AF_UNIX stream socket; the sender writes 128 KiB per I/O (`--size`),
//! the receiver reads 128 KiB per I/O and then touches all, half or none of
//! the pages it received (reads every word of them). The receiver reads
//! either with plain `read(2)` into one reused buffer (`read-write`) or
//! with ferry-io, which produces a pool buffer per read and takes it back
//! when dropped (`ferry-io`), or with ferry-io's `read_unmapped`, which has
//! the kernel splice the bytes into the pool's memfd so that pages the
//! receiver does not touch are never mapped in (`unmapped`, the
//! selective mapping of the paper). Both sides of the socket are the same in both
//! variants: the kernel copies the bytes out of the socket either way (on
//! Linux a socket cannot hand pages over), so what differs is only what the
//! receiver does with memory.

use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::Port;
use serde_json::json;

use super::point::{Head, Point};
use super::Ctx;
use crate::stats::{round, Summary};
use crate::CliError;

/// Bytes per run unless --total says.
const DEFAULT_TOTAL: u64 = 256 << 20;
/// The paper's I/O size.
const DEFAULT_SIZE: usize = 128 << 10;
const PAGE: usize = 4096;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    ReadWrite,
    FerryIo,
    Unmapped,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::ReadWrite => "read-write",
            Variant::FerryIo => "ferry-io",
            Variant::Unmapped => "unmapped",
        }
    }
}

/// Touch (read every word of) the first `fraction`/2 of the pages of `b`.
fn touch(b: &[u8], halves: usize) -> u64 {
    let pages = b.len().div_ceil(PAGE);
    let n = pages * halves / 2;
    let end = (n * PAGE).min(b.len());
    b[..end].chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([0; 8]))).fold(0, u64::wrapping_add)
}

/// Start the sender process: writes `total` bytes in `size`-byte writes,
/// then exits. Returns its pid.
fn start_sender(sock: &UnixStream, size: usize, total: u64) -> Result<libc::pid_t, CliError> {
    let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let fd = sock.as_raw_fd();
    // SAFETY: the child only makes raw write/_exit system calls on memory
    // prepared before the fork (no allocation, no locks), which is safe in
    // the child of a process that may have other threads.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(CliError::Failed(format!("fork failed: {}", std::io::Error::last_os_error())));
    }
    if pid == 0 {
        let mut left = total;
        while left > 0 {
            let n = (left as usize).min(size);
            // SAFETY: `data` is a live buffer of `size` bytes.
            let w = unsafe { libc::write(fd, data.as_ptr().cast(), n) };
            if w <= 0 {
                // SAFETY: leaves the child at once, running nothing of the parent's.
                unsafe { libc::_exit(1) };
            }
            left -= w as u64;
        }
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    Ok(pid)
}

fn reap(pid: libc::pid_t) -> Result<(), CliError> {
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    if r != pid || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(CliError::Failed("the sender process failed".into()));
    }
    Ok(())
}

/// One run: seconds to receive `total` bytes.
fn run_once(v: Variant, size: usize, total: u64, halves: usize, alloc: &Allocator) -> Result<f64, CliError> {
    let (rx, tx) = UnixStream::pair().map_err(|e| CliError::Failed(format!("socketpair failed: {e}")))?;
    let t0 = Instant::now();
    let pid = start_sender(&tx, size, total)?;
    drop(tx);
    let mut got = 0u64;
    let mut sum = 0u64;
    match v {
        Variant::ReadWrite => {
            let mut buf = vec![0u8; size];
            while got < total {
                // SAFETY: `buf` is a live buffer of `size` bytes.
                let n = unsafe { libc::read(rx.as_raw_fd(), buf.as_mut_ptr().cast(), size) };
                if n <= 0 {
                    break;
                }
                sum = sum.wrapping_add(touch(&buf[..n as usize], halves));
                got += n as u64;
            }
        }
        Variant::FerryIo | Variant::Unmapped => {
            let mut port = Port::from_fd(rx, "unix:socketpair").map_err(|e| CliError::Failed(e.to_string()))?;
            while got < total {
                let read = if v == Variant::FerryIo { port.read_some(alloc, 1) } else { port.read_unmapped(alloc, 1) };
                let filled = read.map_err(|e| CliError::Failed(e.to_string()))?;
                let Some(f) = filled.first() else { break };
                sum = sum.wrapping_add(touch(f.bytes(), halves));
                got += f.len as u64;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(sum);
    reap(pid)?;
    if got != total {
        return Err(CliError::Failed(format!("the receiver got {got} of {total} bytes")));
    }
    Ok(secs)
}

/// `ferry bench socket-touch`.
pub fn run(ctx: &mut Ctx) -> Result<(), CliError> {
    let a = ctx.args;
    let sizes = if a.sizes.is_empty() { vec![DEFAULT_SIZE] } else { a.sizes.clone() };
    let runs = a.runs.unwrap_or(5);
    let total = a.total.unwrap_or(DEFAULT_TOTAL);
    for &size in &sizes {
        let alloc = Allocator::new(&Domain::new("socket-touch"), 4, size, PoolConstraints::default())?;
        for (halves, touched) in [(2, "all"), (1, "half"), (0, "none")] {
            for v in [Variant::ReadWrite, Variant::FerryIo, Variant::Unmapped] {
                let mut rates = Vec::with_capacity(runs);
                for run in 0..=runs {
                    let secs = run_once(v, size, total, halves, &alloc)?;
                    if run > 0 {
                        rates.push(total as f64 / secs / 1e9);
                    }
                }
                let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
                let head = Head {
                    experiment: "socket-touch",
                    backend: v.name(),
                    size,
                    trust: "n/a",
                    mode: "blocking",
                    touch: halves > 0,
                    runs,
                    unit: "GB/s",
                };
                let extra = json!({ "variant": format!("touched={touched}"), "total": total,
                    "copies_kernel": 2, "gbit_s_median": round(s.median * 8.0) });
                ctx.emit(Point::new(head, s, Some(0), extra));
                let _ = std::io::stdout().flush();
            }
        }
    }
    Ok(())
}
