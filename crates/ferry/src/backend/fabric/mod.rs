//! The fabric backend: channels between machines over libfabric (OFI), so
//! that payloads ride the fabric a cluster runs (InfiniBand or RoCE verbs,
//! AWS EFA, HPE Slingshot, or TCP) with one-sided RMA writes
//! (feature `fabric`; docs/FABRIC.md).
//!
//! Like the TCP backend, a pool assigned over the channel is mirrored on the
//! peer (fresh memory, same id and geometry) and buffer *i* lands in the
//! peer's buffer *i*. Here each end registers every pool of the channel
//! with the fabric when it is assigned (exported, imported or reused) and
//! announces its key and base address to the peer in a key message that
//! goes before the assignment's request or answer. A move (or a pass or a
//! copy with payload) writes the buffer straight from the sender's memory
//! into the peer's buffer with `fi_writedata`, whose remote completion data
//! is a sequence number, and then sends the message itself. The receiver
//! hands a payload message up only once the write with its number has
//! completed in its queue (the bytes are in its memory then): messages are
//! ordered (FI_ORDER_SAS) and numbered by their order, so the k-th payload
//! message waits for write k. The sender never stages a payload and the
//! receiver never copies one; small messages (passes without payload,
//! releases, pool control) are sends of one slot.
//!
//! A TCP connection sets the channel up (the setup messages of every
//! backend, then each end's provider and fabric address) and then stays
//! open as the lifeline: its end without the fabric goodbye before it
//! means the peer died (its buffers come back), and TCP keep-alives find
//! a dead host.
//!
//! # Trust
//!
//! The peer writes into registered memory by itself: what it writes is
//! not checked before it lands, only the message that announces it (the
//! channel's gate then refuses a buffer it must not take, and the channel
//! fails). So the backend does not offer trust NONE, whose promise is that
//! each side has memory the other cannot write.

mod sys;
#[cfg(test)]
mod tests;

use std::collections::{HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::setup_msg;
use super::{Landing, Link, LinkStats, PayloadGate, Pending, PendingSetup, SetupDone};
use crate::error::{Error, ErrorKind, Result};
use crate::pool::{BufferId, Geometry, PoolId, PoolMap, PoolMemory, TrustLevel};
use crate::proto::{self, Message, Meta};
use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup};
use crate::sys::{Access, Mapping};
use crate::wake::{Arm, Interest, WakeSet};
use rustix::event::PollFlags;

use sys::{Completion, Contexts, Fabric, Region};

/// Size of a message slot: the frame header and the largest meta data.
const SLOT: usize = proto::HEADER + proto::MAX_META_SIZE;
const TYPE_MOVE: u8 = 1;
const TYPE_COPY: u8 = 2;
const TYPE_PASS: u8 = 3;
/// The closing end's last message.
const TYPE_GOODBYE: u8 = 11;
/// A pool's registration: key, base address, length.
const TYPE_KEY: u8 = 20;
const FLAG_PAYLOAD: u8 = 2;
/// Most receives posted, and most sends in flight.
const MAX_SLOTS: usize = 512;
/// How long a connection to a creator may take to send its bind request.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections a creator reads a bind request from at once.
const MAX_HALF_OPEN: usize = 16;
/// How long a closing end tries to get its last messages out.
const CLOSE_FLUSH: Duration = Duration::from_secs(2);
/// After the lifeline ends without a goodbye, how long the fabric may
/// still bring one (the two paths are not ordered with each other).
const GOODBYE_GRACE: Duration = Duration::from_millis(500);
/// Longest setup frame (a setup message, or a provider name and address).
const MAX_FRAME: usize = 1024;

/// Options of a fabric endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct FabricOptions {
    /// The libfabric provider (`tcp`, `verbs`, `efa`, `cxi`, `shm`, ...;
    /// layered providers such as `tcp;ofi_rxm` are picked for the RDM
    /// endpoint by themselves). `None`: the `FI_PROVIDER` environment
    /// variable, or else the first provider that fits. Both ends must end
    /// up with the same provider.
    pub provider: Option<String>,
    /// Let the setup connection and the fabric leave this host. Default
    /// `false`: an address that is not a loopback address is refused
    /// ([`ErrorKind::InsecureAddress`]), because neither the setup connection
    /// nor the fabric's traffic is encrypted; a cluster's fabric is a
    /// network its operators trust, and saying so is on purpose.
    pub cluster_network: bool,
}

impl FabricOptions {
    /// These options with `provider`.
    pub fn with_provider(self, provider: impl Into<String>) -> FabricOptions {
        FabricOptions { provider: Some(provider.into()), ..self }
    }

    /// These options for a cluster's fabric (addresses beyond loopback).
    pub fn on_cluster_network(self) -> FabricOptions {
        FabricOptions { cluster_network: true, ..self }
    }
}

/// An endpoint for channels over a fabric: the TCP address the creator's
/// setup connection listens on (the fabric address travels over it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricEndpoint {
    addr: SocketAddr,
    options: FabricOptions,
}

/// The fabric error of libfabric code `rc` in `step`.
fn fabric_error(step: &str, rc: i32) -> Error {
    ErrorKind::Fabric(format!("{step}: {}", sys::strerror(rc))).into()
}

