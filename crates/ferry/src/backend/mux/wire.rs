//! The socket: writing what the scheduler committed, reading frames,
//! keep-alives and the peer's liveness, and the goodbye.

use crate::ErrorKind;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use super::codec::{MuxHead, K_CHUNK, K_GOODBYE, K_KEEPALIVE, K_READ, MAX_CHUNK, MUX_HEAD};
use super::demux::Target;
use super::session::{Chan, Inner, CLOSE_FLUSH};
use crate::error::{Error, Result};
use crate::sys::{self, RecvPart, SendPart};
use crate::tls::TlsSession;
use crate::wake::{Interest, WakeSet};

/// The socket send buffer asked for: small, so that bytes sent and not yet
/// acknowledged stay few as well (what is unsent is bounded by
/// [`UNSENT_LOW_WATER`]). On loopback (one pair of runs, busy machine)
/// 1 MiB gave about 30 % more aggregate throughput but priority round
/// trips no better than equal priorities; 256 KiB kept them about half of
/// those.
pub const SEND_BUFFER: usize = 256 << 10;
/// Unsent bytes the kernel may hold (`TCP_NOTSENT_LOWAT`): the socket
/// takes more, and reports itself writable, only while fewer are waiting
/// to go out. What is written is already in the order of the wire, so
/// keeping it short keeps the scheduler, not the kernel's queue, in
/// charge of what goes next (HTTP/2 servers do the same).
pub const UNSENT_LOW_WATER: usize = 128 << 10;
/// The bytes a session keeps on their way by default before it holds bulk
/// (see [`MuxSession::set_bulk_budget`](super::MuxSession::set_bulk_budget)).
/// On loopback with 15 channels saturating (`ferry bench demux`, busy
/// machine), 256 KiB cut the priority round trip to about a quarter of
/// what it was without a budget, at no loss of throughput; 160 KiB cost
/// throughput in some rounds, 384 KiB and 1 MiB lengthened the round
/// trip about in proportion.
pub const BULK_BUDGET: usize = 256 << 10;
/// A receiver reports the bytes it has read from the connection whenever
/// this many more were read since its last report (a read report frame).
pub const READ_REPORT_EVERY: usize = 64 << 10;
/// The smallest bulk budget: a report's worth plus the largest bulk frame,
/// so that what the peer has read and not reported yet never stops the
/// session.
pub const MIN_BULK_BUDGET: usize = READ_REPORT_EVERY + MUX_HEAD + MAX_CHUNK;
/// Frames read per poll before the polling channel gets its answer.
pub(super) const READ_FRAMES: usize = 256;

pub(super) enum RxState {
    Head { have: usize },
    Body { head: MuxHead, have: usize },
    Chunk { chan: u32, have: usize, len: usize },
}

impl Inner {
    /// Send what the socket takes now.
    pub(super) fn pump_write(&mut self) -> Result<()> {
        self.check()?;
        // Ciphertext TLS holds goes first: it is older than any frame.
        if let Some(t) = &mut self.tls {
            let before = t.written();
            if t.flush(self.stream.as_fd()).is_err() {
                return Err(self.fail(ErrorKind::PeerGone.into(), true));
            }
            if t.written() != before {
                let now = Instant::now();
                self.last_tx = now;
                self.last_progress = now;
            }
        }
        loop {
            if self.wire.is_empty() {
                if self.ctrl.is_empty() && !self.chans.values().any(Chan::ready) {
                    return Ok(());
                }
                self.last_progress = Instant::now();
            }
            self.schedule();
            if self.wire.is_empty() {
                return Ok(());
            }
            let sent = {
                let ready = self.ready_frames();
                let mut parts: Vec<SendPart<'_>> = Vec::with_capacity(2 * ready);
                let mut skip = self.wire_sent;
                for f in self.wire.iter().take(ready) {
                    if skip < f.head.len() {
                        parts.push(SendPart::slice(&f.head[skip..]));
                        skip = 0;
                    } else {
                        skip -= f.head.len();
                    }
                    if let Some(p) = &f.payload {
                        parts.push(
                            SendPart::mapping(&p.pool.map, p.offset + skip, p.len - skip).expect("chunk in range"),
                        );
                    }
                    skip = 0;
                }
                match &mut self.tls {
                    None => sys::send_parts(self.stream.as_fd(), &parts),
                    Some(t) => t.send_parts(self.stream.as_fd(), &parts),
                }
            };
            let mut n = match sent {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(self.fail(ErrorKind::PeerGone.into(), true)),
            };
            let now = Instant::now();
            self.last_tx = now;
            self.last_progress = now;
            self.counters.bytes_sent += n as u64;
            while n > 0 {
                let left = self.wire.front().expect("sent bytes are queued").len() - self.wire_sent;
                if n < left {
                    self.wire_sent += n;
                    break;
                }
                n -= left;
                self.wire_sent = 0;
                self.wire.pop_front();
            }
        }
    }

