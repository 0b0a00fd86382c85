//! The floors of a round trip between two processes on two cores, with no
//! payload (`size` 0):
//!
//! * `eventfd` (blocking): the source writes 1 to the "ping" eventfd and
//!   blocks in read() on the "pong" eventfd; the echo blocks in read() on
//!   "ping" and writes 1 to "pong". Two wake-ups of a sleeping task per
//!   round trip: the floor of any blocking transport.
//! * `memfd-spin` (--busy-poll): two 8-byte counters on separate cache lines
//!   of a shared memfd mapping (MAP_SHARED); the source stores the next
//!   sequence number in "ping" and spins until "pong" equals it, the echo
//!   spins on "ping" and copies it to "pong". Two cache-line transfers each
//!   way per round trip: the floor of any busy-polling transport.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use crate::child::{self, EchoArgs};
use crate::plan::{Peer, Plan, RTT_PER_RUN};
use crate::report::Point;
use crate::stats::Summary;

const PING: u64 = 1;
const STOP: u64 = 2;
/// Offset of the pong counter: two cache lines away from ping (no adjacent-line prefetch sharing).
const PONG_OFFSET: usize = 128;
const SPIN_STALL: Duration = Duration::from_secs(10);

fn efd_write(fd: BorrowedFd<'_>, v: u64) -> Result<(), String> {
    loop {
        match rustix::io::write(fd, &v.to_ne_bytes()) {
            Ok(8) => return Ok(()),
            Ok(n) => return Err(format!("eventfd write of {n} bytes")),
            Err(Errno::INTR) => {}
            Err(e) => return Err(format!("eventfd write: {e}")),
        }
    }
}

fn efd_read(fd: BorrowedFd<'_>) -> Result<u64, String> {
    let mut b = [0u8; 8];
    loop {
        match rustix::io::read(fd, &mut b) {
            Ok(8) => return Ok(u64::from_ne_bytes(b)),
            Ok(n) => return Err(format!("eventfd read of {n} bytes")),
            Err(Errno::INTR) => {}
            Err(e) => return Err(format!("eventfd read: {e}")),
        }
    }
}

/// A shared mapping of one page of a memfd, holding the two counters.
struct Shared {
    ptr: *mut std::ffi::c_void,
}