impl FabricEndpoint {
    /// An endpoint at `addr`: `create` listens there (port 0: the kernel
    /// picks one, see [`crate::Channel::listen_addr`]), `bind` connects.
    pub fn new(addr: SocketAddr, options: FabricOptions) -> Self {
        FabricEndpoint { addr, options }
    }

    /// The setup address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn check(&self, trust: Option<TrustLevel>) -> Result<()> {
        if !self.options.cluster_network && !self.addr.ip().is_loopback() {
            return Err(ErrorKind::InsecureAddress(self.addr.ip()).into());
        }
        if trust == Some(TrustLevel::None) {
            return Err(ErrorKind::TrustNotSupported { trust: TrustLevel::None, backend: "fabric" }.into());
        }
        Ok(())
    }

    /// Open the fabric endpoint, its source the address `ip` (the setup
    /// connection's, so the fabric takes the same interface); a provider
    /// that does not know the address (its fabric is not IP-addressed)
    /// picks the source itself.
    fn open(&self, ip: IpAddr) -> Result<Fabric> {
        sys::load().map_err(ErrorKind::FabricUnavailable)?;
        let provider = self.options.provider.as_deref();
        let cq_size = 4 * MAX_SLOTS;
        if ip.is_unspecified() {
            return Fabric::open(provider, None, cq_size).map_err(|e| ErrorKind::Fabric(e).into());
        }
        Fabric::open(provider, Some(&ip.to_string()), cq_size)
            .or_else(|first| Fabric::open(provider, None, cq_size).map_err(|_| first))
            .map_err(|e| ErrorKind::Fabric(e).into())
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        self.check(Some(setup.trust))?;
        let fabric = self.open(self.addr.ip())?;
        let listener = TcpListener::bind(self.addr).map_err(|e| match e.kind() {
            io::ErrorKind::AddrInUse => ErrorKind::EndpointInUse.into(),
            _ => Error::from(e),
        })?;
        listener.set_nonblocking(true)?;
        Ok(Box::new(CreatorPending {
            listener: Some(listener),
            fabric: Some(fabric),
            setup: *setup,
            half_open: VecDeque::new(),
        }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        self.check(params.trust)?;
        let deadline = Instant::now() + params.timeout;
        let timeout = params.timeout.max(Duration::from_millis(1));
        let stream = super::net::connect_stream(self.addr, timeout)?;
        stream.set_nodelay(true)?;
        let fabric = self.open(stream.local_addr()?.ip())?;
        let mut hello = frame(&setup_msg::encode_bind(params));
        hello.extend_from_slice(&frame(&hello_body(&fabric)?));
        // Two small frames fit in any socket buffer: this write does not wait.
        stream.set_write_timeout(Some(timeout))?;
        (&stream).write_all(&hello)?;
        stream.set_nonblocking(true)?;
        Ok(Box::new(BinderPending {
            conn: Some(SetupConn { stream, buf: Vec::new(), deadline }),
            fabric: Some(fabric),
            params: *params,
        }))
    }
}

/// A setup frame: the u16 length of `body`, then `body`.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u16).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// This end's hello: the provider's name (u8 length first) and the
/// endpoint's fabric address.
fn hello_body(fabric: &Fabric) -> Result<Vec<u8>> {
    let name = fabric.name().map_err(|rc| fabric_error("fi_getname", rc))?;
    let provider = fabric.provider().as_bytes();
    let mut v = vec![provider.len().min(255) as u8];
    v.extend_from_slice(&provider[..provider.len().min(255)]);
    v.extend_from_slice(&name);
    if v.len() > MAX_FRAME {
        return Err(ErrorKind::Fabric(format!("a fabric address of {} bytes", name.len())).into());
    }
    Ok(v)
}

/// The peer's hello, checked against our provider: its fabric address.
fn peer_address<'a>(fabric: &Fabric, body: &'a [u8]) -> Result<&'a [u8]> {
    let (&len, rest) = body.split_first().ok_or_else(|| setup_msg::bad("empty fabric hello"))?;
    let name = rest.get(..usize::from(len)).ok_or_else(|| setup_msg::bad("truncated fabric hello"))?;
    if name != fabric.provider().as_bytes() {
        return Err(ErrorKind::Fabric(format!(
            "the peer uses the provider {} and this end {}; give both ends the same provider",
            String::from_utf8_lossy(name),
            fabric.provider()
        ))
        .into());
    }
    Ok(&rest[usize::from(len)..])
}

/// A setup connection reading length-prefixed frames without waiting.
struct SetupConn {
    stream: TcpStream,
    buf: Vec<u8>,
    deadline: Instant,
}