    /// Keep-alives and the peer's liveness.
    pub(super) fn tick(&mut self) -> Result<()> {
        self.check()?;
        let now = Instant::now();
        let timeout = self.options.peer_timeout;
        if now.duration_since(self.last_rx) > timeout {
            return Err(self.fail(ErrorKind::PeerUnresponsive(timeout).into(), true));
        }
        let busy = self.wants_write();
        if busy && now.duration_since(self.last_progress) > timeout {
            return Err(self.fail(ErrorKind::PeerUnresponsive(timeout).into(), true));
        }
        if !busy && now.duration_since(self.last_tx) > self.keepalive {
            self.queue_ctrl(K_KEEPALIVE, 0, Vec::new(), 0)?;
            self.pump_write()?;
        }
        Ok(())
    }

    /// Watch the socket in `wake` (for writing too if output is queued):
    /// the deadline to wake at for keep-alives and liveness, `None` if
    /// something is ready now. `watching` is what `wake` watches the socket
    /// for already (`None`: unknown), kept up to date: an unchanged
    /// interest costs no system call.
    pub(super) fn arm_socket(&mut self, wake: &WakeSet, watching: &mut Option<Interest>) -> Option<Instant> {
        if self.gone.is_some() || self.pump_write().is_err() || self.tick().is_err() {
            return None;
        }
        // Bytes TLS took off the socket and has not given out: the socket
        // will not say so again.
        if self.tls.as_ref().is_some_and(|t| t.has_input()) {
            return None;
        }
        let out = self.wants_write();
        let interest = if out { Interest::ReadWrite } else { Interest::Read };
        if *watching != Some(interest) {
            *watching = None;
            if wake.watch(self.stream.as_fd(), interest).is_err() {
                return None;
            }
            *watching = Some(interest);
        }
        let timeout = self.options.peer_timeout;
        let ours = if out { self.last_progress + timeout } else { self.last_tx + self.keepalive };
        // Rounded up to a grain of the timeout, so that the deadline (the
        // channel's timer) moves only now and then, not with every frame.
        let at = ours.min(self.last_rx + timeout) + Duration::from_millis(1);
        let grain = (timeout / 32).max(Duration::from_millis(1)).as_nanos();
        let since = at.saturating_duration_since(self.epoch).as_nanos();
        let rounded = since.div_ceil(grain) * grain;
        Some(self.epoch + Duration::from_nanos(u64::try_from(rounded).unwrap_or(u64::MAX)))
    }

    /// Read frames until the socket is dry, a bounded number was read, or
    /// (with `want`) that channel has a message or one of a higher priority
    /// got one. Then queue a report of what was read if one is due, and
    /// write what a report from the peer let go. A report is written here
    /// only when an earlier one still waits: else it goes out with the next
    /// write (a reply the application sends, or the write of a poll that
    /// finds nothing, of an `arm` or a flush), one system call and one
    /// wake-up of the peer.
    pub(super) fn pump_read(&mut self, want: Option<u32>) -> Result<()> {
        let reported = self.counters.bytes_reported_read;
        let read = self.read_frames(want);
        if self.gone.is_some() {
            return read;
        }
        let unreported = self.counters.bytes_received - self.counters.bytes_reported_to_peer;
        let report = unreported >= READ_REPORT_EVERY as u64;
        // A report waits behind no other: a reader that writes nothing
        // keeps its peer at most one report short.
        let mut write = false;
        if report {
            write = self.ctrl_waiting(K_READ, 0);
            let n = u32::try_from(unreported).unwrap_or(u32::MAX);
            self.counters.bytes_reported_to_peer += u64::from(n);
            self.queue_ctrl(K_READ, 0, Vec::new(), n)?;
        }
        if write || (self.counters.bytes_reported_read != reported && self.has_output()) {
            self.pump_write()?;
        }
        read
    }

