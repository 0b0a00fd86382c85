//! Copying baselines: Unix stream socket, TCP loopback, two pipes.
//!
//! Every message is `size` bytes written with write() and read with read()
//! (the kernel copies it in and out: `copies_kernel` = 2 per one-way
//! message); the echo reads a whole message into its buffer and writes that
//! same buffer back (no user-space copy: `copies_user` = 0). Each message
//! starts with the 8-byte tag of its sequence number, which the echo and the
//! source check (framing, loss, order); with --touch the source fills the
//! whole message with the pattern and the echo checks every byte.
//!
//! rtt: blocking write of one message, blocking read of the echo.
//! throughput: the source is one thread doing non-blocking I/O with poll(),
//! keeping up to --inflight messages sent but not yet echoed; the echo
//! reads one message and writes it back, blocking.
//!
//! Buffers: socket buffers as the kernel sets them (TCP autotuning); each
//! pipe is enlarged to /proc/sys/fs/pipe-max-size (1 MiB) with F_SETPIPE_SZ,
//! as a bulk-transfer program would do (the 64 KiB default costs 16 wake-ups
//! per MiB).

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;

use crate::child::{self, EchoArgs, EchoProc};
use crate::pattern;
use crate::plan::{Experiment, Peer, Plan, PointPlan, FBUFS_PER_RUN, PAGE, RTT_PER_RUN};
use crate::report::Point;
use crate::stats::Summary;

/// No progress on a non-blocking connection for this long is an error.
const IO_STALL: Duration = Duration::from_secs(10);

struct Ends {
    rd: OwnedFd,
    wr: OwnedFd,
    socket: bool,
}

fn errno(what: &str) -> impl Fn(Errno) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn io(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Connect the source to a new echo process over `plan.peer`.
fn connect(plan: &Plan, pp: PointPlan) -> Result<(Ends, EchoProc), String> {
    let mut e = EchoArgs::new(plan.peer, pp.size);
    e.touch = plan.touch;
    e.oneway = plan.experiment == Experiment::Fbufs;
    e.die_after = plan.die_after;
    let timeout = Duration::from_secs(plan.timeout_s);
    match plan.peer {
        Peer::Uds => {
            let (mine, theirs) = UnixStream::pair().map_err(io("socketpair"))?;
            e.fds = vec![theirs.as_raw_fd()];
            let proc = child::spawn(&e, timeout)?;
            drop(theirs);
            let rd = OwnedFd::from(mine);
            let wr = rd.try_clone().map_err(io("dup"))?;
            Ok((Ends { rd, wr, socket: true }, proc))
        }
        Peer::Tcp => {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("bind 127.0.0.1:0"))?;
            e.port = Some(listener.local_addr().map_err(io("local_addr"))?.port());
            let proc = child::spawn(&e, timeout)?;
            listener.set_nonblocking(true).map_err(io("listener"))?;
            let t0 = Instant::now();
            let stream = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock && t0.elapsed() < IO_STALL => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(err) => return Err(format!("accept: {err}")),
                }
            };
            stream.set_nonblocking(false).map_err(io("tcp"))?;
            stream.set_nodelay(true).map_err(io("TCP_NODELAY"))?;
            let rd = OwnedFd::from(stream);
            let wr = rd.try_clone().map_err(io("dup"))?;
            Ok((Ends { rd, wr, socket: true }, proc))
        }
        Peer::Pipe => {
            let (their_rd, my_wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(errno("pipe"))?;
            let (my_rd, their_wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(errno("pipe"))?;
            // Bulk pipes are given the largest buffer an unprivileged process may ask for
            // (/proc/sys/fs/pipe-max-size, 1 MiB by default) instead of 64 KiB.
            let max = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(1 << 20);
            for p in [&my_wr, &their_wr] {
                if let Err(err) = rustix::pipe::fcntl_setpipe_size(p, max) {
                    eprintln!("ferry-peers: F_SETPIPE_SZ {max}: {err} (keeping the default pipe buffer)");
                }
            }
            e.fds = vec![their_rd.as_raw_fd(), their_wr.as_raw_fd()];
            let proc = child::spawn(&e, timeout)?;
            drop((their_rd, their_wr));
            Ok((Ends { rd: my_rd, wr: my_wr, socket: false }, proc))
        }
        Peer::Iceoryx2 | Peer::Eventfd => unreachable!("not a stream peer"),
    }
}

/// Tell the echo we are done (end of file) and check what it saw.
fn stop(ends: Ends, mut proc: EchoProc, expected: u64) -> Result<(), String> {
    proc.disarm();
    if ends.socket {
        rustix::net::shutdown(&ends.wr, rustix::net::Shutdown::Write).map_err(errno("shutdown"))?;
    }
    drop(ends);
    let echoed = proc.finish()?;
    if echoed != expected {
        return Err(format!("the echo saw {echoed} messages, expected {expected}"));
    }
    Ok(())
}