impl SetupConn {
    /// The first `n` frames once they are all there; `PeerGone` at the end
    /// of the stream, `TimedOut` past the deadline.
    fn poll(&mut self, n: usize) -> Result<Option<Vec<&[u8]>>> {
        loop {
            // Split again to return them: a borrow returned from the loop
            // would last across the reads below.
            if split_frames(&self.buf, n)?.is_some() {
                return split_frames(&self.buf, n);
            }
            let mut chunk = [0u8; 512];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ErrorKind::PeerGone.into()),
                Ok(got) => {
                    if self.buf.len() + got > 2 * (2 + MAX_FRAME) {
                        return Err(setup_msg::bad("too long"));
                    }
                    self.buf.extend_from_slice(&chunk[..got]);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if Instant::now() >= self.deadline { Err(ErrorKind::TimedOut.into()) } else { Ok(None) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The first `n` frames of `buf`, if complete.
fn split_frames(buf: &[u8], n: usize) -> Result<Option<Vec<&[u8]>>> {
    let mut frames = Vec::with_capacity(n);
    let mut rest = buf;
    while frames.len() < n {
        let Some(len) = rest.get(..2).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]]))) else {
            return Ok(None);
        };
        if len > MAX_FRAME {
            return Err(setup_msg::bad("too long"));
        }
        let Some(body) = rest.get(2..2 + len) else { return Ok(None) };
        frames.push(body);
        rest = &rest[2 + len..];
    }
    Ok(Some(frames))
}

struct CreatorPending {
    listener: Option<TcpListener>,
    /// The fabric endpoint, opened when the creator started listening (so
    /// a provider that does not fit fails the creation).
    fabric: Option<Fabric>,
    setup: ChannelSetup,
    half_open: VecDeque<SetupConn>,
}

impl CreatorPending {
    /// Answer a complete bind request: `Ok(None)` if refused.
    fn answer(&mut self, conn: SetupConn) -> Result<Option<SetupDone>> {
        let frames = split_frames(&conn.buf, 2)?.expect("complete");
        let params = setup_msg::parse_bind(frames[0])?;
        let fabric = self.fabric.as_ref().expect("listening");
        let reply = |msg: &[u8], hello: Option<Vec<u8>>| {
            let mut v = frame(msg);
            if let Some(h) = hello {
                v.extend_from_slice(&frame(&h));
            }
            // A fresh socket's buffer takes the reply at once.
            (&conn.stream).write_all(&v).is_ok()
        };
        let neg = match negotiate(&self.setup, &params) {
            Ok(neg) => neg,
            Err(why) => {
                reply(&setup_msg::encode_refuse(why), None);
                return Ok(None);
            }
        };
        let depth = self.setup.queue_depth;
        // Our hello goes out even if the binder's provider differs: the
        // binder then says why.
        if !reply(&setup_msg::encode_accept(&neg, depth), Some(hello_body(fabric)?)) {
            return Ok(None);
        }
        let peer = peer_address(fabric, frames[1])?;
        fabric.set_peer(peer).map_err(|e| ErrorKind::Protocol(format!("the binder's fabric address: {e}")))?;
        let fabric = self.fabric.take().expect("listening");
        let link = FabricLink::new(fabric, conn.stream, neg.meta_size, depth)?;
        Ok(Some((Box::new(link), neg, true)))
    }

    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else { return };
        for _ in 0..4 * MAX_HALF_OPEN {
            let Ok((stream, _)) = listener.accept() else { break };
            if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                continue;
            }
            if self.half_open.len() == MAX_HALF_OPEN {
                self.half_open.pop_front();
            }
            self.half_open.push_back(SetupConn { stream, buf: Vec::new(), deadline: Instant::now() + SETUP_TIMEOUT });
        }
    }
}

impl PendingSetup for CreatorPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        self.listener.as_ref()?;
        self.accept_all();
        let mut i = 0;
        while i < self.half_open.len() {
            match self.half_open[i].poll(2) {
                Ok(None) => i += 1,
                Ok(Some(_)) => {
                    let conn = self.half_open.remove(i).expect("in range");
                    match self.answer(conn) {
                        Ok(Some(done)) => {
                            self.listener = None;
                            self.half_open.clear();
                            return Some(Ok(done));
                        }
                        // Refused, gone, another provider, or a connector
                        // that does not speak the protocol: keep listening.
                        Ok(None) => {}
                        Err(e) if matches!(e.kind(), ErrorKind::Protocol(_) | ErrorKind::Fabric(_)) => {}
                        Err(e) => return Some(Err(e)),
                    }
                }
                Err(_) => {
                    self.half_open.remove(i);
                }
            }
        }
        None
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(listener) = &self.listener else { return Arm::SLEEP };
        super::arm_listening(wake, listener.as_fd(), self.half_open.iter().map(|c| (c.stream.as_fd(), c.deadline)))
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref()?.local_addr().ok()
    }
}

struct BinderPending {
    conn: Option<SetupConn>,
    fabric: Option<Fabric>,
    params: BindParams,
}

impl BinderPending {
    fn finish(&mut self) -> Result<Option<SetupDone>> {
        let conn = self.conn.as_mut().expect("present");
        // A refusal comes alone, an acceptance with the creator's hello.
        let Some(first) = conn.poll(1)? else { return Ok(None) };
        let (neg, depth) = setup_msg::parse_reply(first[0])?;
        check_reply(&self.params, &neg)?;
        let Some(frames) = conn.poll(2)? else { return Ok(None) };
        let fabric = self.fabric.as_ref().expect("present");
        let peer = peer_address(fabric, frames[1])?.to_vec();
        fabric.set_peer(&peer).map_err(|e| ErrorKind::Protocol(format!("the creator's fabric address: {e}")))?;
        let conn = self.conn.take().expect("present");
        let link = FabricLink::new(self.fabric.take().expect("present"), conn.stream, neg.meta_size, depth)?;
        Ok(Some((Box::new(link), neg, false)))
    }
}