impl Shared {
    fn map(fd: BorrowedFd<'_>) -> Result<Shared, String> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        // SAFETY: a fresh shared mapping of our own memfd; unmapped in Drop.
        let ptr =
            unsafe { mmap(std::ptr::null_mut(), 4096, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0) }
                .map_err(|e| format!("mmap: {e}"))?;
        Ok(Shared { ptr })
    }
    fn ping(&self) -> &AtomicU64 {
        // SAFETY: page-aligned, inside the mapping, only ever accessed atomically.
        unsafe { &*(self.ptr as *const AtomicU64) }
    }
    fn pong(&self) -> &AtomicU64 {
        // SAFETY: as above, at an 8-aligned offset inside the page.
        unsafe { &*(self.ptr.cast::<u8>().add(PONG_OFFSET) as *const AtomicU64) }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; no references outlive `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr, 4096) };
    }
}

pub fn measure(plan: &Plan) -> Result<(), String> {
    let point = rtt(plan)?;
    point.print();
    Ok(())
}

fn rtt(plan: &Plan) -> Result<Point<'_>, String> {
    let mut e = EchoArgs::new(Peer::Eventfd, 0);
    e.busy_poll = plan.busy;
    e.die_after = plan.die_after;
    let timeout = Duration::from_secs(plan.timeout_s);
    let mut samples = Vec::with_capacity(plan.runs * RTT_PER_RUN);
    let mut seq = 0u64;
    let proc;
    if plan.busy {
        let fd = rustix::fs::memfd_create("ferry-peers-spin", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| format!("memfd_create: {e}"))?;
        rustix::fs::ftruncate(&fd, 4096).map_err(|e| format!("ftruncate: {e}"))?;
        let shm = Shared::map(fd.as_fd())?;
        shm.ping().store(0, Ordering::Relaxed);
        shm.pong().store(0, Ordering::Relaxed);
        e.fds = vec![fd.as_raw_fd()];
        proc = child::spawn(&e, timeout)?;
        for run in 0..=plan.runs {
            for _ in 0..RTT_PER_RUN {
                seq += 1;
                plan.idle();
                let t0 = Instant::now();
                shm.ping().store(seq, Ordering::Release);
                let mut spins = 0u32;
                while shm.pong().load(Ordering::Acquire) != seq {
                    std::hint::spin_loop();
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(1 << 20) && t0.elapsed() > SPIN_STALL {
                        return Err(format!("no pong {seq} within {} s", SPIN_STALL.as_secs()));
                    }
                }
                let dt = t0.elapsed();
                if run > 0 {
                    samples.push(dt.as_secs_f64() * 1e6);
                }
            }
            proc.tick();
        }
        let mut proc = proc;
        proc.disarm();
        shm.ping().store(u64::MAX, Ordering::Release);
        finish(proc, seq)?;
    } else {
        let flags = rustix::event::EventfdFlags::CLOEXEC;
        let ping = rustix::event::eventfd(0, flags).map_err(|e| format!("eventfd: {e}"))?;
        let pong = rustix::event::eventfd(0, flags).map_err(|e| format!("eventfd: {e}"))?;
        e.fds = vec![ping.as_raw_fd(), pong.as_raw_fd()];
        proc = child::spawn(&e, timeout)?;
        for run in 0..=plan.runs {
            for _ in 0..RTT_PER_RUN {
                plan.idle();
                let t0 = Instant::now();
                efd_write(ping.as_fd(), PING)?;
                let v = efd_read(pong.as_fd())?;
                let dt = t0.elapsed();
                if v != PING {
                    return Err(format!("pong counter {v}, expected {PING}"));
                }
                seq += 1;
                if run > 0 {
                    samples.push(dt.as_secs_f64() * 1e6);
                }
            }
            proc.tick();
        }
        let mut proc = proc;
        proc.disarm();
        efd_write(ping.as_fd(), STOP)?;
        finish(proc, seq)?;
    }
    let summary = Summary::of(&samples).ok_or("no samples")?;
    Ok(Point { plan, size: 0, summary, moves: None, run_medians: None })
}

fn finish(proc: child::EchoProc, expected: u64) -> Result<(), String> {
    let echoed = proc.finish()?;
    if echoed != expected {
        return Err(format!("the echo saw {echoed} round trips, expected {expected}"));
    }
    Ok(())
}

pub fn echo(a: &EchoArgs) -> Result<u64, String> {
    let mut n = 0u64;
    if a.busy_poll {
        let &[fd] = a.fds.as_slice() else { return Err("spin echo: expected one --fd".into()) };
        // SAFETY: inherited for us alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let shm = Shared::map(fd.as_fd())?;
        loop {
            let v = shm.ping().load(Ordering::Acquire);
            if v == n {
                std::hint::spin_loop();
                continue;
            }
            if v == u64::MAX {
                return Ok(n);
            }
            if v != n + 1 {
                return Err(format!("ping {v} after {n}"));
            }
            shm.pong().store(v, Ordering::Release);
            n = v;
            a.maybe_die(n);
        }
    } else {
        let &[ping, pong] = a.fds.as_slice() else { return Err("eventfd echo: expected two --fd".into()) };
        // SAFETY: inherited for us alone.
        let (ping, pong) = unsafe { (OwnedFd::from_raw_fd(ping), OwnedFd::from_raw_fd(pong)) };
        loop {
            match efd_read(ping.as_fd())? {
                PING => efd_write(pong.as_fd(), PING)?,
                STOP => return Ok(n),
                v => return Err(format!("ping counter {v}")),
            }
            n += 1;
            a.maybe_die(n);
        }
    }
}
