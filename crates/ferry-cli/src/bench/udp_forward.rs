//! `ferry bench udp-forward`: the experiment of Container Shipping's Fig. 6
//! (Pasquale, Anderson and Muller) on Linux. A generator sends datagrams of
//! `--size` bytes (4 KiB by default) to a forwarder's socket on loopback;
//! the forwarder sends each one on, untouched, to a sink's socket. The
//! forwarder is either ferry-io (`Port::read` of a batch of pool buffers,
//! one datagram each, then `Port::write` of the same buffers: one
//! `recvmmsg` and one `sendmmsg` per batch) or a conventional forwarder
//! (`recv` into a buffer of its own, `send` from it, one datagram per
//! system call). Each point runs with 0, 1, 2 or 3 competing CPU-bound
//! processes (`--competitors`), real processes that spin for the whole
//! point.
//!
//! The generator keeps at most [`WINDOW`] datagrams ahead of the sink (a
//! shared counter; after a loss it goes on once nothing arrives for a
//! moment), so the loopback queues do not overflow and a lost datagram is
//! the exception. The sink checks that sequence numbers only rise and
//! every datagram has its size; the rate is datagrams delivered to the
//! sink per second, from the first send to the last arrival.
//!
//! On Linux the kernel copies each datagram twice in either forwarder
//! (into the forwarder's memory on receive, out of it on send): a UDP
//! socket cannot hand pages over. What ferry-io saves is system calls and
//! the forwarder's own buffer management.

use std::io::Write as _;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::{IoError, Port};
use serde_json::json;

use super::point::{Head, Point};
use super::Ctx;
use crate::stats::{round, Summary};
use crate::CliError;

/// Datagrams per run unless --total says otherwise (--total / --size).
const DEFAULT_DATAGRAMS: u64 = 100_000;
/// Default datagram size (the paper's ≈ 4 KiB).
const DEFAULT_SIZE: usize = 4096;
/// Datagrams the generator keeps in flight at most.
const WINDOW: u64 = 128;
/// Datagrams one ferry-io read takes at most (buffers of the pool).
const BATCH: usize = 64;
/// How long a receiver waits for the next datagram before it looks
/// whether the run is over.
const IDLE: Duration = Duration::from_millis(50);
/// Longest a run may take.
const RUN_LIMIT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    ReadWrite,
    FerryIo,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::ReadWrite => "read-write",
            Variant::FerryIo => "ferry-io",
        }
    }
}

fn os(what: &str) -> impl Fn(std::io::Error) -> CliError + '_ {
    move |e| CliError::Failed(format!("udp-forward: {what}: {e}"))
}

/// A socket's receive buffer as large as the kernel lets us make it.
fn big_rcvbuf(s: &UdpSocket) {
    let bytes: libc::c_int = 4 << 20;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on our open socket with a valid int option value.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&bytes as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return;
        }
    }
}

/// CPU-bound processes that spin until killed.
struct Competitors(Vec<Child>);