impl PendingSetup for BinderPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        self.conn.as_ref()?;
        match self.finish() {
            Ok(None) => None,
            Ok(Some(done)) => Some(Ok(done)),
            Err(e) => {
                self.conn = None;
                Some(Err(e))
            }
        }
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(c) = &self.conn else { return Arm::SLEEP };
        if wake.watch(c.stream.as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        Arm::Sleep { until: Some(c.deadline) }
    }
}

// --------------------------------------------------------------------- link

/// A pool of the channel as this end registered it.
struct LinkPool {
    region: Region,
    geometry: Geometry,
    memory: Arc<PoolMemory>,
    /// Our writes from it still in flight.
    writes_out: usize,
    /// The channel forgot the pool: dropped once no write needs it.
    forgotten: bool,
}

/// Where the peer registered its memory of a pool.
#[derive(Clone, Copy)]
struct RemotePool {
    base: u64,
    key: u64,
    len: u64,
}

/// A message waiting to be posted.
struct OutMsg {
    slot: [u8; SLOT],
    len: usize,
    /// The buffer whose bytes are written first, and whether that write
    /// is posted already.
    payload: Option<(BufferId, bool)>,
}

/// What a context slot is posted for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Idle,
    Recv,
    Send,
    Write(PoolId),
}

/// One end of a fabric channel.
pub(crate) struct FabricLink {
    fabric: Fabric,
    /// The setup connection, kept as the lifeline.
    lifeline: TcpStream,
    meta_size: usize,
    depth: usize,
    /// Message slots: the receives, then `tx_slots` sends.
    control: Arc<Region>,
    tx_slots: usize,
    /// One context per receive slot, per send slot, and per write.
    contexts: Arc<Contexts>,
    ops: Vec<Op>,
    free_tx: Vec<usize>,
    free_writes: Vec<usize>,
    pools: PoolMap<LinkPool>,
    remote: PoolMap<RemotePool>,
    next_key: u64,
    backlog: VecDeque<OutMsg>,
    /// Our next write's number, and the peer's next one we wait for.
    write_seq: u32,
    expect_seq: u32,
    end: EndState,
}

/// What a link learns as it runs: arrivals not handed up yet, and how its
/// end came. A lingering copy of a link starts with a fresh one.
#[derive(Default)]
struct EndState {
    /// Messages received, in order, not handed up yet.
    inbox: VecDeque<([u8; SLOT], usize)>,
    /// Sequence numbers of the peer's writes that completed here and wait
    /// for their message.
    writes_in: HashSet<u32>,
    copied_in: HashSet<BufferId>,
    lifeline_ended: Option<Instant>,
    goodbye_seen: bool,
    closed: bool,
    /// A [`Linger`] took over the endpoint (it closes it).
    lingering: bool,
    died: bool,
    gone: Option<Error>,
    stats: LinkStats,
}

impl FabricLink {
    fn new(fabric: Fabric, lifeline: TcpStream, meta_size: usize, depth: u32) -> Result<Self> {
        lifeline.set_nonblocking(true)?;
        super::net::configure_liveness(&lifeline, Duration::from_secs(10));
        let depth = depth as usize;
        let rx_slots = depth.min(MAX_SLOTS) + 16;
        let tx_slots = depth.min(MAX_SLOTS);
        let writes = depth.min(MAX_SLOTS);
        let len = ((rx_slots + tx_slots) * SLOT).next_multiple_of(crate::sys::page_size());
        let fd = crate::sys::memfd("ferry-fabric-slots", len)?;
        let map = Mapping::map_shared(fd.as_fd(), len, Access::ReadWrite, 1)?;
        // Messages arrive by sends only: the peer gets no RMA access to the ring.
        let control =
            fabric.register(Arc::new(map), 1, false).map_err(|rc| fabric_error("fi_mr_reg (message slots)", rc))?;
        let control = Arc::new(control);
        let n = rx_slots + tx_slots + writes;
        let mut link = FabricLink {
            contexts: Arc::new(Contexts::new(n)),
            ops: vec![Op::Idle; n],
            free_tx: (rx_slots..rx_slots + tx_slots).rev().collect(),
            free_writes: (rx_slots + tx_slots..n).rev().collect(),
            fabric,
            lifeline,
            meta_size,
            depth,
            control,
            tx_slots,
            pools: PoolMap::default(),
            remote: PoolMap::default(),
            next_key: 2,
            backlog: VecDeque::new(),
            write_seq: 0,
            expect_seq: 0,
            end: EndState::default(),
        };
        for slot in 0..rx_slots {
            link.post_recv(slot)?;
        }
        Ok(link)
    }

    fn post_recv(&mut self, slot: usize) -> Result<()> {
        self.fabric
            .recv(&self.control, slot * SLOT, SLOT, &self.contexts, slot)
            .map_err(|rc| fabric_error("fi_recv", rc))?;
        self.ops[slot] = Op::Recv;
        Ok(())
    }