fn write_all(fd: BorrowedFd<'_>, mut buf: &[u8]) -> Result<(), String> {
    while !buf.is_empty() {
        match rustix::io::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::INTR) => {}
            Err(e) => return Err(format!("write: {e}")),
        }
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes; `Ok(false)` on end of file before the first byte.
fn read_exact(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Result<bool, String> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(fd, &mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(format!("end of file inside a message ({got} of {} bytes)", buf.len())),
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
    Ok(true)
}

/// Prepare message `seq` in `buf`: the whole pattern with --touch, else its tag.
fn prepare(buf: &mut [u8], seq: u64, touch: bool) {
    if touch {
        pattern::fill(buf, seq);
    } else {
        buf[..8].copy_from_slice(&pattern::tag(seq));
    }
}

fn check_echo(buf: &[u8], seq: u64) -> Result<(), String> {
    if pattern::check_tag(buf, seq) {
        Ok(())
    } else {
        Err(format!("message {seq} came back with a wrong tag (lost, reordered or mangled)"))
    }
}

pub fn measure(plan: &Plan) -> Result<(), String> {
    for &pp in &plan.points {
        let point = match plan.experiment {
            Experiment::Rtt => rtt(plan, pp)?,
            Experiment::Throughput => throughput(plan, pp)?,
            Experiment::Fbufs => fbufs(plan, pp)?,
        };
        point.print();
    }
    Ok(())
}

/// Write the transfer's sequence number into the first word of every page.
fn write_pages(buf: &mut [u8], seq: u64) {
    for page in buf.chunks_mut(PAGE) {
        if page.len() >= 8 {
            page[..8].copy_from_slice(&seq.to_le_bytes());
        }
    }
}

/// Whether the first word of every page holds `seq`.
fn check_pages(buf: &[u8], seq: u64) -> bool {
    let want = seq.to_le_bytes();
    buf.chunks(PAGE).filter(|p| p.len() >= 8).fold(true, |ok, p| ok & (p[..8] == want))
}

/// The \[FBUFS\] Table 1 transfer over a copying transport: the source writes one word
/// per page and sends the message; the echo reads it whole, reads (checks)
/// one word per page and answers with the 8-byte sequence number. One
/// sample per transfer, from the first byte written to the answer read.
fn fbufs(plan: &Plan, pp: PointPlan) -> Result<Point<'_>, String> {
    let (ends, proc) = connect(plan, pp)?;
    let (rd, wr) = (ends.rd.as_fd(), ends.wr.as_fd());
    let mut sbuf = vec![1u8; pp.size];
    let mut ack = [0u8; 8];
    let mut samples = Vec::with_capacity(plan.runs * FBUFS_PER_RUN);
    let mut medians = Vec::with_capacity(plan.runs);
    let mut seq = 0u64;
    for run in 0..=plan.runs {
        let mut times = Vec::with_capacity(FBUFS_PER_RUN);
        for _ in 0..FBUFS_PER_RUN {
            let t0 = Instant::now();
            write_pages(&mut sbuf, seq);
            write_all(wr, &sbuf)?;
            if !read_exact(rd, &mut ack)? {
                return Err("the echo closed the connection".into());
            }
            times.push(t0.elapsed().as_secs_f64() * 1e6);
            if u64::from_le_bytes(ack) != seq {
                return Err(format!("transfer {seq} answered with {}", u64::from_le_bytes(ack)));
            }
            seq += 1;
        }
        if run > 0 {
            medians.push(Summary::of(&times).ok_or("no samples")?.median);
            samples.extend(times);
        }
        proc.tick();
    }
    stop(ends, proc, seq)?;
    let summary = Summary::of(&samples).ok_or("no samples")?;
    Ok(Point { plan, size: pp.size, summary, moves: None, run_medians: Some(medians) })
}

fn rtt(plan: &Plan, pp: PointPlan) -> Result<Point<'_>, String> {
    let (ends, proc) = connect(plan, pp)?;
    let (rd, wr) = (ends.rd.as_fd(), ends.wr.as_fd());
    // Pre-fault both buffers: we measure transfers, not first touches.
    let mut sbuf = vec![1u8; pp.size];
    let mut rbuf = vec![1u8; pp.size];
    let mut samples = Vec::with_capacity(plan.runs * RTT_PER_RUN);
    let mut seq = 0u64;
    // One warm-up run, not recorded.
    for run in 0..=plan.runs {
        for _ in 0..RTT_PER_RUN {
            prepare(&mut sbuf, seq, plan.touch);
            plan.idle();
            let t0 = Instant::now();
            write_all(wr, &sbuf)?;
            if !read_exact(rd, &mut rbuf)? {
                return Err("the echo closed the connection".into());
            }
            let dt = t0.elapsed();
            check_echo(&rbuf, seq)?;
            seq += 1;
            if run > 0 {
                samples.push(dt.as_secs_f64() * 1e6);
            }
        }
        proc.tick();
    }
    stop(ends, proc, seq)?;
    let summary = Summary::of(&samples).ok_or("no samples")?;
    Ok(Point { plan, size: pp.size, summary, moves: None, run_medians: None })
}

