//! The shared-memory backend: channels between processes on one host, after
//! the application-device-channel idea of [OS-HSC] and \[OSIRIS\] — the kernel takes
//! part only in setup; then the data path is two descriptor rings in a
//! shared segment, no system call per transfer.
//!
//! Setup runs over a Unix `SOCK_SEQPACKET` socket (a path or an abstract
//! name). The binder sends its bind request with its doorbell (an eventfd);
//! the creator negotiates, makes the segment (a sealed memfd holding the two
//! rings) and answers with the segment and its own doorbell. Afterwards the
//! socket carries only pool memfds (`SCM_RIGHTS`, sent before the assignment
//! descriptor that names them) and tells us when the peer hangs up.
//!
//! A consumer that has nothing to do spins briefly, declares itself asleep
//! in the ring and waits on its doorbell and the socket; a producer rings the
//! doorbell only when its push found the consumer asleep (OSIRIS: notify on
//! the empty → non-empty transition only).
//!
//! Setup messages (`setup_msg`), each one seqpacket datagram: the bind
//! request carries the binder's doorbell; the acceptance carries the segment
//! and the creator's doorbell; a pool announcement carries the pool's memfd.

use crate::ErrorKind;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::setup_msg::{self, bad, PoolFile};
use super::uds::{self, Conn, Listener, UnixName};
use super::unshared::{carried, UnsharedPool, WriteBack};
use super::{Landing, Link, PayloadGate, Pending, PendingSetup, SetupDone};
use crate::error::{Error, Result};
use crate::ledger::Ledger;
use crate::pool::BufferId;
use crate::pool::{Geometry, PoolId, PoolMap, PoolMemory, TrustLevel};
use crate::proto::{self, Message};
use crate::ring::{self, Consumer, Producer, RingError, RingLayout, RingMemory};
use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup, Negotiated};
use crate::sys::{self, Mapping};
use crate::wake::{self, Arm, Interest, WakeSet};

/// How often a busy-polling end checks that the peer still exists.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);
/// Empty polls between two looks at the clock for that check (reading the
/// clock on every empty poll cost 10% of a busy echo's time).
const CLOCK_EVERY: u32 = 64;
/// How long setup steps that the peer must answer at once may take (a
/// connection to a creator that sends no bind request in this time is
/// dropped).
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections a creator keeps waiting for their bind request at
/// once; one more sheds the oldest, so silent connectors cannot lock a
/// binder out.
const MAX_HALF_OPEN: usize = 8;

/// An endpoint for channels between processes: a Unix socket name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmEndpoint {
    name: UnixName,
}

/// The socket's path, or `@name` for an abstract name.
impl std::fmt::Display for ShmEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.name {
            UnixName::Path(path) => write!(f, "{}", path.display()),
            UnixName::Abstract(name) => write!(f, "@{}", String::from_utf8_lossy(name)),
        }
    }
}

impl ShmEndpoint {
    /// An endpoint named by a socket file path.
    pub fn path(path: impl Into<std::path::PathBuf>) -> Self {
        ShmEndpoint { name: UnixName::Path(path.into()) }
    }

    /// An endpoint with a Linux abstract socket name (no file).
    pub fn abstract_name(name: &str) -> Self {
        ShmEndpoint { name: UnixName::Abstract(name.as_bytes().to_vec()) }
    }

    /// The socket name, for the registry (`@name` for an abstract one).
    pub(crate) fn describe(&self) -> String {
        match &self.name {
            UnixName::Path(p) => p.display().to_string(),
            UnixName::Abstract(n) => format!("@{}", String::from_utf8_lossy(n)),
        }
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        let listener = Listener::bind(&self.name).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => ErrorKind::EndpointInUse.into(),
            _ => Error::from(e),
        })?;
        Ok(Box::new(CreatorPending { listener: Some(listener), setup: *setup, half_open: VecDeque::new() }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        let deadline = Instant::now() + params.timeout;
        let conn = Conn::connect(&self.name, params.timeout).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                ErrorKind::EndpointNotListening.into()
            }
            std::io::ErrorKind::TimedOut => ErrorKind::TimedOut.into(),
            _ => Error::from(e),
        })?;
        let bell = crate::wake::eventfd()?;
        conn.send(&setup_msg::encode_bind(params), &[bell.as_fd()]).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock => ErrorKind::TimedOut.into(),
            _ => Error::from(e),
        })?;
        conn.clear_send_timeout()?;
        Ok(Box::new(BinderPending { conn: Some(conn), bell: Some(bell), deadline, params: *params }))
    }
}