    fn fail(&mut self, e: Error, died: bool) -> Error {
        if self.end.gone.is_none() {
            self.end.died = died;
            self.end.gone = Some(e.clone());
        }
        self.end.gone.clone().expect("set")
    }

    fn check(&self) -> Result<()> {
        match &self.end.gone {
            Some(e) => Err(e.clone()),
            None if self.end.closed => Err(ErrorKind::PeerGone.into()),
            None => Ok(()),
        }
    }

    /// Register a pool of the channel and tell the peer where it is.
    fn register(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        let id = memory.id();
        if let Some(p) = self.pools.get_mut(&id) {
            if Arc::ptr_eq(&p.memory, memory) {
                p.forgotten = false;
                return Ok(());
            }
            if p.writes_out > 0 || self.backlog.iter().any(|m| m.payload.is_some_and(|(b, _)| b.pool == id)) {
                // New memory for a pool whose old memory is still written
                // from: the channel never does that (it removes a pool only
                // after its buffers are back).
                return Err(ErrorKind::Protocol(format!("pool {id} replaced while its bytes are in flight")).into());
            }
        }
        let geometry = memory.geometry();
        let map = Arc::new(memory.map(Access::ReadWrite, 1)?);
        let key = self.next_key;
        self.next_key += 1;
        let region = self.fabric.register(map, key, true).map_err(|rc| fabric_error("fi_mr_reg (a pool)", rc))?;
        let base = if self.fabric.virt_addr() { region.map().as_ptr() as u64 } else { 0 };
        let mut slot = [0u8; SLOT];
        slot[0] = TYPE_KEY;
        slot[8..16].copy_from_slice(&region.key().to_le_bytes());
        slot[16..32].copy_from_slice(&id.as_u128().to_le_bytes());
        slot[32..40].copy_from_slice(&base.to_le_bytes());
        slot[40..48].copy_from_slice(&(geometry.len() as u64).to_le_bytes());
        self.pools.insert(id, LinkPool { region, geometry, memory: memory.clone(), writes_out: 0, forgotten: false });
        self.backlog.push_back(OutMsg { slot, len: 48, payload: None });
        self.pump()
    }

    fn queue(&mut self, msg: &Message, with_payload: bool) -> Result<()> {
        self.check()?;
        let mut slot = [0u8; SLOT];
        msg.encode(&mut slot);
        let len = proto::HEADER + usize::from(u16::from_le_bytes([slot[2], slot[3]]));
        let mut payload = None;
        if let (true, Some(buf)) = (with_payload, msg.payload_buffer()) {
            let pool = self
                .pools
                .get(&buf.pool)
                .ok_or_else(|| ErrorKind::Protocol(format!("pool {} unknown to the fabric link", buf.pool)))?;
            slot[1] |= FLAG_PAYLOAD;
            slot[8..16].copy_from_slice(&(pool.geometry.buffer_size() as u64).to_le_bytes());
            payload = Some((buf, false));
        }
        self.backlog.push_back(OutMsg { slot, len, payload });
        self.pump()
    }

    fn queue_control(&mut self, kind: u8) -> Result<()> {
        let mut slot = [0u8; SLOT];
        slot[0] = kind;
        self.backlog.push_back(OutMsg { slot, len: proto::HEADER, payload: None });
        self.pump()
    }

    /// Post what the fabric takes now, in order: a payload's write, then
    /// its message.
    fn pump(&mut self) -> Result<()> {
        self.check()?;
        loop {
            let Some(front) = self.backlog.front() else { return Ok(()) };
            if let Some((buf, false)) = front.payload {
                let Some(&ctx) = self.free_writes.last() else { return Ok(()) };
                let pool = self.pools.get(&buf.pool).expect("queued with its pool");
                let remote = *self.remote.get(&buf.pool).ok_or_else(|| {
                    ErrorKind::Protocol(format!("the peer never said where its memory of pool {} is", buf.pool))
                })?;
                let size = pool.geometry.buffer_size();
                let offset = buf.index as usize * size;
                if (offset + size) as u64 > remote.len {
                    return Err(
                        ErrorKind::Protocol(format!("the peer's memory of pool {} is too small", buf.pool)).into()
                    );
                }
                let posted = self.fabric.write(
                    &pool.region,
                    offset,
                    size,
                    remote.base + offset as u64,
                    remote.key,
                    u64::from(self.write_seq),
                    &self.contexts,
                    ctx,
                );
                match posted {
                    Ok(()) => {}
                    // The provider's queue is full: completions free it.
                    Err(rc) if rc == -sys::EAGAIN => return self.progress(),
                    Err(rc) => return Err(self.fail(fabric_error("fi_writedata", rc), true)),
                }
                self.write_seq = self.write_seq.wrapping_add(1);
                self.free_writes.pop();
                self.ops[ctx] = Op::Write(buf.pool);
                self.pools.get_mut(&buf.pool).expect("present").writes_out += 1;
                self.end.stats.send_calls += 1;
                self.backlog.front_mut().expect("present").payload = Some((buf, true));
            }
            let Some(&slot) = self.free_tx.last() else { return Ok(()) };
            let front = self.backlog.front().expect("present");
            let offset = slot * SLOT;
            // The slot is idle (not posted): the provider does not touch it.
            write_slot(self.control.map(), offset, &front.slot[..front.len]);
            match self.fabric.send(&self.control, offset, front.len, &self.contexts, slot) {
                Ok(()) => {}
                Err(rc) if rc == -sys::EAGAIN => return self.progress(),
                Err(rc) => return Err(self.fail(fabric_error("fi_send", rc), true)),
            }
            self.free_tx.pop();
            self.ops[slot] = Op::Send;
            self.end.stats.send_calls += 1;
            self.end.stats.frames_sent += 1;
            self.backlog.pop_front();
        }
    }

