//! The shared-memory backend: channels between processes on one host, after
//! the application-device-channel idea of seeds 001/002 — the kernel takes
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
//! Setup messages (little endian), each one seqpacket datagram:
//!
//! | message | bytes | fds |
//! |---|---|---|
//! | bind request | `FRY1`, 1, role, trust (255: any), max meta u16, alignment u64, min size u64, max size u64 | binder doorbell |
//! | bind accepted | `FRY1`, 2, binder direction, binder role, creator role, trust, meta u16, queue depth u32, alignment u64, min u64, max u64 | segment, creator doorbell |
//! | bind refused | `FRY1`, 3, reason | — |
//! | pool | `FRY1`, 4, pool id u128, buffer size u64, buffer count u32 | pool memfd |

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::uds::{self, Conn, Listener, UnixName};
use super::{Link, Pending, PendingSetup, SetupDone};
use crate::channel::{negotiate, BindParams, ChannelConstraints, ChannelSetup, Direction, Negotiated, Role};
use crate::error::{Error, Result};
use crate::pool::{Geometry, PoolId, PoolMemory, TrustLevel};
use crate::proto::{self, Message};
use crate::ring::{self, Consumer, Producer, RingError, RingLayout, RingMemory, PUBLISH_EVERY};
use crate::sys::{self, Mapping};

/// How long a waiting end spins before it sleeps (a cross-core wake-up
/// costs ≈ 50 µs on the machines measured, DESIGN.md §3).
const SPIN: Duration = Duration::from_micros(20);
/// How often a busy-polling end checks that the peer still exists.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);
/// Empty polls between two looks at the clock for that check (reading the
/// clock on every empty poll cost 10% of a busy echo's time).
const CLOCK_EVERY: u32 = 64;
/// How long setup steps that the peer must answer at once may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

const MAGIC: &[u8; 4] = b"FRY1";
const KIND_BIND: u8 = 1;
const KIND_ACCEPT: u8 = 2;
const KIND_REFUSE: u8 = 3;
const KIND_POOL: u8 = 4;

/// Why a creator refused a bind: the strings of `negotiate`, by code.
const REASONS: [&str; 3] = [
    "the binder requires another trust level",
    "the binder cannot take the channel's meta size",
    "both ends want the same role",
];

/// An endpoint for channels between processes: a Unix socket name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmEndpoint {
    name: UnixName,
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

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        if setup.trust == TrustLevel::None {
            return Err(Error::TrustNotSupported { trust: TrustLevel::None, backend: "shm" });
        }
        let listener = Listener::bind(&self.name).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => Error::EndpointInUse,
            _ => Error::from(e),
        })?;
        Ok(Box::new(CreatorPending { listener: Some(listener), setup: *setup, conn: None }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        let conn = Conn::connect(&self.name).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => Error::EndpointNotListening,
            _ => Error::from(e),
        })?;
        let bell = uds::doorbell()?;
        let mut w = Wire::new(KIND_BIND);
        w.u8(role_code(params.role));
        w.u8(params.trust.map_or(255, TrustLevel::to_u8));
        w.u16(params.max_meta_size.min(usize::from(u16::MAX)) as u16);
        w.constraints(&params.constraints);
        conn.send(&w.0, &[bell.as_fd()])?;
        Ok(Box::new(BinderPending { conn: Some(conn), bell: Some(bell) }))
    }
}

// ------------------------------------------------------------ wire helpers

struct Wire(Vec<u8>);

impl Wire {
    fn new(kind: u8) -> Wire {
        let mut v = MAGIC.to_vec();
        v.push(kind);
        Wire(v)
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn constraints(&mut self, c: &ChannelConstraints) {
        self.u64(c.alignment as u64);
        self.u64(c.min_buffer_size as u64);
        self.u64(c.max_buffer_size as u64);
    }
}

/// Reads a setup message; every shortfall is a protocol error.
struct Reader<'a>(&'a [u8]);

fn bad(what: &str) -> Error {
    Error::Protocol(format!("setup message: {what}"))
}

