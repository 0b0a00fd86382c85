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
//! selective mapping of the paper). Both sides of the socket are the same in
//! these three variants: the kernel copies the bytes out of the socket either
//! way (on Linux a socket that carries the bytes cannot hand pages over), so
//! what differs is only what the receiver does with memory.
//!
//! The fourth row (`ferry-channel`) is the paper's cs_write/cs_read as Ferry
//! does it between two processes: a Ferry shared-memory channel whose AF_UNIX
//! (seqpacket) socket carries only the setup — the bind request with the
//! receiver's doorbell (an eventfd), the reply with the ring segment's memfd
//! and the sender's doorbell, the pool's memfd — and afterwards only tells
//! either side that the other hung up. The data pages never cross it: the
//! sender process (`ferry bench-child socket-touch-sender`) fills a pool
//! buffer of `--size` bytes (copies the same 128 KiB into it that the
//! read/write sender's `write(2)` copies into the socket) and moves it; the
//! receiver finds the same pages mapped in its pool mapping, touches all,
//! half or none of them by the same rule, and passes the buffer back to the
//! sender's allocator. What travels per buffer is a ring slot in the shared
//! segment and, when the peer sleeps, one eventfd doorbell.

use std::io::{BufRead as _, Write as _};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use ferry::{Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, PoolConstraints, Role};
use ferry_io::Port;
use serde_json::json;

use super::point::{Head, Point};
use super::Ctx;
use crate::setup::{describe_event, send_when_room};
use crate::stats::{round, Summary};
use crate::CliError;

/// Bytes per run unless --total says.
const DEFAULT_TOTAL: u64 = 256 << 20;
/// The paper's I/O size.
const DEFAULT_SIZE: usize = 128 << 10;
const PAGE: usize = 4096;
/// Pool buffers the Ferry sender fills ahead of the receiver.
const WINDOW: usize = 32;
/// Longest wait for one setup step or one buffer.
const STEP: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    ReadWrite,
    FerryIo,
    Unmapped,
    Channel,
    ChannelPrefilled,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::ReadWrite => "read-write",
            Variant::FerryIo => "ferry-io",
            Variant::Unmapped => "unmapped",
            Variant::Channel => "ferry-channel",
            Variant::ChannelPrefilled => "ferry-channel-prefilled",
        }
    }
}

