//! The session's shared state: channels, their queues and credit, and
//! the scheduler that picks the next frame for the wire.

use crate::ErrorKind;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::codec::{MuxHead, K_CHUNK, K_CLOSE, K_CREDIT, K_READ, MAX_CHUNK, MSG_HEAD, MUX_HEAD};
use super::demux::Incoming;
use super::wire::{RxState, BULK_BUDGET};
use super::MuxStats;
use crate::backend::{LinkStats, PayloadGate};
use crate::error::{Error, Result};
use crate::pool::{BufferId, Geometry, PoolMap, PoolMemory};
use crate::proto::{self, Message};
use crate::setup::{ChannelSetup, Negotiated};
use crate::sys::{Access, Mapping};
use crate::tls::TlsSession;
use crate::wake::Doorbell;
use crate::NetOptions;

/// Bytes committed to the wire at once (the scheduler decides again after).
pub(super) const WIRE_BYTES: usize = 4 * MAX_CHUNK;
/// Frames committed to the wire at once.
pub(super) const WIRE_FRAMES: usize = 64;
/// Bind requests kept for channel numbers nobody listens on yet.
pub(super) const MAX_UNCLAIMED: usize = 64;
/// Bytes of control frames (the session's own frames and its answers to
/// the peer: open replies, closes, credit, read reports, keep-alives)
/// that may wait for the connection before the peer is cut off with
/// [`ErrorKind::PeerBacklog`] (see [`MuxSession::set_control_limit`](super::MuxSession::set_control_limit)).
///
/// A peer that reads what it is sent never makes this end hold more than
/// a few frames per channel: credit grants and read reports waiting in
/// the queue are merged into one frame each, and the rest answers the
/// peer's opens and closes, one each. 1 MiB is the answers to some 65,000
/// opens and closes the peer did not read, on top of what both kernels
/// hold; it costs a few MiB of memory at most.
pub const CONTROL_LIMIT: usize = 1 << 20;
/// The smallest control limit: room for about fifty of the largest
/// control frames (open replies).
pub const MIN_CONTROL_LIMIT: usize = 4 << 10;
/// How long a closing channel tries to get its last frames out.
pub(super) const CLOSE_FLUSH: Duration = Duration::from_secs(2);
/// Messages a receiver takes beyond the credit it gave (its close's last
/// messages: replies and releases that bypass the queue).
pub(super) const CREDIT_SLACK: usize = 64;

// -------------------------------------------------------------- inner state

/// Hasher for maps keyed by channel number. SipHash cost about a fifth of
/// a session's instructions per idle round trip (the session looks its
/// channels up several times per frame); a Fibonacci multiply spreads the
/// small numbers applications choose over the high bits hashbrown groups
/// by. The entries are this side's own channels (the peer's opens nobody
/// listens on are bounded apart), so a peer choosing numbers gains nothing.
#[derive(Default, Clone, Copy)]
pub(super) struct ChanHasher(u64);