impl<'a> Reader<'a> {
    fn open(buf: &'a [u8]) -> Result<(u8, Reader<'a>)> {
        if buf.len() < 5 || &buf[..4] != MAGIC {
            return Err(bad("bad magic or version"));
        }
        Ok((buf[4], Reader(&buf[5..])))
    }
    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        if self.0.len() < N {
            return Err(bad("truncated"));
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        Ok(a.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).map_err(|_| bad("value out of range"))
    }
    fn u128(&mut self) -> Result<u128> {
        Ok(u128::from_le_bytes(self.take()?))
    }
    fn constraints(&mut self) -> Result<ChannelConstraints> {
        let c = ChannelConstraints {
            alignment: self.usize()?,
            min_buffer_size: self.usize()?,
            max_buffer_size: self.usize()?,
        };
        if c.alignment != 0 && !c.alignment.is_power_of_two() {
            return Err(bad("alignment not a power of two"));
        }
        Ok(c)
    }
    fn role(&mut self) -> Result<Role> {
        Ok(match self.u8()? {
            0 => Role::Generic,
            1 => Role::Master,
            2 => Role::Slave,
            _ => return Err(bad("bad role")),
        })
    }
    fn direction(&mut self) -> Result<Direction> {
        Ok(match self.u8()? {
            0 => Direction::Tx,
            1 => Direction::Rx,
            _ => return Err(bad("bad direction")),
        })
    }
    fn trust(&mut self) -> Result<TrustLevel> {
        TrustLevel::from_u8(self.u8()?).filter(|t| *t != TrustLevel::Uninitialized).ok_or_else(|| bad("bad trust"))
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Generic => 0,
        Role::Master => 1,
        Role::Slave => 2,
    }
}

fn direction_code(d: Direction) -> u8 {
    match d {
        Direction::Tx => 0,
        Direction::Rx => 1,
    }
}

fn parse_bind(buf: &[u8]) -> Result<BindParams> {
    let (kind, mut r) = Reader::open(buf)?;
    if kind != KIND_BIND {
        return Err(bad("expected a bind request"));
    }
    let role = r.role()?;
    let trust = match r.u8()? {
        255 => None,
        t => Some(TrustLevel::from_u8(t).ok_or_else(|| bad("bad trust"))?),
    };
    let max_meta_size = usize::from(r.u16()?);
    let constraints = r.constraints()?;
    Ok(BindParams { role, trust, max_meta_size, constraints })
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
        RingError::Full => Error::QueueFull,
        RingError::Closed => Error::PeerGone,
        other => Error::Protocol(format!("ring: {other}")),
    }
}

// -------------------------------------------------------------------- setup

struct CreatorPending {
    /// Dropped (and its socket file removed) once a binder is accepted.
    listener: Option<Listener>,
    setup: ChannelSetup,
    /// A binder that connected and whose request has not arrived yet.
    conn: Option<Conn>,
}

impl CreatorPending {
    /// Handle one bind request: `Ok(None)` if refused (keep listening).
    fn answer(&mut self, conn: Conn, buf: &[u8], fds: Vec<OwnedFd>) -> Result<Option<SetupDone>> {
        let params = parse_bind(buf)?;
        let peer_bell = fds.into_iter().next().ok_or_else(|| bad("bind request without a doorbell"))?;
        let neg = match negotiate(&self.setup, &params) {
            Ok(neg) => neg,
            Err(why) => {
                let mut w = Wire::new(KIND_REFUSE);
                w.u8(REASONS.iter().position(|r| *r == why).map_or(255, |i| i as u8));
                let _ = conn.send(&w.0, &[]);
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
        let bell = uds::doorbell()?;
        let mut w = Wire::new(KIND_ACCEPT);
        w.u8(direction_code(neg.binder_direction));
        w.u8(role_code(neg.binder_role));
        w.u8(role_code(neg.creator_role));
        w.u8(neg.trust.to_u8());
        w.u16(neg.meta_size as u16);
        w.u32(depth);
        w.constraints(&neg.constraints);
        conn.send(&w.0, &[fd.as_fd(), bell.as_fd()])?;
        let link = ShmLink::new(tx, rx, conn, bell, peer_bell, neg.meta_size)?;
        Ok(Some((Box::new(link), neg, true)))
    }
}

impl PendingSetup for CreatorPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        if self.conn.is_none() {
            self.conn = self.listener.as_ref()?.accept().ok().flatten();
        }
        let conn = self.conn.take()?;
        let mut buf = [0u8; 128];
        match conn.recv(&mut buf, Some(Duration::ZERO)) {
            Ok(None) => {
                self.conn = Some(conn);
                None
            }
            Ok(Some((n, fds))) if n > 0 => match self.answer(conn, &buf[..n], fds) {
                Ok(Some(done)) => {
                    self.listener = None;
                    Some(Ok(done))
                }
                // Refused, or a connector that does not speak the protocol:
                // drop it and keep listening for a proper binder.
                Ok(None) | Err(Error::Protocol(_)) => None,
                Err(e) => Some(Err(e)),
            },
            // The connector went away before asking.
            Ok(Some(_)) | Err(_) => None,
        }
    }