impl Competitors {
    fn start(n: usize) -> Result<Competitors, CliError> {
        let mut c = Competitors(Vec::new());
        for _ in 0..n {
            let child = Command::new("/bin/sh")
                .args(["-c", "while :; do :; done"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .map_err(os("cannot start a competing process"))?;
            c.0.push(child);
        }
        Ok(c)
    }
}

impl Drop for Competitors {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What one run saw at the sink.
struct Outcome {
    delivered: u64,
    secs: f64,
    /// Datagrams the forwarder forwarded, and the receive calls it made.
    forwarded: (u64, u64),
}

/// The generator: `count` datagrams of `size` bytes, each starting with
/// its sequence number, at most WINDOW ahead of the sink.
fn generate(sock: UdpSocket, size: usize, count: u64, seen: &AtomicU64, stop: &AtomicBool) -> Result<(), CliError> {
    let mut buf = vec![0x5au8; size];
    let mut last_progress = (0u64, Instant::now());
    let mut seq = 0u64;
    while seq < count && !stop.load(Ordering::Relaxed) {
        let s = seen.load(Ordering::Relaxed);
        if seq >= s + WINDOW {
            if s != last_progress.0 {
                last_progress = (s, Instant::now());
            } else if last_progress.1.elapsed() > IDLE {
                // Lost on the way: go on as if it had arrived.
                seen.fetch_max(seq + 1 - WINDOW, Ordering::Relaxed);
            }
            std::thread::yield_now();
            continue;
        }
        buf[..8].copy_from_slice(&seq.to_le_bytes());
        match sock.send(&buf) {
            Ok(_) => seq += 1,
            // The forwarder's queue is full for a moment (ENOBUFS) or
            // it is not bound yet (ECONNREFUSED): try again.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::ECONNREFUSED | libc::EAGAIN)) => {
                std::thread::yield_now();
            }
            Err(e) => return Err(os("generator send")(e)),
        }
    }
    Ok(())
}

/// The conventional forwarder: recv into its own buffer, send from it.
fn forward_read_write(inp: UdpSocket, out: UdpSocket, size: usize, done: &AtomicBool) -> Result<(u64, u64), CliError> {
    let mut buf = vec![0u8; size + 1];
    inp.set_read_timeout(Some(IDLE)).map_err(os("timeout"))?;
    let mut n = 0u64;
    loop {
        match inp.recv(&mut buf) {
            Ok(len) => {
                out.send(&buf[..len]).map_err(os("forwarder send"))?;
                n += 1;
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if done.load(Ordering::Relaxed) {
                    return Ok((n, n));
                }
            }
            Err(e) => return Err(os("forwarder receive")(e)),
        }
    }
}

fn timed_out(e: &IoError) -> bool {
    matches!(e, IoError::Os { source, .. }
        if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// The ferry-io forwarder: a batch of pool buffers filled by one read,
/// consumed by one write.
fn forward_ferry(inp: UdpSocket, out: UdpSocket, alloc: &Allocator, done: &AtomicBool) -> Result<(u64, u64), CliError> {
    inp.set_read_timeout(Some(IDLE)).map_err(os("timeout"))?;
    let fail = |e: IoError| CliError::Failed(format!("udp-forward: forwarder: {e}"));
    let mut inp = Port::from_fd(inp, "udp:forwarder-in").map_err(fail)?;
    let mut out = Port::from_fd(out, "udp:forwarder-out").map_err(fail)?;
    let (mut n, mut reads) = (0u64, 0u64);
    loop {
        match inp.read(alloc, BATCH) {
            Ok(filled) => {
                n += filled.len() as u64;
                reads += 1;
                out.write(filled).map_err(fail)?;
            }
            Err(e) if timed_out(&e) => {
                if done.load(Ordering::Relaxed) {
                    return Ok((n, reads));
                }
            }
            Err(e) => return Err(fail(e)),
        }
    }
}

/// One run: `count` datagrams through the forwarder of variant `v`.
fn run_once(v: Variant, size: usize, count: u64, alloc: &Arc<Allocator>) -> Result<Outcome, CliError> {
    let bind = || UdpSocket::bind("127.0.0.1:0").map_err(os("bind"));
    let (fwd_in, sink) = (bind()?, bind()?);
    big_rcvbuf(&fwd_in);
    big_rcvbuf(&sink);
    let (gen, fwd_out) = (bind()?, bind()?);
    gen.connect(fwd_in.local_addr().map_err(os("address"))?).map_err(os("connect"))?;
    fwd_out.connect(sink.local_addr().map_err(os("address"))?).map_err(os("connect"))?;
    sink.set_read_timeout(Some(IDLE)).map_err(os("timeout"))?;

    let seen = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let gen_done = Arc::new(AtomicBool::new(false));
    let fwd_done = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let generator = {
        let (seen, stop, gen_done) = (seen.clone(), stop.clone(), gen_done.clone());
        std::thread::spawn(move || {
            let r = generate(gen, size, count, &seen, &stop);
            gen_done.store(true, Ordering::Relaxed);
            r
        })
    };
    let forwarder = {
        let (gen_done, alloc) = (gen_done.clone(), alloc.clone());
        let fwd_done = fwd_done.clone();
        std::thread::spawn(move || {
            let r = match v {
                Variant::ReadWrite => forward_read_write(fwd_in, fwd_out, size, &gen_done),
                Variant::FerryIo => forward_ferry(fwd_in, fwd_out, &alloc, &gen_done),
            };
            fwd_done.store(true, Ordering::Relaxed);
            r
        })
    };
    // The sink, here: check and count.
    let mut buf = vec![0u8; size + 1];
    let (mut delivered, mut next, mut last) = (0u64, 0u64, t0);
    let mut bad: Option<String> = None;
    loop {
        match sink.recv(&mut buf) {
            Ok(len) => {
                last = Instant::now();
                let seq = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0xff; 8]));
                if len != size || seq < next || seq >= count {
                    bad.get_or_insert(format!("datagram {delivered} arrived wrong: {len} bytes, number {seq}"));
                }
                next = seq + 1;
                delivered += 1;
                seen.fetch_max(next, Ordering::Relaxed);
                if next == count {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if fwd_done.load(Ordering::Relaxed) {
                    break;
                }
            }
            Err(e) => {
                bad.get_or_insert(format!("sink receive: {e}"));
                break;
            }
        }
        if t0.elapsed() > RUN_LIMIT {
            bad.get_or_insert(format!("no end within {} s", RUN_LIMIT.as_secs()));
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    gen_done.store(true, Ordering::Relaxed);
    let joined = |r: std::thread::Result<Result<(u64, u64), CliError>>| {
        r.unwrap_or_else(|_| Err(CliError::Failed("udp-forward: a thread panicked".into())))
    };
    generator.join().unwrap_or_else(|_| Err(CliError::Failed("udp-forward: the generator panicked".into())))?;
    let (forwarded, reads) = joined(forwarder.join())?;
    if let Some(why) = bad {
        return Err(CliError::Failed(format!("udp-forward ({}): {why}", v.name())));
    }
    if delivered == 0 || forwarded < delivered {
        return Err(CliError::Failed(format!(
            "udp-forward ({}): {delivered} delivered, {forwarded} forwarded",
            v.name()
        )));
    }
    Ok(Outcome { delivered, secs: last.duration_since(t0).as_secs_f64(), forwarded: (forwarded, reads) })
}

/// `ferry bench udp-forward`.
pub fn run(ctx: &mut Ctx) -> Result<(), CliError> {
    let a = ctx.args;
    let sizes = if a.sizes.is_empty() { vec![DEFAULT_SIZE] } else { a.sizes.clone() };
    let runs = a.runs.unwrap_or(5);
    let competitors = if a.competitors.is_empty() { vec![0, 1, 2, 3] } else { a.competitors.clone() };
    for &size in &sizes {
        if !(8..=65_000).contains(&size) {
            return Err(CliError::Usage(format!(
                "--size {size}: a UDP datagram here carries 8 to 65000 bytes; give e.g. --size 4096"
            )));
        }
        let count = a.total.map_or(DEFAULT_DATAGRAMS, |t| (t / size as u64).max(1));
        let buf = size.next_power_of_two().max(4096);
        let alloc =
            Arc::new(Allocator::new(&Domain::new("udp-forward"), 2 * BATCH as u64, buf, PoolConstraints::default())?);
        for &k in &competitors {
            let _spinners = Competitors::start(k)?;
            let mut medians = Vec::new();
            for v in [Variant::ReadWrite, Variant::FerryIo] {
                let mut rates = Vec::with_capacity(runs);
                let mut lost = 0u64;
                let (mut fwd, mut reads) = (0u64, 0u64);
                for run in 0..=runs {
                    let o = run_once(v, size, count, &alloc)?;
                    if alloc.available() != 2 * BATCH {
                        return Err(CliError::Failed(format!(
                            "udp-forward: {} of {} pool buffers missing after a run",
                            2 * BATCH - alloc.available(),
                            2 * BATCH
                        )));
                    }
                    if run > 0 {
                        rates.push(o.delivered as f64 / o.secs);
                        lost += count - o.delivered;
                        fwd += o.forwarded.0;
                        reads += o.forwarded.1;
                    }
                }
                let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
                medians.push(s.median);
                let head = Head {
                    experiment: "udp-forward",
                    backend: v.name(),
                    size,
                    trust: "n/a",
                    mode: "blocking",
                    touch: false,
                    runs,
                    unit: "datagrams/s",
                };
                let per_read = if reads > 0 { fwd as f64 / reads as f64 } else { 0.0 };
                let extra = json!({ "competitors": k, "datagrams": count, "lost": lost, "verified": true,
                    "datagrams_per_receive_call": round(per_read),
                    "copies_kernel": 2, "gbit_s_median": round(s.median * size as f64 * 8.0 / 1e9) });
                ctx.emit(Point::new(head, s, Some(0), extra));
            }
            let ratio = medians[1] / medians[0];
            if a.json {
                ctx.progress.println(
                    &json!({ "kind": "ratio", "experiment": "udp-forward", "unit": "datagrams/s", "size": size,
                        "competitors": k, "ferry": "ferry-io", "baseline": "read-write",
                        "ratios": [round(ratio)], "median_ratio": round(ratio), "ferry_faster_by": round(ratio) })
                    .to_string(),
                );
            } else {
                ctx.progress.println(&format!(
                    "  udp-forward {size} B, {k} competing: ferry-io / read-write = {}",
                    round(ratio)
                ));
            }
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}