// ------------------------------------------------------------------ segment

/// The channel's shared segment: ring creator→binder, then ring
/// binder→creator, each starting on a page.
fn segment_geometry(meta_size: usize, depth: u32) -> Result<(RingLayout, usize)> {
    let layout = RingLayout::new(depth, proto::slot_size(meta_size)).map_err(|_| bad("bad queue depth"))?;
    let half = layout.region_size().next_multiple_of(sys::page_size());
    Ok((layout, half))
}

/// One ring's part of the mapped segment.
struct SegmentPart {
    map: Arc<Mapping>,
    offset: usize,
    len: usize,
}

impl RingMemory for SegmentPart {
    fn as_ptr(&self) -> *mut u8 {
        // In bounds: offset + len ≤ the mapping's length (segment_geometry).
        self.map.as_ptr().wrapping_add(self.offset)
    }
    fn len(&self) -> usize {
        self.len
    }
}

fn parts(map: Mapping, half: usize, layout: RingLayout) -> (Arc<dyn RingMemory>, Arc<dyn RingMemory>) {
    let map = Arc::new(map);
    let len = layout.region_size();
    let a: Arc<dyn RingMemory> = Arc::new(SegmentPart { map: map.clone(), offset: 0, len });
    let b: Arc<dyn RingMemory> = Arc::new(SegmentPart { map, offset: half, len });
    (a, b)
}

fn ring_err(e: RingError) -> Error {
    match e {
        RingError::Full => ErrorKind::QueueFull.into(),
        RingError::Closed => ErrorKind::PeerGone.into(),
        other => ErrorKind::Protocol(format!("ring: {other}")).into(),
    }
}

// -------------------------------------------------------------------- setup

/// A connection to the creator whose bind request has not come yet.
struct HalfOpen {
    conn: Conn,
    /// Dropped if the request has not come by then.
    deadline: Instant,
}

struct CreatorPending {
    /// Dropped (and its socket file removed) once a binder is accepted.
    listener: Option<Listener>,
    setup: ChannelSetup,
    /// Connections waiting for their bind request, oldest first (at most
    /// [`MAX_HALF_OPEN`]). Whichever request comes first is served.
    half_open: VecDeque<HalfOpen>,
}

impl CreatorPending {
    /// Handle one bind request: `Ok(None)` if refused or if the connector
    /// went away (keep listening); `Protocol` if it does not speak the
    /// protocol (drop it, keep listening).
    fn answer(&mut self, conn: Conn, buf: &[u8], fds: Vec<OwnedFd>) -> Result<Option<SetupDone>> {
        let params = setup_msg::parse_bind(buf)?;
        let peer_bell = fds.into_iter().next().ok_or_else(|| bad("bind request without a doorbell"))?;
        if uds::check_doorbell(&peer_bell).is_err() {
            let _ = conn.send(&setup_msg::encode_refuse(setup_msg::REFUSE_DOORBELL), &[]);
            return Ok(None);
        }
        let neg = match negotiate(&self.setup, &params) {
            Ok(neg) => neg,
            Err(why) => {
                let _ = conn.send(&setup_msg::encode_refuse(why), &[]);
                return Ok(None);
            }
        };
        let depth = self.setup.queue_depth;
        let (layout, half) = segment_geometry(neg.meta_size, depth)?;
        let fd = sys::memfd("ferry-channel", 2 * half)?;
        sys::seal_size(&fd)?;
        let (a, b) = parts(sys::map_segment(&fd, 2 * half)?, half, layout);
        ring::init(a.clone(), layout).map_err(ring_err)?;
        ring::init(b.clone(), layout).map_err(ring_err)?;
        let tx = ring::attach_producer(a, layout).map_err(ring_err)?;
        let rx = ring::attach_consumer(b, layout).map_err(ring_err)?;
        let bell = crate::wake::eventfd()?;
        if conn.send(&setup_msg::encode_accept(&neg, depth), &[fd.as_fd(), bell.as_fd()]).is_err() {
            // The binder went away after asking.
            return Ok(None);
        }
        let link = ShmLink::new(tx, rx, conn, bell, peer_bell, &neg, self.setup.limits)?;
        Ok(Some((Box::new(link), neg, true)))
    }