fn throughput(plan: &Plan, pp: PointPlan) -> Result<Point<'_>, String> {
    let (ends, proc) = connect(plan, pp)?;
    let (rd, wr) = (ends.rd.as_fd(), ends.wr.as_fd());
    for fd in [rd, wr] {
        rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::NONBLOCK).map_err(errno("O_NONBLOCK"))?;
    }
    let (size, window, moves) = (pp.size, plan.inflight as u64, pp.moves as u64);
    let mut sbuf = vec![1u8; size];
    let mut rbuf = vec![1u8; size];
    let mut rates = Vec::with_capacity(plan.runs);
    let (mut sent, mut done) = (0u64, 0u64); // over all runs: sequence numbers
    for run in 0..=plan.runs {
        let end = done + moves;
        let (mut soff, mut roff) = (0usize, 0usize);
        let t0 = Instant::now();
        while done < end {
            let mut progress = false;
            // Send while the window allows: a partly written message counts as in flight.
            while sent < end && sent - done < window {
                if soff == 0 {
                    prepare(&mut sbuf, sent, plan.touch);
                }
                match rustix::io::write(wr, &sbuf[soff..]) {
                    Ok(n) => {
                        progress = true;
                        soff += n;
                        if soff == size {
                            soff = 0;
                            sent += 1;
                        }
                    }
                    Err(Errno::AGAIN) => break,
                    Err(Errno::INTR) => {}
                    Err(e) => return Err(format!("write: {e}")),
                }
            }
            // Take every echo that is there.
            while done < sent {
                match rustix::io::read(rd, &mut rbuf[roff..]) {
                    Ok(0) => return Err("the echo closed the connection".into()),
                    Ok(n) => {
                        progress = true;
                        roff += n;
                        if roff == size {
                            roff = 0;
                            check_echo(&rbuf, done)?;
                            done += 1;
                        }
                    }
                    Err(Errno::AGAIN) => break,
                    Err(Errno::INTR) => {}
                    Err(e) => return Err(format!("read: {e}")),
                }
            }
            if !progress && done < end {
                let can_send = sent < end && sent - done < window;
                let mut fds = [
                    PollFd::new(&rd, PollFlags::IN),
                    PollFd::new(&wr, if can_send { PollFlags::OUT } else { PollFlags::empty() }),
                ];
                let timeout = rustix::event::Timespec { tv_sec: IO_STALL.as_secs() as i64, tv_nsec: 0 };
                match rustix::event::poll(&mut fds, Some(&timeout)) {
                    Ok(0) => return Err(format!("no progress for {} s", IO_STALL.as_secs())),
                    Ok(_) | Err(Errno::INTR) => {}
                    Err(e) => return Err(format!("poll: {e}")),
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push(moves as f64 / secs / 1e6);
        }
        proc.tick();
    }
    for fd in [rd, wr] {
        rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::empty()).map_err(errno("O_NONBLOCK"))?;
    }
    stop(ends, proc, sent)?;
    let summary = Summary::of(&rates).ok_or("no samples")?;
    Ok(Point { plan, size: pp.size, summary, moves: Some(pp.moves), run_medians: None })
}

/// The echo: read a message, check it, write the same buffer back, until end of file.
pub fn echo(a: &EchoArgs) -> Result<u64, String> {
    let (rd, wr): (OwnedFd, OwnedFd) = match a.peer {
        Peer::Uds => {
            let &[fd] = a.fds.as_slice() else { return Err("uds echo: expected one --fd".into()) };
            // SAFETY: the fd was inherited for us alone.
            let s = unsafe { OwnedFd::from_raw_fd(fd) };
            let w = s.try_clone().map_err(io("dup"))?;
            (s, w)
        }
        Peer::Tcp => {
            let port = a.port.ok_or("tcp echo: expected --port")?;
            let s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(io("connect"))?;
            s.set_nodelay(true).map_err(io("TCP_NODELAY"))?;
            let s = OwnedFd::from(s);
            let w = s.try_clone().map_err(io("dup"))?;
            (s, w)
        }
        Peer::Pipe => {
            let &[r, w] = a.fds.as_slice() else { return Err("pipe echo: expected two --fd".into()) };
            // SAFETY: both fds were inherited for us alone.
            unsafe { (OwnedFd::from_raw_fd(r), OwnedFd::from_raw_fd(w)) }
        }
        Peer::Iceoryx2 | Peer::Eventfd => unreachable!("not a stream peer"),
    };
    let mut buf = vec![1u8; a.size];
    let mut n = 0u64;
    if a.oneway {
        while read_exact(rd.as_fd(), &mut buf)? {
            if !check_pages(&buf, n) {
                return Err(format!("transfer {n} arrived with wrong page words"));
            }
            write_all(wr.as_fd(), &n.to_le_bytes())?;
            n += 1;
            a.maybe_die(n);
        }
        return Ok(n);
    }
    while read_exact(rd.as_fd(), &mut buf)? {
        let ok = if a.touch { pattern::check(&buf, n) } else { pattern::check_tag(&buf, n) };
        if !ok {
            return Err(format!("message {n} arrived mangled, lost or out of order"));
        }
        write_all(wr.as_fd(), &buf)?;
        n += 1;
        a.maybe_die(n);
    }
    Ok(n)
}