    /// [`Inner::pump_read`]'s reading.
    fn read_frames(&mut self, want: Option<u32>) -> Result<()> {
        self.check()?;
        // A message for a channel of higher priority than the one reading
        // ends the read: its reader hears of it (its doorbell rang) while
        // this one's application is not left reading on for it.
        let mine = want.and_then(|id| self.chans.get(&id)).map(|c| c.priority);
        self.landed = None;
        for _ in 0..READ_FRAMES {
            if want.is_some_and(|id| self.chans.get(&id).is_some_and(|c| !c.inq.is_empty())) {
                return Ok(());
            }
            if mine.is_some() && self.landed > mine {
                return Ok(());
            }
            match self.read_frame() {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(e) if matches!(e.kind(), ErrorKind::Protocol(_) | ErrorKind::Tls(_)) => {
                    return Err(self.fail(e, false))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Read one frame (or what of it is there): `false` when the socket is dry.
    pub(super) fn read_frame(&mut self) -> Result<bool> {
        loop {
            // A body or chunk is read together with the next frame's
            // header (never payload: it may go into our own memory), so a
            // stream of frames costs one system call per frame.
            let next = RecvPart::slice(&mut self.next[..]);
            let got = match &self.rx {
                // A whole header read ahead: nothing to read.
                RxState::Head { have: MUX_HEAD } => Ok(usize::MAX),
                RxState::Head { have } => {
                    let have = *have;
                    recv_into(&mut self.tls, self.stream.as_fd(), &mut [RecvPart::slice(&mut self.head[have..])])
                }
                RxState::Body { head, have } => {
                    let (len, have) = (head.len as usize, *have);
                    recv_into(
                        &mut self.tls,
                        self.stream.as_fd(),
                        &mut [RecvPart::slice(&mut self.body[have..len]), next],
                    )
                }
                RxState::Chunk { chan, have, len } => {
                    let (id, have, len) = (*chan, *have, *len);
                    let inc = self.chans.get(&id).and_then(|c| c.incoming.as_ref()).expect("chunk of a message");
                    match (inc.target, &inc.pool) {
                        (Target::Land, Some(pool)) => {
                            let at = inc.offset + inc.got + have;
                            let part = RecvPart::mapping(&pool.map, at, len - have).expect("checked range");
                            recv_into(&mut self.tls, self.stream.as_fd(), &mut [part, next])
                        }
                        _ => {
                            self.scratch.resize(MAX_CHUNK, 0);
                            let part = RecvPart::slice(&mut self.scratch[..len - have]);
                            recv_into(&mut self.tls, self.stream.as_fd(), &mut [part, next])
                        }
                    }
                }
            };
            let n = match got {
                Ok(usize::MAX) => 0,
                Ok(0) => return Err(self.stream_ended()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.dry = true;
                    return Ok(false);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // A record that failed its authentication, or a TLS
                // alert: like a malformed frame, whoever sent it.
                Err(e) => match crate::tls::failure(&e) {
                    Some(e) => return Err(self.fail(e, false)),
                    None => return Err(self.stream_ended()),
                },
            };
            self.dry = false;
            self.last_rx = Instant::now();
            self.counters.bytes_received += n as u64;
            match self.rx {
                RxState::Head { have } => {
                    if have + n < MUX_HEAD {
                        self.rx = RxState::Head { have: have + n };
                        continue;
                    }
                    let head = MuxHead::decode(&self.head)?;
                    if head.len == 0 {
                        self.rx = RxState::Head { have: 0 };
                        self.frame(head)?;
                        return Ok(true);
                    }
                    if head.kind == K_CHUNK {
                        self.start_chunk(head)?;
                    } else {
                        self.rx = RxState::Body { head, have: 0 };
                    }
                }
                RxState::Body { head, have } => {
                    if have + n < head.len as usize {
                        self.rx = RxState::Body { head, have: have + n };
                        continue;
                    }
                    self.read_ahead(have + n - head.len as usize);
                    self.frame(head)?;
                    return Ok(true);
                }
                RxState::Chunk { chan, have, len } => {
                    if have + n < len {
                        self.rx = RxState::Chunk { chan, have: have + n, len };
                        continue;
                    }
                    self.read_ahead(have + n - len);
                    self.end_chunk(chan, len);
                    return Ok(true);
                }
            }
        }
    }

    /// A frame is complete and `extra` bytes of the next header came with
    /// it: they start the next header.
    pub(super) fn read_ahead(&mut self, extra: usize) {
        self.head[..extra].copy_from_slice(&self.next[..extra]);
        self.rx = RxState::Head { have: extra };
    }

    pub(super) fn stream_ended(&mut self) -> Error {
        if self.goodbye_seen {
            return self.fail(ErrorKind::PeerGone.into(), false);
        }
        self.fail(ErrorKind::PeerGone.into(), true)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.gone.is_some() {
            return;
        }
        // The last handle is gone: what is queued, then goodbye.
        let _ = self.queue_ctrl(K_GOODBYE, 0, Vec::new(), 0);
        let deadline = Instant::now() + CLOSE_FLUSH.min(self.options.peer_timeout);
        while self.pump_write().is_ok() && self.has_output() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            let _ = poll_out(&self.stream, self.wants_write(), left);
            // Read reports let held bulk go.
            if self.pump_read(None).is_err() {
                break;
            }
        }
        // TLS: close_notify after the goodbye.
        if let (Some(t), None) = (&mut self.tls, &self.gone) {
            t.close(self.stream.as_fd());
            while t.wants_write() && t.flush(self.stream.as_fd()).is_ok() {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
                let _ = poll_out(&self.stream, true, left);
            }
        }
        let _ = self.stream.shutdown(Shutdown::Write);
        let mut sink = [0u8; 4096];
        while matches!((&self.stream).read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// Receive into `parts`: by the kernel straight into them, or decrypted
/// by TLS.
fn recv_into(tls: &mut Option<Box<TlsSession>>, fd: BorrowedFd<'_>, parts: &mut [RecvPart<'_>]) -> io::Result<usize> {
    match tls {
        None => sys::recv_parts(fd, parts),
        Some(t) => t.recv_parts(fd, parts),
    }
}

/// Wait until `stream` is readable, or writable as well if `out`.
pub(super) fn poll_out(stream: &TcpStream, out: bool, timeout: Duration) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags};
    let flags = if out { PollFlags::OUT | PollFlags::IN } else { PollFlags::IN };
    let mut pfd = [PollFd::from_borrowed_fd(stream.as_fd(), flags)];
    match rustix::event::poll(&mut pfd, Some(&crate::wake::timespec(timeout))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