    /// Take the completions there are (and let the provider progress).
    fn progress(&mut self) -> Result<()> {
        // A closed link's completions are its linger's.
        if self.end.lingering {
            return Ok(());
        }
        let mut done = [Completion::default(); 16];
        loop {
            let n = match self.fabric.poll(&mut done) {
                Ok(n) => n,
                Err(rc) => return Err(self.fail(fabric_error("fi_cq_read", rc), true)),
            };
            for c in &done[..n] {
                self.complete(c)?;
            }
            if n < done.len() {
                return Ok(());
            }
        }
    }

    fn complete(&mut self, c: &Completion) -> Result<()> {
        let slot = self.contexts.slot_of(c.ctx);
        let op = slot.map_or(Op::Idle, |s| self.ops[s]);
        if c.err != 0 {
            // A receive cancelled by the endpoint's close is no failure.
            if op == Op::Recv && self.end.closed {
                return Ok(());
            }
            let what = match op {
                Op::Write(_) => "an RMA write",
                Op::Send => "a send",
                _ => "a receive",
            };
            let e = Error::from(ErrorKind::Fabric(format!(
                "{what} failed: {} (provider code {})",
                sys::strerror(c.err),
                c.prov_errno
            )));
            return Err(self.fail(e, true));
        }
        if sys::is_remote_write(c.flags) {
            self.end.writes_in.insert(c.data as u32);
            // Providers that consume a receive for the completion data
            // (FI_RX_CQ_DATA) name that receive: post it again.
            if let (Some(s), Op::Recv) = (slot, op) {
                self.post_recv(s)?;
            }
            return Ok(());
        }
        let Some(s) = slot else { return Ok(()) };
        match op {
            Op::Recv => {
                let len = (c.len as usize).min(SLOT);
                let mut bytes = [0u8; SLOT];
                read_slot(self.control.map(), s * SLOT, &mut bytes[..len]);
                self.end.inbox.push_back((bytes, len));
                self.post_recv(s)?;
            }
            Op::Send => {
                self.ops[s] = Op::Idle;
                self.free_tx.push(s);
            }
            Op::Write(id) => {
                self.ops[s] = Op::Idle;
                self.free_writes.push(s);
                if let Some(p) = self.pools.get_mut(&id) {
                    p.writes_out -= 1;
                    self.end.stats.payload_sent += p.geometry.buffer_size() as u64;
                    if p.forgotten && p.writes_out == 0 {
                        self.pools.remove(&id);
                    }
                }
            }
            Op::Idle => {}
        }
        Ok(())
    }