/// Touch (read every word of) the first `halves`/2 of the pages of `b`.
pub(crate) fn touch(b: &[u8], halves: usize) -> u64 {
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

/// Arguments of the Ferry sender process (set by `ferry bench socket-touch`).
#[derive(Debug, Args)]
pub struct SenderArgs {
    /// The shared-memory endpoint's abstract name.
    #[arg(long)]
    name: String,
    /// Bytes per buffer.
    #[arg(long)]
    size: usize,
    /// Bytes per run (a multiple of --size).
    #[arg(long)]
    total: u64,
    /// Fill every pool buffer once at the start, as the read/write sender
    /// fills its one buffer once, instead of before every move.
    #[arg(long)]
    prefilled: bool,
}

fn failed(what: &'static str) -> impl Fn(std::io::Error) -> CliError {
    move |e| CliError::Failed(format!("socket-touch: {what}: {e}"))
}

/// Wait up to [`STEP`] for the event `want` accepts; anything else is an error.
fn step<T>(ch: &mut Channel, what: &str, want: impl FnOnce(Event) -> Option<T>) -> Result<T, CliError> {
    match ch.wait(Some(STEP)) {
        Ok(Event::Error(e)) => Err(CliError::Failed(format!("socket-touch: {what}: {e}"))),
        Ok(ev) => {
            let words = describe_event(&ev);
            want(ev).ok_or_else(|| CliError::Failed(format!("socket-touch: waiting for the {what}, got {words}")))
        }
        Err(_) => Err(CliError::Failed(format!("socket-touch: no {what} within {} s", STEP.as_secs()))),
    }
}

/// Take the buffers the receiver passed back (wait for one if `block`).
fn take_returns(ch: &mut Channel, block: bool) -> Result<(), CliError> {
    let mut ev = if block {
        Some(ch.wait(Some(STEP)).map_err(|_| CliError::Failed("socket-touch: no buffer came back".into()))?)
    } else {
        ch.poll()
    };
    while let Some(e) = ev {
        match e {
            Event::BufferPassed { buffer, .. } => drop(buffer),
            Event::Error(e) => return Err(e.into()),
            other => return Err(CliError::Failed(format!("socket-touch sender got {}", describe_event(&other)))),
        }
        ev = ch.poll();
    }
    Ok(())
}

/// The Ferry sender process (`ferry bench-child socket-touch-sender`): per
/// line on stdin, fills and moves `total` bytes in `size`-byte pool buffers;
/// at the end of stdin waits for every buffer and tears the channel down.
pub fn sender(a: &SenderArgs) -> Result<(), CliError> {
    if a.size == 0 || a.total % a.size as u64 != 0 {
        return Err(CliError::Usage(format!("--total {} is not a multiple of --size {}", a.total, a.size)));
    }
    let domain = Domain::new("socket-touch-sender");
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        meta_size: 8,
        queue_depth: 64,
        ..ChannelSetup::default()
    };
    let mut ch = Channel::create(&domain, &Endpoint::shm_abstract(&a.name), setup)?;
    step(&mut ch, "bind request", |ev| matches!(ev, Event::BindRequest { .. }).then_some(()))?;
    let alloc = Allocator::new(&domain, WINDOW as u64, a.size, PoolConstraints::default())?;
    ch.assign_pool(alloc.pool())?;
    step(&mut ch, "pool acceptance", |ev| matches!(ev, Event::PoolAssigned(_)).then_some(()))?;
    // Moves are published in batches, at most one doorbell per batch.
    ch.set_batching(true)?;
    // What the read/write sender writes: the same bytes, copied into each buffer.
    let data: Vec<u8> = (0..a.size).map(|i| i as u8).collect();
    if a.prefilled {
        let mut all: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
        for b in &mut all {
            b.as_mut_slice()?.copy_from_slice(&data);
        }
    }
    let mut seq = 0u64;
    for line in std::io::stdin().lock().lines() {
        line.map_err(failed("control"))?;
        for _ in 0..a.total / a.size as u64 {
            let mut buf = loop {
                match alloc.alloc() {
                    Some(b) => break b,
                    None => take_returns(&mut ch, true)?,
                }
            };
            if !a.prefilled {
                buf.as_mut_slice()?.copy_from_slice(&data);
            }
            send_when_room(buf, false, |b| ch.move_buffer(b, &seq.to_le_bytes()))?;
            seq += 1;
        }
        // Batching holds moves back until the next flush, poll or wait (or
        // 32 of them): the receiver must get the run's last ones before we
        // block on the next control line, outside the channel.
        ch.flush()?;
    }
    while alloc.available() < WINDOW {
        take_returns(&mut ch, true)?;
    }
    ch.teardown()?;
    while let Ok(ev) = ch.wait(Some(STEP)) {
        if matches!(ev, Event::Closed { .. }) {
            break;
        }
    }
    Ok(())
}

/// The receiving end of the Ferry channel, in this process, and its sender process.
struct FerryPeer {
    child: Child,
    control: Option<ChildStdin>,
    ch: Channel,
}