    fn wait(&mut self, timeout: Duration) {
        let fd = match (&self.conn, &self.listener) {
            (Some(c), _) => c.as_fd(),
            (None, Some(l)) => l.as_fd(),
            (None, None) => return,
        };
        let _ = uds::wait_readable(&[fd], Some(timeout));
    }
}

struct BinderPending {
    conn: Option<Conn>,
    bell: Option<OwnedFd>,
}

impl BinderPending {
    fn finish(&mut self, buf: &[u8], fds: Vec<OwnedFd>) -> Result<SetupDone> {
        let (kind, mut r) = Reader::open(buf)?;
        match kind {
            KIND_REFUSE => {
                let why = REASONS.get(usize::from(r.u8()?)).copied().unwrap_or("refused by the creator");
                return Err(Error::BindRefused(why));
            }
            KIND_ACCEPT => {}
            _ => return Err(bad("expected a bind reply")),
        }
        let neg = Negotiated {
            binder_direction: r.direction()?,
            binder_role: r.role()?,
            creator_role: r.role()?,
            trust: r.trust()?,
            meta_size: usize::from(r.u16()?),
            constraints: ChannelConstraints::default(),
        };
        let depth = r.u32()?;
        let neg = Negotiated { constraints: r.constraints()?, ..neg };
        if neg.meta_size > proto::MAX_META_SIZE {
            return Err(bad("meta size too large"));
        }
        let mut fds = fds.into_iter();
        let (Some(seg), Some(peer_bell)) = (fds.next(), fds.next()) else {
            return Err(bad("bind reply without segment and doorbell"));
        };
        let (layout, half) = segment_geometry(neg.meta_size, depth)?;
        sys::check_sealed_size(&seg, 2 * half).map_err(|why| bad(&format!("segment: {why}")))?;
        let (a, b) = parts(sys::map_segment(&seg, 2 * half)?, half, layout);
        let rx = ring::attach_consumer(a, layout).map_err(ring_err)?;
        let tx = ring::attach_producer(b, layout).map_err(ring_err)?;
        let conn = self.conn.take().expect("polled once");
        let bell = self.bell.take().expect("polled once");
        let link = ShmLink::new(tx, rx, conn, bell, peer_bell, neg.meta_size)?;
        Ok((Box::new(link), neg, false))
    }
}

impl PendingSetup for BinderPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let mut buf = [0u8; 128];
        let got = self.conn.as_ref()?.recv(&mut buf, Some(Duration::ZERO));
        match got {
            Ok(None) => None,
            Ok(Some((0, _))) => Some(Err(Error::PeerGone)),
            Ok(Some((n, fds))) => Some(self.finish(&buf[..n], fds)),
            Err(e) => Some(Err(e.into())),
        }
    }

    fn wait(&mut self, timeout: Duration) {
        if let Some(c) = &self.conn {
            let _ = uds::wait_readable(&[c.as_fd()], Some(timeout));
        }
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
    /// Pool fds received ahead of their assignment request.
    pools: HashMap<PoolId, Arc<PoolMemory>>,
    last_liveness: Instant,
    /// Empty polls since the clock was last read.
    empty_polls: u32,
    peer_hung_up: bool,
    /// Sends are published in batches (see `Link::set_batching`).
    batching: bool,
}