    /// Take the connections waiting on the listener (a bounded number per
    /// poll); shed the oldest beyond [`MAX_HALF_OPEN`] and those past their
    /// deadline.
    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else { return };
        // Bounded, so a flood of connections cannot keep us here.
        for _ in 0..4 * MAX_HALF_OPEN {
            let Ok(Some(conn)) = listener.accept() else { break };
            if self.half_open.len() == MAX_HALF_OPEN {
                self.half_open.pop_front();
            }
            self.half_open.push_back(HalfOpen { conn, deadline: Instant::now() + SETUP_TIMEOUT });
        }
        let now = Instant::now();
        self.half_open.retain(|h| h.deadline > now);
    }
}

impl PendingSetup for CreatorPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        self.listener.as_ref()?;
        self.accept_all();
        let mut i = 0;
        while i < self.half_open.len() {
            let mut buf = [0u8; 128];
            match self.half_open[i].conn.recv(&mut buf, Some(Duration::ZERO)) {
                Ok(None) => i += 1,
                Ok(Some((n, fds))) if n > 0 => {
                    let h = self.half_open.remove(i).expect("in range");
                    match self.answer(h.conn, &buf[..n], fds) {
                        Ok(Some(done)) => {
                            self.listener = None;
                            self.half_open.clear();
                            return Some(Ok(done));
                        }
                        // Refused, gone, or a connector that does not speak
                        // the protocol: drop it and keep listening.
                        Ok(None) => {}
                        Err(e) if matches!(e.kind(), ErrorKind::Protocol(_)) => {}
                        Err(e) => return Some(Err(e)),
                    }
                }
                // The connector went away before asking, or sent too much.
                Ok(Some(_)) | Err(_) => {
                    self.half_open.remove(i);
                }
            }
        }
        None
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(listener) = &self.listener else { return Arm::SLEEP };
        super::arm_listening(wake, listener.as_fd(), self.half_open.iter().map(|h| (h.conn.as_fd(), h.deadline)))
    }
}

struct BinderPending {
    conn: Option<Conn>,
    bell: Option<OwnedFd>,
    /// The creator must have answered by then ([`BindParams::timeout`]).
    deadline: Instant,
    params: BindParams,
}

impl BinderPending {
    fn finish(&mut self, buf: &[u8], fds: Vec<OwnedFd>) -> Result<SetupDone> {
        let (neg, depth) = setup_msg::parse_reply(buf)?;
        check_reply(&self.params, &neg)?;
        let mut fds = fds.into_iter();
        let (Some(seg), Some(peer_bell)) = (fds.next(), fds.next()) else {
            return Err(bad("bind reply without segment and doorbell"));
        };
        uds::check_doorbell(&peer_bell).map_err(|why| bad(&why))?;
        let (layout, half) = segment_geometry(neg.meta_size, depth)?;
        sys::check_sealed_size(&seg, 2 * half).map_err(|why| bad(&format!("segment: {why}")))?;
        let (a, b) = parts(sys::map_segment(&seg, 2 * half)?, half, layout);
        let rx = ring::attach_consumer(a, layout).map_err(ring_err)?;
        let tx = ring::attach_producer(b, layout).map_err(ring_err)?;
        let conn = self.conn.take().expect("polled once");
        let bell = self.bell.take().expect("polled once");
        let link = ShmLink::new(tx, rx, conn, bell, peer_bell, &neg, self.params.limits)?;
        Ok((Box::new(link), neg, false))
    }
}