impl FerryPeer {
    fn start(size: usize, total: u64, prefilled: bool) -> Result<FerryPeer, CliError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("ferry-socket-touch-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let exe = std::env::current_exe().map_err(failed("cannot find own executable"))?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench-child", "socket-touch-sender", "--name", &name, "--size", &size.to_string()])
            .args(["--total", &total.to_string()]);
        if prefilled {
            cmd.arg("--prefilled");
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(failed("cannot start the sender"))?;
        let control = child.stdin.take();
        let mut peer = FerryPeer { child, control, ch: Self::bind(&name)? };
        step(&mut peer.ch, "bind reply", |ev| matches!(ev, Event::Bound).then_some(()))?;
        let req = step(&mut peer.ch, "pool", |ev| match ev {
            Event::PoolAssignRequest(req) => Some(req),
            _ => None,
        })?;
        peer.ch.respond_pool(req.pool, true)?;
        // Buffers go back in batches, at most one doorbell per batch.
        peer.ch.set_batching(true)?;
        Ok(peer)
    }

    fn bind(name: &str) -> Result<Channel, CliError> {
        let domain = Domain::new("socket-touch-receiver");
        let t0 = Instant::now();
        loop {
            match Channel::bind(&domain, &Endpoint::shm_abstract(name), BindParams::default()) {
                Ok(ch) => return Ok(ch),
                Err(e) if e == ferry::ErrorKind::EndpointNotListening && t0.elapsed() < STEP => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One run: seconds to receive and touch `total` bytes.
    fn run_once(&mut self, total: u64, halves: usize) -> Result<f64, CliError> {
        let ctl = self.control.as_mut().ok_or_else(|| CliError::Failed("socket-touch: sender stopped".into()))?;
        let t0 = Instant::now();
        ctl.write_all(b"go\n").and_then(|()| ctl.flush()).map_err(failed("the sender is gone"))?;
        let (mut got, mut sum) = (0u64, 0u64);
        while got < total {
            match self.ch.wait(Some(STEP)) {
                Ok(Event::MoveReceived { buffer, meta }) => {
                    sum = sum.wrapping_add(touch(&buffer, halves));
                    got += buffer.len() as u64;
                    send_when_room(buffer, false, |b| self.ch.pass(b, &meta))?;
                }
                Ok(Event::Error(e)) => return Err(e.into()),
                Ok(other) => {
                    return Err(CliError::Failed(format!("socket-touch receiver got {}", describe_event(&other))))
                }
                Err(_) => return Err(CliError::Failed(format!("socket-touch: {got} of {total} bytes, then nothing"))),
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        Ok(secs)
    }

    /// End the sender: it takes its buffers home and tears the channel down.
    fn stop(mut self) -> Result<(), CliError> {
        drop(self.control.take());
        while let Ok(ev) = self.ch.wait(Some(STEP)) {
            if matches!(ev, Event::Closed { .. }) {
                break;
            }
        }
        let t0 = Instant::now();
        loop {
            match self.child.try_wait().map_err(failed("sender"))? {
                Some(st) if st.success() => return Ok(()),
                Some(st) => return Err(CliError::Failed(format!("socket-touch: the sender failed ({st})"))),
                None if t0.elapsed() < STEP => std::thread::sleep(Duration::from_millis(2)),
                None => return Err(CliError::Failed("socket-touch: the sender did not exit".into())),
            }
        }
    }
}

impl Drop for FerryPeer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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
        Variant::Channel | Variant::ChannelPrefilled => {
            return Err(CliError::Failed("socket-touch: the channel rows run in FerryPeer::run_once".into()))
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

/// Each row's median against read/write's, in the same run.
fn ratio_lines(ctx: &mut Ctx<'_>, size: usize, touched: &str, medians: &[(Variant, f64)]) {
    let Some(&(_, base)) = medians.iter().find(|(v, _)| *v == Variant::ReadWrite) else { return };
    for &(v, m) in medians.iter().filter(|(v, _)| *v != Variant::ReadWrite) {
        let r = round(m / base);
        if ctx.args.json {
            let l = json!({ "kind": "ratio", "experiment": "socket-touch", "unit": "GB/s", "size": size,
                "touched": touched, "ferry": v.name(), "baseline": "read-write", "median_ratio": r,
                "ferry_faster_by": r });
            ctx.progress.println(&l.to_string());
        } else {
            ctx.progress.println(&format!("  socket-touch touched={touched}: {} / read-write = {r}", v.name()));
        }
    }
}

/// `ferry bench socket-touch`.
pub fn run(ctx: &mut Ctx) -> Result<(), CliError> {
    let a = ctx.args;
    let sizes = if a.sizes.is_empty() { vec![DEFAULT_SIZE] } else { a.sizes.clone() };
    let runs = a.runs.unwrap_or(5);
    let total = a.total.unwrap_or(DEFAULT_TOTAL);
    if let Some(&size) = sizes.iter().find(|&&s| s == 0 || total % s as u64 != 0) {
        return Err(CliError::Usage(format!("--total {total} is not a multiple of --size {size}")));
    }
    for &size in &sizes {
        let alloc = Allocator::new(&Domain::new("socket-touch"), 4, size, PoolConstraints::default())?;
        let mut filling = FerryPeer::start(size, total, false)?;
        let mut prefilled = FerryPeer::start(size, total, true)?;
        for (halves, touched) in [(2, "all"), (1, "half"), (0, "none")] {
            let mut medians = Vec::new();
            let all =
                [Variant::ReadWrite, Variant::FerryIo, Variant::Unmapped, Variant::Channel, Variant::ChannelPrefilled];
            for v in all {
                let mut rates = Vec::with_capacity(runs);
                for run in 0..=runs {
                    let secs = match v {
                        Variant::Channel => filling.run_once(total, halves)?,
                        Variant::ChannelPrefilled => prefilled.run_once(total, halves)?,
                        _ => run_once(v, size, total, halves, &alloc)?,
                    };
                    if run > 0 {
                        rates.push(total as f64 / secs / 1e9);
                    }
                }
                let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
                medians.push((v, s.median));
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
                // The channel: the sender's copy into the pool buffer is the
                // user-space fill that `write(2)` does in the kernel; no copy crosses.
                let copies = if matches!(v, Variant::Channel | Variant::ChannelPrefilled) { 0 } else { 2 };
                let extra = json!({ "variant": format!("touched={touched}"), "total": total,
                    "copies_kernel": copies, "gbit_s_median": round(s.median * 8.0) });
                ctx.emit(Point::new(head, s, Some(0), extra));
                let _ = std::io::stdout().flush();
            }
            ratio_lines(ctx, size, touched, &medians);
        }
        filling.stop()?;
        prefilled.stop()?;
    }
    Ok(())
}