impl std::hash::Hasher for ChanHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than u32; fold the bytes in.
        for &b in bytes {
            self.write_u32(u32::from(b));
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0.rotate_left(5) ^ u64::from(v)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// `HashMap` keyed by channel number.
pub(super) type ChanMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<ChanHasher>>;

/// A pool as the session sees it: its own read-write mapping.
pub(super) struct LinkPool {
    pub(super) map: Mapping,
    pub(super) geometry: Geometry,
    pub(super) memory: Arc<PoolMemory>,
}

pub(super) enum ChanState {
    Listening { setup: ChannelSetup },
    Binding,
    Open,
}

/// Payload bytes in a pool: `len` bytes from `offset`.
#[derive(Clone)]
pub(super) struct Span {
    pub(super) pool: Arc<LinkPool>,
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// A message queued to go out.
pub(super) struct OutMsg {
    /// Message frame header, message header and meta.
    pub(super) head: Vec<u8>,
    pub(super) payload: Option<Span>,
    /// Sent even without credit (a closing end's last messages).
    pub(super) last: bool,
}
pub(super) struct Chan {
    pub(super) state: ChanState,
    pub(super) priority: u8,
    pub(super) meta_size: usize,
    pub(super) depth: usize,
    /// A bind request (creator) or reply (binder) that arrived.
    pub(super) setup_in: Option<Vec<u8>>,
    pub(super) pools: PoolMap<Arc<LinkPool>>,
    pub(super) gate: Option<Box<dyn PayloadGate + Send>>,
    /// Complete messages for the channel, in order; `true`: its payload landed.
    pub(super) inq: VecDeque<(Message, bool)>,
    pub(super) incoming: Option<Incoming>,
    pub(super) outq: VecDeque<OutMsg>,
    /// The payload whose chunks are going out, and how much of it went.
    pub(super) sending: Option<(Span, usize)>,
    pub(super) credit: usize,
    /// Messages our application took since the last grant.
    pub(super) consumed: usize,
    /// Messages the peer may still send (what we granted, minus what came).
    pub(super) allowed: usize,
    pub(super) bell: Doorbell,
    pub(super) armed: bool,
    /// The doorbell rang since it was last reset.
    pub(super) rung: bool,
    /// The peer closed its end (`true`: it failed).
    pub(super) peer_closed: Option<bool>,
    /// Our end closed: a close frame follows what is queued.
    pub(super) close_queued: Option<u8>,
    /// Our close frame went out.
    pub(super) close_sent: bool,
    /// The link is gone: frames for the channel are read and dropped.
    pub(super) detached: bool,
    pub(super) copied_in: HashSet<BufferId>,
    pub(super) stats: LinkStats,
}

impl Chan {
    pub(super) fn new(state: ChanState, priority: u8) -> Result<Chan> {
        Ok(Chan {
            state,
            priority,
            meta_size: 0,
            depth: 0,
            setup_in: None,
            pools: PoolMap::default(),
            gate: None,
            inq: VecDeque::new(),
            incoming: None,
            outq: VecDeque::new(),
            sending: None,
            credit: 0,
            consumed: 0,
            allowed: 0,
            bell: Doorbell::new()?,
            armed: false,
            rung: false,
            peer_closed: None,
            close_queued: None,
            close_sent: false,
            detached: false,
            copied_in: HashSet::new(),
            stats: LinkStats::default(),
        })
    }

    pub(super) fn wake(&mut self) {
        if self.armed {
            self.armed = false;
            self.rung = true;
            self.bell.ring();
        }
    }

    /// Whether the channel has messages or a payload waiting to go out
    /// (for credit, the bulk budget or the socket).
    pub(super) fn has_queued(&self) -> bool {
        self.sending.is_some() || !self.outq.is_empty()
    }

    /// Whether the channel has a frame to send now (a chunk, a message it
    /// has credit for, or its close).
    pub(super) fn ready(&self) -> bool {
        if self.sending.is_some() {
            return true;
        }
        match self.outq.front() {
            Some(m) => m.last || self.credit > 0,
            None => self.close_queued.is_some() && !self.close_sent,
        }
    }

    /// The length on the wire of the channel's next frame (when it is
    /// [`ready`](Chan::ready)).
    pub(super) fn next_len(&self) -> usize {
        match (&self.sending, self.outq.front()) {
            (Some((span, sent)), _) => MUX_HEAD + (span.len - sent).min(MAX_CHUNK),
            (None, Some(m)) => m.head.len(),
            (None, None) => MUX_HEAD,
        }
    }

    /// Whether the channel's frames are bulk: held by the session's bulk
    /// budget (priority 0, the default).
    pub(super) fn bulk(&self) -> bool {
        self.priority == 0
    }
}

/// One frame committed to the wire.
pub(super) struct WireFrame {
    pub(super) head: Vec<u8>,
    pub(super) payload: Option<Span>,
    /// The priority of the channel whose frame it is; `None`: a control
    /// frame, which nothing overtakes.
    pub(super) priority: Option<u8>,
}

impl WireFrame {
    pub(super) fn len(&self) -> usize {
        self.head.len() + self.payload.as_ref().map_or(0, |p| p.len)
    }
}

pub(super) struct Inner {
    pub(super) stream: TcpStream,
    /// The TLS state (`None`: plain TCP, straight from and into buffers).
    pub(super) tls: Option<Box<TlsSession>>,
    pub(super) options: NetOptions,
    /// How often a keep-alive goes out when nothing else does: a quarter
    /// of the shorter of the two ends' peer timeouts.
    pub(super) keepalive: Duration,
    pub(super) chans: ChanMap<Chan>,
    pub(super) unclaimed: ChanMap<Vec<u8>>,
    pub(super) ctrl: VecDeque<WireFrame>,
    /// Bytes of the frames in `ctrl`.
    pub(super) ctrl_bytes: usize,
    /// The most `ctrl_bytes` may grow to before the peer is cut off.
    pub(super) control_limit: usize,
    pub(super) wire: VecDeque<WireFrame>,
    pub(super) wire_sent: usize,
    /// Round-robin position: the channel served last.
    pub(super) last_served: u32,
    pub(super) rx: RxState,
    pub(super) head: [u8; MUX_HEAD],
    /// Header bytes of the next frame read together with a body or chunk.
    pub(super) next: [u8; MUX_HEAD],
    pub(super) body: [u8; MSG_HEAD + proto::MAX_META_SIZE],
    pub(super) scratch: Vec<u8>,
    pub(super) last_rx: Instant,
    pub(super) last_tx: Instant,
    pub(super) last_progress: Instant,
    pub(super) goodbye_seen: bool,
    /// The highest priority of the channels a message was queued for
    /// since the current read began.
    pub(super) landed: Option<u8>,
    /// The session is over: the error, and whether the peer counts as dead.
    pub(super) gone: Option<(Error, bool)>,
    /// The last read found the socket empty (nothing was read since).
    pub(super) dry: bool,
    /// When the session started: deadlines are rounded from it.
    pub(super) epoch: Instant,
    /// Bytes of bulk frames that may be on their way (committed and not
    /// yet reported read by the peer) before the next one is held.
    pub(super) budget: usize,
    /// Bytes committed to the wire so far (every frame).
    pub(super) committed: u64,
    /// The session's counters: bytes written, read, reported read by the
    /// peer and to it, and what the bulk budget did.
    pub(super) counters: MuxStats,
}

impl Inner {
    /// The session's state over `stream`, whose peer announced
    /// `peer_timeout` in its hello.
    pub(super) fn new(
        stream: TcpStream,
        tls: Option<Box<TlsSession>>,
        options: NetOptions,
        peer_timeout: Duration,
    ) -> Result<Inner> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        // Not a TCP socket (a fuzzing socket pair): nothing to bound.
        let _ = crate::sys::set_unsent_low_water(&stream, super::wire::UNSENT_LOW_WATER);
        let now = Instant::now();
        Ok(Inner {
            stream,
            tls,
            keepalive: crate::backend::net::keepalive_interval(options.peer_timeout, peer_timeout),
            options,
            chans: ChanMap::default(),
            unclaimed: ChanMap::default(),
            ctrl: VecDeque::new(),
            ctrl_bytes: 0,
            control_limit: CONTROL_LIMIT,
            wire: VecDeque::new(),
            wire_sent: 0,
            last_served: 0,
            rx: RxState::Head { have: 0 },
            head: [0; MUX_HEAD],
            next: [0; MUX_HEAD],
            body: [0; MSG_HEAD + proto::MAX_META_SIZE],
            scratch: Vec::new(),
            last_rx: now,
            last_tx: now,
            last_progress: now,
            goodbye_seen: false,
            landed: None,
            gone: None,
            dry: false,
            epoch: now,
            budget: BULK_BUDGET,
            committed: 0,
            counters: MuxStats::default(),
        })
    }

    pub(super) fn check(&self) -> Result<()> {
        match &self.gone {
            Some((e, _)) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The session is over: every channel hears of it.
    pub(super) fn fail(&mut self, e: Error, died: bool) -> Error {
        if self.gone.is_none() {
            self.gone = Some((e, died));
            let _ = self.stream.shutdown(Shutdown::Both);
            for chan in self.chans.values_mut() {
                chan.armed = true;
                chan.wake();
            }
        }
        self.gone.as_ref().expect("set").0.clone()
    }

    pub(super) fn open(&mut self, id: u32, neg: &Negotiated, depth: u32) {
        let chan = self.chans.get_mut(&id).expect("claimed");
        chan.state = ChanState::Open;
        chan.meta_size = neg.meta_size;
        chan.depth = depth as usize;
        chan.credit = depth as usize;
        chan.allowed = depth as usize;
    }

    /// Queue a control frame. A credit grant or read report right behind
    /// one of the same kind (and channel) that still waits is merged into
    /// it. Past the control limit the session fails with
    /// [`ErrorKind::PeerBacklog`]: the peer provokes frames it does not read.
    pub(super) fn queue_ctrl(&mut self, kind: u8, channel: u32, body: Vec<u8>, credit: u32) -> Result<()> {
        self.check()?;
        if self.ctrl.is_empty() && self.wire.is_empty() {
            self.last_progress = Instant::now();
        }
        if matches!(kind, K_CREDIT | K_READ) && body.is_empty() {
            if let Some(last) = self.ctrl.back_mut().filter(|f| f.head.len() == MUX_HEAD) {
                let same = last.head[0] == kind && last.head[4..8] == channel.to_le_bytes();
                let queued = u32::from_le_bytes(last.head[12..16].try_into().expect("4 bytes"));
                if let (true, Some(sum)) = (same, queued.checked_add(credit)) {
                    last.head[12..16].copy_from_slice(&sum.to_le_bytes());
                    return Ok(());
                }
            }
        }
        let head = MuxHead { credit, ..MuxHead::new(kind, channel, 0) }.frame(&body);
        self.ctrl_bytes += head.len();
        self.counters.max_control_queued = self.counters.max_control_queued.max(self.ctrl_bytes as u64);
        self.ctrl.push_back(WireFrame { head, payload: None, priority: None });
        if self.ctrl_bytes > self.control_limit {
            let e = ErrorKind::PeerBacklog { what: "control frames", limit: self.control_limit as u64 };
            return Err(self.fail(e.into(), true));
        }
        Ok(())
    }

    /// Whether a control frame of `kind` for `channel` waits for the
    /// connection (a credit grant or read report not written yet).
    pub(super) fn ctrl_waiting(&self, kind: u8, channel: u32) -> bool {
        self.ctrl.iter().any(|f| f.head[0] == kind && f.head[4..8] == channel.to_le_bytes())
    }

    /// Whether a control frame of `len` bytes that this side starts (an
    /// open) fits in the control limit now.
    pub(super) fn ctrl_room(&self, len: usize) -> bool {
        self.ctrl_bytes + len <= self.control_limit
    }

    pub(super) fn has_output(&self) -> bool {
        self.wants_write() || self.chans.values().any(Chan::ready)
    }

    /// Whether frames wait for the socket to take them (not for the
    /// scheduler, credit or the bulk budget).
    pub(super) fn wants_write(&self) -> bool {
        !self.wire.is_empty() || !self.ctrl.is_empty() || self.tls_unsent()
    }

    /// Whether TLS holds ciphertext of frames already taken off the wire
    /// queue for the socket.
    pub(super) fn tls_unsent(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    /// Bytes committed to the wire that the peer has not reported read:
    /// what is still in our wire queue, in both kernels, or read by the
    /// peer since its last report.
    pub(super) fn on_the_way(&self) -> u64 {
        self.committed - self.counters.bytes_reported_read
    }

    /// Whether the bulk budget holds a frame of `len` bytes back.
    fn held(&self, len: usize) -> bool {
        self.on_the_way() + len as u64 > self.budget as u64
    }

    /// The next channel to send from: highest priority, round-robin among
    /// equals (the first after the one served last). A bulk channel whose
    /// next frame the budget holds back is skipped.
    pub(super) fn pick(&self) -> Option<u32> {
        let mut best: Option<(u8, bool, u32)> = None;
        for (&id, chan) in &self.chans {
            if !chan.ready() || (chan.bulk() && self.held(chan.next_len())) {
                continue;
            }
            // Among equals, ids after the last served come first, then the
            // smallest id.
            let key = (chan.priority, id > self.last_served, u32::MAX - id);
            if best.is_none_or(|b| key > b) {
                best = Some(key);
            }
        }
        best.map(|(_, _, inv)| u32::MAX - inv)
    }

    /// Take the next frame of channel `id` for the wire.
    pub(super) fn take_frame(&mut self, id: u32) -> Option<WireFrame> {
        let chan = self.chans.get_mut(&id)?;
        let priority = Some(chan.priority);
        if let Some((span, sent)) = chan.sending.take() {
            let n = (span.len - sent).min(MAX_CHUNK);
            let head = MuxHead::new(K_CHUNK, id, n as u32).encode().to_vec();
            chan.stats.payload_sent += n as u64;
            chan.stats.frames_sent += 1;
            let chunk = Span { pool: span.pool.clone(), offset: span.offset + sent, len: n };
            if sent + n < span.len {
                chan.sending = Some((span, sent + n));
            }
            return Some(WireFrame { head, payload: Some(chunk), priority });
        }
        if let Some(m) = chan.outq.pop_front() {
            if !m.last {
                chan.credit -= 1;
            }
            if let Some(span) = m.payload {
                chan.sending = Some((span, 0));
            }
            chan.stats.frames_sent += 1;
            return Some(WireFrame { head: m.head, payload: None, priority });
        }
        let flags = chan.close_queued?;
        chan.close_sent = true;
        let head = MuxHead { flags, ..MuxHead::new(K_CLOSE, id, 0) }.encode().to_vec();
        if chan.detached && chan.peer_closed.is_some() {
            self.chans.remove(&id);
        }
        Some(WireFrame { head, payload: None, priority })
    }

    /// Commit frames to the wire (control first, then by priority) up to a
    /// bounded amount. A channel's frame overtakes committed frames of
    /// lower priority that have not started to go out; what counts against
    /// the bounds for it is what would still go out before it.
    pub(super) fn schedule(&mut self) {
        loop {
            if !self.ctrl.is_empty() {
                // Control frames keep their order against everything (a
                // channel's frames never go before its open reply).
                if self.committed_ahead_of(None) {
                    break;
                }
                let f = self.ctrl.pop_front().expect("not empty");
                self.ctrl_bytes -= f.len();
                self.committed += f.len() as u64;
                self.wire.push_back(f);
                continue;
            }
            let Some(id) = self.pick() else {
                if self.chans.values().any(Chan::ready) {
                    self.counters.budget_holds += 1;
                }
                break;
            };
            if self.committed_ahead_of(self.chans.get(&id).map(|c| c.priority)) {
                break;
            }
            self.last_served = id;
            let Some(f) = self.take_frame(id) else { break };
            // After the frame going out now (if one started), after every
            // control frame, and after every frame of this priority or
            // higher (this channel's own among them: its order holds).
            let floor = usize::from(self.wire_sent > 0);
            let mut at = self.wire.len();
            while at > floor && self.wire[at - 1].priority.is_some_and(|p| Some(p) < f.priority) {
                at -= 1;
            }
            if f.priority > Some(0) {
                // What this frame queues behind: everything on its way but
                // the frames it overtakes.
                let overtaken: usize = self.wire.iter().skip(at).map(WireFrame::len).sum();
                let ahead = self.on_the_way().saturating_sub(overtaken as u64);
                self.counters.max_ahead_of_priority = self.counters.max_ahead_of_priority.max(ahead);
            }
            self.committed += f.len() as u64;
            self.wire.insert(at, f);
        }
    }

    /// How many of the committed frames go to the socket now: those before
    /// the first one (not yet started) of a lower priority than a channel
    /// whose frames wait for the scheduler still (they go before it once
    /// committed), and at least one.
    pub(super) fn ready_frames(&self) -> usize {
        let Some(waiting) = self.chans.values().filter(|c| c.ready()).map(|c| c.priority).max() else {
            return self.wire.len();
        };
        let first_lower = self
            .wire
            .iter()
            .enumerate()
            .position(|(i, f)| !(i == 0 && self.wire_sent > 0) && f.priority.is_some_and(|p| p < waiting));
        first_lower.unwrap_or(self.wire.len()).max(1)
    }

    /// Whether the frames committed to the wire that would go out before a
    /// frame of `priority` (`None`: all of them) fill the commitment
    /// ([`WIRE_BYTES`], [`WIRE_FRAMES`]).
    fn committed_ahead_of(&self, priority: Option<u8>) -> bool {
        let (mut bytes, mut frames) = (0, 0);
        for (i, f) in self.wire.iter().enumerate() {
            let started = i == 0 && self.wire_sent > 0;
            if started || priority.is_none() || f.priority.is_none_or(|p| Some(p) >= priority) {
                bytes += f.len();
                frames += 1;
            }
        }
        bytes - self.wire_sent >= WIRE_BYTES || frames >= WIRE_FRAMES
    }

    /// Register a pool of channel `id`.
    pub(super) fn register(&mut self, id: u32, memory: &Arc<PoolMemory>) -> Result<()> {
        let chan = self.chans.get_mut(&id).ok_or(ErrorKind::PeerGone)?;
        if chan.pools.get(&memory.id()).is_some_and(|p| Arc::ptr_eq(&p.memory, memory)) {
            return Ok(());
        }
        let map = memory.map(Access::ReadWrite, 1)?;
        chan.pools.insert(memory.id(), Arc::new(LinkPool { map, geometry: memory.geometry(), memory: memory.clone() }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{self, Read};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    use super::super::codec::{MuxHead, K_MESSAGE, MAX_CHUNK, MUX_HEAD};
    use super::super::wire::UNSENT_LOW_WATER;
    use super::super::MuxSession;
    use crate::pool::{BufferId, Geometry, PoolId, PoolMemory};
    use crate::proto::{Message, Meta};
    use crate::sys::unsent_bytes;

    /// Bytes the peer's socket has received and its application not read.
    fn unread(stream: &TcpStream) -> usize {
        let mut value: libc::c_int = 0;
        // SAFETY: the descriptor is the live socket `stream` owns; FIONREAD
        // writes one c_int into `value`.
        let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut value) };
        assert_eq!(rc, 0, "FIONREAD: {}", io::Error::last_os_error());
        value.max(0) as usize
    }

    /// Bytes in the socket's send queue, sent or not (`SIOCOUTQ`).
    fn queued(stream: &TcpStream) -> usize {
        let mut value: libc::c_int = 0;
        // SAFETY: as above; SIOCOUTQ (= TIOCOUTQ) writes one c_int.
        let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut value) };
        assert_eq!(rc, 0, "SIOCOUTQ: {}", io::Error::last_os_error());
        value.max(0) as usize
    }

    /// Two bulk channels queue 32 MiB on a session whose peer reads
    /// nothing for a while, then a priority channel queues one message.
    /// The kernel never holds much more than the low-water mark of unsent
    /// bytes, and the priority message is on the wire ahead of every bulk
    /// chunk that had not reached the kernel when it was queued: what comes
    /// before it is what the kernel held plus at most the one frame that
    /// was half out.
    #[test]
    fn the_kernel_holds_little_and_priority_overtakes_queued_bulk() {
        const BULK: usize = 1 << 20;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut theirs = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let probe = ours.try_clone().unwrap();
        let session = MuxSession::over(ours);
        // The peer here reads without reporting: no budget, the kernel
        // alone bounds what it takes.
        session.set_bulk_budget(usize::MAX);
        let mut links = [session.open_link(1, 8, 64), session.open_link(2, 8, 64), session.open_link(3, 8, 64)];
        session.lock().chans.get_mut(&3).expect("open").priority = 7;
        let geometry = |size| Geometry::new(size, 16).unwrap();
        let pools: Vec<_> = [BULK, BULK, 4096]
            .into_iter()
            .enumerate()
            .map(|(i, size)| PoolMemory::mirror(PoolId::from_u128(i as u128 + 1), geometry(size), None).unwrap())
            .collect();
        for (link, pool) in links.iter_mut().zip(&pools) {
            link.use_pool(pool).unwrap();
        }
        let mv = |pool: usize, index: u32| Message::Move {
            buf: BufferId { pool: PoolId::from_u128(pool as u128 + 1), index },
            meta: Meta::empty(),
        };
        for index in 0..16 {
            for (i, link) in links[..2].iter_mut().enumerate() {
                link.send(&mv(i, index)).unwrap();
            }
        }
        let mut max_unsent = unsent_bytes(&probe).unwrap();
        // What the kernel holds ahead of anything queued from now on.
        let ahead = unread(&theirs) + queued(&probe);
        links[2].send(&mv(2, 0)).unwrap();
        max_unsent = max_unsent.max(unsent_bytes(&probe).unwrap());

        // The peer reads the stream (the session writes on as it drains)
        // until the priority message.
        theirs.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut stream = Vec::new();
        let mut at = 0;
        let before = loop {
            let mut chunk = [0u8; 64 << 10];
            match theirs.read(&mut chunk) {
                Ok(0) => panic!("the session ended"),
                Ok(n) => stream.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no priority message within 20 s");
                    links[0].flush().unwrap();
                    max_unsent = max_unsent.max(unsent_bytes(&probe).unwrap());
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("read: {e}"),
            }
            let mut found = None;
            while stream.len() >= at + MUX_HEAD {
                let head = MuxHead::decode(stream[at..at + MUX_HEAD].try_into().unwrap()).unwrap();
                if head.kind == K_MESSAGE && head.channel == 3 {
                    found = Some(at);
                    break;
                }
                assert_ne!(head.channel, 3, "a priority frame before its message");
                if stream.len() < at + MUX_HEAD + head.len as usize {
                    break;
                }
                at += MUX_HEAD + head.len as usize;
            }
            if let Some(before) = found {
                break before;
            }
        };
        assert!(
            max_unsent <= UNSENT_LOW_WATER + 2 * MAX_CHUNK,
            "{max_unsent} unsent bytes in the kernel (low-water mark {UNSENT_LOW_WATER})"
        );
        assert!(
            before <= ahead + MUX_HEAD + MAX_CHUNK,
            "{before} bytes of bulk before the priority message; the kernel held {ahead} when it was queued"
        );
        assert!(before < 16 * BULK, "the bulk channels were not saturating the session");
        // The peer goes first: the channels' closes need not wait for it.
        drop(theirs);
    }

    /// A session over one end of a socket pair whose other end (returned,
    /// to keep it open) never reads: what the session queues stays queued.
    fn unread_session() -> (MuxSession, std::os::unix::net::UnixStream) {
        use std::os::fd::OwnedFd;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        (MuxSession::over(TcpStream::from(OwnedFd::from(ours))), theirs)
    }

    fn credit_of(frame: &super::WireFrame) -> u32 {
        MuxHead::decode(frame.head[..MUX_HEAD].try_into().unwrap()).unwrap().credit
    }

    /// Credit grants of one channel, and read reports, that wait behind one
    /// another are one frame; closes are not merged, and past the control
    /// limit the session is cut off with `PeerBacklog` (the peer counts as
    /// dead), having queued at most one frame more than the limit.
    #[test]
    fn waiting_grants_and_reports_merge_and_the_control_queue_is_bounded() {
        use super::super::codec::{K_CLOSE, K_CREDIT, K_READ};
        use super::{CONTROL_LIMIT, MIN_CONTROL_LIMIT};
        use crate::ErrorKind;
        let (session, _theirs) = unread_session();
        assert_eq!(session.control_limit(), CONTROL_LIMIT);
        session.set_control_limit(0);
        let mut inner = session.lock();
        inner.queue_ctrl(K_CREDIT, 1, Vec::new(), 2).unwrap();
        inner.queue_ctrl(K_CREDIT, 1, Vec::new(), 3).unwrap();
        assert_eq!((inner.ctrl.len(), credit_of(&inner.ctrl[0])), (1, 5));
        inner.queue_ctrl(K_CREDIT, 2, Vec::new(), 1).unwrap();
        inner.queue_ctrl(K_READ, 0, Vec::new(), u32::MAX - 1).unwrap();
        inner.queue_ctrl(K_READ, 0, Vec::new(), 1).unwrap();
        // A sum past u32 starts a new report.
        inner.queue_ctrl(K_READ, 0, Vec::new(), 1).unwrap();
        let credits: Vec<u32> = inner.ctrl.iter().map(credit_of).collect();
        assert_eq!(credits, [5, 1, u32::MAX, 1]);
        assert_eq!(inner.ctrl_bytes, 4 * MUX_HEAD);

        let mut id = 100;
        let e = loop {
            if let Err(e) = inner.queue_ctrl(K_CLOSE, id, Vec::new(), 0) {
                break e;
            }
            id += 1;
            assert!(inner.ctrl_bytes <= MIN_CONTROL_LIMIT, "{} bytes queued", inner.ctrl_bytes);
        };
        assert_eq!(e, ErrorKind::PeerBacklog { what: "control frames", limit: MIN_CONTROL_LIMIT as u64 });
        assert_eq!(inner.ctrl_bytes, MIN_CONTROL_LIMIT + MUX_HEAD);
        assert_eq!(inner.counters.max_control_queued, (MIN_CONTROL_LIMIT + MUX_HEAD) as u64);
        assert_eq!(inner.gone, Some((e.clone(), true)), "the peer counts as dead: lent buffers come back");
        assert_eq!(inner.queue_ctrl(K_CREDIT, 1, Vec::new(), 1), Err(e));
    }

    /// This side's own opens never cut the peer off: past the control
    /// limit a bind on the session says `QueueFull`, its number stays free,
    /// and the session goes on.
    #[test]
    fn a_bind_past_the_control_limit_is_refused_and_the_session_goes_on() {
        use super::super::codec::K_CLOSE;
        use super::MIN_CONTROL_LIMIT;
        use crate::backend::Endpoint;
        use crate::BindParams;
        use crate::ErrorKind;
        let (session, _theirs) = unread_session();
        session.set_control_limit(0);
        let Endpoint::Mux(endpoint) = session.endpoint(7) else { unreachable!("a session's endpoint") };
        {
            let mut inner = session.lock();
            // The socket takes nothing more, the wire queue is full.
            let chunk = [0u8; 4096];
            while rustix::net::send(&inner.stream, &chunk, rustix::net::SendFlags::DONTWAIT).is_ok() {}
            let mut id = 100;
            while inner.ctrl_bytes + MUX_HEAD <= MIN_CONTROL_LIMIT {
                inner.queue_ctrl(K_CLOSE, id, Vec::new(), 0).unwrap();
                inner.pump_write().unwrap();
                id += 1;
            }
            assert!(!inner.ctrl_room(MUX_HEAD + 1));
        }
        assert!(matches!(
            endpoint.connect(&BindParams::default()).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::QueueFull)
        ));
        let inner = session.lock();
        assert!(inner.check().is_ok(), "the session goes on");
        assert!(!inner.chans.contains_key(&7), "the number is free again");
    }

    /// Ciphertext TLS took for the last queued frame and could not write
    /// (the socket is full): with no frame queued the session still
    /// watches its socket for writability, and the ciphertext goes out once
    /// the peer reads.
    #[test]
    fn ciphertext_held_by_tls_alone_keeps_the_session_watching_for_writability() {
        use std::os::fd::AsFd;

        use super::super::codec::K_KEEPALIVE;
        use super::super::TLS_SEND_LIMIT;
        use super::Inner;
        use crate::backend::NetOptions;
        use crate::tls::testing;
        use crate::wake::{Interest, WakeSet};

        let ((stream, tls), (mut peer, _)) = testing::pair(TLS_SEND_LIMIT);
        // Small buffers: the socket fills after a few frames.
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), 4096);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(peer.as_fd(), 4096);
        let mut inner =
            Inner::new(stream, Some(Box::new(tls)), NetOptions::default(), Duration::from_secs(10)).unwrap();
        let mut held = false;
        for _ in 0..100_000 {
            inner.queue_ctrl(K_KEEPALIVE, 0, Vec::new(), 0).unwrap();
            inner.pump_write().unwrap();
            if inner.wire.is_empty() && inner.ctrl.is_empty() && inner.tls_unsent() {
                held = true;
                break;
            }
        }
        assert!(held, "the socket never filled with the last frame's ciphertext");
        let wake = WakeSet::new().unwrap();
        let mut watching = None;
        assert!(inner.arm_socket(&wake, &mut watching).is_some());
        assert_eq!(
            watching,
            Some(Interest::ReadWrite),
            "TLS holds ciphertext: the session must wake when the socket drains"
        );
        let mut sink = vec![0u8; 64 << 10];
        loop {
            match peer.read(&mut sink) {
                Ok(n) => assert!(n > 0, "the session closed the connection"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("peer: {e}"),
            }
        }
        assert!(wake.wait(Duration::from_secs(10)), "the drained socket did not wake the session");
        inner.pump_write().unwrap();
        assert!(!inner.tls_unsent(), "the held ciphertext went out");
    }
}