impl PendingSetup for BinderPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let mut buf = [0u8; 128];
        let got = self.conn.as_ref()?.recv(&mut buf, Some(Duration::ZERO));
        let done = match got {
            Ok(None) if Instant::now() < self.deadline => return None,
            Ok(None) => Err(ErrorKind::TimedOut.into()),
            Ok(Some((0, _))) => Err(ErrorKind::PeerGone.into()),
            Ok(Some((n, fds))) => self.finish(&buf[..n], fds),
            Err(e) => Err(e.into()),
        };
        self.conn = None;
        Some(done)
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(c) = &self.conn else { return Arm::SLEEP };
        if wake.watch(c.as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        Arm::Sleep { until: Some(self.deadline) }
    }
}

// --------------------------------------------------------------------- link

/// One end of a shared-memory channel.
pub(crate) struct ShmLink {
    tx: Producer,
    rx: Consumer,
    conn: Conn,
    /// Our doorbell: the peer rings it when we sleep and it sends.
    bell: OwnedFd,
    peer_bell: OwnedFd,
    /// Readable once the peer process has exited.
    peer_pidfd: Option<OwnedFd>,
    meta_size: usize,
    /// Pool fds received ahead of the descriptor that needs them.
    pools: HashMap<PoolId, Arc<PoolMemory>>,
    /// Trust NONE: pool ledgers received ahead of the pool's offer.
    ledgers: HashMap<PoolId, Ledger>,
    /// Trust NONE: no memory is shared writable. Each side keeps its own
    /// memory of every pool and gives the peer only a read-only fd of it
    /// (sealed against new writers); a buffer that arrives is copied from
    /// the peer's memory into ours before it is delivered.
    untrusted: bool,
    /// Trust NONE: the pools on this channel, ours and the peer's memory.
    copy_pools: PoolMap<UnsharedPool>,
    /// Trust FULL, HALF: pools the peer has in other memory than ours.
    write_back: WriteBack,
    last_liveness: Instant,
    /// Empty polls since the clock was last read.
    empty_polls: u32,
    peer_hung_up: bool,
    /// Sends are published in batches (see `Link::set_batching`).
    batching: bool,
    /// A message came from the peer since our last publication: it is
    /// likely waiting for what we send next (see `send`).
    received_since_publish: bool,
    /// What the peer may make us take on: pool files beyond these are not
    /// taken from the socket's message (their fds are closed at once).
    limits: crate::setup::ChannelLimits,
    /// Pools whose offer the library vetoed before their file was read:
    /// that file is dropped when it comes (at most `max_peer_pools` ids).
    discarded: VecDeque<PoolId>,
}

impl ShmLink {
    fn new(
        tx: Producer,
        rx: Consumer,
        conn: Conn,
        bell: OwnedFd,
        peer_bell: OwnedFd,
        neg: &Negotiated,
        limits: crate::setup::ChannelLimits,
    ) -> Result<Self> {
        let peer_pidfd = conn
            .peer_pid()
            .ok()
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        Ok(ShmLink {
            tx,
            rx,
            conn,
            bell,
            peer_bell,
            peer_pidfd,
            meta_size: neg.meta_size,
            pools: HashMap::new(),
            ledgers: HashMap::new(),
            untrusted: neg.trust == TrustLevel::None,
            copy_pools: PoolMap::default(),
            write_back: WriteBack::default(),
            last_liveness: Instant::now(),
            empty_polls: 0,
            peer_hung_up: false,
            batching: false,
            received_since_publish: false,
            limits,
            discarded: VecDeque::new(),
        })
    }