impl ShmLink {
    fn new(
        tx: Producer,
        rx: Consumer,
        conn: Conn,
        bell: OwnedFd,
        peer_bell: OwnedFd,
        meta_size: usize,
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
            meta_size,
            pools: HashMap::new(),
            last_liveness: Instant::now(),
            empty_polls: 0,
            peer_hung_up: false,
            batching: false,
        })
    }

    /// Read pool offers from the socket until `want` arrives (or without
    /// waiting when `want` is `None`). Notices a hang-up.
    fn read_socket(&mut self, want: Option<PoolId>) -> Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        loop {
            if want.is_some_and(|id| self.pools.contains_key(&id)) {
                return Ok(());
            }
            let wait = match want {
                Some(_) => Some(deadline.saturating_duration_since(Instant::now())),
                None => Some(Duration::ZERO),
            };
            let mut buf = [0u8; 64];
            match self.conn.recv(&mut buf, wait)? {
                None if want.is_none() => return Ok(()),
                None => return Err(Error::Protocol("pool announced but its memory never came".into())),
                Some((0, _)) => {
                    self.peer_hung_up = true;
                    return if want.is_some() { Err(Error::PeerGone) } else { Ok(()) };
                }
                Some((n, fds)) => {
                    let (kind, mut r) = Reader::open(&buf[..n])?;
                    if kind != KIND_POOL {
                        return Err(bad("unexpected message after setup"));
                    }
                    let id = PoolId::from_u128(r.u128()?);
                    let size = r.usize()?;
                    let count = r.u32()?;
                    let geometry = Geometry::new(size, u64::from(count)).map_err(|e| bad(&e.to_string()))?;
                    let fd = fds.into_iter().next().ok_or_else(|| bad("pool message without its memfd"))?;
                    self.pools.insert(id, PoolMemory::from_peer(id, geometry, fd)?);
                }
            }
        }
    }

    /// Make the staged messages visible to the peer; ring its doorbell if
    /// it sleeps.
    fn publish(&mut self) {
        if self.tx.publish() {
            uds::ring(&self.peer_bell);
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

impl Link for ShmLink {
    fn has_room(&mut self) -> bool {
        if self.tx.free_slots() > 0 {
            return true;
        }
        // Full: whatever is held back must reach the consumer so it can
        // make room.
        self.publish();
        false
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        if self.peer_hung_up {
            return Err(Error::PeerGone);
        }
        self.tx.stage(|slot| msg.encode(slot)).map_err(ring_err)?;
        if !self.batching || self.tx.staged() >= PUBLISH_EVERY || *msg == Message::Teardown {
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

    fn recv(&mut self) -> Result<Option<Message>> {
        let meta = self.meta_size;
        if let Some(decoded) = self.rx.try_pop(|slot| Message::decode(slot, meta)).map_err(ring_err)? {
            return decoded.map(Some);
        }
        // Nothing to do here for now: what we held back goes out.
        self.publish();
        if self.peer_gone(false) {
            // Whatever the peer pushed before it went is still ours to take.
            return match self.rx.try_pop(|slot| Message::decode(slot, meta)).map_err(ring_err)? {
                Some(decoded) => decoded.map(Some),
                None => Err(Error::PeerGone),
            };
        }
        Ok(None)
    }

    fn wait(&mut self, timeout: Duration) {
        self.publish();
        let start = Instant::now();
        if self.rx.spin_for_work(SPIN.min(timeout)) {
            return;
        }
        if !self.rx.prepare_sleep() || self.peer_gone(true) {
            self.rx.cancel_sleep();
            return;
        }
        let _ =
            uds::wait_readable(&[self.bell.as_fd(), self.conn.as_fd()], Some(timeout.saturating_sub(start.elapsed())));
        self.rx.cancel_sleep();
        uds::reset(&self.bell);
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        let g = memory.geometry();
        let mut w = Wire::new(KIND_POOL);
        w.u128(memory.id().as_u128());
        w.u64(g.buffer_size() as u64);
        w.u32(g.count());
        self.conn.send(&w.0, &[memory.fd().as_fd()]).map_err(|e| match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::PIPE.raw_os_error() => Error::PeerGone,
            _ => Error::from(e),
        })
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        self.read_socket(Some(id))?;
        let memory = self.pools.remove(&id).expect("read_socket returned it");
        if memory.geometry() != geometry {
            return Err(Error::Protocol(format!("pool {id}: memory and assignment disagree on its geometry")));
        }
        Ok(memory)
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
        uds::ring(&self.peer_bell);
    }

    fn peer_can_die(&self) -> bool {
        true
    }

    fn peer_died(&mut self) -> bool {
        let Some(pidfd) = &self.peer_pidfd else { return false };
        // A pidfd polls readable once the process has exited.
        uds::wait_readable(&[pidfd.as_fd()], Some(Duration::from_millis(50))).unwrap_or(false)
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.tx.close();
        self.rx.close();
        uds::ring(&self.peer_bell);
    }
}