    /// The next message of the inbox that can be handed up; link messages
    /// (keys, goodbye) are taken here.
    fn deliver(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        while let Some((bytes, len)) = self.end.inbox.front() {
            let (bytes, len) = (*bytes, *len);
            let Some(head) = proto::SlotHead::read(&bytes[..len]) else {
                return Err(ErrorKind::Protocol(format!("a message of {len} bytes")).into());
            };
            let proto::SlotHead { op: kind, flags, meta_len: meta, index, aux, pool } = head;
            let bad = |what: String| Error::from(ErrorKind::Protocol(format!("fabric message type {kind}: {what}")));
            if kind == TYPE_GOODBYE {
                self.end.inbox.pop_front();
                self.end.goodbye_seen = true;
                continue;
            }
            if kind == TYPE_KEY {
                if len != 48 {
                    return Err(bad("key message of another length".into()));
                }
                let base = u64::from_le_bytes(bytes[32..40].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes"));
                self.remote.insert(pool, RemotePool { base, key: aux, len });
                self.end.inbox.pop_front();
                continue;
            }
            let Some(limit) = proto::body_limit(kind, self.meta_size) else {
                return Err(bad("unknown type".into()));
            };
            if meta > limit || len != proto::HEADER + meta {
                return Err(bad(format!("meta length {meta} in a message of {len} bytes")));
            }
            let payload = flags & FLAG_PAYLOAD != 0;
            let mut landed = false;
            match (kind, payload) {
                (TYPE_MOVE | TYPE_COPY | TYPE_PASS, true) => {
                    // The bytes must be here before the message goes up.
                    if !self.end.writes_in.remove(&self.expect_seq) {
                        return Ok(None);
                    }
                    self.expect_seq = self.expect_seq.wrapping_add(1);
                    let p = self.pools.get(&pool).ok_or_else(|| bad(format!("pool {pool} not on this channel")))?;
                    if index >= p.geometry.count() {
                        return Err(bad(format!("buffer index {index} out of range")));
                    }
                    if aux != p.geometry.buffer_size() as u64 {
                        return Err(bad(format!(
                            "payload of {aux} bytes for {}-byte buffers",
                            p.geometry.buffer_size()
                        )));
                    }
                    let probe = head.payload_probe().expect("a move, copy or pass");
                    // The bytes landed already; a buffer this end must not
                    // take fails the channel.
                    let _: Landing = gate.admit(&probe)?;
                    self.end.stats.payload_received += aux;
                    landed = true;
                }
                (TYPE_COPY, false) => {
                    let buf = BufferId { pool, index };
                    let probe = Message::Copy { buf, meta: Meta::empty() };
                    if gate.admit(&probe)? == Landing::Land && !self.end.copied_in.contains(&buf) {
                        return Err(bad("copy without payload of a buffer we never received".into()));
                    }
                }
                (TYPE_MOVE, false) => return Err(bad("move without its payload".into())),
                (_, true) => return Err(bad("payload on a message that carries none".into())),
                (_, false) => {}
            }
            let msg = Message::decode(&bytes[..len], self.meta_size)?;
            if let (true, Some(buf)) = (landed, msg.payload_buffer()) {
                if kind == TYPE_COPY {
                    self.end.copied_in.insert(buf);
                } else {
                    self.end.copied_in.remove(&buf);
                }
            }
            self.end.inbox.pop_front();
            self.end.stats.frames_received += 1;
            self.end.stats.recv_calls += 1;
            return Ok(Some(msg));
        }
        Ok(None)
    }

    /// Whether the lifeline has ended (the peer closed it or died).
    fn lifeline_down(&mut self) -> bool {
        if self.end.lifeline_ended.is_some() {
            return true;
        }
        let mut byte = [0u8; 1];
        match (&self.lifeline).read(&mut byte) {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => false,
            // Nothing is sent on the lifeline: bytes are as bad as its end.
            _ => {
                self.end.lifeline_ended = Some(Instant::now());
                true
            }
        }
    }

    fn receive(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        self.progress()?;
        self.pump()?;
        if let Some(msg) = self.deliver(gate)? {
            return Ok(Some(msg));
        }
        if self.end.goodbye_seen {
            return Err(self.fail(ErrorKind::PeerGone.into(), false));
        }
        if self.lifeline_down() {
            let since = self.end.lifeline_ended.expect("ended");
            if since.elapsed() >= GOODBYE_GRACE {
                return Err(self.fail(ErrorKind::PeerGone.into(), true));
            }
        }
        Ok(None)
    }

    /// Whether anything of ours is still to go out or in flight.
    fn busy(&self) -> bool {
        !self.backlog.is_empty() || self.free_tx.len() < self.tx_slots || self.pools.values().any(|p| p.writes_out > 0)
    }
}

/// Copy `bytes` into the control mapping at `offset` (an idle slot).
fn write_slot(map: &Mapping, offset: usize, bytes: &[u8]) {
    assert!(offset + bytes.len() <= map.len(), "slot in the mapping");
    let part = crate::sys::RecvPart::mapping(map, offset, bytes.len()).expect("slot in the mapping");
    let mut part = part;
    part.as_mut_slice().copy_from_slice(bytes);
}

/// Copy a received slot at `offset` of the control mapping into `out`.
fn read_slot(map: &Mapping, offset: usize, out: &mut [u8]) {
    let part = crate::sys::SendPart::mapping(map, offset, out.len()).expect("slot in the mapping");
    out.copy_from_slice(part.as_slice());
}

impl Link for FabricLink {
    fn has_room(&mut self) -> bool {
        let _ = self.pump();
        self.backlog.len() < self.depth
    }

    fn room(&mut self) -> usize {
        let _ = self.pump();
        self.depth.saturating_sub(self.backlog.len())
    }

    fn capacity(&self) -> usize {
        self.depth
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        if !self.has_room() {
            self.check()?;
            return Err(ErrorKind::QueueFull.into());
        }
        self.queue(msg, true)
    }

    fn send_unfilled(&mut self, msg: &Message) -> Result<()> {
        if !self.has_room() {
            self.check()?;
            return Err(ErrorKind::QueueFull.into());
        }
        self.queue(msg, false)
    }

    /// Post what the fabric takes and let the provider progress: with
    /// manual progress, posted data moves only while its end polls.
    fn flush(&mut self) -> Result<()> {
        self.pump()?;
        self.progress()
    }

    fn recv(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        self.check()?;
        match self.receive(gate) {
            Err(e) if matches!(e.kind(), ErrorKind::Protocol(_)) => {
                let e = self.fail(e, false);
                let _ = self.lifeline.shutdown(Shutdown::Both);
                Err(e)
            }
            other => other,
        }
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        wake.watch(self.fabric.wait_fd(), Interest::Read)?;
        wake.watch(self.lifeline.as_fd(), Interest::Read)?;
        Ok(())
    }

    fn unregister(&mut self, wake: &WakeSet) {
        wake.unwatch(self.fabric.wait_fd());
        wake.unwatch(self.lifeline.as_fd());
    }