    /// Read pool files from the socket until `want` arrives (or without
    /// waiting when `want` is `None`). Notices a hang-up.
    fn read_socket(&mut self, want: Option<(PoolFile, PoolId)>) -> Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        loop {
            let arrived = |link: &Self, (file, id): (PoolFile, PoolId)| match file {
                PoolFile::Memory => link.pools.contains_key(&id),
                PoolFile::Ledger => link.ledgers.contains_key(&id),
            };
            if want.is_some_and(|w| arrived(self, w)) {
                return Ok(());
            }
            let wait = match want {
                Some(_) => Some(deadline.saturating_duration_since(Instant::now())),
                None => Some(Duration::ZERO),
            };
            let mut buf = [0u8; 64];
            match self.conn.recv(&mut buf, wait)? {
                None if want.is_none() => return Ok(()),
                None => return Err(ErrorKind::Protocol("pool announced but its memory never came".into()).into()),
                Some((0, _)) => {
                    self.peer_hung_up = true;
                    return if want.is_some() { Err(ErrorKind::PeerGone.into()) } else { Ok(()) };
                }
                Some((n, fds)) => {
                    let (file, id, geometry) = setup_msg::parse_pool(&buf[..n])?;
                    if !self.take_pool_file(id, geometry, want)? {
                        continue;
                    }
                    let mut fds = fds.into_iter();
                    let fd = fds.next().ok_or_else(|| bad("pool message without its memfd"))?;
                    match file {
                        PoolFile::Memory => {
                            let ledger = fds.next().map(|l| Ledger::from_peer(l, geometry.count())).transpose()?;
                            self.pools.insert(id, PoolMemory::from_peer(id, geometry, fd, ledger)?);
                        }
                        PoolFile::Ledger => {
                            self.ledgers.insert(id, Ledger::from_peer(fd, geometry.count())?);
                        }
                    }
                }
            }
        }
    }

    /// Whether to keep the file of pool `id` that just came (its fds are
    /// closed otherwise): not one whose offer was vetoed already, and none
    /// beyond the channel's limits — neither larger than all the peer's
    /// pools may be, nor more files held than the peer may have pools.
    /// Such an offer is vetoed when it comes; an error if it is `want`.
    fn take_pool_file(&mut self, id: PoolId, geometry: Geometry, want: Option<(PoolFile, PoolId)>) -> Result<bool> {
        if let Some(pos) = self.discarded.iter().position(|d| *d == id) {
            self.discarded.remove(pos);
            return Ok(false);
        }
        let limits = self.limits;
        let over = if geometry.len() > limits.max_peer_bytes {
            Some(ErrorKind::LimitExceeded {
                what: "bytes of pools assigned by the peer",
                limit: limits.max_peer_bytes as u64,
            })
        } else if self.pools.len() + self.ledgers.len() >= limits.max_peer_pools {
            Some(ErrorKind::LimitExceeded { what: "pools assigned by the peer", limit: limits.max_peer_pools as u64 })
        } else {
            None
        };
        match over {
            Some(e) if want.is_some_and(|(_, w)| w == id) => Err(e.into()),
            Some(_) => Ok(false),
            None => Ok(true),
        }
    }

    /// Send one of a pool's files ahead of the descriptor that needs it.
    fn send_pool(&mut self, file: PoolFile, memory: &PoolMemory, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let msg = setup_msg::encode_pool(file, memory.id(), memory.geometry());
        self.conn.send(&msg, fds).map_err(|e| match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::PIPE.raw_os_error() => ErrorKind::PeerGone.into(),
            _ => Error::from(e),
        })
    }

    /// The peer's memory of pool `id`, sent ahead of what needs it.
    fn peer_memory(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        self.read_socket(Some((PoolFile::Memory, id)))?;
        let memory = self.pools.remove(&id).expect("read_socket returned it");
        if memory.geometry() != geometry {
            return Err(
                ErrorKind::Protocol(format!("pool {id}: memory and assignment disagree on its geometry")).into()
            );
        }
        Ok(memory)
    }

    /// Trust NONE: the ledger of pool `id`, sent ahead of its offer.
    fn peer_ledger(&mut self, id: PoolId) -> Result<Ledger> {
        self.read_socket(Some((PoolFile::Ledger, id)))?;
        Ok(self.ledgers.remove(&id).expect("read_socket returned it"))
    }

    /// Trust NONE: put `memory` (ours) on the link. A pool offered again
    /// after a veto may come with new memory of ours (the domain dropped
    /// the old): copies must land in the memory the domain now maps.
    fn add_copy_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        let old = self.copy_pools.get(&memory.id());
        if old.is_some_and(|p| Arc::ptr_eq(&p.memory, memory)) {
            return Ok(());
        }
        let mut pool = UnsharedPool::untrusted(memory)?;
        // The peer's memory is the same as before; ours is new to the peer.
        if let Some(old) = self.copy_pools.remove(&memory.id()) {
            pool.take_peer_from(old);
        }
        self.copy_pools.insert(memory.id(), pool);
        Ok(())
    }

    /// Trust NONE: before the first buffer of `pool` goes to the peer, give
    /// the peer a read-only fd of our memory of it. Not earlier: sealing the
    /// memory against new writers cannot be undone, and only an accepted
    /// assignment fixes the pool's trust for good (an offer may be vetoed,
    /// and the pool may then go to a channel of another trust).
    fn share(&mut self, pool: PoolId) -> Result<()> {
        let Some(p) = self.copy_pools.get_mut(&pool) else {
            return Err(ErrorKind::Protocol(format!("buffer of pool {pool} which is not on this link")).into());
        };
        if p.shared {
            return Ok(());
        }
        let memory = p.memory.clone();
        let fd = memory.read_only_fd()?;
        self.send_pool(PoolFile::Memory, &memory, &[fd.as_fd()])?;
        self.copy_pools.get_mut(&pool).expect("looked up above").shared = true;
        Ok(())
    }

    /// Trust NONE: copy buffer `buf` from the peer's memory into ours (the
    /// channel's gate has admitted it: on the channel, in range, not a
    /// buffer this domain owns or reads).
    fn copy_in(&mut self, buf: BufferId) -> Result<()> {
        let Some(pool) = self.copy_pools.get(&buf.pool) else {
            return Err(ErrorKind::Protocol(format!("buffer of pool {} which is not on this channel", buf.pool)).into());
        };
        if !pool.has_peer() {
            // The peer sent its read-only fd ahead of the first buffer of
            // the pool it sent us.
            let memory = self.peer_memory(buf.pool, pool.memory.geometry())?;
            self.copy_pools.get_mut(&buf.pool).expect("looked up above").set_peer(&memory)?;
        }
        // Our memory is sealed against every writer but us; what is
        // delivered is our copy, which the peer cannot change.
        self.copy_pools[&buf.pool].copy_in(buf.index)
    }

    /// Make the staged messages visible to the peer; ring its doorbell if
    /// it sleeps.
    fn publish(&mut self) {
        self.received_since_publish = false;
        if self.tx.publish() {
            wake::ring(&self.peer_bell);
        }
    }

    /// Whether the peer is gone (socket hung up), checked at most every
    /// [`LIVENESS_EVERY`] unless `now`.
    fn peer_gone(&mut self, now: bool) -> bool {
        if self.peer_hung_up || self.rx.peer_closed() {
            return true;
        }
        if !now {
            self.empty_polls += 1;
            if self.empty_polls < CLOCK_EVERY {
                return false;
            }
        }
        self.empty_polls = 0;
        if now || self.last_liveness.elapsed() >= LIVENESS_EVERY {
            self.last_liveness = Instant::now();
            if self.conn.hung_up() {
                // Pick up any pool offers still queued before the EOF.
                let _ = self.read_socket(None);
                self.peer_hung_up = true;
            }
        }
        self.peer_hung_up
    }
}

impl ShmLink {
    /// A message from the ring, before it goes up: under trust NONE a
    /// buffer's bytes are copied into our memory first (unless the gate
    /// says we hold them already). By reference: the message goes up as
    /// it came (moving it through here and back cost a copy of it).
    fn land(&mut self, msg: &Message, gate: &mut dyn PayloadGate) -> Result<()> {
        if !self.untrusted {
            return self.write_back.arrive(msg, gate);
        }
        if let Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. } = msg {
            if gate.admit(msg)? == Landing::Land {
                self.copy_in(*buf)?;
            }
        }
        Ok(())
    }
}

impl Link for ShmLink {
    fn queued(&mut self) -> Option<usize> {
        Some((self.tx.capacity() - self.tx.free_slots_now()) as usize)
    }

    fn peer(&self) -> String {
        self.conn.peer_pid().map(|pid| format!("pid {}", pid.as_raw_nonzero())).unwrap_or_default()
    }

    fn has_room(&mut self) -> bool {
        if self.tx.free_slots() > 0 {
            return true;
        }
        // Full: whatever is held back must reach the consumer so it can
        // make room.
        self.publish();
        false
    }

    fn room(&mut self) -> usize {
        self.tx.free_slots_now() as usize
    }

    fn capacity(&self) -> usize {
        self.tx.capacity() as usize
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        if self.peer_hung_up {
            return Err(ErrorKind::PeerGone.into());
        }
        if self.untrusted {
            if let Some(buf) = carried(msg) {
                self.share(buf.pool)?;
            }
        } else {
            self.write_back.depart(msg)?;
        }
        self.tx.stage(|slot| msg.encode(slot)).map_err(ring_err)?;
        // A batching end still publishes at once when the peer is waiting
        // for this message: it sent us something since our last
        // publication and we have taken all we know of (request and
        // answer). Held back, the message would go out only at our next
        // empty poll, after a look at our incoming ring that costs a cache
        // miss on the round trip's path. For the same reason "all we know
        // of" takes no look: after a message found by its slot's phase
        // alone, more of a burst may be published, and the answer to the
        // burst's first message goes at once too. Within a stream we keep
        // batching after that: there the peer's messages are still coming
        // (the head we read at the second tells how many), or none came in
        // between. So the batch boundaries move with timing; the
        // application flushes before it waits elsewhere (see
        // `Channel::set_batching`).
        if super::publish_now(self.tx.staged(), self.batching, msg)
            || (self.received_since_publish && self.rx.caught_up())
        {
            self.publish();
        }
        Ok(())
    }