    fn arm(&mut self, _wake: &WakeSet) -> Arm {
        if self.end.gone.is_some() || self.pump().is_err() || self.progress().is_err() {
            return Arm::Ready;
        }
        // A message ready in the inbox, or completions the queue has: the
        // fd would not say so.
        let ready = self.end.inbox.front().is_some_and(|(b, _)| {
            b[1] & FLAG_PAYLOAD == 0 || self.end.writes_in.contains(&self.expect_seq) || !matches!(b[0], 1..=3)
        });
        if ready || self.end.goodbye_seen || !self.fabric.trywait() {
            return Arm::Ready;
        }
        match self.end.lifeline_ended {
            Some(at) => Arm::Sleep { until: Some(at + GOODBYE_GRACE) },
            // A provider with manual progress moves our writes only when
            // polled: while they are in flight, look again soon.
            None if self.busy() => Arm::Sleep { until: Some(Instant::now() + Duration::from_millis(50)) },
            None => Arm::SLEEP,
        }
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.register(memory)
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        let memory = PoolMemory::mirror(id, geometry, None)?;
        self.register(&memory)?;
        Ok(memory)
    }

    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.register(memory)
    }

    fn forget_pool(&mut self, id: PoolId) {
        self.end.copied_in.retain(|b| b.pool != id);
        let queued = self.backlog.iter().any(|m| m.payload.is_some_and(|(b, _)| b.pool == id));
        if let Some(p) = self.pools.get_mut(&id) {
            if p.writes_out > 0 || queued {
                p.forgotten = true;
            } else {
                self.pools.remove(&id);
            }
        }
    }

    fn close(&mut self, last: Vec<Message>) {
        if self.end.closed {
            return;
        }
        if self.end.gone.is_none() {
            for msg in &last {
                if self.queue(msg, true).is_err() {
                    break;
                }
            }
            let _ = self.queue_control(TYPE_GOODBYE);
            if self.end.gone.is_none() {
                self.linger();
            }
        }
        self.end.closed = true;
    }

    fn peer_can_die(&self) -> bool {
        true
    }

    fn abandon(&mut self) -> bool {
        self.fail(ErrorKind::PeerGone.into(), true);
        let _ = self.lifeline.shutdown(Shutdown::Both);
        self.end.died
    }

    fn peer_died(&mut self) -> bool {
        self.end.died
    }

    fn stats(&self) -> Option<LinkStats> {
        Some(self.end.stats)
    }
}

impl Drop for FabricLink {
    fn drop(&mut self) {
        // Nothing may land in (or be sent from) memory once it is unmapped:
        // the endpoint goes first, then the registrations and mappings. A
        // linger closes it itself, and holds what it needs until then.
        if !self.end.lingering {
            self.fabric.close_endpoint();
        }
    }
}

impl FabricLink {
    /// Hand the endpoint and what is still to go out to a lingering link of
    /// its own thread: the last messages (the goodbye among them) go out
    /// and complete while the application goes on, as the kernel lingers
    /// over a closed socket's last bytes; then the lifeline ends, so the
    /// peer reads the goodbye before the end, and the endpoint closes
    /// before the memory it may still use is unmapped (at most
    /// [`CLOSE_FLUSH`] later). This end keeps only its counters.
    fn linger(&mut self) {
        let Ok(lifeline) = self.lifeline.try_clone() else { return };
        let mut linger = FabricLink {
            fabric: self.fabric.clone(),
            lifeline,
            meta_size: self.meta_size,
            depth: self.depth,
            control: self.control.clone(),
            tx_slots: self.tx_slots,
            contexts: self.contexts.clone(),
            ops: std::mem::take(&mut self.ops),
            free_tx: std::mem::take(&mut self.free_tx),
            free_writes: std::mem::take(&mut self.free_writes),
            pools: std::mem::take(&mut self.pools),
            remote: std::mem::take(&mut self.remote),
            next_key: self.next_key,
            backlog: std::mem::take(&mut self.backlog),
            write_seq: self.write_seq,
            expect_seq: self.expect_seq,
            end: EndState::default(),
        };
        self.end.lingering = true;
        let mut run = move || {
            let deadline = Instant::now() + CLOSE_FLUSH;
            while linger.busy() && Instant::now() < deadline {
                if linger.pump().is_err() || linger.progress().is_err() {
                    break;
                }
                linger.end.inbox.clear();
                if linger.busy() && linger.fabric.trywait() {
                    let _ = super::net::poll_fd(linger.fabric.wait_fd(), PollFlags::IN, Duration::from_millis(10));
                }
            }
            let _ = linger.lifeline.shutdown(Shutdown::Write);
            // Dropping it closes the endpoint, then the registrations.
        };
        let (hand, take) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let thread = std::thread::Builder::new().name("ferry-fabric-linger".into()).spawn(move || {
            if let Ok(run) = take.recv() {
                run();
            }
        });
        match thread {
            Ok(_) => {
                let _ = hand.send(Box::new(run));
            }
            // No thread to be had: linger here, within the same bound.
            Err(_) => run(),
        }
    }
}