    fn set_batching(&mut self, on: bool) {
        self.batching = on;
        if !on {
            self.publish();
        }
    }

    fn flush(&mut self) -> Result<()> {
        self.publish();
        Ok(())
    }

    fn recv(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        let meta = self.meta_size;
        if let Some(decoded) = self.rx.try_pop(|slot| Message::decode(slot, meta)).map_err(ring_err)? {
            self.received_since_publish = true;
            if self.rx.take_room_request() {
                wake::ring(&self.peer_bell);
            }
            let msg = decoded?;
            self.land(&msg, gate)?;
            return Ok(Some(msg));
        }
        // Nothing to do here for now: what we held back goes out.
        self.publish();
        if self.peer_gone(false) {
            // Whatever the peer pushed before it went is still ours to take.
            return match self.rx.try_pop(|slot| Message::decode(slot, meta)).map_err(ring_err)? {
                Some(decoded) => {
                    let msg = decoded?;
                    self.land(&msg, gate)?;
                    Ok(Some(msg))
                }
                None => Err(ErrorKind::PeerGone.into()),
            };
        }
        Ok(None)
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        wake.watch(self.bell.as_fd(), Interest::Read)?;
        // Pool files come on the socket ahead of the descriptors that need
        // them and are read then: only its hang-up (the peer process gone)
        // wakes us.
        wake.watch(self.conn.as_fd(), Interest::HangUp)?;
        // The channel end's fd stays readable until its next arm, and the
        // setup that woke it has just left the set. Until this end arms,
        // the peer does not ring for what it sends (we have not said we
        // sleep), and it may send at once: ring our own bell, so the fd
        // stays readable until the arm that declares us asleep.
        wake::ring(&self.bell);
        Ok(())
    }

    fn unregister(&mut self, wake: &WakeSet) {
        wake.unwatch(self.bell.as_fd());
        wake.unwatch(self.conn.as_fd());
    }

    fn spin(&mut self, spin: Duration) -> bool {
        self.publish();
        self.rx.spin_for_work(spin)
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        self.arm_for_room(wake, 1)
    }

    fn arm_for_room(&mut self, _wake: &WakeSet, slots: usize) -> Arm {
        self.publish();
        // Take an old ring before asking for anything: a ring after the
        // requests (for a message or for room) stays. If none came, the
        // last wake-up (if any) may have been the socket's hang-up: look at
        // it before sleeping.
        let rung = wake::reset(&self.bell);
        let slots = u32::try_from(slots).unwrap_or(u32::MAX).max(1);
        if self.tx.free_slots() < slots && !self.tx.want_room_for(slots) {
            return Arm::Ready;
        }
        let sleep = self.rx.prepare_sleep();
        if self.rx.take_room_request() {
            wake::ring(&self.peer_bell);
        }
        if !sleep || self.peer_gone(!rung) {
            self.rx.cancel_sleep();
            return Arm::Ready;
        }
        Arm::SLEEP
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        let ledger = memory.ledger()?.fd().as_fd();
        if self.untrusted {
            // Only the ledger now; a read-only fd of the memory goes with
            // the first buffer (`share`).
            self.send_pool(PoolFile::Ledger, memory, &[ledger])?;
            return self.add_copy_pool(memory);
        }
        self.send_pool(PoolFile::Memory, memory, &[memory.fd().as_fd(), ledger])
    }

    fn discard_pool(&mut self, id: PoolId) {
        // The file was sent ahead of the offer: held already, or still in
        // the socket (then dropped when read).
        if self.pools.remove(&id).is_none() && self.ledgers.remove(&id).is_none() {
            if self.discarded.len() >= self.limits.max_peer_pools {
                self.discarded.pop_front();
            }
            self.discarded.push_back(id);
        }
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        if !self.untrusted {
            let memory = self.peer_memory(id, geometry)?;
            self.write_back.imported(&memory);
            return Ok(memory);
        }
        // Memory of our own under the pool's id, with the pool's ledger;
        // the peer's memory comes with its first buffer.
        let ledger = self.peer_ledger(id)?;
        let ours = PoolMemory::mirror(id, geometry, Some(ledger))?;
        self.add_copy_pool(&ours)?;
        Ok(ours)
    }

    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        if self.untrusted {
            // We have the pool and its ledger already.
            self.peer_ledger(memory.id())?;
            return self.add_copy_pool(memory);
        }
        // We have the pool already, maybe in other memory than the peer's
        // (one of us got it over TCP, or from another process).
        let peers = self.peer_memory(memory.id(), memory.geometry())?;
        self.write_back.offered(memory, &peers)
    }

    fn forget_pool(&mut self, id: PoolId) {
        // Trust NONE: our mapping of our memory and of the peer's. (Files
        // read ahead stay: they are for an offer still to come.)
        self.copy_pools.remove(&id);
        // Trust FULL, HALF: our mapping of the peer's other memory of it.
        self.write_back.forget(id);
    }

    fn close(&mut self, last: Vec<Message>) {
        // What fits still goes through the ring; the rest is lost with the
        // link (the peer notices the hang-up either way).
        for msg in last {
            if self.tx.free_slots() == 0 || self.send(&msg).is_err() {
                break;
            }
        }
        // Publishes what is staged, then the closed flag.
        self.tx.close();
        self.rx.close();
        wake::ring(&self.peer_bell);
    }

    fn peer_can_die(&self) -> bool {
        true
    }

    fn abandon(&mut self) -> bool {
        if !self.untrusted {
            // The peer may still be alive and writing memory we share.
            return false;
        }
        // Trust NONE: each side's memory is its own, so what we lent may
        // come back at once; the peer notices the closed rings.
        self.tx.close();
        self.rx.close();
        wake::ring(&self.peer_bell);
        self.peer_hung_up = true;
        true
    }

    fn peer_process(&self) -> Option<OwnedFd> {
        // A peer in this very process does not exit before we do.
        if self.conn.peer_pid().ok()? == rustix::process::getpid() {
            return None;
        }
        self.peer_pidfd.as_ref()?.try_clone().ok()
    }

    fn peer_died(&mut self) -> bool {
        let Some(pidfd) = &self.peer_pidfd else { return false };
        // A pidfd polls readable once the process has exited.
        wake::wait_readable(&[pidfd.as_fd()], Some(Duration::from_millis(50))).unwrap_or(false)
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.tx.close();
        self.rx.close();
        wake::ring(&self.peer_bell);
    }
}
